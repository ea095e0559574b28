"""Module-name patterns, checked: ``precision.keep_high``, ``precision.only`` and
``parallel.shard_modules`` name layers of a model, and a pattern that names nothing is an error.

A typo in a skip list is silent in most tools: the layer it meant stays quantized (torchtitan#4008
quantized its users' LM head so). Here every pattern must match, and one that does not gets one line
with the pattern and the module names closest to it.

Two ways of matching, one per use:

- ``covers``: fnmatch on the module's name or on any of its ancestors' (``lm_head``, ``layer4``
  and ``layer4.*`` all keep ResNet's last stage high), like torchtitan's ``filter_fqns``;
- ``matches_exactly``: fnmatch per dotted segment (``*`` stays within one segment), for FSDP
  units, where ``blocks.*`` must mean each block and not every module inside one.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Sequence

from mptrain.errors import MptrainError


def ancestors(name: str) -> list[str]:
    """``a.b.c`` -> ``[a.b.c, a.b, a]``: the name and the names of the modules around it."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def covers(pattern: str, name: str) -> bool:
    """Whether ``pattern`` names the module ``name`` or a module around it."""
    return any(fnmatch.fnmatchcase(n, pattern) for n in ancestors(name))


def matches_exactly(pattern: str, name: str) -> bool:
    """fnmatch per dotted segment: ``blocks.*`` is each block, not what is inside one."""
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats, strict=True))


def closest(pattern: str, names: Iterable[str], n: int = 3) -> list[str]:
    """The names most like ``pattern`` (difflib's ratio), best first; the first few names if none is close."""
    names = sorted(set(names))
    close = difflib.get_close_matches(pattern, names, n=n, cutoff=0.5)
    return close or names[:n]


def check_all_match(key: str, patterns: Sequence[str], hits: dict[str, int], names: Iterable[str],
                    what: str = "layer") -> None:
    """Raise MptrainError naming the first pattern with no hit, and the names closest to it."""
    for pattern in patterns:
        if not hits.get(pattern):
            near = ", ".join(closest(pattern, names))
            raise MptrainError(f"{key}: {pattern!r} matches no {what} of the model; closest {what} names: {near}")


def check_patterns(key: str, patterns: object) -> list[str]:
    """``patterns`` as a list of non-empty strings, or MptrainError naming ``key``."""
    if isinstance(patterns, str) or not isinstance(patterns, Sequence) or not all(
            isinstance(p, str) and p for p in patterns):
        raise MptrainError(f"{key}={patterns!r}: must be a list of module-name patterns, e.g. ['fc', 'layer4.*']")
    return list(patterns)


class PatternHits:
    """The patterns of several keys (``precision.keep_high``, ``precision.only``) held against the
    layers of every network a task converts: ``first`` answers per layer, ``check`` raises for a
    pattern that covered no layer of any network."""

    def __init__(self, lists: dict[str, list[str]]) -> None:
        self.lists = {key: list(ps) for key, ps in lists.items()}
        self.hits: dict[str, dict[str, int]] = {key: dict.fromkeys(ps, 0) for key, ps in self.lists.items()}
        self.names: set[str] = set()

    def see(self, names: Iterable[str]) -> None:
        """Module names a pattern may have meant (for the closest names in ``check``'s line)."""
        self.names.update(n for n in names if n)

    def first(self, key: str, name: str) -> str | None:
        """The first of ``key``'s patterns that covers layer ``name`` (each covering one is counted)."""
        found = None
        for pattern in self.lists[key]:
            if covers(pattern, name):
                self.hits[key][pattern] += 1
                found = found or pattern
        return found

    def check(self) -> None:
        for key, ps in self.lists.items():
            check_all_match(key, ps, self.hits[key], self.names)

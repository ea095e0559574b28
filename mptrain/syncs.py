"""Count the host syncs a piece of training code makes: ``with count_host_syncs() as c: ...``.

On a GPU, a value read back to the host (``.item()``, ``bool(t)``, ``.tolist()``, ``float(t)``, a
data-dependent shape such as ``nonzero``) or a blocking host-to-device copy stalls the CPU until
the device has caught up, and the step's launches stop overlapping its kernels. Those calls look the
same on a CPU, where they cost nothing, so the counter works anywhere: a test on a CPU-only machine
can pin the number of syncs a CUDA step would make.

Written as a ``TorchFunctionMode`` because torch has no device-independent sync audit:
``torch.cuda.set_sync_debug_mode`` sees only CUDA syncs (and not ``bool`` on a CPU tensor that
the same code would make on a GPU). On CUDA the counter also turns that mode to "warn", so a sync
made inside a C++ op that Python never sees is reported as a warning.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that read a value back to the host, by the kind they are reported as.
_READBACKS = {
    "item": "item", "__bool__": "bool", "tolist": "tolist", "__float__": "item", "__int__": "item",
    "__index__": "item", "__complex__": "item", "nonzero": "nonzero", "numpy": "tolist",
    "masked_select": "nonzero", "unique": "nonzero",
}  # fmt: skip
_MOVES = {"to", "cuda", "copy_"}


@dataclass
class SyncCounts:
    """What ``count_host_syncs`` saw: ``total``, per kind, and where (file:line of the caller)."""

    by_kind: Counter[str] = field(default_factory=Counter)
    sites: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def report(self) -> str:
        """One line per call site, most frequent first, for an assertion message."""
        return "; ".join(f"{site} x{n}" for site, n in self.sites.most_common()) or "none"


def _innermost() -> str:
    """The file of the innermost frame outside this module (torch's own included)."""
    for frame in reversed(traceback.extract_stack()):
        f = frame.filename.replace("\\", "/")
        if not f.endswith("mptrain/syncs.py"):
            return f
    return "?"


def _caller() -> str:
    # The innermost frame outside torch and this module: the line of mptrain (or a test) that asked.
    for frame in reversed(traceback.extract_stack()):
        f = frame.filename.replace("\\", "/")
        if "/torch/" not in f and not f.endswith("mptrain/syncs.py"):
            return f"{f.rsplit('/', 2)[-2]}/{f.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


def _is_host_to_device(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A copy from host memory onto an accelerator (``t.to('cuda')``, ``dst.copy_(host)``)."""
    name = getattr(func, "__name__", "")
    if name not in _MOVES or not args or not isinstance(args[0], torch.Tensor):
        return False
    if name == "copy_":
        src = args[1] if len(args) > 1 else kwargs.get("src")
        return isinstance(src, torch.Tensor) and src.device.type == "cpu" and args[0].device.type != "cpu"
    if args[0].device.type != "cpu":
        return False
    if name == "cuda":
        return True
    target = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (torch.device, str)):
            target = a
        elif isinstance(a, torch.Tensor):
            target = a.device
    if target is None:
        return False
    try:
        return torch.device(target).type != "cpu"
    except (RuntimeError, TypeError):
        return False


class _Counter(TorchFunctionMode):
    def __init__(self, counts: SyncCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kind = _READBACKS.get(getattr(func, "__name__", ""))
        if kind is None and _is_host_to_device(func, args, kwargs):
            kind = "host_to_device"
        # torch.optim reads its own step counters, which stay on the host on every device (they
        # are never a sync): not counted.
        if kind == "item" and "/torch/optim/" in _innermost():
            kind = None
        if kind is not None:
            self.counts.by_kind[kind] += 1
            self.counts.sites[f"{kind} at {_caller()}"] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs() -> Iterator[SyncCounts]:
    """Count the host syncs made inside the block (see the module docstring)."""
    counts = SyncCounts()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    before = torch.cuda.get_sync_debug_mode() if cuda else 0
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with _Counter(counts):
            yield counts
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(before)

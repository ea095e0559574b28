"""Dotted-path callables: the ``_target_`` of ``model=custom`` and ``data=custom``.

Hydra's ``instantiate`` builds a ``_target_`` node too, but mptrain needs what it does not give: one
line naming the key when the module does not import or the arguments do not fit, the current
directory on the path (the ``mptrain`` console script, unlike ``python -m``, does not put it there),
and arguments of mptrain's own (``num_classes``) passed only where the callable takes them.
Nested ``_target_`` nodes in the kwargs are built by ``instantiate`` first.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from mptrain.errors import MptrainError, check


def import_target(target: str, key: str) -> Callable[..., Any]:
    """The callable named by a dotted path; MptrainError naming ``key``, the module and the error."""
    module_name, _, attr = target.rpartition(".")
    check(bool(module_name) and bool(attr), f"{key}={target}: must be a dotted path, package.module.callable")
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            if os.getcwd() in sys.path or "" in sys.path:
                raise
            sys.path.append(os.getcwd())
            module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may raise anything while it imports
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise MptrainError(f"{key}={target}: cannot import {module_name} ({detail})") from exc
    obj = getattr(module, attr, None)
    check(obj is not None, f"{key}={target}: {module_name} has no attribute {attr!r}")
    check(callable(obj), f"{key}={target}: {type(obj).__name__} {attr!r} is not callable")
    return obj  # type: ignore[return-value]


def call_target(fn: Callable[..., Any], target: str, key: str, kwargs: DictConfig | dict[str, Any] | None,
                extra: dict[str, Any]) -> Any:
    """``fn(**kwargs, **extra)``: ``extra`` only where the signature takes it and kwargs lack it.
    Arguments the signature refuses are one line; the call itself raises what it raises."""
    kw: dict[str, Any] = {}
    if kwargs:
        node = kwargs if isinstance(kwargs, DictConfig) else OmegaConf.create(kwargs)
        kw = instantiate(node, _convert_="all")  # nested _target_ nodes are built first
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: pass what was given
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name, value in extra.items():
        if name not in kw and (name in params or takes_any):
            kw[name] = value
    if params:
        try:
            inspect.signature(fn).bind(**kw)
        except TypeError as exc:
            raise MptrainError(f"{key.rsplit('.', 1)[0]}.kwargs={kw}: {target} refuses them ({exc})") from exc
    return fn(**kw)

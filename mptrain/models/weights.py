"""``model.init_from=PATH``: start a run from local weights, on every route.

PATH is a state dict saved with ``torch.save(model.state_dict(), PATH)``, a ``.safetensors`` file
(transformers' ``save_pretrained``), or an mptrain checkpoint (``checkpoints/step_N.pt``: its model's
weights). Everything loads with ``weights_only=True``: opening the file never runs pickled code.
The keys that DDP (``module.``) and torch.compile (``_orig_mod.``) put in front of every name are
removed. Strict by default: any missing or unexpected key, or a shape that differs, is one line
naming the first few; ``model.init_strict=false`` loads the keys that fit and logs the rest.

This only initialises the weights; ``trainer.resume`` continues a run (optimizer, scaler, step, RNG).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor, nn

from mptrain.errors import MptrainError

log = logging.getLogger("mptrain")

_PREFIXES = ("module.", "_orig_mod.")
_SHOWN = 4  # keys named in a message


def _names(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return shown + (f" (and {len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else "")


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix):], True
    return key


def read_state_dict(path: str) -> dict[str, Tensor]:
    """The tensors of ``path`` (see the module docstring), keys without DDP/compile prefixes."""
    key = f"model.init_from={path}"
    file = Path(path).expanduser()
    if file.is_dir():
        raise MptrainError(f"{key}: a directory (a sharded parallel=fsdp2 checkpoint?); give one file, e.g. "
                           "python -m torch.distributed.checkpoint.format_utils dcp_to_torch_save DIR out.pt")
    if not file.is_file():
        raise MptrainError(f"{key}: no such file")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: object = load_file(str(file))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # not a torch file, truncated, or pickled code that weights_only refuses
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise MptrainError(f"{key}: not a readable state dict ({first})") from exc
    if isinstance(state, dict) and state.get("format") == 1 and "modules" in state:  # an mptrain checkpoint
        modules = state["modules"]
        if "model" not in modules:
            raise MptrainError(f"{key}: an mptrain checkpoint of {', '.join(modules)}, with no 'model' to load")
        state = modules["model"]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise MptrainError(f"{key}: holds a {type(state).__name__}, not a state dict of tensors")
    return {_strip(str(k)): v for k, v in state.items()}


def load_init(model: nn.Module, path: str, *, strict: bool = True) -> None:
    """Copy ``path``'s weights into ``model`` (in place; dtypes converted to the model's)."""
    state = read_state_dict(path)
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
              for k in own if k in state and state[k].shape != own[k].shape]
    problems = [f"{what}: {_names(keys)}" for what, keys in
                (("shapes differ (file vs model)", shapes), ("missing", missing), ("unexpected", unexpected)) if keys]
    if problems and strict:
        raise MptrainError(f"model.init_from={path}: does not fit {type(model).__name__}; " + "; ".join(problems)
                           + " (model.init_strict=false loads the keys that fit)")
    fitting = {k: v for k, v in state.items() if k in own and v.shape == own[k].shape}
    model.load_state_dict(fitting, strict=False)
    log.info("model.init_from=%s: %d of %d tensors loaded%s", path, len(fitting), len(own),
             "; " + "; ".join(problems) if problems else "")

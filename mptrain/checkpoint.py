"""Checkpoints: atomic writes, safe loads, and finding the latest one in a run directory.

A checkpoint is a plain dict of tensors and Python primitives, so it loads with
``torch.load(weights_only=True)``: opening a checkpoint never runs pickled code. Under
``parallel=fsdp2`` a checkpoint is a directory, ``step_N/``, that every rank writes its shard into
(``mptrain.sharded_checkpoint``); both kinds are listed, pruned and resumed alike.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mptrain.errors import MptrainError
from mptrain.numerics import rounding_rng

CKPT_DIR = "checkpoints"
_NAME = re.compile(r"step_(\d+)(\.pt)?")
SHARDED_META = "meta.pt"  # in a sharded checkpoint's directory: written last, so its presence marks it complete


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Write to a temp file in the same directory, fsync, then rename over ``path``.

    A crash or a full disk mid-write leaves the previous checkpoint untouched: rename is atomic on
    POSIX filesystems, and the temp file lives on the same filesystem.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / CKPT_DIR / f"step_{step:08d}.pt"


def list_checkpoints(run_dir: Path) -> list[Path]:
    folder = run_dir / CKPT_DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name)) and _complete(p)]
    return [p for _, p in sorted(found)]


def _complete(path: Path) -> bool:
    """A file (written by an atomic rename), or a sharded checkpoint's directory (renamed into
    place once every rank's shard and the meta file are written)."""
    return path.is_file() if path.suffix == ".pt" else (path / SHARDED_META).is_file()


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / SHARDED_META).is_file()


def prune(run_dir: Path, keep: int) -> None:
    for old in list_checkpoints(run_dir)[:-keep]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    """``trainer.resume``: null (fresh run), auto (this run dir's latest, if any), or a path to a
    checkpoint (a file, or a sharded checkpoint's directory) or to a run directory (its latest)."""
    if resume is None:
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if is_sharded(path):
        return path
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise MptrainError(f"trainer.resume={resume}: no checkpoints in {path / CKPT_DIR}")
        return found[-1]
    if not path.is_file():
        raise MptrainError(f"trainer.resume={resume}: no such checkpoint file or run directory")
    return path


def load(path: Path) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt, truncated, or not a torch file at all
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MptrainError(f"trainer.resume={path}: not a readable mptrain checkpoint ({first[:160]})") from exc
    if not isinstance(state, dict) or state.get("format") != 1:
        raise MptrainError(f"trainer.resume={path}: not an mptrain checkpoint (no format marker)")
    return state


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG streams: CPU torch, this process's own GPU (not every visible one: under
    DDP each rank owns one device, and another rank's stream is not ours to save), Python, numpy."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": random.getstate(),
        # numpy's state holds an ndarray, which weights_only refuses: store it as a list.
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "rounding": rounding_rng.state_dict(),  # stochastic rounding's own stream (issue 18)
    }


def set_rng_state(saved: list[dict[str, Any]] | dict[str, Any], rank: int, device: torch.device) -> bool:
    """Restore this rank's streams from a checkpoint's per-rank list (rank 0 gathers them on save).

    Resuming on fewer ranks uses the first ones; a rank the checkpoint has no state for (more ranks
    than were saved) keeps the streams its seed gave it. Returns whether a state was restored.
    """
    if isinstance(saved, dict):  # checkpoints before per-rank states: one state, every GPU's stream
        saved = [{**saved, "cuda": _own_cuda(saved.get("cuda"), device)}]
    if rank >= len(saved):
        return False
    state = saved[rank]
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    random.setstate(_to_tuple(state["python"]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    rounding_rng.load_state_dict(state.get("rounding"))  # absent in checkpoints before issue 18
    return True


def _own_cuda(states: list[torch.Tensor] | None, device: torch.device) -> torch.Tensor | None:
    if not states or device.type != "cuda":
        return None
    index = device.index or 0
    return states[index] if index < len(states) else None


def _to_tuple(x: Any) -> Any:
    return tuple(_to_tuple(v) for v in x) if isinstance(x, list | tuple) else x

"""Sharded checkpoints (``parallel=fsdp2``), and resuming across layouts and world sizes.

A sharded checkpoint is a directory ``checkpoints/step_N/``:

- the tensors, through ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards of
  the parameters (``modules/<network>/<fqn>``) and of the optimizer state
  (``optimizers/<objective>/<fqn>/<key>``), as ``torch.distributed.checkpoint.state_dict.get_state_dict``
  gives them; a load reads whichever pieces the new layout needs, so the world size may change;
- ``meta.pt``, everything else (step, scalers, schedulers, every rank's RNG streams, the precision's
  state, the optimizer's hyper-parameters, the config), written by rank 0 with ``torch.save``.

Loading stays ``weights_only``: ``meta.pt`` is read with ``torch.load(weights_only=True)``, DCP
reads tensors with ``weights_only=True`` too, and the one pickle DCP writes itself (``.metadata``)
is read through an unpickler that admits DCP's own metadata classes and nothing else
(``SafeReader``). Nothing but tensors goes through DCP, so its pickled-bytes path is never used.

Atomic as the one-file checkpoints are: the ranks write into ``.step_N.partial/``; once all have
written, rank 0 writes ``meta.pt`` and renames the directory to ``step_N``. A crash at any point
leaves the previous checkpoint as it was (a directory without ``meta.pt`` is never listed).

Layouts switch both ways: a DDP checkpoint (one file, the whole model) resumes under FSDP2 through
``set_state_dict(full_state_dict=True)``, and a sharded one resumes under DDP by reading every tensor
whole. Optimizer state is keyed by parameter name here and by position in a DDP file; FP16 weights
with an FP32 master copy (DDP's fp16_master) map to FSDP2's FP32 shards, which are that copy.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mptrain import checkpoint, distributed
from mptrain.errors import MptrainError
from mptrain.parallel import local, reshard

# The engine and its slots are passed in (typed Any): mptrain.engine imports this module.
Engine = Slot = Any

log = logging.getLogger("mptrain")

# --------------------------------------------------------------------------------------------
# reading DCP's metadata without running pickled code

_SAFE_GLOBALS: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
        "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle (DCP reads it with ``pickle.load``); this admits the classes
    DCP puts there (dataclasses, torch.Size, dtypes, paths) and refuses any other global."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _SAFE_GLOBALS.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")
        return super().find_class(module, name)


def read_metadata(path: Path) -> Any:
    """DCP's metadata of the checkpoint at ``path``, unpickled with the allowlist above."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    try:
        with open(path / ".metadata", "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as exc:
        raise MptrainError(f"trainer.resume={path}: not a readable sharded checkpoint ({exc})") from exc
    pickled = [k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    if pickled:
        raise MptrainError(f"trainer.resume={path}: the checkpoint holds pickled objects ({pickled[0]}, ...); "
                           "mptrain writes tensors only into DCP and will not unpickle these")
    return meta


def _reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        """DCP's file reader, with ``.metadata`` checked by ``_MetadataUnpickler`` first."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            read_metadata(path)
            return super().read_metadata(*args, **kwargs)

    return SafeReader(path)


# --------------------------------------------------------------------------------------------
# save


def save(engine: Engine, rng: list[dict[str, Any]]) -> None:
    """Every rank writes its shards; rank 0 writes meta.pt and renames the directory into place.
    A collective: every rank calls it at the same step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    for m in engine.task.modules.values():
        reshard(m)
    finite = [local(p).detach().isfinite().all() for m in engine.task.modules.values() for p in m.parameters()]
    bad = (~torch.stack(finite).all()).float() if finite else torch.zeros((), device=engine.device)
    if float(distributed.all_reduce(bad, "max")):  # any rank's shard: then no rank writes
        if engine.dist.is_main:
            log.warning("step %d: weights are not finite; checkpoint not written", engine.step)
        return
    tensors: dict[str, Tensor] = {}
    groups: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for slot in engine.slots:
        model_sd, optim_sd = get_state_dict(slot.module, slot.optimizer)
        tensors.update({f"modules/{slot.objective.module}/{k}": v for k, v in model_sd.items()})
        name = slot.objective.name
        for fqn, state in optim_sd["state"].items():
            for key, value in state.items():
                if isinstance(value, Tensor):
                    tensors[f"optimizers/{name}/{fqn}/{key}"] = value
                else:
                    extra.setdefault(name, {}).setdefault(fqn, {})[key] = value
        groups[name] = optim_sd["param_groups"]
    meta = {**engine.run_state(rng), "layout": "fsdp2", "world_size": engine.dist.world_size,
            "param_groups": groups, "optim_extra": extra}

    final = checkpoint.checkpoint_path(engine.run_dir, engine.step).with_suffix("")
    tmp = final.with_name(f".{final.name}.partial")
    if engine.dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed save's leftovers
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp))
    if engine.dist.is_main:
        checkpoint.save_atomic(meta, tmp / checkpoint.SHARDED_META)  # written last: marks it complete
        _commit(tmp, final)
        checkpoint.prune(engine.run_dir, engine.cfg.trainer.keep_checkpoints)
    dist.barrier()  # no rank goes on (or exits) before the checkpoint is in place


def _commit(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` (atomic on POSIX); an existing ``final`` (the same step saved
    again) is moved aside first and deleted after."""
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# load


def read_meta(path: Path) -> dict[str, Any]:
    return checkpoint.load(path / checkpoint.SHARDED_META)


def load_full(path: Path) -> dict[str, Tensor]:
    """Every tensor of a sharded checkpoint, whole, on this process (no collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = read_metadata(path).state_dict_metadata
    full = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in entries.items()
            if isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():  # DCP says it assumes one process: it is told so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(full, storage_reader=_reader(path), no_dist=True)
    return full


def optimizer_fqns(slot: Slot) -> list[str]:
    """The parameter name of each tensor the optimizer updates, in its order (a DDP checkpoint keys
    optimizer state by that position; an FP32 master stands for its FP16 parameter)."""
    module = slot.module.module if isinstance(slot.module, nn.parallel.DistributedDataParallel) else slot.module
    names = {id(p): n for n, p in module.named_parameters()}
    back = {}
    if slot.master is not None:
        back = {id(m): p for p, m in zip(slot.master.model_params, slot.master.masters, strict=True)}
    return [names[id(back.get(id(p), p))] for g in slot.optimizer.param_groups for p in g["params"]]


def _canonical_names(module: nn.Module) -> dict[str, str]:
    """Every parameter name -> the first name of that parameter (a tied weight has several)."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n) for n, p in module.named_parameters(remove_duplicate=False)}


def restore(engine: Engine, path: Path, state: dict[str, Any]) -> None:
    """Load the modules and optimizers of ``engine`` from the checkpoint at ``path`` (``state``: its
    meta.pt, or the whole one-file checkpoint), whatever layout wrote it and whichever this run has."""
    from torch.distributed.checkpoint.api import CheckpointException

    if engine.sharding is not None:
        for m in engine.task.modules.values():
            reshard(m)
    try:
        if not checkpoint.is_sharded(path):
            _from_file_into_fsdp2(engine, state)
        elif engine.sharding is not None:
            _from_sharded_into_fsdp2(engine, path, state)
        else:
            _from_sharded_into_ddp(engine, path, state)
    except CheckpointException as exc:  # a BaseException: say it as the engine's other load errors
        raise RuntimeError(str(exc).strip().splitlines()[0] if str(exc).strip() else "DCP load failed") from exc


def _from_sharded_into_fsdp2(engine: Engine, path: Path, meta: dict[str, Any]) -> None:
    """DCP reads each rank's pieces of the saved shards, whatever world size wrote them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    saved = set(read_metadata(path).state_dict_metadata)
    for slot in engine.slots:
        name, net = slot.objective.name, slot.objective.module
        model_sd, optim_sd = get_state_dict(slot.module, slot.optimizer)  # targets: this layout's shards
        targets = {f"modules/{net}/{k}": v for k, v in model_sd.items()}
        kept: dict[str, dict[str, Any]] = {}
        for fqn, st in optim_sd["state"].items():
            keys = {key: f"optimizers/{name}/{fqn}/{key}" for key, v in st.items() if isinstance(v, Tensor)}
            if keys and all(k in saved for k in keys.values()):  # a parameter that had no state then has none now
                targets.update({k: st[key] for key, k in keys.items()})
                kept[fqn] = st
        dcp.load(targets, storage_reader=_reader(path))
        model_sd = {k: targets[f"modules/{net}/{k}"] for k in model_sd}
        for fqn, st in kept.items():
            st.update({key: targets[f"optimizers/{name}/{fqn}/{key}"]
                       for key, v in st.items() if isinstance(v, Tensor)})
            st.update(meta["optim_extra"].get(name, {}).get(fqn, {}))
        set_state_dict(slot.module, slot.optimizer, model_state_dict=model_sd,
                       optim_state_dict={"state": kept, "param_groups": meta["param_groups"][name]})


def _from_sharded_into_ddp(engine: Engine, path: Path, meta: dict[str, Any]) -> None:
    """Every tensor whole (this run holds the whole model), then each DDP structure filled by name."""
    full = load_full(path)
    for slot in engine.slots:
        name, net = slot.objective.name, slot.objective.module
        module = engine.task.modules[net]
        inner = module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
        prefix = f"modules/{net}/"
        model_sd = {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
        inner.load_state_dict(model_sd)  # FP32 values into FP16 storage (fp16_master): rounded, as after a step
        if slot.master is not None:
            names = {id(p): n for n, p in inner.named_parameters()}
            for p, m in zip(slot.master.model_params, slot.master.masters, strict=True):
                m.data.copy_(model_sd[names[id(p)]])  # FSDP2's FP32 shards are the master copy
        fqns = optimizer_fqns(slot)
        index = {fqn: i for i, fqn in enumerate(fqns)}
        state: dict[int, dict[str, Any]] = {}
        for key, value in full.items():
            if key.startswith(f"optimizers/{name}/"):
                fqn, _, leaf = key[len(f"optimizers/{name}/"):].rpartition("/")
                state.setdefault(index[fqn], {})[leaf] = value
        for fqn, extra in meta["optim_extra"].get(name, {}).items():
            state.setdefault(index[fqn], {}).update(extra)
        groups = [{**g, "params": [index[f] for f in g["params"]]} for g in meta["param_groups"][name]]
        slot.optimizer.load_state_dict({"state": state, "param_groups": groups})


def _from_file_into_fsdp2(engine: Engine, state: dict[str, Any]) -> None:
    """A one-file (DDP or single-process) checkpoint: each rank reads it whole and keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    for slot in engine.slots:
        name, net = slot.objective.name, slot.objective.module
        fqns = optimizer_fqns(slot)
        model_sd = dict(state["modules"][net])
        # DDP's fp16_master kept FP16 weights and, in parameter order, an FP32 master for each: the
        # masters are what FSDP2's FP32 shards hold.
        masters = state.get("masters", {}).get(name, {}).get("masters", [])
        low = [f for f in fqns if model_sd[f].dtype != torch.float32]
        if len(low) != len(masters):
            raise MptrainError(f"{len(masters)} FP32 masters for {len(low)} low-precision weights")
        by_param = dict(zip(low, masters, strict=True))
        for alias, fqn in _canonical_names(slot.module).items():  # a tied weight: every name gets the master
            if fqn in by_param:
                model_sd[alias] = by_param[fqn]
        current = slot.module.state_dict()
        model_sd = {k: v.to(current[k].dtype) if k in current else v for k, v in model_sd.items()}
        optim = state["optimizers"][name]
        optim_sd = {
            "state": {fqns[int(i)]: s for i, s in optim["state"].items()},
            "param_groups": [{**g, "params": [fqns[int(i)] for i in g["params"]]} for g in optim["param_groups"]],
        }
        set_state_dict(slot.module, slot.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=StateDictOptions(full_state_dict=True))

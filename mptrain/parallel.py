"""Sharded data parallelism (``parallel=fsdp2``): FSDP2 units, the precision modes mapped onto its
MixedPrecisionPolicy, and each rank's state in bytes (under DDP too).

Everything here is PyTorch's: ``fully_shard`` over an ``init_device_mesh`` mesh shards every
parameter along dim 0 as a DTensor; a unit all-gathers its weights just before its forward and
backward and reduce-scatters its gradients after. The optimizer, ``torch.amp.GradScaler`` and
``clip_grad_norm_`` work on the DTensor shards as they are (the norm of DTensor gradients is the
global norm). What is written here is the glue that mptrain's precision object needs:

- ``shard_policy``: how each precision mode maps onto FSDP2 (README.md's table is this function);
- ``Fsdp2.shard``: the units (the model's default, or ``parallel.shard_modules`` patterns), then the root;
- ``Fsdp2.after_step``: per-step work on the shards (bf16_pure's rounding, torchao's scales);
- ``state_bytes``: parameter, gradient and optimizer-state bytes held by this rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from mptrain.distributed import DistEnv
from mptrain.errors import MptrainError
from mptrain.numerics.precision import _NORM_TYPES, Precision, stochastic_round_to_bf16
from mptrain.patterns import check_all_match, matches_exactly

log = logging.getLogger("mptrain")

_SHORT = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def fsdp2_available() -> bool:
    """``torch.distributed.fsdp.fully_shard`` is public from torch 2.6 on."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def has_param_dtype_override() -> bool:
    """``MixedPrecisionPolicy(param_dtype_override_fn=...)``: a per-parameter gather dtype (torch 2.15)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return "param_dtype_override_fn" in {f.name for f in dataclasses.fields(MixedPrecisionPolicy)}


# --------------------------------------------------------------------------------------------
# the precision modes, sharded


@dataclass(frozen=True)
class ShardPolicy:
    """How one precision mode runs under FSDP2."""

    param_dtype: torch.dtype | None  # the dtype weights are all-gathered in for compute (None: as stored, FP32)
    reduce_dtype: torch.dtype | None  # the dtype gradients are reduce-scattered in (None: the gathered dtype)
    keep_fp32: tuple[type[nn.Module], ...] = ()  # layers whose weights are gathered in FP32 whatever param_dtype
    round_shards: torch.dtype | None = None  # after each step, round the FP32 shards onto this grid (bf16_pure)
    # The FP32 shards start on this grid (keep_fp32 layers excepted), as masters copied from a model
    # cast to it do on one process (fp16_master, bf16_pure)
    start_grid: torch.dtype | None = None
    master: str = "the FP32 shards (no separate master copy)"
    why: str = ""

    def describe(self, autocast: torch.dtype | None) -> dict[str, Any]:
        return {
            "param_dtype": _SHORT.get(self.param_dtype, "float32") if self.param_dtype else "float32",
            "reduce_dtype": _SHORT[self.reduce_dtype or self.param_dtype or torch.float32],
            "keep_fp32": [t.__name__ for t in self.keep_fp32],
            "autocast": _SHORT[autocast] if autocast is not None else None,
            "round_shards": _SHORT[self.round_shards] if self.round_shards else None,
            "master": self.master,
            "why": self.why,
        }


def shard_policy(precision: Precision) -> ShardPolicy:
    """The FSDP2 mapping of ``precision`` (its requested and resolved mode). Every mode keeps FP32
    shards: they are what the optimizer updates."""
    resolved, half = precision.resolved, precision.autocast_dtype
    if precision.requested == "mixed" and half is not None:
        # The paper's recipe, sharded: the FP32 shards are the master copy. Linear/Conv weights are
        # gathered in the half type, which is what autocast casts them to per op anyway (same values,
        # half the all-gather bytes); norms and embeddings in FP32, as autocast leaves them.
        return ShardPolicy(
            half, torch.float32, keep_fp32=(*_NORM_TYPES, nn.Embedding),
            master="the FP32 shards are the master copy (no MasterWeights)",
            why="mixed: half weights gathered for compute, FP32 gradient reduce-scatter, autocast as on one process",
        )
    if precision.fp8 == "torchao":
        return ShardPolicy(
            None, None,
            why="torchao float8 as on one process (bf16 autocast over FP32 shards); with the tensorwise recipe the "
                "Float8Linear weights are all-gathered in float8 (enable_fsdp_float8_all_gather), scales precomputed "
                "from the whole weight after each step",
        )
    if resolved in ("amp_fp16", "amp_bf16"):
        return ShardPolicy(
            None, None,
            why="autocast over FP32 shards: every op sees what torch.autocast gives it on one process (its per-op "
                "lists decide what runs in half), so the numerics are the single-process mode's; FP32 all-gathers",
        )
    if resolved == "fp16_master":
        return ShardPolicy(
            torch.float16, torch.float32, keep_fp32=_NORM_TYPES, start_grid=torch.float16,
            master="the FP32 shards are the master copy (no MasterWeights)",
            why="Micikevicius et al. sharded: FP16 weights gathered for compute (norm layers FP32, as on one process), "
                "gradients reduce-scattered and unscaled in FP32, the update applied to the FP32 shards, which start "
                "from the FP16-cast weights as the masters do",
        )
    if resolved == "bf16_pure":
        return ShardPolicy(
            torch.bfloat16, torch.bfloat16, round_shards=torch.bfloat16, start_grid=torch.bfloat16,
            master="none: the FP32 shards hold bf16 values (rounded after every step)",
            why="pure bf16: weights and gradient communication in bf16 (as DDP all-reduces bf16 gradients); the "
                "update is applied in FP32 and rounded back to bf16, stochastically with precision.stochastic_rounding",
        )
    if precision.fp8 == "emulated" or precision.mx is not None:
        return ShardPolicy(
            None, None,
            why="the emulated quantizers see the all-gathered FP32 weight, so every block is quantized exactly as on "
                "one process"
                + ("; master_weights=fp16 rounds each rank's shard onto the FP16 grid" if precision.fp8 else ""),
        )
    return ShardPolicy(None, None, why=f"{resolved}: FP32 storage, compute and communication")


# --------------------------------------------------------------------------------------------
# which modules become FSDP units


def auto_unit_types() -> tuple[type[nn.Module], ...]:
    """The model families' rule: transformer blocks, ResNet bottleneck/basic blocks, GoogLeNet and
    Inception v3 blocks, and the LSTM. AlexNet, VGG and DCGAN have none: one unit, the root."""
    from torchvision.models.googlenet import Inception
    from torchvision.models.inception import InceptionA, InceptionAux, InceptionB, InceptionC, InceptionD, InceptionE
    from torchvision.models.resnet import BasicBlock, Bottleneck

    from mptrain.models.transformer import Block

    return (Block, Bottleneck, BasicBlock, Inception, InceptionA, InceptionB, InceptionC, InceptionD, InceptionE,
            InceptionAux, nn.LSTM)


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def stage_units(model: nn.Module) -> list[str]:
    """A zoo model's top-level stages: descend through any child that holds over 90% of the
    parameters (timm's ``stages``, torchvision's ``features``), then take the children there that are
    blocks of layers, not single layers (``stages.0``..``stages.3``, ``layer1``..``layer4``). Fewer
    than two such children (AlexNet: its weight is in three Linear layers) is none: the root alone."""
    node, prefix = model, ""
    while True:
        total = _n_params(node)
        big = next(((n, m) for n, m in node.named_children() if _n_params(m) > 0.9 * total
                    and any(True for _ in m.children())), None)
        if big is None:
            break
        prefix, node = f"{prefix}{big[0]}.", big[1]
    units = [f"{prefix}{n}" for n, m in node.named_children() if _n_params(m) and any(True for _ in m.children())]
    return units if len(units) >= 2 else []


def _outermost(names: list[str]) -> list[str]:
    return [n for n in names if not any(n.startswith(o + ".") for o in names)]


def unit_names(model: nn.Module, patterns: list[str]) -> list[str]:
    """Names of the modules that become FSDP units before the root, innermost first (fully_shard
    must see a nested unit before the one around it). ``[auto]``, outermost matches only: the classes a
    Hugging Face model lists in ``_no_split_modules`` (its decoder layers) and ``auto_unit_types``;
    where neither is found, ``stage_units``. Else patterns of module names (fnmatch per dotted
    segment), each of which must match."""
    if list(patterns) == ["auto"]:
        types = auto_unit_types()
        no_split = set(getattr(model, "_no_split_modules", None) or ())
        found = _outermost([n for n, m in model.named_modules()
                            if n and (isinstance(m, types) or type(m).__name__ in no_split)])
        found = found or stage_units(model)
    else:
        names = [n for n, _ in model.named_modules() if n]
        hits = {p: sum(matches_exactly(p, n) for n in names) for p in patterns}
        check_all_match(f"parallel.shard_modules={list(patterns)}", patterns, hits, names, what="module")
        found = [n for n in names if any(matches_exactly(p, n) for p in patterns)]
    return sorted(found, key=lambda n: -n.count("."))


class Fsdp2:
    """``parallel=fsdp2``: the mesh, the units and the policy of one run. Reads ``parallel.*``."""

    def __init__(self, cfg: DictConfig, device: torch.device, env: DistEnv, precision: Precision) -> None:
        if not fsdp2_available():
            raise MptrainError(f"parallel=fsdp2 needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); "
                               f"this is torch {torch.__version__}")
        if not env.enabled:
            raise MptrainError("parallel=fsdp2 needs a process group: launch with torchrun (--nproc_per_node=1 for "
                               "one process) or as SLURM tasks")
        from torch.distributed.device_mesh import init_device_mesh

        replicate = int(cfg.replicate)
        if env.world_size % replicate:
            raise MptrainError(f"parallel.replicate={replicate}: must divide the world size ({env.world_size})")
        self.patterns = list(cfg.shard_modules)
        self.reshard_after_forward = bool(cfg.reshard_after_forward)
        self.precision = precision
        self.policy = shard_policy(precision)
        shape = (replicate, env.world_size // replicate) if replicate > 1 else (env.world_size,)
        names = ("replicate", "shard") if replicate > 1 else ("shard",)
        self.mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        self.units: dict[str, list[str]] = {}
        self.fallback_units: list[str] = []  # keep_fp32 layers made units of their own (no override fn)
        self.float8_all_gather = (precision.fp8 == "torchao"
                                  and str(precision.options.get("recipe", "tensorwise")) == "tensorwise")
        self._round: list[nn.Module] = []

    def _mp_policy(self, model: nn.Module) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        p = self.policy
        if not p.keep_fp32 or p.param_dtype is None or not has_param_dtype_override():
            # Without the override fn the keep_fp32 layers are already FP32 units of their own (shard()).
            return MixedPrecisionPolicy(param_dtype=p.param_dtype, reduce_dtype=p.reduce_dtype)
        keep = {id(q) for m in model.modules() if isinstance(m, p.keep_fp32) for q in m.parameters(recurse=False)}
        return MixedPrecisionPolicy(param_dtype=p.param_dtype, reduce_dtype=p.reduce_dtype,
                                    param_dtype_override_fn=lambda q: torch.float32 if id(q) in keep else None)

    def shard(self, name: str, model: nn.Module) -> nn.Module:
        """``fully_shard`` the units of ``model`` (a task network called ``name``), then its root.
        Parameters must be FP32 (``Precision.prepare_model(sharded=True)`` leaves them so)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        units = unit_names(model, self.patterns)
        p = self.policy
        if p.keep_fp32 and p.param_dtype is not None and not has_param_dtype_override():
            if nn.Embedding in p.keep_fp32:
                # A tied embedding cannot be a unit apart from its head: autocast over FP32 shards instead.
                p = self.policy = dataclasses.replace(p, param_dtype=None, reduce_dtype=None, keep_fp32=(),
                                                      why=p.why + " (this torch has no param_dtype_override_fn: "
                                                      "gathered in FP32, autocast casts per op)")
            else:
                # No per-parameter gather dtype before torch 2.15: FP32 layers become units of their own.
                own = [n for n, m in model.named_modules() if n and isinstance(m, p.keep_fp32)]
                fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=p.reduce_dtype, cast_forward_inputs=False)
                for n in sorted(own, key=lambda n: -n.count(".")):
                    fully_shard(model.get_submodule(n), mesh=self.mesh, mp_policy=fp32,
                                reshard_after_forward=self.reshard_after_forward)
                self.fallback_units += [f"{name}.{n}" for n in own]
        policy = self._mp_policy(model)
        with warnings.catch_warnings():
            # An LSTM unit returns its state as views; nothing here modifies them in place.
            warnings.filterwarnings("ignore", message=".*returned a view tensor")
            for n in units:
                fully_shard(model.get_submodule(n), mesh=self.mesh, mp_policy=policy,
                            reshard_after_forward=self.reshard_after_forward)
            # The root too (not FSDP2's keep-the-root-gathered default): a forward without backward (the
            # precision plan, evaluation) then leaves every parameter sharded, as the optimizer sees it.
            fully_shard(model, mesh=self.mesh, mp_policy=policy, reshard_after_forward=self.reshard_after_forward)
        self.units[name] = [*units, "<root>"]
        if p.start_grid is not None:
            with torch.no_grad():
                for m in model.modules():
                    if not isinstance(m, p.keep_fp32):
                        for q in m.parameters(recurse=False):
                            local(q).copy_(local(q).to(p.start_grid).float())
        if p.round_shards is not None:
            self._round.append(model)
        return model

    @torch.no_grad()
    def _round_shards(self, model: nn.Module, stochastic: bool) -> None:
        for q in model.parameters():
            shard = local(q)
            shard.copy_((stochastic_round_to_bf16(shard) if stochastic else shard.to(torch.bfloat16)).float())

    def after_step(self, model: nn.Module) -> None:
        """After each optimizer step (skipped or not, as the single-process masters are written back)."""
        for m in self._round:
            if m is model:
                self._round_shards(m, stochastic=bool(self.precision.options.get("stochastic_rounding", False)))
        if self.float8_all_gather:
            # torchao's FSDP hook: one all-reduce of every float8 weight's amax for the next all-gather.
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)

    @contextlib.contextmanager
    def gathered(self, models: Iterable[nn.Module]) -> Iterator[None]:
        """Every unit's weights gathered once and kept until the block ends: forwards inside issue no
        collectives, so ranks may run different numbers of them (evaluation: validation shards can
        differ by a batch). Costs the whole model in param_dtype on each rank meanwhile."""
        from torch.distributed.fsdp import FSDPModule

        units = [m for model in models for m in model.modules() if isinstance(m, FSDPModule)]
        for u in units:
            u.set_reshard_after_forward(False, recurse=False)
            u.unshard()
        try:
            yield
        finally:
            for u in units:
                u.reshard()
                u.set_reshard_after_forward(self.reshard_after_forward, recurse=False)

    def describe(self) -> dict[str, Any]:
        return {
            "mesh": {"shape": list(self.mesh.shape), "dim_names": list(self.mesh.mesh_dim_names or ())},
            "reshard_after_forward": self.reshard_after_forward,
            "shard_modules": self.patterns,
            "units": self.units,
            "fp32_units": self.fallback_units,
            "mixed_precision": self.policy.describe(self.precision.autocast_dtype),
            "float8_all_gather": self.float8_all_gather,
        }


def reshard(model: nn.Module) -> None:
    """Register every FSDP unit's sharded parameters again, should a forward without backward have
    left one gathered (``reshard_after_forward=false``): what named_parameters() and the optimizer see."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


# --------------------------------------------------------------------------------------------
# what each rank holds


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t``: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors: Any) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors if isinstance(t, Tensor))


def state_bytes(modules: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                masters: list[list[Tensor]]) -> dict[str, int]:
    """Bytes of parameters (with any FP32 master copy), gradients and optimizer state this rank holds
    now. A parameter shared by two modules counts once."""
    params = {id(p): p for m in modules for p in m.parameters()}
    for group in masters:
        params.update({id(p): p for p in group})
    grads = [p.grad for p in params.values() if p.grad is not None]
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values()]
    out = {"param_bytes": _nbytes(params.values()), "grad_bytes": _nbytes(grads), "optim_bytes": _nbytes(state)}
    out["total_bytes"] = sum(out.values())
    return out


def parallel_record(name: str, env: DistEnv, sharding: Fsdp2 | None, masters: bool,
                    state: list[dict[str, int]]) -> dict[str, Any]:
    """summary.json's ``parallel``: the layout, how the precision maps onto it, and ``state`` (every
    rank's state bytes after the last step; this rank's alone if training did not finish)."""
    record: dict[str, Any] = {"name": name, "distributed": env.enabled, "world_size": env.world_size}
    if sharding is not None:
        record.update(sharding.describe())
    else:
        record["master"] = "MasterWeights: an FP32 copy of the low-precision weights, whole on every rank" \
            if masters else None
    record["state_bytes"] = state
    return record

"""Precision: the one object that says how numbers are stored and computed in a run.

Every mode goes through the same engine path; this object supplies the differences:

- ``autocast()``: the context the forward pass and loss run in (FP16/BF16 per op, FP32 for
  reductions such as softmax and batch-norm statistics, as torch.autocast's op lists decide);
- ``prepare_model()``: storage casts (fp16_master: FP16 weights except batch norm; bf16_pure:
  everything bf16) and FP8 conversion;
- ``master_weights()``: the FP32 copy that the optimizer updates (Micikevicius et al. 2017),
  because an FP16 weight w does not move under an update smaller than half an ulp (|w| * 2^-11);
- ``after_step()``: per-step work of the mode itself (FP8's FP16 master rounding).

Modes (``precision.name``): fp32 (TF32 off: a true baseline), tf32, amp_fp16, amp_bf16, mixed
(the fastest half type the device computes natively, see ``mptrain.hardware``: amp_fp16 on CUDA,
amp_bf16 on a CPU with AVX512-BF16/AMX, fp32 on other CPUs), fp16_master, bf16_pure, fp8, mx
(emulated OCP MX / NVFP4 GEMMs, ``mptrain.numerics``).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from mptrain.errors import MptrainError
from mptrain.hardware import DeviceCapability, device_capability, emulation_slowdown
from mptrain.numerics import fused
from mptrain.numerics.formats import stochastic_round_to_bf16 as stochastic_round_to_bf16  # re-exported
from mptrain.numerics.rounding_rng import rounding_generator

log = logging.getLogger(__name__)

_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


class MasterWeights:
    """An FP32 master copy of low-precision parameters, which the optimizer updates.

    ``before_unscale`` copies gradients to FP32 (GradScaler refuses FP16 gradients, and unscaling in
    FP32 avoids a second rounding); ``after_step`` writes the masters back into the model's storage
    dtype, optionally with stochastic rounding. With ``refresh=True`` (bf16_pure) the masters are
    re-read from the model before every step, so no FP32 information survives between steps: the
    numerics of pure-bf16 training with a stochastically rounded update.
    """

    def __init__(self, params: list[nn.Parameter], stochastic_rounding: bool = False, refresh: bool = False):
        self.model_params = [p for p in params if p.dtype != torch.float32]
        self.masters = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in self.model_params]
        self._by_id = {id(p): m for p, m in zip(self.model_params, self.masters, strict=True)}
        self.stochastic_rounding = stochastic_rounding
        self.refresh = refresh
        self._grad_bufs: list[Tensor] | None = None

    def swap(self, p: nn.Parameter) -> nn.Parameter:
        """The tensor the optimizer should own in place of model parameter p."""
        return self._by_id.get(id(p), p)

    @torch.no_grad()
    def before_unscale(self) -> None:
        """Gradients into the FP32 masters: one multi-tensor copy into buffers kept across steps (the
        optimizer's zero_grad drops the masters' .grad, not the buffers), not a cast per parameter."""
        if self.refresh:
            torch._foreach_copy_(self.masters, self.model_params)
        have = [i for i, p in enumerate(self.model_params) if p.grad is not None]
        if self._grad_bufs is None:
            self._grad_bufs = [torch.empty_like(m) for m in self.masters]
        if have:
            torch._foreach_copy_([self._grad_bufs[i] for i in have], [self.model_params[i].grad for i in have])
        for i, (p, m) in enumerate(zip(self.model_params, self.masters, strict=True)):
            m.grad = self._grad_bufs[i] if p.grad is not None else None
            p.grad = None

    @torch.no_grad()
    def after_step(self) -> None:
        """Masters back into the model's storage dtype: one multi-tensor copy (round to nearest), or
        for stochastic rounding, fused kernels that the small parameters share and a large one has
        to itself (``fused.write_back_``; one draw per parameter, as the reference loop)."""
        if not self.model_params:
            return
        if self.stochastic_rounding:
            fused.write_back_(self.model_params, self.masters, rounding_generator(self.masters[0].device))
        else:
            torch._foreach_copy_(self.model_params, self.masters)

    def state_dict(self) -> dict[str, Any]:
        return {"masters": [m.detach() for m in self.masters]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for m, saved in zip(self.masters, state["masters"], strict=True):
            m.data.copy_(saved)


@dataclass
class Precision:
    """How a run stores and computes numbers. Built by ``build_precision``; reads ``precision.*``."""

    requested: str  # the configured mode, e.g. "mixed"
    resolved: str  # what runs on this device, e.g. "fp32" for mixed on an AVX2-only CPU
    device: torch.device
    autocast_dtype: torch.dtype | None = None
    param_dtype: torch.dtype = torch.float32  # storage dtype of weights (batch norm stays FP32)
    allow_tf32: bool = False
    fp8: str | None = None  # "torchao" (real FP8 kernels) | "emulated" | None
    note: str | None = None  # said in the log, e.g. why mixed resolved to bf16
    options: dict[str, Any] = field(default_factory=dict)
    fp8_state: Any = None  # owned by mptrain.numerics.fp8 (the converted layers, for after_step)
    mx: str | None = None  # precision=mx: the block format (mxfp8, ..., nvfp4)
    mx_state: Any = None  # owned by mptrain.numerics.convert (the per-layer decisions)
    capability: DeviceCapability | None = None  # what the device computes natively (build_precision sets it)

    @property
    def emulated(self) -> bool:
        """Whether GEMM operands are quantized by emulation (FP8 emulated, MX, NVFP4)."""
        return self.fp8 == "emulated" or self.mx is not None

    @property
    def half_dtype(self) -> torch.dtype | None:
        """The low-precision type gradients live in, for telemetry and underflow checks."""
        if self.autocast_dtype is not None:
            return self.autocast_dtype
        return None if self.param_dtype == torch.float32 else self.param_dtype

    def configure_backends(self) -> None:
        """TF32 on or off (global torch flags): off is what makes fp32 a true FP32 baseline.

        Through ``fp32_precision``, the API torch documents from 2.9 on (every supported torch):
        once anything (inductor, torchao, a user) has used it, the legacy ``allow_tf32`` flags
        raise when read, and setting them leaves cuDNN's convolution flag at "none". cuDNN's own
        flag is set beside its conv and rnn ones because inductor reads it.

        torch still keeps a legacy cuDNN bool beside those flags (True by default), and its getter,
        which ``torch.backends.cudnn.flags()`` and ``torch.export`` call, raises unless that bool
        agrees with conv and rnn. It is set first (its setter also writes conv and rnn), so that
        turning TF32 off leaves a process where both still work: an H100 run of the CUDA tests
        failed on it after an fp32 run in the same process.
        """
        value = "tf32" if self.allow_tf32 else "ieee"
        torch.backends.cudnn.allow_tf32 = self.allow_tf32
        for backend in (torch.backends.cuda.matmul, torch.backends.cudnn, torch.backends.cudnn.conv,
                        torch.backends.cudnn.rnn):
            backend.fp32_precision = value

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def prepare_model(self, model: nn.Module, sharded: bool = False, compiled: bool = False) -> nn.Module:
        """Cast storage and convert layers for this mode. Call before building the optimizer.

        ``sharded`` (parallel=fsdp2): weights stay FP32, as FSDP2's shards are the master copy and its
        MixedPrecisionPolicy gathers them in ``param_dtype`` (mptrain.parallel.shard_policy).
        ``compiled`` (trainer.compile): emulated MX layers are traced into the model's graph."""
        if self.param_dtype != torch.float32 and not sharded:
            model.to(self.param_dtype)
            if self.resolved == "fp16_master":
                # Batch norm keeps FP32 weights and statistics: its reductions need the range.
                for module in model.modules():
                    if isinstance(module, _NORM_TYPES):
                        module.float()
        if self.fp8 is not None:
            # Imported here: FP8 is optional numerics (fp8 itself never imports this module).
            from mptrain.numerics.fp8 import convert_model

            # Adds to the state of the task's other networks (a GAN's two): all get the recipe.
            options = {**self.options, "backend": self.fp8, "fsdp_float8_all_gather": sharded}
            model, self.fp8_state = convert_model(model, options, self.fp8_state)
        if self.mx is not None:
            from mptrain.numerics.convert import convert_model as convert_mx

            model, self.mx_state = convert_mx(model, self.options, self.mx_state, in_graph=compiled)
        return model

    def master_weights(self, groups: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], MasterWeights | None]:
        """Param groups for one optimizer, with FP32 masters in place of low-precision parameters.

        Returns the groups and the MasterWeights to drive (None when weights are FP32 already).
        """
        if self.param_dtype == torch.float32:
            return groups, None
        params = [p for g in groups for p in g["params"]]
        master = MasterWeights(
            params,
            stochastic_rounding=bool(self.options.get("stochastic_rounding", False)),
            refresh=self.resolved == "bf16_pure",
        )
        return [{**g, "params": [master.swap(p) for p in g["params"]]} for g in groups], master

    def check_patterns(self) -> None:
        """Once every network is converted: MptrainError for a ``precision.keep_high`` or
        ``precision.only`` pattern that named no layer (a typo would otherwise keep nothing high)."""
        for state in (self.fp8_state, self.mx_state):
            if state is not None:
                state.check_patterns()

    def after_step(self) -> None:
        """Per-step work of the precision itself, after every optimizer step (FP8 master rounding)."""
        for state in (self.fp8_state, self.mx_state):
            if state is not None:
                state.after_step()

    def state_dict(self) -> dict[str, Any]:
        """What the precision itself must carry across a resume: MX's rounding streams (stochastic
        rounding and nothing else draws from them; every rank seeds and draws alike)."""
        return {"mx_rng": self.mx_state.rng.state_dict() if self.mx_state is not None else None}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state and state.get("mx_rng") and self.mx_state is not None:  # absent before MX checkpointed it
            self.mx_state.rng.load_state_dict(state["mx_rng"])

    def input_cast(self, x: Tensor) -> Tensor:
        """Inputs follow the weights' dtype when the model itself is stored in low precision."""
        if self.autocast_dtype is None and x.is_floating_point() and self.param_dtype != torch.float32:
            return x.to(self.param_dtype)
        return x

    def plan_default(self) -> tuple[str, str]:
        """(format, reason) of a GEMM layer this mode computes in its own dtype, for the plan: for the
        emulated modes, a layer they leave unquantized (kept high), which computes in FP32 or in the
        autocast, never in ``emulated_compute`` (that is the quantized GEMMs' own)."""
        short = {torch.float16: "fp16", torch.bfloat16: "bf16"}
        if self.emulated:
            if self.autocast_dtype is not None:
                return short[self.autocast_dtype], "autocast (precision.autocast)"
            return "fp32", f"precision={self.resolved}: outside the emulated GEMMs"
        if self.autocast_dtype is not None:
            return short[self.autocast_dtype], f"autocast ({self.resolved})"
        if self.param_dtype != torch.float32:
            name = short[self.param_dtype]
            return name, f"{name} weights ({self.resolved})"
        if self.allow_tf32 and self.device.type == "cuda":
            return "tf32", "TF32 matmuls (precision=tf32)"
        return "fp32", f"precision={self.resolved}"

    def describe(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "resolved": self.resolved,
            "autocast_dtype": str(self.autocast_dtype).replace("torch.", "") if self.autocast_dtype else None,
            "param_dtype": str(self.param_dtype).replace("torch.", ""),
            "allow_tf32": self.allow_tf32,
            "fp8": self.fp8,
            "fp8_layers": self.fp8_state.describe() if self.fp8_state is not None else None,
            "mx": self.mx,
            "mx_layers": self.mx_state.describe() if self.mx_state is not None else None,
            "note": self.note,
        }


def build_precision(cfg: DictConfig, device: torch.device) -> Precision:
    """Resolve ``precision.name`` for ``device`` and check that the device can run it.

    Reads ``precision.name`` and, for bf16_pure/fp8, their options. Impossible combinations
    (bf16 on a GPU without bf16, torchao FP8 off CUDA or below sm89) raise MptrainError.
    """
    name = cfg.name
    options = {k: v for k, v in cfg.items() if k != "name"}
    cuda = device.type == "cuda"
    cap = device_capability(device)
    p = Precision(requested=name, resolved=name, device=device, capability=cap, options=options)
    if name == "fp32":
        pass
    elif name == "tf32":
        p.allow_tf32 = True
        if not cuda:
            p.note = "tf32 affects CUDA matmuls only; on CPU it is plain FP32"
    elif name == "amp_fp16":
        p.autocast_dtype = torch.float16
    elif name == "amp_bf16":
        p.autocast_dtype = torch.bfloat16
    elif name == "mixed":
        # The fastest half type this device computes natively (mptrain.hardware).
        half = cap.best_half
        if half == torch.float16:
            p.resolved, p.autocast_dtype = "amp_fp16", torch.float16
            p.note = "mixed = FP16 autocast + FP32 master weights + dynamic loss scaling (CUDA)"
        elif half == torch.bfloat16:
            p.resolved, p.autocast_dtype = "amp_bf16", torch.bfloat16
            p.note = f"mixed resolved to amp_bf16: this CPU computes bf16 natively ({cap.detail})"
        else:
            p.resolved = "fp32"
            p.note = (
                f"mixed resolved to fp32: this CPU ({cap.detail}) has no native bf16 or FP16 arithmetic "
                "(no AVX512-BF16 or AMX), so half precision would be emulated and slower than FP32; "
                "force it with precision=amp_bf16 (or amp_fp16) to study its numerics"
            )
    elif name == "fp16_master":
        p.param_dtype = torch.float16
    elif name == "bf16_pure":
        p.param_dtype = torch.bfloat16
    elif name == "fp8":
        backend = options.get("backend", "emulated")
        p.fp8 = backend
        if backend == "torchao":
            _check_torchao(device)
            p.autocast_dtype = torch.bfloat16  # non-Linear ops run in bf16 around the FP8 matmuls
        else:
            masters = str(options.get("master_weights", "fp16")).upper()
            recipe = {
                "tensor": "per-tensor scales (current scaling)",
                "rowwise": "a power-of-two scale per row along each GEMM's reduction dim (torchao's rowwise)",
            }.get(
                str(options.get("scaling", "loss")),
                "no per-tensor scaling: the loss scale keeps gradients in range (Mellempudi et al.)",
            )
            p.note = f"FP8 emulated: E5M2/E4M3 values computed in higher precision, {masters} master weights, {recipe}"
    elif name == "mx":
        from mptrain.numerics.convert import MxOptions

        opts = MxOptions.parse(options)  # bad values stop here, before any model is built
        p.mx = opts.format.name
        # The emulated GEMMs leave any autocast (qgemm.no_autocast) and compute in opts.compute; the
        # autocast decides only what they do not compute.
        p.autocast_dtype = torch.bfloat16 if opts.autocast == "bf16" else None
        rest = "in a bf16 autocast" if p.autocast_dtype else "in FP32"
        p.note = (
            f"{opts.format.name} emulated: every Linear/Conv2d GEMM rounds its operands onto {opts.format.name} "
            f"blocks along its reduction dim (forward and backward) and multiplies in {opts.compute}; the layers "
            f"kept high and the other ops run {rest}; FP32 master weights; per-block scales, so no loss scaling"
        )
    else:
        raise MptrainError(f"precision={name!r}: unknown mode")

    for dtype in (p.autocast_dtype, p.param_dtype):
        if cuda and dtype == torch.bfloat16 and not cap.native_bf16:
            raise MptrainError(
                f"precision={name}: this GPU ({torch.cuda.get_device_name(device)}) has no bf16 support; "
                "use amp_fp16, mixed or fp32"
            )
    if not cuda:
        _warn_if_emulated(p)
    return p


def _warn_if_emulated(p: Precision) -> None:
    """An explicit low-precision mode on a CPU without that arithmetic still runs (its numerics are
    worth studying anywhere), but the user hears once, in one line, how slow that will be."""
    cap = p.capability
    assert cap is not None
    if p.fp8 == "emulated" or p.mx is not None:
        what = "fp8" if p.mx is None else f"mx ({p.mx})"
        compute = str(p.options.get("emulated_compute", "fp32"))
        autocast = p.autocast_dtype == torch.bfloat16
        bf16 = compute == "bf16" or autocast
        slowdown = emulation_slowdown(torch.bfloat16) if bf16 and not cap.native(torch.bfloat16) else 1.0
        log.warning(
            "precision=%s: no CPU has this arithmetic, so it is emulated: every converted layer rounds its weights, "
            "activations and gradients onto the format's grid and computes in %s%s%s. Expect it several times "
            "slower than fp32 (docs/benchmarks); use it to study the numerics, not for speed",
            what, compute, ", the rest in a bf16 autocast" if autocast else "",
            f" (bf16 itself emulated here, about {slowdown:.0f}x slower than fp32)" if slowdown > 1.5 else "",
        )
        return
    dtype = p.half_dtype
    if dtype is None or cap.native(dtype):
        return
    short = {torch.float16: "FP16", torch.bfloat16: "bf16"}[dtype]
    log.warning(
        "precision=%s: this CPU (%s) has no native %s arithmetic, so it is emulated through FP32: about %.0fx "
        "slower than fp32 here (a convolution probe). Fine for studying numerics on small models; for speed use "
        "precision=mixed, which resolves to %s on this CPU",
        p.requested, cap.detail, short, emulation_slowdown(dtype), "amp_bf16" if cap.native_bf16 else "fp32",
    )


def _check_torchao(device: torch.device) -> None:
    if device.type != "cuda":
        raise MptrainError("precision=fp8 precision.backend=torchao needs a CUDA GPU; use backend=emulated")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise MptrainError(
            f"precision.backend=torchao needs a GPU of compute capability 8.9+ (Ada/Hopper); "
            f"this one is sm{major}{minor}: use backend=emulated"
        )
    try:
        import torchao  # noqa: F401
    except ImportError as exc:
        raise MptrainError("precision.backend=torchao needs the torchao package: pip install torchao") from exc

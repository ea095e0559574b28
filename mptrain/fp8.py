"""FP8 training: exact FP8 numerics, emulated FP8 layers (Mellempudi et al. 2019), and torchao.

Selected by ``precision=fp8``; options ``precision.backend`` (emulated | torchao),
``precision.format`` (e5m2 | hybrid), ``precision.master_weights`` (fp16 | fp32),
``precision.stochastic_rounding``, ``precision.emulated_compute`` (fp32 | bf16) and, for torchao,
``precision.recipe``.

Numerics (usable on their own):

- ``quantize(x, fmt, scale=None)``: round-to-nearest-even onto the format's grid, subnormals
  included, saturating at +-max; NaN stays NaN. Values come back dequantized in x's dtype.
- ``stochastic_round(x, fmt_or_dtype)``: unbiased rounding, E[round(x)] = x.
- ``tensor_scale(x, fmt)`` / ``quantize_scaled``: per-tensor power-of-two scaling, computed on
  the device (no host sync).

Emulated training: ``convert_model`` swaps every nn.Linear, nn.Conv2d and nn.ConvTranspose2d for
a subclass that quantizes weights and input activations (round-to-nearest; E5M2, or E4M3 for
``format=hybrid``) and, in backward, the error (grad wrt output) and the weight gradient to E5M2.
The products are computed in ``emulated_compute`` on the dequantized values, as FP8 hardware
accumulates in higher precision. ``after_step`` keeps FP16 master weights.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mptrain.errors import MptrainError

if TYPE_CHECKING:
    from mptrain.precision import Precision

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# formats


@dataclass(frozen=True)
class Fp8Format:
    """A binary floating-point format, described by what rounding onto its grid needs.

    Named for FP8 but also used for FP16/BF16 (``FP16``, ``BF16``), so the rounding helpers
    handle FP16 master weights with the same code.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    min_exp: int  # exponent of the smallest normal number: min_normal = 2**min_exp
    max: float  # largest finite value; quantization saturates here
    dtype: torch.dtype  # torch's native storage type for the format

    @property
    def min_normal(self) -> float:
        return 2.0**self.min_exp

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.min_exp - self.mantissa_bits)


E5M2 = Fp8Format("e5m2", 5, 2, -14, 57344.0, torch.float8_e5m2)
E4M3 = Fp8Format("e4m3fn", 4, 3, -6, 448.0, torch.float8_e4m3fn)
FP16 = Fp8Format("fp16", 5, 10, -14, 65504.0, torch.float16)
BF16 = Fp8Format("bf16", 8, 7, -126, float(torch.finfo(torch.bfloat16).max), torch.bfloat16)

_BY_DTYPE = {f.dtype: f for f in (E5M2, E4M3, FP16, BF16)}
_BY_NAME = {f.name: f for f in (E5M2, E4M3, FP16, BF16)} | {"e4m3": E4M3, "float16": FP16, "bfloat16": BF16}


def as_format(fmt: Fp8Format | torch.dtype | str) -> Fp8Format:
    """An Fp8Format from itself, a torch dtype (float8_e5m2, float8_e4m3fn, float16, bfloat16) or a name."""
    if isinstance(fmt, Fp8Format):
        return fmt
    found = _BY_DTYPE.get(fmt) if isinstance(fmt, torch.dtype) else _BY_NAME.get(fmt)
    if found is None:
        raise ValueError(f"no rounding format for {fmt!r}; known: {sorted(_BY_NAME)}")
    return found


def _exp2i(k: Tensor) -> Tensor:
    """2**k as float32 for integer-valued k in [-126, 127], built from the exponent bits.

    Exact by construction (torch.exp2 need not be exact for integer arguments).
    """
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def _work(x: Tensor) -> Tensor:
    # Rounding is computed in FP32: it holds every FP8/FP16/BF16 value exactly (float64 inputs
    # are first rounded to FP32).
    return x.float() if x.dtype != torch.float32 else x


# --------------------------------------------------------------------------------------------
# rounding


def quantize(x: Tensor, fmt: Fp8Format | torch.dtype, scale: Tensor | float | None = None) -> Tensor:
    """Round x to nearest-even on ``fmt``'s grid (subnormals included), saturating at +-max.

    NaN stays NaN; +-Inf saturates too. With ``scale``, rounds ``x * scale`` and divides back
    (see ``tensor_scale``); then non-finite values pass through unchanged, so an FP32 overflow
    still reaches the loss scaler. Returns dequantized values in x's dtype.
    """
    fmt = as_format(fmt)
    xf = _work(x)
    if scale is not None:
        q = torch.where(torch.isfinite(xf), _native_round(xf * scale, fmt) / scale, xf)
    else:
        q = _native_round(xf, fmt)
    return q.to(x.dtype)


def _native_round(xf: Tensor, fmt: Fp8Format) -> Tensor:
    # torch's own cast rounds to nearest-even with subnormals, but overflows (E5M2, FP16: Inf
    # past max + half an ulp) instead of saturating, so clamp first (clamp keeps NaN).
    return xf.clamp(-fmt.max, fmt.max).to(fmt.dtype).to(xf.dtype)


def stochastic_round(
    x: Tensor,
    fmt_or_dtype: Fp8Format | torch.dtype,
    generator: torch.Generator | None = None,
    *,
    scale: Tensor | float | None = None,
) -> Tensor:
    """Round x down to the grid point below |x| with probability 1 - (|x| - down) / eps, else up.

    eps is the grid spacing at x (the subnormal spacing below the smallest normal), so
    E[round(x)] = x (Mellempudi et al. 2019). Saturates at +-max; NaN stays NaN. ``scale`` as in
    ``quantize``. Written by hand: torch has no stochastic-rounding cast.
    """
    fmt = as_format(fmt_or_dtype)
    xf = _work(x)
    if scale is not None:
        q = stochastic_round(xf * scale, fmt, generator) / scale
        return torch.where(torch.isfinite(xf), q, xf).to(x.dtype)
    a = xf.abs().clamp(max=fmt.max)
    _, e = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1): floor(log2(a)) = e - 1
    e = (e - 1).clamp(fmt.min_exp, 127)  # below min normal the spacing is the subnormal one
    eps = _exp2i(e) * 2.0**-fmt.mantissa_bits  # exact: a power of two >= 2**-133
    down = torch.floor(a / eps) * eps
    p_up = (a - down) / eps  # exact: a and down share a binade, eps is a power of two
    u = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
    r = torch.copysign(down + eps * (u < p_up), xf)  # max is a grid point: down + eps <= max
    return torch.where(torch.isnan(xf), xf, r).to(x.dtype)


def tensor_scale(x: Tensor, fmt: Fp8Format | torch.dtype) -> Tensor:
    """Per-tensor scale s = 2**floor(log2(fmt.max / amax(x))), a 0-dim float32 tensor on x's device.

    A power of two, so scaling and unscaling are exact, and amax * s <= fmt.max. s = 1 when amax
    is 0 or non-finite. Computed on the device: no host sync.
    """
    fmt = as_format(fmt)
    if x.numel() == 0:
        return torch.ones((), device=x.device)
    amax = x.detach().abs().amax().float()
    ok = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(ok, amax, torch.ones_like(amax))
    k = torch.floor(math.log2(fmt.max) - torch.log2(safe)).clamp(-126, 126)
    # log2 may be off by one near powers of two: settle k with exact power-of-two products.
    k = torch.where(safe * _exp2i(k) > fmt.max, k - 1, k)
    k = torch.where(safe * _exp2i(k + 1) <= fmt.max, k + 1, k).clamp(-126, 126)
    return torch.where(ok, _exp2i(k), torch.ones_like(amax))


def quantize_scaled(
    x: Tensor,
    fmt: Fp8Format | torch.dtype,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Quantize x with its own per-tensor power-of-two scale; returns dequantized values."""
    s = tensor_scale(x, fmt)
    if stochastic:
        return stochastic_round(x, fmt, generator, scale=s)
    return quantize(x, fmt, s)


# --------------------------------------------------------------------------------------------
# emulated FP8 layers


@dataclass(frozen=True)
class Fp8LayerSpec:
    """How a converted layer rounds: forward format, backward (error and weight-grad) format."""

    forward: Fp8Format  # weights and input activations: E5M2, or E4M3 for format=hybrid
    backward: Fp8Format = E5M2  # errors and weight gradients
    stochastic: bool = True  # stochastic rounding of errors and weight gradients
    compute_dtype: torch.dtype = torch.float32  # precision.emulated_compute


class _QuantizeOperand(torch.autograd.Function):
    """Forward: round an operand to nearest (per-tensor scaled), in the compute dtype.

    Backward: straight through, except that a weight's gradient is itself quantized
    (``grad_fmt`` set): that is the FP8 weight gradient.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        fmt: Fp8Format,
        grad_fmt: Fp8Format | None,
        stochastic: bool,
        compute_dtype: torch.dtype,
    ) -> Tensor:
        ctx.x_dtype, ctx.grad_fmt, ctx.stochastic = x.dtype, grad_fmt, stochastic
        return quantize_scaled(x, fmt).to(compute_dtype)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        g = g.to(ctx.x_dtype)
        if ctx.grad_fmt is not None:
            g = quantize_scaled(g, ctx.grad_fmt, ctx.stochastic)
        return g, None, None, None, None


class _QuantizeError(torch.autograd.Function):
    """Forward: cast the layer output back to the input's dtype. Backward: quantize the error
    (grad wrt output) to the backward format before the layer's products see it."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, y: Tensor, fmt: Fp8Format, stochastic: bool, out_dtype: torch.dtype
    ) -> Tensor:
        ctx.y_dtype, ctx.fmt, ctx.stochastic = y.dtype, fmt, stochastic
        # A copy, not a view: the next op may be in place (VGG's and AlexNet's ReLU(inplace=True)).
        return y.to(out_dtype) if y.dtype != out_dtype else y.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return quantize_scaled(g, ctx.fmt, ctx.stochastic).to(ctx.y_dtype), None, None, None


class _Fp8Mixin:
    """Shared by the converted layers; ``fp8_spec`` is set by ``convert_model``.

    A plain attribute, not a buffer: parameter names and state_dict keys stay those of the
    original layer.
    """

    fp8_spec: Fp8LayerSpec
    weight: nn.Parameter
    bias: nn.Parameter | None

    def _fp8_operands(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        s = self.fp8_spec
        xq = _QuantizeOperand.apply(x, s.forward, None, s.stochastic, s.compute_dtype)
        wq = _QuantizeOperand.apply(self.weight, s.forward, s.backward, s.stochastic, s.compute_dtype)
        # Bias stays unquantized (added in the accumulator's precision); its gradient is the
        # sum of the already-quantized error.
        b = None if self.bias is None else self.bias.to(s.compute_dtype)
        return xq, wq, b

    def _fp8_output(self, y: Tensor, x: Tensor) -> Tensor:
        s = self.fp8_spec
        return _QuantizeError.apply(y, s.backward, s.stochastic, x.dtype)

    def extra_repr(self) -> str:
        s = self.fp8_spec
        return (
            f"{super().extra_repr()}, fp8={s.forward.name}/{s.backward.name}, "  # type: ignore[misc]
            f"stochastic={s.stochastic}, compute={str(s.compute_dtype).replace('torch.', '')}"
        )


class Fp8Linear(_Fp8Mixin, nn.Linear):
    """nn.Linear with emulated FP8 operands (see module docstring)."""

    def forward(self, input: Tensor) -> Tensor:
        x, w, b = self._fp8_operands(input)
        return self._fp8_output(F.linear(x, w, b), input)


class Fp8Conv2d(_Fp8Mixin, nn.Conv2d):
    """nn.Conv2d with emulated FP8 operands (see module docstring)."""

    def forward(self, input: Tensor) -> Tensor:
        x, w, b = self._fp8_operands(input)
        return self._fp8_output(self._conv_forward(x, w, b), input)


class Fp8ConvTranspose2d(_Fp8Mixin, nn.ConvTranspose2d):
    """nn.ConvTranspose2d with emulated FP8 operands (see module docstring)."""

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        x, w, b = self._fp8_operands(input)
        output_padding = self._output_padding(
            input,
            output_size,
            self.stride,  # type: ignore[arg-type]
            self.padding,  # type: ignore[arg-type]
            self.kernel_size,  # type: ignore[arg-type]
            2,
            self.dilation,  # type: ignore[arg-type]
        )
        stride, padding, dilation = self.stride, self.padding, self.dilation
        y = F.conv_transpose2d(x, w, b, stride, padding, output_padding, self.groups, dilation)  # type: ignore[arg-type]
        return self._fp8_output(y, input)


# Exact types only: a subclass may have its own forward (or, like MultiheadAttention's
# out_proj, none that is ever called), which swapping the class would silently replace.
_EMULATED: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: Fp8Linear,
    nn.Conv2d: Fp8Conv2d,
    nn.ConvTranspose2d: Fp8ConvTranspose2d,
}


# --------------------------------------------------------------------------------------------
# conversion and master weights


@dataclass
class Fp8State:
    """What ``convert_model`` did, kept on ``Precision.fp8_state`` for logs and ``after_step``."""

    backend: str  # precision.backend
    converted: list[str]  # names of the converted layers ("" is the root module)
    format: str | None = None  # precision.format (emulated)
    recipe: str | None = None  # precision.recipe (torchao)
    master_weights: str = "fp32"  # precision.master_weights (emulated)
    stochastic_rounding: bool = False
    # The converted model itself, not a list of its parameters: a later .to() or
    # load_state_dict(assign=True) may replace Parameter objects.
    model: nn.Module | None = field(default=None, repr=False)

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "format": self.format,
            "recipe": self.recipe,
            "master_weights": self.master_weights,
            "stochastic_rounding": self.stochastic_rounding,
            "converted": list(self.converted),
        }


_COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def convert_model(model: nn.Module, precision: Precision) -> nn.Module:
    """Convert ``model`` for FP8 training per ``precision.backend``; fills ``precision.fp8_state``.

    emulated: every nn.Linear / nn.Conv2d / nn.ConvTranspose2d (exact type) becomes its Fp8*
    subclass in place, with forward format from ``precision.format``, stochastic rounding of
    gradients from ``precision.stochastic_rounding`` and products in
    ``precision.emulated_compute``. With ``precision.master_weights=fp16`` every parameter is
    rounded to FP16 now and after every step (``after_step``).
    torchao: see ``_convert_torchao``.
    """
    opts = precision.options
    backend = precision.fp8 or str(opts.get("backend", "emulated"))
    if backend == "torchao":
        return _convert_torchao(model, precision)
    if backend != "emulated":
        raise MptrainError(f"precision.backend={backend!r}: must be one of emulated, torchao")

    fmt_name = str(opts.get("format", "e5m2"))
    masters = str(opts.get("master_weights", "fp16"))
    compute = str(opts.get("emulated_compute", "fp32"))
    forward = {"e5m2": E5M2, "hybrid": E4M3}.get(fmt_name)
    if forward is None:
        raise MptrainError(f"precision.format={fmt_name!r}: must be one of e5m2, hybrid")
    if masters not in ("fp16", "fp32"):
        raise MptrainError(f"precision.master_weights={masters!r}: must be one of fp16, fp32")
    if compute not in _COMPUTE:
        raise MptrainError(f"precision.emulated_compute={compute!r}: must be one of fp32, bf16")
    stochastic = bool(opts.get("stochastic_rounding", True))
    spec = Fp8LayerSpec(
        forward=forward, backward=E5M2, stochastic=stochastic, compute_dtype=_COMPUTE[compute]
    )

    converted = []
    for name, module in model.named_modules():
        cls = _EMULATED.get(type(module))
        if cls is None:
            continue
        # Swapping the class keeps the very same parameters, names, hooks and device.
        module.__class__ = cls
        module.fp8_spec = spec  # type: ignore[assignment]
        converted.append(name)
    if not converted:
        log.warning(
            "precision=fp8 (emulated): the model has no Linear/Conv2d/ConvTranspose2d layer to convert"
        )

    precision.fp8_state = Fp8State(
        backend="emulated",
        converted=converted,
        format=fmt_name,
        master_weights=masters,
        stochastic_rounding=stochastic,
        model=model,
    )
    if masters == "fp16":
        # The master copy starts as FP16 too, as if the model had been cast.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(quantize(p, FP16))
    log.info(
        "fp8 emulated: %s forward, E5M2 backward, %s masters, %d layers converted: %s",
        forward.name,
        masters,
        len(converted),
        ", ".join(n or "<root>" for n in converted),
    )
    return model


@torch.no_grad()
def after_step(precision: Precision) -> None:
    """After each optimizer step: with ``precision.master_weights=fp16``, round every parameter
    onto the FP16 grid (stochastically if ``precision.stochastic_rounding``), so the master copy
    carries only FP16 information. No host sync: device ops only."""
    state = precision.fp8_state
    if not isinstance(state, Fp8State) or state.model is None or state.master_weights != "fp16":
        return
    for p in state.model.parameters():
        p.copy_(stochastic_round(p, FP16) if state.stochastic_rounding else quantize(p, FP16))


def _fp8_eligible(m: nn.Linear) -> bool:
    # torchao's float8 matmul (torch._scaled_mm) needs both dimensions divisible by 16.
    return m.in_features % 16 == 0 and m.out_features % 16 == 0


def _convert_torchao(model: nn.Module, precision: Precision) -> nn.Module:
    """torchao ``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name``
    (``precision.recipe``), skipping Linear layers whose in/out features are not divisible by 16."""
    recipe = str(precision.options.get("recipe", "tensorwise"))
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not any(_fp8_eligible(m) for _, m in linears):
        found = ", ".join(f"{n or '<root>'}: {m.in_features}x{m.out_features}" for n, m in linears)
        raise MptrainError(
            "precision.backend=torchao: no Linear layer has in/out features divisible by 16 "
            f"(found {found or 'no Linear layers'})"
        )
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise MptrainError(
            "precision.backend=torchao needs the torchao package: pip install torchao"
        ) from exc

    def module_filter_fn(module: nn.Module, fqn: str) -> bool:
        return not isinstance(module, nn.Linear) or _fp8_eligible(module)

    config = Float8LinearConfig.from_recipe_name(recipe)
    model = convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)
    converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    precision.fp8_state = Fp8State(backend="torchao", converted=converted, recipe=recipe)
    log.info("fp8 torchao (%s): %d Linear layers converted: %s", recipe, len(converted), ", ".join(converted))
    return model

"""FP8 training: exact FP8 numerics, emulated FP8 layers (Mellempudi et al. 2019), and torchao.

Selected by ``precision=fp8``; options ``precision.backend`` (emulated | torchao),
``precision.scaling`` (loss | tensor | rowwise), ``precision.format`` (e5m2 | hybrid),
``precision.master_weights`` (fp16 | fp32), ``precision.stochastic_rounding``,
``precision.emulated_compute`` (fp32 | bf16) and, for torchao, ``precision.recipe``.

Three recipes (``precision.scaling``):

- ``loss`` (the default): Mellempudi et al. 2019 as written. Tensors are rounded to E5M2 as they
  are, with no per-tensor rescaling, so the loss scale is what moves errors and gradients into
  E5M2's range (smallest subnormal 2^-16, max 57344): it decides how many gradients underflow, and
  an error or gradient past max becomes Inf so that the loss scaler backs off (enhanced loss
  scaling, ``loss_scale=auto``).
- ``tensor``: the modern "current scaling" recipe (Transformer Engine, torchao ``tensorwise``):
  every quantisation gets its own power-of-two scale from the tensor's amax. E5M2 rounding is
  invariant under a power-of-two rescaling, so here the loss scale has no effect on the rounded
  values at all.
- ``rowwise``: torchao's ``rowwise`` recipe: one power-of-two scale per row along each GEMM's
  reduction dim (Linear and Conv2d; ``mptrain.numerics.qgemm``), so the input and the error are
  each quantized twice, once per GEMM that reads them (x along in_features for the forward and
  along tokens for the weight gradient), and the weight gradient itself stays in high precision,
  as torchao leaves it. ConvTranspose2d has no row-wise emulation and stays high (recorded).

Numerics (usable on their own):

- ``quantize(x, fmt, scale=None, saturate=True)``: round-to-nearest-even onto the format's grid,
  subnormals included, saturating at +-max (or overflowing to +-Inf with ``saturate=False``); NaN
  stays NaN. Values come back dequantized in x's dtype.
- ``stochastic_round(x, fmt_or_dtype)``: unbiased rounding, E[round(x)] = x.
- ``tensor_scale(x, fmt)`` / ``quantize_scaled``: per-tensor power-of-two scaling, computed on
  the device (no host sync).

Rounding is ``mptrain.numerics.formats``' (one implementation for FP8, FP6, FP4, FP16 and BF16).

Emulated training: ``convert_model`` swaps every nn.Linear, nn.Conv2d and nn.ConvTranspose2d for
a subclass that quantizes weights and input activations (round-to-nearest, saturating; E5M2, or
E4M3 for ``format=hybrid``) and, in backward, the error (grad wrt output) and the weight gradient
to E5M2. The products are computed in ``emulated_compute`` on the dequantized values, as FP8
hardware accumulates in higher precision. ``Fp8State.after_step`` keeps FP16 master weights. Every
network of a task (a GAN's generator and discriminator) is converted into the same state.

This module does not import the precision object: ``convert_model`` takes the options and returns
the state that ``mptrain.numerics.precision.Precision`` keeps. Its ``decisions`` list says, for every GEMM
layer, what it computes in and why (``mptrain.numerics.convert.LayerDecision``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from mptrain import patterns
from mptrain.errors import MptrainError
from mptrain.numerics import formats as nf
from mptrain.numerics import fused
from mptrain.numerics.convert import LayerDecision, gemm_kind, prefixed, tag
from mptrain.numerics.qgemm import (
    AxiswiseQuantizer,
    GemmRecipe,
    QuantConv2dFn,
    QuantLinearFn,
    RngStreams,
    no_autocast,
    traced_output,
)
from mptrain.numerics.rounding_rng import RoundingStream, rounding_generator

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
# The same formats as mptrain.numerics describes them, for its rounding.
_ELEMENT = {E5M2: nf.E5M2, E4M3: nf.E4M3, FP16: nf.FP16, BF16: nf.BF16}
_BY_NAME = {f.name: f for f in (E5M2, E4M3, FP16, BF16)} | {"e4m3": E4M3, "float16": FP16, "bfloat16": BF16}


def as_format(fmt: Fp8Format | torch.dtype | str) -> Fp8Format:
    """An Fp8Format from itself, a torch dtype (float8_e5m2, float8_e4m3fn, float16, bfloat16) or a name."""
    if isinstance(fmt, Fp8Format):
        return fmt
    found = _BY_DTYPE.get(fmt) if isinstance(fmt, torch.dtype) else _BY_NAME.get(fmt)
    if found is None:
        raise ValueError(f"no rounding format for {fmt!r}; known: {sorted(_BY_NAME)}")
    return found


_exp2i = nf.exp2i  # 2**k as float32, exact


def _work(x: Tensor) -> Tensor:
    # Rounding is computed in FP32, which holds every FP8/FP16/BF16 value exactly; float64 stays
    # float64, so that it is rounded once, straight onto the format's grid.
    return nf.work_dtype(x)


# --------------------------------------------------------------------------------------------
# rounding


def quantize(
    x: Tensor, fmt: Fp8Format | torch.dtype, scale: Tensor | float | None = None, *, saturate: bool = True
) -> Tensor:
    """Round x to nearest-even on ``fmt``'s grid (subnormals included), saturating at +-max.

    NaN stays NaN; +-Inf saturates too. With ``saturate=False`` (formats with an Inf: E5M2, FP16)
    values at or past max + half an ulp become +-Inf, as an IEEE cast does: that is how an
    overflowing FP8 gradient reaches the loss scaler. With ``scale``, rounds ``x * scale`` and
    divides back (see ``tensor_scale``); then non-finite values pass through unchanged, so an FP32
    overflow still reaches the loss scaler. Returns dequantized values in x's dtype.
    """
    fmt = as_format(fmt)
    xf = _work(x)
    if scale is not None:
        q = torch.where(torch.isfinite(xf), _native_round(xf * scale, fmt, saturate) / scale, xf)
    else:
        q = _native_round(xf, fmt, saturate)
    return q.to(x.dtype)


def _native_round(xf: Tensor, fmt: Fp8Format, saturate: bool = True) -> Tensor:
    # numerics' round-to-nearest-even: torch's cast, saturating or (saturate=False) overflowing to
    # Inf past max + half an ulp as an IEEE cast does.
    return nf.round_to_element(xf, _ELEMENT[fmt], saturate=saturate).to(xf.dtype)


def stochastic_round(
    x: Tensor,
    fmt_or_dtype: Fp8Format | torch.dtype,
    generator: torch.Generator | RoundingStream | None = None,
    *,
    scale: Tensor | float | None = None,
    saturate: bool = True,
) -> Tensor:
    """Round x down to the grid point below |x| with probability 1 - (|x| - down) / eps, else up.

    eps is the grid spacing at x (the subnormal spacing below the smallest normal), so
    E[round(x)] = x (Mellempudi et al. 2019). Saturates at +-max (with ``saturate=False``,
    |x| > max becomes +-Inf); NaN stays NaN. ``scale`` as in ``quantize``. The rounding is
    ``mptrain.numerics.formats.round_generic`` (torch has no stochastic-rounding cast).
    """
    fmt = as_format(fmt_or_dtype)
    xf = _work(x)
    if scale is not None:
        q = stochastic_round(xf * scale, fmt, generator, saturate=saturate) / scale
        return torch.where(torch.isfinite(xf), q, xf).to(x.dtype)
    if generator is None:  # the run's own rounding stream: keeps dropout paired with FP32 (issue 18)
        generator = rounding_generator(xf.device)
    # Outside a run (nothing seeded) the generator stays None and the global RNG is used.
    r = nf.round_generic(xf, _ELEMENT[fmt], stochastic=True, generator=generator)
    if not saturate:
        r = torch.where(xf.abs() > fmt.max, torch.copysign(torch.full_like(r, math.inf), xf), r)
    return r.to(x.dtype)


def tensor_scale(x: Tensor, fmt: Fp8Format | torch.dtype) -> Tensor:
    """Per-tensor scale s = 2**floor(log2(fmt.max / amax(x))), a 0-dim float32 tensor on x's device.

    A power of two, so scaling and unscaling are exact, and amax * s <= fmt.max. s = 1 when amax
    is 0 or non-finite. Computed on the device: no host sync.
    """
    fmt = as_format(fmt)
    if x.numel() == 0:
        return torch.ones((), device=x.device)
    return nf.pow2_scale(x.detach().abs().amax().float(), _ELEMENT[fmt])


def quantize_scaled(
    x: Tensor,
    fmt: Fp8Format | torch.dtype,
    stochastic: bool = False,
    generator: torch.Generator | RoundingStream | None = None,
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
    scaling: str = "loss"  # precision.scaling: loss (Mellempudi et al.) | tensor | rowwise
    rng: RngStreams | None = field(default=None, compare=False)  # rowwise: stochastic rounding's generators

    def gemm_recipe(self) -> GemmRecipe:
        """scaling=rowwise: the quantized-GEMM recipe (forward format for inputs and weights,
        backward format for errors, per-row power-of-two scales)."""
        q = AxiswiseQuantizer(
            _ELEMENT[self.forward], _ELEMENT[self.backward], self.stochastic, self.rng or RngStreams(0)
        )
        return GemmRecipe(quantizer=q, compute_dtype=self.compute_dtype)

    def round_operand(self, x: Tensor) -> Tensor:
        """Weights and activations: round to nearest, saturating at the forward format's max.
        Fused (``mptrain.numerics.fused``); the eager reference is ``quantize`` / ``quantize_scaled``."""
        fmt = _ELEMENT[self.forward]
        if self.scaling == "tensor":
            return fused.quantize_scaled(x, fmt)
        return fused.round_to_element(x, fmt).to(x.dtype)

    def round_gradient(self, g: Tensor) -> Tensor:
        """Errors and weight gradients in the backward format. With loss scaling alone they are
        rounded as they are, and past E5M2's max they become Inf: the loss scaler's overflow.
        Stochastic rounding draws from the run's rounding stream (the global RNG outside a run)."""
        fmt = _ELEMENT[self.backward]
        gen = rounding_generator(g.device) if self.stochastic else None
        if self.scaling == "tensor":
            return fused.quantize_scaled(g, fmt, stochastic=self.stochastic, generator=gen)
        return fused.round_to_element(g, fmt, stochastic=self.stochastic, generator=gen, saturate=False).to(g.dtype)


class _QuantizeOperand(torch.autograd.Function):
    """Forward: round an operand to nearest, in the compute dtype (or take ``kept``, the weight's
    rounding that ``Fp8State.after_step`` already wrote).

    Backward: straight through, except that a weight's gradient is itself quantized
    (``is_weight``): that is the FP8 weight gradient.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, spec: Fp8LayerSpec, is_weight: bool,  # type: ignore[override]
                kept: Tensor | None = None) -> Tensor:
        ctx.x_dtype, ctx.spec, ctx.is_weight = x.dtype, spec, is_weight
        # An alias, not the kept tensor itself: autograd records this output's history on it.
        return traced_output(kept.detach() if kept is not None else spec.round_operand(x).to(spec.compute_dtype))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        g = g.to(ctx.x_dtype)
        if ctx.is_weight:
            g = ctx.spec.round_gradient(g)
        return g, None, None, None


class _KeptWeight(NamedTuple):
    version: int  # the weight's version counter when it was written
    forward: Fp8Format
    dtype: torch.dtype
    q: Tensor  # the weight rounded onto ``forward``, in ``dtype``


# A converted layer's weight rounded for its next forward, written by ``Fp8State.after_step`` in the
# pass that rounds the FP16 master (``fused.round_params_``'s ``forward``), so the forward does not
# read and round the weight once more: one weight-sized pass less a step, the cost that separates
# FP8 hybrid's step from FP32's most on a small-batch MLP (scripts/hybrid_gap_bench.py measures the
# two ways side by side). Keyed by the weight tensor itself, and used only while its version counter
# says nothing has written to it since: an optimizer step, load_state_dict or any in-place op makes
# the forward round it again. (Writes through ``.data`` bypass version counters, as they bypass
# autograd's own checks; mptrain makes none to these weights.) Costs one weight-sized copy between
# steps (during a step the forward's rounded weight is held for the backward either way).
_kept_weights: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _kept_weight(w: Tensor, spec: Fp8LayerSpec) -> Tensor | None:
    kept = _kept_weights.get(w)
    if (kept is None or kept.version != w._version or kept.forward != spec.forward or kept.dtype != spec.compute_dtype
            or spec.scaling != "loss"):
        return None
    return kept.q


class _QuantizeError(torch.autograd.Function):
    """Forward: cast the layer output back to the input's dtype. Backward: quantize the error
    (grad wrt output) to the backward format before the layer's products see it."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, spec: Fp8LayerSpec, out_dtype: torch.dtype) -> Tensor:  # type: ignore[override]
        ctx.y_dtype, ctx.spec = y.dtype, spec
        # A copy, not a view: the next op may be in place (VGG's and AlexNet's ReLU(inplace=True)).
        return y.to(out_dtype) if y.dtype != out_dtype else y.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return ctx.spec.round_gradient(g).to(ctx.y_dtype), None, None


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
        xq = _QuantizeOperand.apply(x, s, False)
        wq = _QuantizeOperand.apply(self.weight, s, True, _kept_weight(self.weight, s))
        # Bias stays unquantized (added in the accumulator's precision); its gradient is the
        # sum of the already-quantized error.
        b = None if self.bias is None else self.bias.to(s.compute_dtype)
        return xq, wq, b

    def _fp8_output(self, y: Tensor, x: Tensor) -> Tensor:
        return _QuantizeError.apply(y, self.fp8_spec, x.dtype)

    def extra_repr(self) -> str:
        s = self.fp8_spec
        return (
            f"{super().extra_repr()}, fp8={s.forward.name}/{s.backward.name}, "  # type: ignore[misc]
            f"stochastic={s.stochastic}, compute={str(s.compute_dtype).replace('torch.', '')}, "
            f"scaling={s.scaling}"
        )


class Fp8Linear(_Fp8Mixin, nn.Linear):
    """nn.Linear with emulated FP8 operands (see module docstring)."""

    fp8_recipe: GemmRecipe | None = None  # scaling=rowwise

    @torch.compiler.disable  # as MxLinear's: a graph break under a user's torch.compile
    def forward(self, input: Tensor) -> Tensor:
        if self.fp8_recipe is not None:
            return QuantLinearFn.apply(input, self.weight, self.bias, self.fp8_recipe)
        x, w, b = self._fp8_operands(input)
        with no_autocast(x):  # the products compute in emulated_compute, inside autocast too
            y = F.linear(x, w, b)
        return self._fp8_output(y, input)


class Fp8Conv2d(_Fp8Mixin, nn.Conv2d):
    """nn.Conv2d with emulated FP8 operands (see module docstring)."""

    fp8_recipe: GemmRecipe | None = None  # scaling=rowwise

    @torch.compiler.disable  # as MxConv2d's
    def forward(self, input: Tensor) -> Tensor:
        if self.fp8_recipe is not None:
            return QuantConv2dFn.apply(
                input, self.weight, self.bias, self.fp8_recipe, self.stride, self.padding, self.dilation
            )
        x, w, b = self._fp8_operands(input)
        with no_autocast(x):
            y = self._conv_forward(x, w, b)
        return self._fp8_output(y, input)


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
        with no_autocast(x):
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
    """What ``convert_model`` did, kept on ``Precision.fp8_state`` for logs and ``after_step``.

    One state for every network of a task: ``convert_model`` adds each network it converts (a
    GAN's generator and discriminator), so all of them get the recipe and FP16 master rounding.
    """

    backend: str  # precision.backend
    converted: list[str] = field(default_factory=list)  # converted layers ("" is the root module)
    format: str | None = None  # precision.format (emulated)
    scaling: str | None = None  # precision.scaling (emulated): loss | tensor
    recipe: str | None = None  # precision.recipe (torchao)
    master_weights: str = "fp32"  # precision.master_weights (emulated)
    stochastic_rounding: bool = False
    rng: RngStreams | None = field(default=None, repr=False)  # scaling=rowwise: stochastic rounding's generators
    # The converted models themselves, not lists of their parameters: a later .to() or
    # load_state_dict(assign=True) may replace Parameter objects.
    models: list[nn.Module] = field(default_factory=list, repr=False)
    networks: dict[str, list[str]] = field(default_factory=dict)  # network name -> its layers
    decisions: list[LayerDecision] = field(default_factory=list)  # every GEMM layer: format or high, and why
    # precision.keep_high / precision.only held against every network's layers (check_patterns)
    hits: patterns.PatternHits = field(default_factory=lambda: patterns.PatternHits({}), repr=False)
    _decisions: dict[str, list[LayerDecision]] = field(default_factory=dict, repr=False)

    def add(self, name: str, model: nn.Module, layers: list[str], decisions: list[LayerDecision] | None = None) -> None:
        while name in self.networks:  # two networks of one class
            name += "'"
        self.networks[name] = layers
        self._decisions[name] = list(decisions or [])
        self.decisions = (
            list(self._decisions[name]) if len(self.networks) == 1
            else [d for net, ds in self._decisions.items() for d in prefixed(net, ds)]
        )  # fmt: skip
        self.models.append(model)
        # One network: layer names as they are; several: prefixed by the network.
        self.converted = (
            list(layers) if len(self.networks) == 1
            else [f"{net}.{n}" if n else net for net, ls in self.networks.items() for n in ls]
        )  # fmt: skip

    def check_patterns(self) -> None:
        """MptrainError for a keep_high or only pattern that named no layer of any network."""
        self.hits.check()

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "format": self.format,
            "scaling": self.scaling,
            "recipe": self.recipe,
            "master_weights": self.master_weights,
            "stochastic_rounding": self.stochastic_rounding,
            "converted": list(self.converted),
            "networks": {k: list(v) for k, v in self.networks.items()},
            "decisions": [asdict(d) for d in self.decisions],
        }

    @torch.no_grad()
    def after_step(self) -> None:
        """After each optimizer step: with ``master_weights=fp16``, round every parameter of every
        converted network onto the FP16 grid (stochastically if ``stochastic_rounding``), so the
        master copy carries only FP16 information. The small parameters of a network share one fused
        kernel call, a large one has its own (``fused.round_params_``); one stochastic draw per
        parameter; no host sync. The weight of a layer that rounds it as it is (``scaling=loss``) also
        gets its next forward operand written in that pass (``_kept_weights``)."""
        if self.backend != "emulated" or self.master_weights != "fp16":
            return
        for model in self.models:
            specs = {id(m.weight): m.fp8_spec for m in model.modules()
                     if isinstance(m, _Fp8Mixin) and m.fp8_spec.scaling == "loss"
                     and getattr(m, "fp8_recipe", None) is None}  # fmt: skip
            # parallel=fsdp2: a DTensor parameter rounds its own shard (rounding is elementwise); the
            # forward reads the gathered weight, so a shard's rounding is kept for nothing
            params = list(model.parameters())
            local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
            spec = [specs.get(id(p)) if q is p else None for p, q in zip(params, local, strict=True)]
            if not local:
                continue
            gen = rounding_generator(local[0].device) if self.stochastic_rounding else None
            forward = [None if s is None else _ELEMENT[s.forward] for s in spec]
            out = fused.round_params_(local, nf.FP16, stochastic=self.stochastic_rounding, generator=gen,
                                      forward=forward)
            for p, s, q in zip(params, spec, out, strict=True):
                if s is not None and q is not None:
                    _kept_weights[p] = _KeptWeight(p._version, s.forward, s.compute_dtype, q.to(s.compute_dtype))


_COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16}
SCALINGS = ("loss", "tensor", "rowwise")


def _pattern_hits(options: Mapping[str, Any]) -> patterns.PatternHits:
    return patterns.PatternHits({
        "precision.keep_high": patterns.check_patterns("precision.keep_high", options.get("keep_high") or []),
        "precision.only": patterns.check_patterns("precision.only", options.get("only") or []),
    })


def _plan_reason(kept: str | None, listed: str | None, hits: patterns.PatternHits) -> str | None:
    """Why the plan's patterns keep a layer high (keep_high wins over only), or None."""
    if kept is not None:
        return f"keep_high pattern {kept!r}"
    if hits.lists["precision.only"] and listed is None:
        return "not named by precision.only"
    return None


def convert_model(
    model: nn.Module, options: Mapping[str, Any], state: Fp8State | None = None
) -> tuple[nn.Module, Fp8State]:
    """Convert ``model`` for FP8 training per ``options["backend"]``; returns it and the state.

    Pass the state of the task's previous networks as ``state``: the new network is added to it.
    emulated: every nn.Linear / nn.Conv2d / nn.ConvTranspose2d (exact type) becomes its Fp8*
    subclass in place, with forward format from ``format``, range handling from ``scaling``,
    stochastic rounding of gradients from ``stochastic_rounding`` and products in
    ``emulated_compute``. With ``master_weights=fp16`` every parameter is rounded to FP16 now and
    after every step (``Fp8State.after_step``).
    torchao: see ``_convert_torchao``.
    """
    backend = str(options.get("backend", "emulated"))
    if backend == "torchao":
        return _convert_torchao(model, options, state)
    if backend != "emulated":
        raise MptrainError(f"precision.backend={backend!r}: must be one of emulated, torchao")

    fmt_name = str(options.get("format", "e5m2"))
    masters = str(options.get("master_weights", "fp16"))
    compute = str(options.get("emulated_compute", "fp32"))
    scaling = str(options.get("scaling", "loss"))
    forward = {"e5m2": E5M2, "hybrid": E4M3}.get(fmt_name)
    if forward is None:
        raise MptrainError(f"precision.format={fmt_name!r}: must be one of e5m2, hybrid")
    if masters not in ("fp16", "fp32"):
        raise MptrainError(f"precision.master_weights={masters!r}: must be one of fp16, fp32")
    if compute not in _COMPUTE:
        raise MptrainError(f"precision.emulated_compute={compute!r}: must be one of fp32, bf16")
    if scaling not in SCALINGS:
        raise MptrainError(f"precision.scaling={scaling!r}: must be one of {', '.join(SCALINGS)}")
    stochastic = bool(options.get("stochastic_rounding", True))
    rng = state.rng if state is not None and state.rng is not None else RngStreams(int(options.get("seed", 0) or 0))
    spec = Fp8LayerSpec(
        forward=forward, backward=E5M2, stochastic=stochastic, compute_dtype=_COMPUTE[compute], scaling=scaling,
        rng=rng if scaling == "rowwise" else None,
    )  # fmt: skip
    recipe = spec.gemm_recipe() if scaling == "rowwise" else None
    label = f"fp8_{fmt_name}"

    hits = state.hits if state is not None else _pattern_hits(options)
    hits.see(n for n, _ in model.named_modules())
    converted, decisions = [], []
    for name, module in model.named_modules():
        kind = gemm_kind(module)
        if kind is None or any(name.startswith(d.name + ".") for d in decisions if d.name):
            continue  # not a GEMM, or inside one decided already (MultiheadAttention's out_proj)
        kept = hits.first("precision.keep_high", name)
        listed = hits.first("precision.only", name)
        cls = _EMULATED.get(type(module))
        if cls is None or (recipe is not None and cls is Fp8ConvTranspose2d):
            why = (
                "no row-wise emulation for ConvTranspose2d" if cls is not None
                else "a subclass with its own forward" if isinstance(module, tuple(_EMULATED))
                else f"no FP8 emulation for {type(module).__name__}"
            )  # fmt: skip
            decisions.append(LayerDecision(name, kind, "high", why))
            continue
        plan_why = _plan_reason(kept, listed, hits)
        if plan_why is not None:
            decisions.append(LayerDecision(name, kind, "high", plan_why))
            continue
        # Swapping the class keeps the very same parameters, names, hooks and device.
        module.__class__ = cls
        module.fp8_spec = spec  # type: ignore[assignment]
        if recipe is not None:
            module.fp8_recipe = recipe  # type: ignore[assignment]
        converted.append(name)
        decisions.append(LayerDecision(name, kind, label, f"scaling={scaling}"))
    tag(model, decisions)
    if not converted:
        log.warning(
            "precision=fp8 (emulated): the model has no Linear/Conv2d/ConvTranspose2d layer to convert"
        )

    if state is None:
        state = Fp8State(
            backend="emulated", format=fmt_name, scaling=scaling, master_weights=masters,
            stochastic_rounding=stochastic, rng=rng, hits=hits,
        )  # fmt: skip
    state.add(type(model).__name__, model, converted, decisions)
    if masters == "fp16":
        # The master copy starts as FP16 too, as if the model had been cast.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(quantize(p, FP16))
    log.info(
        "fp8 emulated (%s scaling): %s forward, E5M2 backward, %s masters, %d layers of %s converted: %s",
        scaling,
        forward.name,
        masters,
        len(converted),
        type(model).__name__,
        ", ".join(n or "<root>" for n in converted),
    )
    return model, state


def _torchao_reason(m: nn.Module) -> str:
    if not isinstance(m, nn.Linear):
        return f"torchao float8 converts nn.Linear only, not {type(m).__name__}"
    return f"{m.in_features}x{m.out_features}: not divisible by 16, as float8 GEMMs need"


def _fp8_eligible(m: nn.Linear) -> bool:
    # torchao's float8 matmul (torch._scaled_mm) needs both dimensions divisible by 16.
    return m.in_features % 16 == 0 and m.out_features % 16 == 0


def _convert_torchao(
    model: nn.Module, options: Mapping[str, Any], state: Fp8State | None
) -> tuple[nn.Module, Fp8State]:
    """torchao ``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name``
    (``precision.recipe``), skipping Linear layers whose in/out features are not divisible by 16."""
    recipe = str(options.get("recipe", "tensorwise"))
    hits = state.hits if state is not None else _pattern_hits(options)
    hits.see(n for n, _ in model.named_modules())
    plan_why: dict[str, str] = {}
    for n, m in model.named_modules():
        if gemm_kind(m) is not None:
            why = _plan_reason(hits.first("precision.keep_high", n), hits.first("precision.only", n), hits)
            if why is not None:
                plan_why[n] = why
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not any(_fp8_eligible(m) for n, m in linears if n not in plan_why):
        found = ", ".join(f"{n or '<root>'}: {m.in_features}x{m.out_features}" for n, m in linears
                          if n not in plan_why)
        raise MptrainError(
            "precision.backend=torchao: no Linear layer left by the plan has in/out features divisible by 16 "
            f"(found {found or 'no Linear layers'})"
        )
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise MptrainError(
            "precision.backend=torchao needs the torchao package: pip install torchao"
        ) from exc

    def module_filter_fn(module: nn.Module, fqn: str) -> bool:
        # torchao's only-list hook: the plan's patterns, then float8's shape rule
        return fqn not in plan_why and (not isinstance(module, nn.Linear) or _fp8_eligible(module))

    # The weight-gradient GEMM contracts over the batch (tokens), which torch._scaled_mm needs
    # divisible by 16 like the feature dims: pad_inner_dim zero-pads it, so any batch size trains.
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)
    if options.get("fsdp_float8_all_gather") and recipe == "tensorwise":
        # parallel=fsdp2: all-gather the weights in float8 (torchao's FSDP2 hook; tensorwise scales only).
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    model = convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)
    converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    decisions = [
        LayerDecision(n, kind or "linear", f"torchao_{recipe}", "Float8Linear") if n in converted
        else LayerDecision(n, kind, "high", plan_why.get(n) or _torchao_reason(m))
        for n, m in model.named_modules() if (kind := gemm_kind(m)) is not None or n in converted
    ]  # fmt: skip
    tag(model, decisions)
    if state is None:
        state = Fp8State(backend="torchao", recipe=recipe, hits=hits)
    state.add(type(model).__name__, model, converted, decisions)
    log.info("fp8 torchao (%s): %d Linear layers converted: %s", recipe, len(converted), ", ".join(converted))
    return model, state

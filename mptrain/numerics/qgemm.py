"""Quantized GEMMs: Linear and Conv2d with every GEMM operand quantized along its reduction dim.

A layer's three GEMMs, and how their operands are quantized (forward and backward):

    fprop  y  = x  @ W^T      x blocked along in_features,   W along in_features
    dgrad  dx = dy @ W        dy blocked along out_features, W along out_features
    wgrad  dW = dy^T @ x      dy blocked along tokens,       x along tokens

That is how block-scaled hardware works: a block's scale must be constant along the contraction,
so the block axis follows it, and a tensor used by two GEMMs is quantized twice from its
high-precision copy (Transformer Engine keeps a "rowwise" and a "columnwise" copy). With 2D weight
tiles (NVFP4 recipe) W and W^T quantize identically and the forward copy serves dgrad too.

Gradients reach the FP32 master weights through the straight-through estimator: dW is the GEMM of
the quantized operands, with no derivative of the rounding.

Conv2d is taken as the implicit GEMM of a channels-last convolution, whose reduction index runs
over (kh, kw, C_in): a block of 32 along it is 32 input channels at one filter tap. So activations
are blocked along C (per pixel) and weights along C_in (per output channel and tap), which is the
im2col GEMM's blocking without materialising im2col, exactly when C_in is a multiple of the
block; otherwise each tap's channels are zero-padded to a block, as channels-last kernels pad
C_in. dgrad likewise blocks along C_out. wgrad contracts over (batch, output pixel), so it does
unfold the input (im2col) and blocks both operands along that dim.

The products are computed in ``compute_dtype`` on ``local`` values (elements times block scales) and
multiplied by the operands' per-tensor scales afterwards, as the hardware applies them (NVFP4's
global scales; MX and row-wise FP8 have none). ``local`` is exact in FP32 always, and in bf16 for
every block whose scale is at least 2**``mx.bf16_exact_min_scale_exponent(fmt)``: always for FP6,
FP4 and NVFP4, from 2**-124 for MXFP8 and 2**-117 for MXFP8 E5M2 (below that, bf16 rounds the
smallest values of blocks whose amax is under ~2**-116 / 2**-102). The GEMMs compute in
``compute_dtype`` whatever autocast region they run in, forward and backward: autocast is off
inside them.

Every quantizer runs fused (``mptrain.numerics.fused``: compiled, bit-identical to the eager
reference); stochastic rounding draws from counter-based streams (``RngStreams``).

Written by hand: torchao's mx_formats quantizers (the tests' reference) take contiguous tensors
blocked along the last dim, lengths divisible by the block, and its MX/NVFP4 training covers
nn.Linear; here any dim, padding, Conv2d, stochastic rounding and the Hadamard transform run on
plain tensors on any device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from mptrain.numerics import fused
from mptrain.numerics.formats import ElementFormat
from mptrain.numerics.formats import axiswise_round as axiswise_round  # the rowwise reference, re-exported
from mptrain.numerics.mx import HADAMARD_SIZE, BlockFormat, hadamard_rotation, random_signs, rotate
from mptrain.numerics.rounding_rng import RoundingStream


class Quantizer(Protocol):
    """Quantizes one GEMM operand along its reduction ``dim``: returns (local, tensor scale or None)
    with x ~ local * scale. ``role`` is input, weight or grad (gradients may round stochastically)."""

    def __call__(self, x: Tensor, dim: int, role: str) -> tuple[Tensor, Tensor | None]: ...


class RngStreams:
    """One counter-based stream per device (``rounding_rng.RoundingStream``), seeded deterministically:
    stochastic rounding draws from these, never from the global RNG (which decides a run's data and
    dropout), and compiled and eager quantizers draw the same numbers from them."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._streams: dict[torch.device, RoundingStream] = {}

    def get(self, device: torch.device) -> RoundingStream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = RoundingStream(self.seed, device)
        return stream

    def state_dict(self) -> dict[str, dict[str, int]]:
        """Each device's draw count: a resumed run rounds as the uninterrupted one would."""
        return {str(d): s.state_dict() for d, s in self._streams.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for d, s in state.items():
            if isinstance(s, dict):  # before the counter-based streams: a torch.Generator state, not resumable
                self.get(torch.device(d)).load_state_dict(s)


@dataclass
class BlockQuantizer:
    """MX / NVFP4: ``quantize_blocks`` per operand; stochastic rounding for gradients if asked."""

    fmt: BlockFormat
    stochastic_grads: bool = False
    rng: RngStreams = field(default_factory=lambda: RngStreams(0))

    def __call__(self, x: Tensor, dim: int, role: str) -> tuple[Tensor, Tensor | None]:
        sr = self.stochastic_grads and role == "grad"
        return fused.quantize_blocks(
            x, self.fmt, dim, stochastic=sr, generator=self.rng.get(x.device) if sr else None,
            block_2d=role == "weight_2d",
        )  # fmt: skip


@dataclass
class AxiswiseQuantizer:
    """FP8 with one power-of-two scale per row along the reduction dim (torchao's ``rowwise``
    recipe: 2**floor(log2(max / amax)) for each row of the left operand and each column of the
    right one). Inputs and weights in ``forward``, gradients in ``backward`` (E4M3 / E5M2 for
    ``hybrid``)."""

    forward: ElementFormat
    backward: ElementFormat
    stochastic_grads: bool = False
    rng: RngStreams = field(default_factory=lambda: RngStreams(0))

    def __call__(self, x: Tensor, dim: int, role: str) -> tuple[Tensor, Tensor | None]:
        fmt = self.backward if role == "grad" else self.forward
        sr = self.stochastic_grads and role == "grad"
        return fused.axiswise_round(x, fmt, dim, stochastic=sr, generator=self.rng.get(x.device) if sr else None), None


@dataclass
class GemmRecipe:
    """What a quantized layer does to its GEMMs: the quantizer, the Hadamard transform on wgrad
    (NVFP4 recipe; a random sign vector shared by all layers), and the compute dtype."""

    quantizer: Any  # a Quantizer; role "weight_2d" asks for square tiles over the last two dims
    compute_dtype: torch.dtype = torch.float32
    hadamard_signs: Tensor | None = None  # 16 random +-1 signs: RHT on both wgrad operands
    weight_2d: bool = False  # the weight's forward quantization serves dgrad as well (2D tiles)

    def __post_init__(self) -> None:
        # the signs as host values, read once: the rotation is then cached per device and dtype
        signs = self.hadamard_signs
        self._signs = None if signs is None else tuple(int(v) for v in signs.tolist())

    def rotation(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        return hadamard_rotation(self._signs, device, dtype)  # type: ignore[arg-type]

    @staticmethod
    def signs(seed: int) -> Tensor:
        """The Hadamard sign vector for ``seed`` (CPU; moved to each operand's device)."""
        return random_signs(torch.Generator().manual_seed(seed), HADAMARD_SIZE)


def no_autocast(x: Tensor) -> torch.autocast:
    """Autocast off for an emulated GEMM: ``precision.emulated_compute`` decides what it computes in,
    not an autocast region around the model (which would cast its operands to bf16/FP16)."""
    return torch.autocast(x.device.type, enabled=False)


def _scale(y: Tensor, a: Tensor | None, b: Tensor | None) -> Tensor:
    if a is None and b is None:
        return y
    s = (a if a is not None else 1.0) * (b if b is not None else 1.0)  # type: ignore[operator]
    return y * s


def _wgrad_operands(recipe: GemmRecipe, g: Tensor, x: Tensor) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """Quantize the wgrad GEMM's operands g (rows, K) and x (cols, K), both along K (tokens); with
    the Hadamard transform, K is zero-padded to a multiple of 16 and both are rotated first."""
    if recipe.hadamard_signs is not None:
        extra = -g.shape[1] % HADAMARD_SIZE
        if extra:
            g, x = F.pad(g, (0, extra)), F.pad(x, (0, extra))
        g = rotate(g, 1, recipe.rotation(g.device, g.dtype))
        x = rotate(x, 1, recipe.rotation(x.device, x.dtype))
    gl, gs = recipe.quantizer(g, 1, "grad")
    xl, xs = recipe.quantizer(x, 1, "input")
    return gl, gs, xl, xs


class QuantLinearFn(torch.autograd.Function):
    """y = x W^T + b with quantized operands in all three GEMMs (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: GemmRecipe) -> Tensor:  # type: ignore[override]
        with no_autocast(x):
            return QuantLinearFn._forward(ctx, x, weight, bias, recipe)

    @staticmethod
    def _forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: GemmRecipe) -> Tensor:
        cd = recipe.compute_dtype
        # Quantized in x's own shape (blocks along its last dim), so that the output is no view:
        # the next layer may modify it in place (AlexNet's and VGG's ReLU(inplace=True)).
        xl, xs = recipe.quantizer(x, -1, "input")
        wl, ws = recipe.quantizer(weight, 1, "weight_2d" if recipe.weight_2d else "weight")
        y = _scale((xl.to(cd) @ wl.to(cd).t()).float(), xs, ws)
        if bias is not None:
            y = y + bias.float()
        ctx.recipe, ctx.x_shape, ctx.x_dtype, ctx.has_bias = recipe, x.shape, x.dtype, bias is not None
        ctx.w_dtype, ctx.w_scale = weight.dtype, ws
        # 2D tiles: the forward's quantized weight is also dgrad's (W^T has the same tiles).
        ctx.save_for_backward(x, wl if recipe.weight_2d else weight)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        with no_autocast(dy):
            return QuantLinearFn._backward(ctx, dy)

    @staticmethod
    def _backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        recipe: GemmRecipe = ctx.recipe
        cd = recipe.compute_dtype
        x, w = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        g = dy.reshape(-1, dy.shape[-1]).float()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            gl, gs = recipe.quantizer(g, 1, "grad")  # along out_features
            wl, ws = (w, ctx.w_scale) if recipe.weight_2d else recipe.quantizer(w, 0, "weight")  # along out_features
            dx = _scale((gl.to(cd) @ wl.to(cd)).float(), gs, ws).reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            gl, gs, xl, xs = _wgrad_operands(recipe, g.t(), x2.float().t())  # (out, N), (in, N)
            dw = _scale((gl.to(cd) @ xl.to(cd).t()).float(), gs, xs).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0)  # the bias is added in high precision; its gradient is a high-precision reduction
        return dx, dw, db, None


class QuantConv2dFn(torch.autograd.Function):
    """conv2d with quantized operands in fprop, dgrad and wgrad (groups=1; see the module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: GemmRecipe,
        stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
    ) -> Tensor:
        with no_autocast(x):
            return QuantConv2dFn._forward(ctx, x, weight, bias, recipe, stride, padding, dilation)

    @staticmethod
    def _forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: GemmRecipe,
        stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
    ) -> Tensor:
        cd = recipe.compute_dtype
        xl, xs = recipe.quantizer(x, 1, "input")  # per pixel, along C_in
        wl, ws = _conv_weight(recipe, weight, "fprop")
        y = _scale(F.conv2d(xl.to(cd), wl.to(cd), None, stride, padding, dilation).float(), xs, ws)
        if bias is not None:
            y = y + bias.float().view(1, -1, 1, 1)
        ctx.recipe, ctx.conv = recipe, (stride, padding, dilation)
        ctx.x_dtype, ctx.w_dtype, ctx.has_bias, ctx.w_scale = x.dtype, weight.dtype, bias is not None, ws
        ctx.save_for_backward(x, wl if recipe.weight_2d else weight)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        with no_autocast(dy):
            return QuantConv2dFn._backward(ctx, dy)

    @staticmethod
    def _backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        recipe: GemmRecipe = ctx.recipe
        cd = recipe.compute_dtype
        stride, padding, dilation = ctx.conv
        x, w = ctx.saved_tensors
        g = dy.float()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            gl, gs = recipe.quantizer(g, 1, "grad")  # per output pixel, along C_out
            wl, ws = (w, ctx.w_scale) if recipe.weight_2d else _conv_weight(recipe, w, "dgrad")
            dx = torch.nn.grad.conv2d_input(x.shape, wl.to(cd), gl.to(cd), stride, padding, dilation)
            dx = _scale(dx.float(), gs, ws).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            c_out, c_in, kh, kw = w.shape
            # wgrad contracts over (batch, output pixel): the im2col columns of x, (N, C_in*kh*kw, L), against dy.
            cols = F.unfold(x.float(), (kh, kw), dilation=dilation, padding=padding, stride=stride)
            a = g.permute(1, 0, 2, 3).reshape(c_out, -1)
            b = cols.permute(1, 0, 2).reshape(c_in * kh * kw, -1)
            gl, gs, xl, xs = _wgrad_operands(recipe, a, b)
            dw = _scale((gl.to(cd) @ xl.to(cd).t()).float(), gs, xs).reshape(w.shape).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum((0, 2, 3))
        return dx, dw, db, None, None, None, None


def _conv_weight(recipe: GemmRecipe, w: Tensor, gemm: str) -> tuple[Tensor, Tensor | None]:
    """The conv weight (C_out, C_in, kh, kw) for fprop (blocked along C_in at each tap) or dgrad
    (along C_out); with 2D tiles, (C_out, C_in) tiles at each tap, the same for both."""
    if recipe.weight_2d:
        wl, ws = recipe.quantizer(w.permute(2, 3, 0, 1), -1, "weight_2d")  # tiles over (C_out, C_in)
        return wl.permute(2, 3, 0, 1), ws
    return recipe.quantizer(w, 1 if gemm == "fprop" else 0, "weight")

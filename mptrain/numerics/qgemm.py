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

import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from mptrain.numerics import compiled_calls, fused
from mptrain.numerics.formats import ElementFormat
from mptrain.numerics.formats import axiswise_round as axiswise_round  # the rowwise reference, re-exported
from mptrain.numerics.im2col import columns_of_rows, row_windows, shares_rows, wgrad_columns
from mptrain.numerics.mx import HADAMARD_SIZE, BlockFormat, hadamard_rotation, random_signs, rotate
from mptrain.numerics.rounding_rng import RoundingStream


class Quantizer(Protocol):
    """Quantizes one GEMM operand along its reduction ``dim``: returns (local, tensor scale or None)
    with x ~ local * scale, local in ``dtype`` (the GEMM's compute dtype; FP32 if None). ``role`` is
    input, weight or grad (gradients may round stochastically)."""

    def __call__(self, x: Tensor, dim: int, role: str,
                 dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]: ...


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

    def for_graph(self, device: torch.device) -> RoundingStream:
        """The stream on ``device``, for a model compiled whole (``convert_model(in_graph=True)``): made
        before the graph is traced, as one made during the trace, inside an autograd function's
        backward, is a side effect dynamo breaks the graph for; and its tensors marked as static
        inputs (unguarded, as parameters are), so that the model's CUDA graph (compile_mode
        reduce-overhead) may advance the counter in place rather than be skipped for mutating an input."""
        stream = self.get(device)
        torch._dynamo.mark_static_address(stream.keys)
        torch._dynamo.mark_static_address(stream.counter)
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
    rotates = True  # takes wgrad's Hadamard rotation into its kernel (``_wgrad_operands``)

    def __call__(self, x: Tensor, dim: int, role: str, dtype: torch.dtype | None = None,
                 rotation: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        sr = self.stochastic_grads and role == "grad"
        return fused.quantize_blocks(
            x, self.fmt, dim, stochastic=sr, generator=self.rng.get(x.device) if sr else None,
            block_2d=role == "weight_2d", rotation=rotation, dtype=dtype,
        )  # fmt: skip

    def graph_key(self) -> str:
        """What a compiled graph of this quantizer specialises on (``compiled_calls.call_graph``)."""
        return f"{self.fmt.name}{'-sr' if self.stochastic_grads else ''}"

    def fusable(self, device: torch.device) -> bool:
        """Whether a graph of this quantizer's calls can be compiled (``compiled_calls.call_graph``); makes
        what the graph reads on ``device`` first."""
        if not fused.blocks_fusable(self.fmt):
            return False
        fused.prepare(self.fmt.element, device)
        self.rng.get(device)
        return True


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

    def __call__(self, x: Tensor, dim: int, role: str,
                 dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
        fmt = self.backward if role == "grad" else self.forward
        sr = self.stochastic_grads and role == "grad"
        q = fused.axiswise_round(x, fmt, dim, stochastic=sr, generator=self.rng.get(x.device) if sr else None)
        return (q if dtype is None else fused.cast(q, dtype)), None

    def graph_key(self) -> str:
        return f"{self.forward.name}/{self.backward.name}{'-sr' if self.stochastic_grads else ''}"

    def fusable(self, device: torch.device) -> bool:
        """As ``BlockQuantizer.fusable``."""
        if not (fused.element_fusable(self.forward) and fused.element_fusable(self.backward)):
            return False
        fused.prepare(self.forward, device)
        fused.prepare(self.backward, device)
        self.rng.get(device)
        return True


@dataclass
class GemmRecipe:
    """What a quantized layer does to its GEMMs: the quantizer, the Hadamard transform on wgrad
    (NVFP4 recipe; a random sign vector shared by all layers), and the compute dtype."""

    quantizer: Any  # a Quantizer; role "weight_2d" asks for square tiles over the last two dims
    compute_dtype: torch.dtype = torch.float32
    hadamard_signs: Tensor | None = None  # 16 random +-1 signs: RHT on both wgrad operands
    weight_2d: bool = False  # the weight's forward quantization serves dgrad as well (2D tiles)
    combo_kernels: bool = False  # its compiled graphs launch independent kernels as one (compiled_calls)
    static_shapes: bool = False  # its compiled graphs are compiled per shape, no dim dynamic (compiled_calls)

    def __post_init__(self) -> None:
        # the signs as host values, read once: the rotation is then cached per device and dtype
        signs = self.hadamard_signs
        self._signs = None if signs is None else tuple(int(v) for v in signs.tolist())

    def graph_key(self) -> str:
        """The recipe's static choices, in a compiled graph's variant name: each recipe compiles its own
        graphs (one process may run several: the benchmark's cells) rather than recompiling one."""
        return (f"{self.quantizer.graph_key()}:{str(self.compute_dtype)[6:]}:{'rht' if self._signs else ''}:"
                f"{'2d' if self.weight_2d else ''}{':combo' if self.combo_kernels else ''}"
                f"{':static' if self.static_shapes else ''}")

    def stream_tensors(self, device: torch.device) -> dict[str, Tensor]:
        """The rounding stream a compiled graph of this recipe reads on ``device`` (stochastic rounding of
        gradients), by name; none without it. A graph's direct call (``compiled_calls._Direct``) reads
        them off the recipe it is given, as dynamo's guarded call would."""
        q = self.quantizer
        if not getattr(q, "stochastic_grads", False) or getattr(q, "rng", None) is None:
            return {}
        stream = q.rng.get(device)
        return {"keys": stream.keys, "counter": stream.counter}

    def rotation(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        if torch.compiler.is_compiling():  # traced into a model's graph: built in it, as dynamo would
            return hadamard_rotation.__wrapped__(self._signs, device, dtype)  # type: ignore[arg-type]
        return hadamard_rotation(self._signs, device, dtype)  # type: ignore[arg-type]

    def rotation_for(self, dy: Tensor) -> Tensor | None:
        """wgrad's FP32 rotation on dy's device, or None without the Hadamard transform (built and
        cached outside the compiled graph, which takes it as an input)."""
        return None if self._signs is None else self.rotation(dy.device, torch.float32)

    @staticmethod
    def signs(seed: int) -> Tensor:
        """The Hadamard sign vector for ``seed`` (CPU; moved to each operand's device)."""
        return random_signs(torch.Generator().manual_seed(seed), HADAMARD_SIZE)


def no_autocast(x: Tensor) -> contextlib.AbstractContextManager[Any]:
    """Autocast off for an emulated GEMM: ``precision.emulated_compute`` decides what it computes in,
    not an autocast region around the model (which would cast its operands to bf16/FP16). Outside
    one, nothing to turn off: entering and leaving an autocast region costs a few microseconds, twice
    per layer and step."""
    if not torch.is_autocast_enabled(x.device.type):
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, enabled=False)


def traced_output(y: Tensor) -> Tensor:
    """A custom autograd function's forward output: a clone where dynamo traces the function, ``y``
    itself in eager code. Why: on torch 2.11, an autograd.Function traced by dynamo whose forward
    returned the result of a call that returned its own input (``.float()`` or ``.to`` of a tensor
    already in that dtype, ``.contiguous()`` of a dense one; the reference quantizers end with
    one) got zero gradients for every input, silently (torch 2.14.1 is right). A view instead would
    forbid the in-place op a next layer may do (ReLU(inplace=True))."""
    return y.clone() if torch.compiler.is_compiling() else y


def _scale_(y: Tensor, a: Tensor | None, b: Tensor | None) -> Tensor:
    """A GEMM's output times its operands' tensor scales (NVFP4's, FP8's per-tensor ones), in place:
    ``y`` is always the GEMM's own fresh FP32 output, and a new tensor was one more allocation and
    pass over it per GEMM (134 of them in an NVFP4 ResNet-50/8 step)."""
    if a is None and b is None:
        return y
    s = (a if a is not None else 1.0) * (b if b is not None else 1.0)  # type: ignore[operator]
    return y.mul_(s)


def _wgrad_operands(recipe: GemmRecipe, g: Tensor, x: Tensor | None, rot: Tensor | None,
                    xq: tuple[Tensor, Tensor | None] | None = None) -> tuple[Tensor, Tensor | None, Tensor,
                                                                             Tensor | None]:
    """Quantize the wgrad GEMM's operands g (rows, K) and x (cols, K), both along K (tokens); with
    the Hadamard transform, K is zero-padded to a multiple of 16 and both are rotated first. ``xq``:
    x's (local, scale), quantized already (``_quantized_rows``: K needs no padding), for x None."""
    cd = recipe.compute_dtype
    if xq is not None:
        gl, gs = recipe.quantizer(g, 1, "grad", cd, rotation=rot)
        return gl, gs, *xq
    assert x is not None
    if recipe.hadamard_signs is not None:
        extra = -g.shape[1] % HADAMARD_SIZE
        if extra:
            g, x = F.pad(g, (0, extra)), F.pad(x, (0, extra))
        if getattr(recipe.quantizer, "rotates", False):
            # rotated inside the quantizer's kernel: no pass over memory of its own (it was two eager
            # GEMMs a layer, ~7% of an NVFP4 ResNet-50/8 step on a CPU)
            gl, gs = recipe.quantizer(g, 1, "grad", cd, rotation=rot)
            xl, xs = recipe.quantizer(x, 1, "input", cd, rotation=rot)
            return gl, gs, xl, xs
        g, x = rotate(g, 1, rot), rotate(x, 1, rot)  # type: ignore[arg-type]
    gl, gs = recipe.quantizer(g, 1, "grad", cd)
    xl, xs = recipe.quantizer(x, 1, "input", cd)
    return gl, gs, xl, xs


def _quantized_rows(recipe: GemmRecipe, x: Tensor, k: tuple[int, int], stride: tuple[int, int],
                    padding: tuple[int, int], dilation: tuple[int, int],
                    rot: Tensor | None) -> tuple[Tensor, Tensor | None] | None:
    """wgrad's x operand, quantized as x's row windows and copied out to the columns
    (``im2col.shares_rows``), or None where that does not apply: a block format's blocks (and the
    Hadamard transform's) along the columns repeat where the filter is taller than its stride, and
    each is then quantized once. Why: on ResNet-50/8's stem (7x7, stride 2, 16 output pixels a row)
    the columns hold 3 times the windows' elements, and NVFP4's rotated quantizer on them took more
    time than any other call of the step (scratch, one CPU thread: 2.5 ms, against 1.4 ms this way,
    the same values bit for bit). Values are the same as quantizing the columns: only row-wise
    scales (FP8 row-wise: one per column row, over all its windows) would differ."""
    q = recipe.quantizer
    if not isinstance(q, BlockQuantizer) or (rot is not None and not q.rotates):
        return None
    block = max(q.fmt.block_size, HADAMARD_SIZE if rot is not None else 1)  # powers of two: their lcm
    if not shares_rows(x.shape, k, stride, padding, dilation, block):
        return None
    local, scale = q(row_windows(x.float(), k, stride, padding), 1, "input", rotation=rot)
    return columns_of_rows(local, x.shape, k, stride, padding, recipe.compute_dtype), scale


def _linear_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: GemmRecipe) -> tuple[Tensor, Tensor | None,
                                                                                            Tensor | None]:
    """fprop: (y, the quantized weight if it serves dgrad too (2D tiles), its tensor scale)."""
    cd = recipe.compute_dtype
    # Quantized in x's own shape (blocks along its last dim), so that the output is no view:
    # the next layer may modify it in place (AlexNet's and VGG's ReLU(inplace=True)).
    xl, xs = recipe.quantizer(x, -1, "input", cd)
    wl, ws = recipe.quantizer(weight, 1, "weight_2d" if recipe.weight_2d else "weight", cd)
    y = _scale_((xl @ wl.t()).float(), xs, ws)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), (wl if recipe.weight_2d else None), ws


def _linear_bwd(dy: Tensor, x: Tensor, w: Tensor, w_scale: Tensor | None, rot: Tensor | None, recipe: GemmRecipe,
                needs: tuple[bool, bool], w_dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
    """dgrad and wgrad; ``w`` is the weight, or its quantized 2D tiles."""
    cd = recipe.compute_dtype
    x2 = x.reshape(-1, x.shape[-1])
    g = dy.reshape(-1, dy.shape[-1]).float()
    dx = dw = None
    if needs[0]:
        gl, gs = recipe.quantizer(g, 1, "grad", cd)  # along out_features
        wl, ws = (w, w_scale) if recipe.weight_2d else recipe.quantizer(w, 0, "weight", cd)  # along out_features
        dx = _scale_((gl @ wl).float(), gs, ws).reshape(x.shape).to(x.dtype)
    if needs[1]:
        gl, gs, xl, xs = _wgrad_operands(recipe, g.t(), x2.float().t(), rot)  # (out, N), (in, N)
        dw = _scale_((gl @ xl.t()).float(), gs, xs).to(w_dtype)
    return dx, dw


def _conv_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: GemmRecipe, stride: tuple[int, int],
              padding: tuple[int, int], dilation: tuple[int, int]) -> tuple[Tensor, Tensor | None, Tensor | None]:
    cd = recipe.compute_dtype
    xl, xs = recipe.quantizer(x, 1, "input")  # per pixel, along C_in
    wl, ws = _conv_weight(recipe, weight, "fprop")
    # dense once: with 2D tiles dgrad takes this same operand (a kxk filter's tiles are a permuted view)
    wl = _as(wl.to(cd), weight)
    y = _conv(_as(xl.to(cd), x), wl, stride, padding, dilation)
    y = _scale_(y.float(), xs, ws)
    if bias is not None:
        y = y + bias.float().view(1, -1, 1, 1)
    return y.to(x.dtype), (wl if recipe.weight_2d else None), ws


def _conv_bwd(dy: Tensor, x: Tensor, w: Tensor, w_scale: Tensor | None, rot: Tensor | None, recipe: GemmRecipe,
              needs: tuple[bool, bool], w_dtype: torch.dtype, stride: tuple[int, int],
              padding: tuple[int, int], dilation: tuple[int, int]) -> tuple[Tensor | None, Tensor | None]:
    cd = recipe.compute_dtype
    g = dy.float()
    dx = dw = None
    if needs[0]:
        gl, gs = recipe.quantizer(g, 1, "grad")  # per output pixel, along C_out
        wl, ws = (w, w_scale) if recipe.weight_2d else _conv_weight(recipe, w, "dgrad")
        # The input gradient alone, given the saved x as autograd's conv backward is. Not the expanded
        # placeholder torch.nn.grad.conv2d_input passes: aten copied it to a contiguous x-sized tensor
        # on every call (+20-40 us a layer on a CPU), and a channels-last layer's dx came out NCHW, summed
        # in another order than the plain conv's backward. x's values are not read, only its shape,
        # strides and dtype, which must be the products' (bf16 products): with FP32 x, aten's CPU path
        # for small maps on one thread refused it ("expected scalar type Float but found BFloat16").
        gl, wl = _as(gl.to(cd), dy), _as(wl.to(cd), w)
        dx = _pointwise(gl, wl, stride, padding, transposed=True)
        if dx is None:
            xd = x if x.dtype == cd else torch.empty_like(x, dtype=cd)
            dx = torch.ops.aten.convolution_backward(gl, xd, wl, None, stride, padding, dilation, False, [0], 1,
                                                     (True, False, False))[0]  # fmt: skip
        dx = _scale_(dx.float(), gs, ws).to(x.dtype)
    if needs[1]:
        c_out, _, kh, kw = w.shape
        # wgrad contracts over (batch, output pixel): dy against the im2col columns of x.
        a = g.permute(1, 0, 2, 3).reshape(c_out, -1)
        xq = _quantized_rows(recipe, x, (kh, kw), stride, padding, dilation, rot)
        b = wgrad_columns(x.float(), (kh, kw), stride, padding, dilation) if xq is None else None
        gl, gs, xl, xs = _wgrad_operands(recipe, a, b, rot, xq)
        dw = _scale_((gl.to(cd) @ xl.to(cd).t()).float(), gs, xs).reshape(w.shape).to(w_dtype)
    return dx, dw


def _gemms(body: Any, recipe: GemmRecipe, x: Tensor, *args: Any) -> Any:
    """Run one direction of a Linear layer's GEMMs (``body``: quantizers, products, scales, bias) as
    one compiled graph where ``fused.graph_enabled`` says so (CUDA), else eagerly, each quantizer a
    fused kernel of its own (or the reference).

    Why a graph on a GPU: each call into a compiled function costs tens of microseconds of host time
    (guards, the runtime wrapper), a layer has up to six quantizers, and on a GPU a small layer's
    quantizers and GEMMs take less than that, so the host set the pace (an H200 ran transformer_lm's
    mxfp8 step at 2.7x bf16's). The graph holds the same ops as the eager body: inductor fuses the
    elementwise ones and calls the same GEMM kernels (tests hold the results bit-identical). Not on a
    CPU, where the GEMMs set the pace and a graph saved little of an MLP step, nor for convolutions,
    whose many shapes and options recompiled past dynamo's limit (ResNet-50/8: minutes of compiles,
    then slower)."""
    with no_autocast(x):
        fusable = getattr(recipe.quantizer, "fusable", None)
        if not fused.graph_enabled(x) or fusable is None or not fusable(x.device):
            return body(x, *args)
        return compiled_calls.call_graph(body, x, *args)


class QuantLinearFn(torch.autograd.Function):
    """y = x W^T + b with quantized operands in all three GEMMs (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: GemmRecipe) -> Tensor:  # type: ignore[override]
        y, w2d, ws = _gemms(_linear_fwd, recipe, x, weight, bias, recipe)
        ctx.recipe, ctx.w_dtype, ctx.w_scale = recipe, weight.dtype, ws
        # 2D tiles: the forward's quantized weight is also dgrad's (W^T has the same tiles).
        ctx.save_for_backward(x, w2d if recipe.weight_2d else weight)
        return traced_output(y)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        recipe: GemmRecipe = ctx.recipe
        x, w = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:2])
        dx, dw = _gemms(_linear_bwd, recipe, dy, x, w, ctx.w_scale, recipe.rotation_for(dy), recipe, needs,
                        ctx.w_dtype)
        # The bias is added in high precision; its gradient is a high-precision reduction, eager:
        # inductor's reduction would add in another order.
        db = dy.reshape(-1, dy.shape[-1]).float().sum(0) if ctx.needs_input_grad[2] else None
        return dx, dw, db, None


class QuantConv2dFn(torch.autograd.Function):
    """conv2d with quantized operands in fprop, dgrad and wgrad (groups=1; see the module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: GemmRecipe,
        stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
    ) -> Tensor:
        conv = (tuple(stride), tuple(padding), tuple(dilation))
        with no_autocast(x):
            y, w2d, ws = _conv_fwd(x, weight, bias, recipe, *conv)
        ctx.recipe, ctx.conv, ctx.w_dtype, ctx.w_scale = recipe, conv, weight.dtype, ws
        ctx.save_for_backward(x, w2d if recipe.weight_2d else weight)
        return traced_output(y)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        recipe: GemmRecipe = ctx.recipe
        x, w = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:2])
        with no_autocast(dy):
            dx, dw = _conv_bwd(dy, x, w, ctx.w_scale, recipe.rotation_for(dy), recipe, needs, ctx.w_dtype, *ctx.conv)
        db = dy.float().sum((0, 2, 3)) if ctx.needs_input_grad[2] else None  # as QuantLinearFn's, eager
        return dx, dw, db, None, None, None, None


def _as(q: Tensor, like: Tensor) -> Tensor:
    """``q`` dense in ``like``'s memory format (channels-last or contiguous). A quantizer may return
    a strided view (padded blocks, a transposed copy), and a convolution's algorithm, so the order of
    its sums, follows its operands' layout: the same layout whichever quantizer path ran."""
    cl = like.dim() == 4 and _channels_last(like)
    return q.contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)


def _conv(x: Tensor, w: Tensor, stride: tuple[int, int], padding: tuple[int, int],
          dilation: tuple[int, int]) -> Tensor:
    """fprop's convolution of the quantized operands (dense, in the layer's layout)."""
    y = _pointwise(x, w, stride, padding)
    return F.conv2d(x, w, None, stride, padding, dilation) if y is None else y


def _pointwise(x: Tensor, w: Tensor, stride: tuple[int, int], padding: tuple[int, int],
               transposed: bool = False) -> Tensor | None:
    """A small 1x1 convolution with stride 1 and no padding (33 of ResNet-50's 53) on a CPU, as the
    GEMM it is: W (C_out, C_in) times x's channels at every pixel, fprop or (``transposed``: x is dy,
    the product W^T dy) dgrad; None for any other convolution, layout or size, which the caller
    convolves.

    Why: oneDNN's convolution costs tens of microseconds a call beyond its arithmetic on small layers,
    and about twice that in an emulated step, whose quantizer kernels between the convolutions leave
    its code and buffers out of cache (ResNet-50/8, batch 32, a scratch timing: 190 us a call in the
    step against 96 us replayed alone). As matmuls, ResNet-50/8's MX, NVFP4 and row-wise FP8 steps
    took 9-12% less time (scripts/pointwise_bench.py; docs/benchmarks). Only up to _POINTWISE_FLOPS:
    on a full-width ResNet-50's layers the GEMMs gained nothing, or lost (scratch timings). On
    ResNet-50/8's layers the sums came out the same (weights bit-identical after a step); in general
    a GEMM kernel may split the sum along C where the convolution does not, and the tests hold the
    two within FP32 rounding. Output in the convolution's layout, which follows x's (a 1x1 filter's
    strides are the same in either)."""
    if x.device.type != "cpu" or w.shape[2:] != (1, 1) or tuple(stride) != (1, 1) or any(padding):
        return None
    n, c, h, wd = x.shape
    w2 = w.reshape(w.shape[0], w.shape[1])
    w2 = w2.t() if transposed else w2  # (outputs, inputs) of this product
    if 2 * x.numel() * w2.shape[0] > _POINTWISE_FLOPS:
        return None
    if h * wd == 1:  # a pixel an image (either layout): one GEMM over the batch, nothing copied
        return (x.reshape(n, c) @ w2.t()).view(n, -1, 1, 1)
    if _channels_last(x):  # (N*H*W, C) rows: one GEMM, its (N*H*W, C') result read back channels-last
        return (x.permute(0, 2, 3, 1).reshape(-1, c) @ w2.t()).view(n, h, wd, -1).permute(0, 3, 1, 2)
    if not x.is_contiguous():
        return None
    if h * wd < _PER_IMAGE_MIN_PIXELS:  # one GEMM over every pixel, x and its result copied
        return (w2 @ x.transpose(0, 1).reshape(c, -1)).view(-1, n, h, wd).transpose(0, 1).contiguous()
    return torch.matmul(w2, x.view(n, c, h * wd)).view(n, -1, h, wd)  # a GEMM per image, nothing copied


# _pointwise's limits, from scratch timings on one CPU thread (an AVX-512 Xeon), each alone: up to
# 2**24 flops a call (16.8 MFLOP: 256 channels in and out on 32 images of 2x2 pixels), the GEMMs of
# every square layer tried took 0.12x to 0.77x the convolution's time; on a full-width ResNet-50's
# layers (hundreds of MFLOP) as long or longer (8 images of 56x56 pixels, 64 channels in, 256 out:
# 1.8x). A GEMM per image re-reads W for each, and on fewer pixels than an AVX-512 vector (2x2 maps)
# took longer than one GEMM over the batch with its two copies (41 against 26 us: 32 images, 128
# channels in, 32 out).
_POINTWISE_FLOPS = 2**24
_PER_IMAGE_MIN_PIXELS = 16


def _channels_last(t: Tensor) -> bool:
    """As ``_as`` decides: channels-last and not also contiguous (a 1x1 map, a 1x1 filter are both)."""
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def _conv_weight(recipe: GemmRecipe, w: Tensor, gemm: str) -> tuple[Tensor, Tensor | None]:
    """The conv weight (C_out, C_in, kh, kw) for fprop (blocked along C_in at each tap) or dgrad
    (along C_out); with 2D tiles, (C_out, C_in) tiles at each tap, the same for both."""
    if recipe.weight_2d:
        wl, ws = recipe.quantizer(w.permute(2, 3, 0, 1), -1, "weight_2d")  # tiles over (C_out, C_in)
        return wl.permute(2, 3, 0, 1), ws
    return recipe.quantizer(w, 1 if gemm == "fprop" else 0, "weight")

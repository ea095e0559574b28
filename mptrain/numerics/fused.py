"""Fused quantizers: the reference numerics of ``formats``, ``mx``, ``qgemm`` and ``fp8``, compiled.

Emulating a format is a chain of elementwise ops (abs, amax, exponent, scale, round, clamp, select),
and run eagerly every op is one pass over memory: quantize-dequantize took 74% of an MXFP8 step.
Each function here is the same arithmetic as its reference, written once as plain torch code and
handed to ``torch.compile``, which fuses it into two passes over the operand (vectorised C++ on a
CPU, Triton on a GPU): one to find the scales, one to round (the scales themselves, one per block,
are stored in between: ``fused_kernels._kept``). What compile cannot fuse is done differently, on
purpose, and the tests hold every result bit-identical to the eager reference:

- FP8/FP16/BF16 rounding uses the arithmetic rounding (``formats.round_arith``'s rule, with the
  exponent read from the float's bits), not a cast to the 8-bit dtype: inductor's CPU code converts
  to float8 one element at a time, 10x slower than the arithmetic.
- Stochastic rounding draws from the run's counter-based stream (``rounding_rng``) inside the kernel
  (outside a run, from a stream keyed by the global RNG). A ``torch.Generator`` cannot enter a
  compiled graph: with one, the reference runs.
- The random Hadamard transform of wgrad's operands runs inside the block kernel: the reference
  defines it as a sum in index order of exact terms (``mx.rotate_blocks``), which a compiled kernel
  reproduces bit for bit, where a matmul adds in its BLAS kernel's own order.

Tensors are viewed as (A, n, B) with the blocks along n, without a copy for contiguous tensors and
for transposes (the weight-gradient GEMM's operands), so a quantizer reads its operand where it is.
The element format is a kernel argument (a few constants on the device), not compiled in: the five
MX formats share one block kernel and every FP8/FP6/FP4/FP16 rounding one element kernel, so a run,
or the test suite, compiles a handful of kernels (each once, for every shape: dims are dynamic).

The kernel bodies are in ``fused_kernels``. How they are called is in ``compiled_calls``: a call
into ``torch.compile``'d code costs tens of microseconds of host time around kernels of a few, so
from its second time on a call goes to the compiled code directly (``_Direct``), and a block,
row-wise or tile call skips its entry point's planning here as well (``_Fast``, around it the copy
or padding its layout needs: ``_transposed``, ``_tiled``). On CUDA, ``qgemm``
traces these entry points into one compiled graph per direction of a Linear layer
(``compiled_calls.call_graph``): one call into compiled code per layer, not one per quantizer.

Where torch.compile cannot run (no C++ compiler, no Triton, an unsupported platform), the first call
on that device logs one line and every call runs the eager reference. ``MPTRAIN_FUSED=0`` in the
environment, or ``with reference():``, does the same on purpose (tests, debugging).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from mptrain.numerics import compiled_calls, mx
from mptrain.numerics import formats as nf
from mptrain.numerics.compiled_calls import Kept, _call, _Fast, _fast_key, _keep_fast, _Unfused
from mptrain.numerics.formats import ElementFormat
from mptrain.numerics.fused_kernels import _BODIES, _elem
from mptrain.numerics.rounding_rng import RoundingStream, global_stream

log = logging.getLogger(__name__)


_available: dict[str, bool] = {}  # device type -> torch.compile works there
_why_not: dict[str, str] = {}  # device type -> why the probe failed there
_forced_reference = os.environ.get("MPTRAIN_FUSED", "1").strip().lower() in ("0", "false", "off", "no")


@contextlib.contextmanager
def reference() -> Iterator[None]:
    """Run the eager reference inside the block (the tests' side of every bit-identity check)."""
    global _forced_reference
    before, _forced_reference = _forced_reference, True
    try:
        yield
    finally:
        _forced_reference = before


@contextlib.contextmanager
def forced(on: bool = True) -> Iterator[None]:
    """Run fused (``on``) or the reference inside the block, whatever ``MPTRAIN_FUSED`` says."""
    global _forced_reference
    before, _forced_reference = _forced_reference, not on
    try:
        yield
    finally:
        _forced_reference = before


def enabled(x: Tensor) -> bool:
    """Whether the fused kernels run for ``x``: FP32/FP16/BF16 on a device where compile works.
    float64 runs the reference, which rounds it once in float64."""
    if _forced_reference or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    kind = x.device.type
    if kind not in _available:
        _available[kind] = _probe(x.device)
    return _available[kind]


def status(device: torch.device | str) -> str:
    """"fused", or "reference (why)", for the log and summary.json."""
    if _forced_reference:
        return "reference (MPTRAIN_FUSED=0)"
    if enabled(torch.zeros(1, device=device)):
        return "fused"
    return f"reference (torch.compile unavailable: {_why_not.get(torch.device(device).type, '?')})"


WRONG = "the compiled rounding differs from the reference"  # the probe's reason for a miscompiled kernel


def _probe(device: torch.device) -> bool:
    try:
        x = torch.linspace(-3, 3, 64, device=device)
        got = _call("round", _opts(True, False), x, *_elem(nf.E4M3, device), True, None, None)
        if not torch.equal(got, nf.round_to_element(x, nf.E4M3)):
            raise RuntimeError(WRONG)
        return True
    except Exception as exc:  # any failure to build a kernel: no compiler, no Triton, ...
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        _why_not[device.type] = reason
        log.warning("fused quantizers unavailable on %s (torch.compile: %s): running the eager reference, "
                    "several times slower", device.type, reason)
        return False


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process (every frame: these kernels and
    ``trainer.compile``), for keeping compile time out of throughput. 0 where torch does not say.
    A compiled model's backward graph compiles at its first backward, apart from its frame's
    compile: torch counts it on its own."""
    try:
        from torch._dynamo.utils import cumulative_time_spent_ns

        spent = sum(cumulative_time_spent_ns.get(k, 0.0) for k in ("entire_frame_compile", "entire_backward_compile"))
        return float(spent) / 1e9
    except (ImportError, AttributeError):
        return 0.0


def _fast_for(key: tuple[Any, ...]) -> Kept | None:
    """The kept path of a call (``compiled_calls._Fast``), where one is kept and may run."""
    if not compiled_calls._direct_calls or _forced_reference or torch.compiler.is_compiling():
        return None
    return compiled_calls._fast.get(key)


def _may_keep(stochastic: bool, generator: Any) -> bool:
    """Whether a call may take or keep a kept path (``_Fast``): its draws, if any, come from a
    ``RoundingStream`` (without one, a stream is made per call; a torch.Generator cannot enter a kernel)."""
    return not stochastic or type(generator) is RoundingStream


def _stream_args(generator: Any, stochastic: bool) -> tuple[Tensor | None, Tensor | None]:
    """A stream's (keys, counter) as a kernel call's signature sees them, taking no draw."""
    return (generator.keys, generator.counter) if stochastic else (None, None)


def blocks_fusable(fmt: mx.BlockFormat) -> bool:
    """Whether the block kernels know ``fmt`` (MX blocks of 32, NVFP4 blocks of 16, elements that fit)."""
    return fmt.block_size == (16 if fmt.two_level else 32) and _fits(fmt.element)


def element_fusable(fmt: ElementFormat) -> bool:
    """Whether the element kernels know ``fmt``."""
    return _fits(fmt)


def prepare(fmt: ElementFormat, device: torch.device) -> None:
    """Make ``fmt``'s constants on ``device`` before a graph is traced that reads them (a graph must
    not create the cached tensors it reads)."""
    _elem(fmt, device)


# Where qgemm runs a layer's GEMMs as one graph (see ``qgemm._gemms`` for why CUDA only).
_graph_devices: set[str] = {"cuda"}


@contextlib.contextmanager
def graphs(*device_types: str) -> Iterator[None]:
    """Run qgemm's Linear GEMMs as graphs on these device types inside the block (the tests' way to
    check the graphs on a CPU)."""
    global _graph_devices
    before, _graph_devices = _graph_devices, set(device_types)
    try:
        yield
    finally:
        _graph_devices = before


def graph_enabled(x: Tensor) -> bool:
    """Whether qgemm runs the GEMMs of ``x``'s layer as one compiled graph."""
    return x.device.type in _graph_devices and enabled(x)


def _opts(*flags: Any) -> str:
    """The static options of a call as a variant name: bools t/f, strings as they are, None '-'."""
    return "".join("-" if f is None else ("t" if f else "f") if isinstance(f, bool) else str(f) for f in flags)


def _stream(x: Tensor, stochastic: bool, generator: Any, draws: int = 1) -> tuple[Tensor | None, Tensor | None]:
    """(keys, the first of this call's ``draws`` counters) for a kernel; ``_Unfused`` for a
    torch.Generator (its uniforms cannot be drawn inside a compiled kernel: the reference draws them)."""
    if not stochastic:
        return None, None
    if generator is None:
        generator = global_stream(x.device)
    if not isinstance(generator, RoundingStream):
        raise _Unfused
    return generator.keys, generator.take(draws)


def _fits(fmt: ElementFormat) -> bool:
    # the element kernel builds 2**k from the exponent bits, for |k| <= 126 (k = e and e - mbits
    # for e in [emin, emax]): every format but bf16
    return fmt.emin - fmt.mbits >= -126 and fmt.emax <= 126


def _by_stride(x: Tensor) -> list[int]:
    """x's dims from the largest stride to the smallest, ties in dim order: sorted() with a key, as
    an insertion sort, which dynamo can trace (``call_graph``)."""
    order: list[int] = []
    for i in range(x.dim()):
        j = len(order)
        while j > 0 and x.stride(order[j - 1]) < x.stride(i):
            j -= 1
        order.insert(j, i)
    return order


def view3(x: Tensor, dim: int) -> tuple[Tensor, Callable[[Tensor], Tensor], str | None] | None:
    """x as an (A, n, B) view of its storage with ``dim`` as n, and a function taking such a tensor
    back to x's logical layout; None when no view keeps the other dims in their logical order (the
    caller then copies x to contiguous first). Third: the logical order of x's dims as the runs
    A, n and B (``_k_axis``'s ``order``: "anb", "nab" or "abn"), where A's and B's dims are each a
    run of consecutive logical dims (else None)."""
    # Eager: worked out once per shape, stride and dim (a step makes hundreds of these calls). Traced
    # into a graph (call_graph), where sizes may be symbolic: every time.
    compiling = torch.compiler.is_compiling()
    lay = _layout(x, dim) if compiling else _cached_layout(tuple(x.shape), x.stride(), dim)
    if lay is None:
        return None
    return _to3(x, lay), functools.partial(_from3, lay=lay), lay[4]


def _to3(x: Tensor, lay: _Layout) -> Tensor:
    """x as the (A, n, B) view of its layout ``lay``."""
    order, inverse, _, three, _ = lay
    return (x.permute(order) if inverse is not None else x).reshape(three)


def _from3(t: Tensor, lay: _Layout) -> Tensor:
    """An (A, n, B) tensor back in the logical layout of the tensor ``lay`` came from."""
    _, inverse, shape, _, _ = lay
    t = t.reshape(shape)
    return t.permute(inverse) if inverse is not None else t


_Layout = tuple[list[int], list[int] | None, tuple[int, ...], tuple[int, int, int], str | None]


@functools.lru_cache(maxsize=4096)
def _cached_layout(shape: tuple[int, ...], stride: tuple[int, ...], dim: int) -> _Layout | None:
    return _layout(torch.empty_strided(shape, stride, device="meta"), dim)


def _layout(x: Tensor, dim: int) -> _Layout | None:
    """view3's plan: (the permutation to x's storage order, its inverse or None for the identity,
    the permuted shape, (A, n, B), the order of the docstring), or None."""
    d = dim % x.dim()
    order = list(range(x.dim())) if x.is_contiguous() else _by_stride(x)
    base = x.permute(order)
    rest = [i for i in order if i != d]
    if not base.is_contiguous() or rest != sorted(rest):
        return None
    bd = order.index(d)
    a_dims, b_dims = order[:bd], order[bd + 1:]
    inverse = [order.index(i) for i in range(x.dim())]
    runs = all(g == list(range(g[0], g[0] + len(g))) for g in (a_dims, b_dims) if g)
    # A's and B's dims keep their logical order (rest is sorted), so n's place among them is all the
    # kernel needs to draw each element by its row-major index in x, from (A, n, B)'s sizes
    order3 = None
    if runs:
        order3 = "nab" if a_dims and d < a_dims[0] else "abn" if b_dims and d > b_dims[-1] else "anb"
    shape = tuple(base.shape)
    three = (math.prod(shape[:bd]), shape[bd], math.prod(shape[bd + 1:]))
    return order, (None if order == sorted(order) else inverse), shape, three, order3


def round_to_element(
    x: Tensor, fmt: ElementFormat, *, stochastic: bool = False,
    generator: torch.Generator | RoundingStream | None = None, saturate: bool = True,
) -> Tensor:
    """``formats.round_to_element``, fused (FP32 out). Stochastic rounding with no generator draws
    from a stream keyed by the global RNG (FP8's rounding outside a run, as ``fp8`` does)."""
    if not saturate and not (fmt.has_inf or fmt.has_nan):
        raise ValueError(f"{fmt.name} has no Inf or NaN to overflow to: use saturate=True")
    if enabled(x) and _fits(fmt) and x.numel():
        with contextlib.suppress(_Unfused):
            keys, counter = _stream(x, stochastic, generator)
            return _call("round", _opts(saturate, stochastic), x.reshape(-1), *_elem(fmt, x.device), saturate, keys,
                         counter).view(x.shape)
    if stochastic and generator is None:
        generator = global_stream(x.device)
    return nf.round_to_element(x, fmt, stochastic=stochastic, generator=generator, saturate=saturate)


def quantize_scaled(x: Tensor, fmt: ElementFormat, *, stochastic: bool = False,
                    generator: torch.Generator | RoundingStream | None = None) -> Tensor:
    """``fp8.quantize_scaled`` (per-tensor power-of-two scale), fused; x's dtype out."""
    if enabled(x) and x.numel():
        with contextlib.suppress(_Unfused):
            keys, counter = _stream(x, stochastic, generator)
            return _call("scaled", _opts(stochastic), x.reshape(-1), *_elem(fmt, x.device), keys, counter).view(x.shape)
    if stochastic and generator is None:
        generator = global_stream(x.device)
    xf = nf.work_dtype(x)
    s = nf.pow2_scale(xf.abs().amax().float(), fmt) if x.numel() else torch.ones((), device=x.device)
    return nf.round_scaled(x, fmt, s, stochastic=stochastic, generator=generator)


def axiswise_round(x: Tensor, fmt: ElementFormat, dim: int, *, stochastic: bool = False,
                   generator: torch.Generator | RoundingStream | None = None) -> Tensor:
    """``qgemm.axiswise_round``, fused (FP32 out, x's layout)."""
    return _axiswise(x, fmt, dim, stochastic, generator)


def _axiswise(x: Tensor, fmt: ElementFormat, dim: int, stochastic: bool, generator: Any) -> Tensor:
    keep = _may_keep(stochastic, generator)
    if keep:
        fast = _fast_for(_fast_key("axis", fmt, dim, stochastic, x))
        if fast is not None:
            return fast(x, _stream(x, stochastic, generator))[0]  # type: ignore[return-value]
    if enabled(x) and x.numel():
        v = view3(x, dim)
        in_place = v is not None and v[2] is not None
        if not in_place:
            v = view3(x.contiguous(), dim)
        x3, back, order3 = v  # type: ignore[misc]
        narrow = _narrow_inner(x3)
        if torch.compiler.is_compiling():  # call_graph checked the stream
            return _axis_call(x, x3, back, order3, fmt, stochastic, generator, narrow)  # type: ignore[arg-type]
        keep_as = _fast_key("axis", fmt, dim, stochastic, x) if in_place and keep else None
        with contextlib.suppress(_Unfused):
            return _axis_call(x, x3, back, order3, fmt, stochastic, generator, narrow, keep_as)  # type: ignore[arg-type]
    if stochastic and generator is None:
        generator = global_stream(x.device)
    return nf.axiswise_round(x, fmt, dim, stochastic=stochastic, generator=generator)


def _draw_order(order3: str, stochastic: bool) -> str:
    """``_k_axis``'s ``order``: only draws read it, so rounding to nearest compiles one kernel for all."""
    return order3 if stochastic else "anb"


def _axis_call(x: Tensor, x3: Tensor, back: Callable[[Tensor], Tensor], order3: str, fmt: ElementFormat,
               stochastic: bool, generator: Any, narrow: bool, keep_as: tuple[Any, ...] | None = None) -> Tensor:
    """The row-wise kernel's call; ``keep_as``: the key its kept path goes under (x read in place)."""
    keys, counter = _stream(x, stochastic, generator)
    order3 = _draw_order(order3, stochastic)
    pf, pi = _elem(fmt, x.device)
    kept = (pf, pi, order3, *_stream_args(generator, stochastic))  # the signature's arguments, no draw taken
    if not narrow:
        options = _opts(stochastic, False, order3)
        out = back(_call("axis", options, x3, pf, pi, order3, keys, counter)[0])
        if keep_as is not None:
            _keep_fast(keep_as, "axis", options, x3, kept, (0, 4, 5), out, 1, fmt)
        return out
    # A narrow B: a copy with n innermost, whose kernel draws each element by its index in x (the
    # order), as the reference does. With draws, 2.5x to 6x faster than the (A, n, B) kernel on a
    # 3x3 or 2x2 map (a CPU, one thread).
    y = x3.transpose(1, 2).contiguous()
    options = _opts(stochastic, True, order3)
    q = _call("axis", options, y, pf, pi, order3, keys, counter, True)[0]
    if keep_as is not None:
        three = (tuple(x3.shape), x3.stride())
        _keep_fast(keep_as, "axis", options, y, (*kept, True), (0, 4, 5), q, 1, fmt,
                   lambda fast: functools.partial(_transposed, fast, three))
    return _like(x, back(q.transpose(1, 2)))


def _transposed(fast: _Fast, three: tuple[tuple[int, ...], tuple[int, ...]], x: Tensor,
                per_call: tuple[Any, ...]) -> tuple[Tensor]:
    """A narrow row-wise call's kept path (``_axis_call``): x's (A, n, B) view copied with n innermost,
    the kept call on the copy, its result copied back into x's layout, without the entry point's
    planning and dispatch (~30 us of a ~80 us call on a (32, 128, 2, 2) activation, a CPU). x is
    dense here (it has an in-place view), so ``empty_strided`` with its strides is ``_like``'s result."""
    q = fast(x.as_strided(*three).transpose(1, 2).contiguous(), per_call)[0]
    out = torch.empty_strided(x.shape, x.stride(), dtype=torch.float32, device=x.device)
    out.as_strided(*three, 0).copy_(q.transpose(1, 2))  # type: ignore[union-attr]
    return (out,)


def quantize_blocks(
    x: Tensor, fmt: mx.BlockFormat, dim: int = -1, *, stochastic: bool = False,
    generator: torch.Generator | RoundingStream | None = None, block_2d: bool = False,
    rotation: Tensor | None = None, dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``mx.quantize_blocks(...)``'s (local, tensor_scale), fused. Lengths are padded with zeros.
    ``rotation`` (``mx.hadamard_rotation``): x is rotated along ``dim`` first, in FP32, as
    ``mx.rotate(x.float(), dim, rotation)``; its length there must be a multiple of the rotation's.
    ``dtype``: ``local`` in that dtype (a GEMM's compute dtype; FP32 if None). Inside a compiled graph
    the kernel casts it; elsewhere the kernels stay FP32 (one kernel per format) and it is cast after."""
    local, t_scale = _quantize_blocks(x, fmt, dim, stochastic, generator, block_2d, rotation, dtype)
    return (local if dtype is None else cast(local, dtype)), t_scale


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)`` in t's memory layout, inside a compiled graph too. Eager ``to`` keeps the
    strides of wgrad's operands, which are transposed views (quantized along tokens, stored
    token-major); inductor lays a cast out row-major in its logical shape, so inside a Linear's
    graph (``qgemm._gemms``) wgrad's bf16 copy of x was written transposed, against the order its
    kernel reads x in, and the GEMM saw another layout than in eager. Casting the transpose gives the
    same values in eager's layout."""
    if t.dtype == dtype:
        return t
    if t.dim() == 2 and t.stride(0) == 1 and t.stride(1) != 1:
        return t.mT.to(dtype).mT
    return t.to(dtype)


def _quantize_blocks(x: Tensor, fmt: mx.BlockFormat, dim: int, stochastic: bool, generator: Any, block_2d: bool,
                     rotation: Tensor | None, dtype: torch.dtype | None) -> tuple[Tensor, Tensor | None]:
    if _may_keep(stochastic, generator):
        if not block_2d:
            fast = _fast_for(_fast_key("blocks", fmt, dim, stochastic, x, rotation))
            if fast is not None:
                return fast(x, (*_stream(x, stochastic, generator), rotation))  # type: ignore[return-value]
        elif rotation is None:
            fast = _fast_for(_fast_key("tiles", fmt, -1, stochastic, x))
            if fast is not None:
                return fast(x, _stream(x, stochastic, generator))  # type: ignore[return-value]
    if rotation is not None and (block_2d or x.shape[dim] % rotation.shape[1]):
        raise ValueError(f"quantize_blocks: a rotation runs along dim in blocks of {rotation.shape[1]}, not on "
                         f"2D tiles nor on a length of {x.shape[dim]}")
    if enabled(x) and x.numel() and (not block_2d or x.dim() >= 2):
        if torch.compiler.is_compiling():  # call_graph checked that the kernels know the format
            return _blocks(x, fmt, dim, stochastic, generator, block_2d, rotation, dtype)
        try:
            return _blocks(x, fmt, dim, stochastic, generator, block_2d, rotation)
        except _Unfused:
            pass
    if stochastic and generator is None:
        generator = global_stream(x.device)
    if rotation is not None:
        x = mx.rotate(x.float(), dim, rotation)
    q = mx.quantize_blocks(x, fmt, dim, stochastic=stochastic, generator=generator, block_2d=block_2d)
    return q.local, q.tensor_scale


# Inductor's C++ kernels vectorise along the (A, n, B) view's innermost dim, B. With fewer elements
# there than one AVX-512 vector (a 2x2 or 3x3 feature map of an NCHW activation, a 3x3 filter's taps)
# they ran 8 to 11 times slower per element than on a copy with the blocked dim innermost (B = 1): a
# (32, 256, 2, 2) MXFP8 quantize took 1.2 ms against 0.15 ms with the copy. Measured on CPU only.
_CPU_MIN_INNER = 16


def _narrow_inner(x3: Tensor) -> bool:
    return _narrow(x3.shape[2], x3.device.type == "cpu")


def _narrow(inner: int, cpu: bool) -> bool:
    return cpu and 1 < inner < _CPU_MIN_INNER


def _like(x: Tensor, q: Tensor) -> Tensor:
    """``q`` (FP32) in x's memory layout, as the other paths return it: a convolution fed a
    channels-last result where its weights are not converts layouts on every call."""
    return torch.empty_like(x, dtype=torch.float32).copy_(q)


def _blocks(x: Tensor, fmt: mx.BlockFormat, dim: int, stochastic: bool, generator: Any, block_2d: bool,
            rot: Tensor | None = None, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
    """``_quantize_blocks``' kernel call. ``dtype`` (a graph being compiled only): ``local`` cast in the kernel."""
    bs = fmt.block_size
    kind = "nvfp4" if fmt.two_level else f"mx{bs}"
    if fmt.block_size != (16 if fmt.two_level else 32) or not _fits(fmt.element):
        raise _Unfused  # a block format the kernels do not know
    pf, pi = _elem(fmt.element, x.device)
    if block_2d:
        tiling = _tiling(tuple(x.shape), bs, stochastic)
        x2 = _tile_input(x, tiling)
        keys, counter = _stream(x, stochastic, generator)
        options = _opts(kind, stochastic)
        local, t_scale = _call("tiles", options, x2, pf, pi, kind, keys, counter, *_in_graph(dtype))[:2]
        if _may_keep(stochastic, generator) and not torch.compiler.is_compiling():
            _keep_fast(_fast_key("tiles", fmt, -1, stochastic, x), "tiles", options, x2,
                       (pf, pi, kind, *_stream_args(generator, stochastic)), (0, 4, 5), local, 2, fmt,
                       lambda fast: functools.partial(_tiled, fast, tiling))
        return _tile_output(local, t_scale, tiling)
    cpu = x.device.type == "cpu"
    if torch.compiler.is_compiling():  # sizes may be symbolic: planned every time
        plan = _plan_blocks(x, dim, kind, stochastic, cpu, rot is not None)
    else:
        plan = _cached_plan(x.shape, x.stride(), dim, kind, stochastic, cpu, rot is not None)
    if plan.narrow:
        # Blocks along the last dim instead: the draws keep their order (element (a, i, b) of the
        # (A, n, B) view is draw (a * B + b) * n + i either way), and so does every result.
        y = x.movedim(dim, -1).contiguous()
        fast = _fast_for(_fast_key("blocks", fmt, -1, stochastic, y, rot))
        if fast is not None and _may_keep(stochastic, generator):
            local, t_scale = fast(y, (*_stream(y, stochastic, generator), rot))
            # y's call is kept (after its second time): x's calls from now on skip the planning
            compiled_calls._fast.setdefault(_fast_key("blocks", fmt, dim, stochastic, x, rot),
                                            functools.partial(_moved, fast, dim))  # fmt: skip
        else:
            local, t_scale = _blocks(y, fmt, -1, stochastic, generator, False, rot, dtype)
        return _like(x, local.movedim(-1, dim)), t_scale
    x3 = _to3(x.contiguous() if plan.copy else x, plan.layout)
    if plan.pad:
        x3 = torch.nn.functional.pad(x3, (0, 0, 0, plan.pad))
    keys, counter = _stream(x, stochastic, generator)
    # The zeros padded on before the rotation stay zeros (up to sign) and are cut off after it.
    options = plan.options if rot is None else plan.options + "r"
    args = (pf, pi, kind, plan.short, keys, counter, rot)
    local, t_scale = _call("blocks", options, x3, *args, *_in_graph(dtype))[:2]
    if local.dim() == 4:  # the kernel's blocks' shape (fused_kernels._k_blocks)
        local = local.view(x3.shape)
    local = _from3(local[:, :-plan.pad] if plan.pad else local, plan.layout)
    if not (plan.copy or plan.pad or torch.compiler.is_compiling()) and _may_keep(stochastic, generator):
        _keep_fast(_fast_key("blocks", fmt, dim, stochastic, x, rot), "blocks", options, x3, args, (0, 5, 6, 7), local,
                   2, fmt)
    return local, t_scale


def _in_graph(dtype: torch.dtype | None) -> tuple[torch.dtype, ...]:
    """A block or tile kernel's ``out_dtype`` argument: only when traced into a graph, where inductor
    fuses the cast into the kernel's pass; a kernel compiled on its own keeps one FP32 variant."""
    return (dtype,) if dtype is not None and dtype != torch.float32 and torch.compiler.is_compiling() else ()


class _Tiling(NamedTuple):
    """How ``_blocks`` lays an operand out for the 2D tile kernel: zeros padded on, leading dims stacked."""

    pad: tuple[int, int, int, int] | None  # F.pad's (0, columns, 0, rows), or None
    cols: int  # the padded row's length
    one_row: bool  # a row of zero tiles added under the only one
    shape: tuple[int, ...]  # the padded operand's
    cut: tuple[int, int] | None  # the operand's (rows, cols) to cut the result back to, or None


def _tiling(shape: tuple[int, ...], bs: int, stochastic: bool) -> _Tiling:
    *lead, r, c = shape
    # A single column of tiles (a layer of at most bs inputs: a 1x1 convolution on 8 channels)
    # would compile the kernel a second time: there the row stride equals the tile's, and dynamo
    # guards their order. Rounded to nearest, it gets a column of zero tiles beside it, cut off
    # after; stochastic rounding cannot, as its draws are numbered along each row of tiles.
    one_col = c <= bs and not stochastic
    er, ec = -r % bs, -c % bs + (bs if one_col else 0)
    # A single row of tiles (a layer of at most bs outputs: a classifier's head) would too, dynamo
    # specializing a dim of size 1: a row of zero tiles goes under it and is cut off after. Zeros
    # move neither the tensor's amax nor a real element's draw (counted from the first row).
    one_row = math.prod(lead) * (r + er) == bs
    return _Tiling((0, ec, 0, er) if er or ec else None, c + ec, one_row, (*lead, r + er, c + ec),
                   (r, c) if er or ec else None)


def _tile_input(x: Tensor, tiling: _Tiling) -> Tensor:
    """x as the tile kernel's (R, C): padded, leading dims stacked into rows."""
    x2 = (torch.constant_pad_nd(x, tiling.pad) if tiling.pad else x).reshape(-1, tiling.cols)
    return torch.constant_pad_nd(x2, (0, 0, 0, x2.shape[0])) if tiling.one_row else x2


def _tile_output(local: Tensor, t_scale: Tensor | None, tiling: _Tiling) -> tuple[Tensor, Tensor | None]:
    """The tile kernel's result back in the operand's shape, the padding cut off (a view)."""
    local = (local[: local.shape[0] // 2] if tiling.one_row else local).view(tiling.shape)
    return (local[..., : tiling.cut[0], : tiling.cut[1]] if tiling.cut else local), t_scale


def _moved(fast: Kept, dim: int, x: Tensor, per_call: tuple[Any, ...]) -> tuple[Tensor, Tensor | None]:
    """A narrow block call's kept path (``_blocks``): x with ``dim`` moved last and copied, the copy's
    kept call, its result back in x's layout; without the entry point's planning and dispatch (~10 us
    of a ~60 us call on a (32, 64, 2, 2) gradient, a CPU). The draws are the ones the full path makes."""
    local, t_scale = fast(x.movedim(dim, -1).contiguous(), per_call)
    return _like(x, local.movedim(-1, dim)), t_scale  # type: ignore[union-attr]


def _tiled(fast: _Fast, tiling: _Tiling, x: Tensor, per_call: tuple[Any, ...]) -> tuple[Tensor, Tensor | None]:
    """A 2D tile call's kept path: padded as planned, the kept call, cut back; without the entry
    point's planning and dispatch (about half of a ~55 us call on a small conv weight, a CPU)."""
    local, t_scale = fast(_tile_input(x, tiling), per_call)
    return _tile_output(local, t_scale, tiling)  # type: ignore[arg-type]


class _BlockPlan(NamedTuple):
    """How ``_blocks`` runs on one operand layout."""

    layout: _Layout  # of x, or of its contiguous copy
    copy: bool  # x has no (A, n, B) view: a contiguous copy first
    narrow: bool  # blocks along the last dim of a copy instead (_CPU_MIN_INNER)
    short: bool  # n at most one block (exactly one only unrotated): one block, unpadded
    pad: int  # zeros appended to n, up to a multiple of the block
    options: str  # the kernel's static options


@functools.lru_cache(maxsize=4096)
def _cached_plan(shape: torch.Size, stride: tuple[int, ...], dim: int, kind: str, stochastic: bool,
                 cpu: bool, rotated: bool) -> _BlockPlan:
    """_plan_blocks, worked out once per operand layout: a step makes hundreds of calls on a few dozen
    layouts, and planning each call took about as long as the call into the kernel."""
    return _plan_blocks(torch.empty_strided(shape, stride, device="meta"), dim, kind, stochastic, cpu, rotated)


def _plan_blocks(x: Tensor, dim: int, kind: str, stochastic: bool, cpu: bool, rotated: bool) -> _BlockPlan:
    layout = _layout(x, dim)
    copy = layout is None
    if layout is None:
        layout = _layout(x.contiguous(), dim)
        assert layout is not None  # a contiguous tensor always has its (A, n, B) view
    _, n, b = layout[3]
    bs = 16 if kind == "nvfp4" else 32
    # Under one block (3 input channels, a narrow layer's 8): no padding, the kernel takes the dim as
    # one block; else padded, once, so that the kernels never mask. Exactly one block goes the short
    # way too: as (A, n / bs, bs, B), the block index's stride equals B's there, and dynamo guarded
    # their order, compiling the kernel a second time for it. (A rotation views n in blocks either
    # way, and has no short kernel.)
    short = n < bs or (n == bs and not rotated)
    pad = 0 if short else -n % bs
    return _BlockPlan(layout, copy, _narrow(b, cpu), short, pad, _opts(kind, stochastic, short))


def round_params_(params: list[Tensor], fmt: ElementFormat, *, stochastic: bool = False,
                  generator: RoundingStream | None = None,
                  forward: Sequence[ElementFormat | None] | None = None) -> list[Tensor | None]:
    """Round every tensor in place onto ``fmt``, one draw per tensor in order (FP8's FP16 masters).
    The reference: ``p.copy_(quantize(p, fmt))`` or ``stochastic_round`` for each p.

    Fused, one kernel rounds the small ones, concatenated (in groups of up to 2**24 elements): one
    call per parameter cost ~60 us each, 10 ms of a ResNet-50/8 step (161 parameters, 0.4M elements).
    A tensor of ``_ALONE`` elements or more rounds in place in a call of its own, which costs less
    than copying it in and out (an MLP's 1024x1024 weights). Stochastic rounding outside a run (no
    stream given), or from a torch.Generator, keeps one call per tensor: each draws its own key from
    the global RNG, as the reference does, or runs the reference.

    ``forward`` (one format or None per tensor): a tensor also gets its rounded value rounded to
    nearest onto that format, written in the same pass (``round_to_element`` of the result, bit for
    bit: an FP8 layer's next forward weight); small ones that share a kernel, where their group asks
    for one format. Returns those, None elsewhere (and on the reference)."""
    out: list[Tensor | None] = [None] * len(params)
    fwd = list(forward) if forward is not None else out
    same = bool(params) and all(p.is_contiguous() and p.dtype == params[0].dtype and p.device == params[0].device
                                for p in params)  # fmt: skip
    if same and enabled(params[0]) and _fits(fmt) and (not stochastic or isinstance(generator, RoundingStream)):
        keys, first = _stream(params[0], stochastic, generator, len(params))
        small = [p.numel() < _ALONE for p in params]
        for lo, hi in _groups([p.numel() for p in params], _GROUP, small):
            if small[lo]:
                out[lo:hi] = _round_group(params[lo:hi], fmt, keys, _nth(first, lo), fwd[lo:hi])
                continue
            for i in range(lo, hi):
                out[i] = _round_alone(params[i], fmt, stochastic, keys, _nth(first, i), fwd[i], _run)
        return out
    for i, p in enumerate(params):
        if enabled(p) and _fits(fmt) and p.is_contiguous() and p.numel():
            with contextlib.suppress(_Unfused):
                keys, counter = _stream(p, stochastic, generator)
                out[i] = _round_alone(p, fmt, stochastic, keys, counter, fwd[i], _call)
                continue
        gen = generator if generator is not None or not stochastic else global_stream(p.device)
        p.copy_(nf.round_to_element(p, fmt, stochastic=stochastic, generator=gen))
    return out


def _round_alone(p: Tensor, fmt: ElementFormat, stochastic: bool, keys: Tensor | None, counter: Tensor | None,
                 forward: ElementFormat | None, call: Callable[..., Any]) -> Tensor | None:
    """One tensor of ``round_params_`` in place, in a call of its own; its forward copy if asked for."""
    if forward is None or not _fits(forward):
        call("round_", _opts(stochastic), p.view(-1), *_elem(fmt, p.device), keys, counter)
        return None
    return call("round_fwd_", _opts(stochastic), p.view(-1), *_elem(fmt, p.device), keys, counter,
                *_elem(forward, p.device)).view(p.shape)


_GROUP = 2**24  # elements rounded by one call of round_params_'s kernel, at most (but one larger tensor)


_ALONE = 2**15  # elements from which a tensor has a call of its own


def _nth(first: Tensor | None, i: int) -> Tensor | None:
    """Counter ``i`` of a call's draws (None: no draws)."""
    return None if first is None else first + i


def _run(name: str, options: str, x: Tensor, *args: Any) -> Any:
    """``_call``; past dynamo's recompile limit, the same kernel body eagerly (same values, same draws)."""
    try:
        return _call(name, options, x, *args)
    except _Unfused:
        return _BODIES[name](x.detach(), *args)


def _groups(sizes: list[int], limit: int, kinds: list[Any] | None = None) -> Iterator[tuple[int, int]]:
    """Consecutive [lo, hi) ranges of ``sizes`` summing to at most ``limit`` (one larger size alone),
    and of one kind each (``kinds``: one per size)."""
    lo, total = 0, 0
    for i, n in enumerate(sizes):
        if i > lo and (total + n > limit or (kinds is not None and kinds[i] != kinds[lo])):
            yield lo, i
            lo, total = i, 0
        total += n
    if lo < len(sizes):
        yield lo, len(sizes)


@functools.lru_cache(maxsize=64)
def _group_index(sizes: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """A group's element counts and start offsets on ``device``, made once: a copy from the host
    every step would wait for the GPU. The offsets end with the group's end, which no element reads:
    for a group of one tensor they would have one entry, a size dynamo specialises, and its
    kernel compiled a second time for the first group of two."""
    counts = torch.tensor(sizes, dtype=torch.int64, device=device)
    return counts, torch.cumsum(torch.cat([counts.new_zeros(1), counts]), 0).to(torch.int32)


def _which(counts: Tensor, n: int) -> Tensor:
    """Which tensor of a group each of its ``n`` elements belongs to (int32)."""
    # output_size: no read-back of the counts' sum (a host sync on a GPU)
    return torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32, device=counts.device), counts,
                                   output_size=n)


# Groups up to this many elements keep their ``_which`` (4 MiB at most each, 64 groups): a small
# model's parameters are one group, and building the index every step was a fifth of its rounding.
_KEEP_WHICH = 2**20


@functools.lru_cache(maxsize=64)
def _group_which(sizes: tuple[int, ...], device: torch.device) -> Tensor:
    return _which(_group_index(sizes, device)[0], sum(sizes))


def _concat(tensors: list[Tensor], draws: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The tensors' concatenation, and for stochastic rounding which tensor each element belongs to
    and where each tensor starts (``_k_round_all``)."""
    flat = torch.cat([t.view(-1) for t in tensors])
    if not draws or not flat.numel():
        return flat, None, None
    sizes = tuple(t.numel() for t in tensors)
    counts, starts = _group_index(sizes, flat.device)
    which = _group_which(sizes, flat.device) if flat.numel() <= _KEEP_WHICH else _which(counts, flat.numel())
    torch._dynamo.maybe_mark_dynamic(which, 0)  # one kernel for every group and model, as _call's x
    torch._dynamo.maybe_mark_dynamic(starts, 0)
    return flat, which, starts


def _scatter(dst: list[Tensor], flat: Tensor) -> None:
    """Copy the concatenation ``flat`` back into the tensors it came from (or their like)."""
    torch._foreach_copy_(dst, [t.view(p.shape) for t, p in zip(flat.split([p.numel() for p in dst]), dst, strict=True)])


def _round_group(params: list[Tensor], fmt: ElementFormat, keys: Tensor | None, first: Tensor | None,
                 forward: list[ElementFormat | None]) -> list[Tensor | None]:
    """A group of ``round_params_``'s small tensors in one call; with one forward format among them, each
    that asks for it gets its forward copy, a view of one buffer the same call writes."""
    flat, which, starts = _concat(params, keys is not None)
    if not flat.numel():
        return [None] * len(params)
    asked = {f for f in forward if f is not None}
    fwd = asked.pop() if len(asked) == 1 else None
    opts, elem = _opts(keys is not None), _elem(fmt, flat.device)
    if fwd is None or not _fits(fwd):
        _scatter(params, _run("round_all", opts, flat, which, starts, *elem, keys, first))
        return [None] * len(params)
    r, q = _run("round_all_fwd", opts, flat, which, starts, *elem, keys, first, *_elem(fwd, flat.device))
    _scatter(params, r)
    return [None if f is None else t.view(p.shape)
            for t, p, f in zip(q.split([p.numel() for p in params]), params, forward, strict=True)]


def _write_group(dst: list[Tensor], src: list[Tensor], keys: Tensor, first: Tensor) -> None:
    flat, which, starts = _concat(src, True)
    if not flat.numel():
        return
    bf16 = dst[0].dtype == torch.bfloat16
    _scatter(dst, _run("write_all", _opts(bf16), flat, which, starts, *_elem(nf.FP16, flat.device), keys, first, bf16))


def _write_one(p: Tensor, m: Tensor, keys: Tensor, counter: Tensor) -> None:
    """One master into its bf16 / FP16 parameter, stochastically, in a call of its own."""
    if p.dtype == torch.bfloat16:
        flat = m.view(-1)
        torch._dynamo.maybe_mark_dynamic(flat, 0)  # as _call's x (p): else one more compile for a second size
        _run("bf16_", "", p.view(-1), flat, keys, counter)
    else:
        p.view(-1).copy_(_run("round", _opts(True, True), m.view(-1), *_elem(nf.FP16, m.device), True, keys, counter))


def write_back_(dst: list[Tensor], src: list[Tensor], generator: RoundingStream | None) -> None:
    """Stochastically round FP32 masters ``src`` into FP16/bf16 parameters ``dst``, one draw per
    tensor in order (``MasterWeights.after_step``'s reference loop). Fused, one kernel call rounds a
    run of small parameters of one dtype, and a large one has a call of its own, as in
    ``round_params_``; outside a run (no stream) or with a torch.Generator, one call per tensor."""
    same = bool(src) and all(p.is_contiguous() and m.is_contiguous() and m.dtype == torch.float32
                             and p.dtype in (torch.bfloat16, torch.float16) and m.device == p.device == src[0].device
                             for p, m in zip(dst, src, strict=True))  # fmt: skip
    if same and enabled(src[0]) and isinstance(generator, RoundingStream):
        keys, first = _stream(src[0], True, generator, len(src))
        kinds = [(p.dtype, m.numel() < _ALONE) for p, m in zip(dst, src, strict=True)]
        for lo, hi in _groups([m.numel() for m in src], _GROUP, kinds):
            if kinds[lo][1]:
                _write_group(dst[lo:hi], src[lo:hi], keys, first + lo)  # type: ignore[arg-type, operator]
                continue
            for i in range(lo, hi):
                _write_one(dst[i], src[i], keys, first + i)  # type: ignore[arg-type, operator]
        return
    for p, m in zip(dst, src, strict=True):
        if enabled(m) and p.is_contiguous() and m.is_contiguous() and m.numel():
            with contextlib.suppress(_Unfused):
                keys, counter = _stream(m, True, generator)
                _write_one(p, m, keys, counter)  # type: ignore[arg-type]
                continue
        gen = generator if generator is not None else global_stream(m.device)
        bf16 = p.dtype == torch.bfloat16
        p.copy_(nf.stochastic_round_to_bf16(m, gen) if bf16 else nf.round_to_element(m, nf.FP16, stochastic=True,
                                                                                      generator=gen))

"""Fused quantizers: the reference numerics of ``formats``, ``mx``, ``qgemm`` and ``fp8``, compiled.

Emulating a format is a chain of elementwise ops (abs, amax, exponent, scale, round, clamp, select),
and run eagerly every op is one pass over memory: quantize-dequantize took 74% of an MXFP8 step.
Each function here is the same arithmetic as its reference, written once as plain torch code and
handed to ``torch.compile``, which fuses it into one or two loops (vectorised C++ on a CPU, Triton on
a GPU): one pass to find the scales, one to round. What compile cannot fuse is done differently, on
purpose, and the tests hold every result bit-identical to the eager reference:

- FP8/FP16/BF16 rounding uses the arithmetic rounding (``formats.round_arith``'s rule, with the
  exponent read from the float's bits), not a cast to the 8-bit dtype: inductor's CPU code converts
  to float8 one element at a time, 10x slower than the arithmetic.
- Stochastic rounding draws from the run's counter-based stream (``rounding_rng``) inside the kernel;
  a ``torch.Generator`` cannot enter a compiled graph, so with one its uniforms are drawn eagerly,
  exactly as the reference draws them, and passed in.
- The random Hadamard transform stays an eager matmul (its sums must add in the reference's order).

Tensors are viewed as (A, n, B) with the blocks along n, without a copy for contiguous tensors and
for transposes (the weight-gradient GEMM's operands), so a quantizer reads its operand where it is.

Where torch.compile cannot run (no C++ compiler, no Triton, an unsupported platform), the first call
on that device logs one line and every call runs the eager reference. ``MPTRAIN_FUSED=0`` in the
environment, or ``with reference():``, does the same on purpose (tests, debugging).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import types
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mptrain.numerics import formats as nf
from mptrain.numerics import mx
from mptrain.numerics.formats import ElementFormat
from mptrain.numerics.rounding_rng import (
    RoundingStream,
    bits16_from_index,
    draw_keys,
    uniform_from_index,
)

log = logging.getLogger(__name__)

_available: dict[str, bool] = {}  # device type -> torch.compile works there
_forced_reference = os.environ.get("MPTRAIN_FUSED", "1").strip().lower() in ("0", "false", "off", "no")
_kernels: dict[str, Callable[..., Any]] = {}
_given_up: set[str] = set()  # kernels that run the reference after a compile failure


# --------------------------------------------------------------------------------------------
# when to run fused


@contextlib.contextmanager
def reference() -> Iterator[None]:
    """Run the eager reference inside the block (the tests' side of every bit-identity check)."""
    global _forced_reference
    before, _forced_reference = _forced_reference, True
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


def _probe(device: torch.device) -> bool:
    try:
        x = torch.linspace(-3, 3, 64, device=device)
        got = _kernel("round", nf.E4M3)(x, nf.E4M3, True, None, None, None)
        if not torch.equal(got, nf.round_to_element(x, nf.E4M3)):
            raise RuntimeError("the compiled rounding differs from the reference")
        return True
    except Exception as exc:  # any failure to build a kernel: no compiler, no Triton, ...
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        log.warning("fused quantizers unavailable on %s (torch.compile: %s): running the eager reference, "
                    "several times slower", device.type, reason)
        return False


def _kernel(name: str, fmt: Any, variant: str = "") -> Callable[..., Any]:
    """The compiled kernel ``name`` for one format and variant (how its noise arrives, which of its
    dims are 1), built on first use.

    Each gets a code object of its own: dynamo caches compiled code per code object, so variants
    neither share one recompile budget nor make each other's constants (block size, mantissa bits)
    look dynamic. Tensor dims are marked dynamic from the first call (``_call``), so one kernel
    serves every layer's shapes: a run compiles each variant once, not once per shape.
    """
    tag = f"{getattr(fmt, 'name', fmt)}_{variant}" if variant else str(getattr(fmt, "name", fmt))
    key = f"{name}:{tag}"
    k = _kernels.get(key)
    if k is None:
        body = _BODIES[name]
        code = body.__code__.replace(co_name=f"{body.__name__}_{tag}")
        fn = types.FunctionType(code, body.__globals__, code.co_name, body.__defaults__, body.__closure__)
        k = _kernels[key] = torch.compile(fn, fullgraph=True)
    return k


class _Unfused(Exception):
    """A kernel that cannot run compiled (it hit dynamo's recompile limit): use the reference."""


def _run(key: str, kernel: Callable[..., Any], *args: Any) -> Any:
    if key in _given_up:
        raise _Unfused
    try:
        return kernel(*args)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        _given_up.add(key)
        log.warning("fused quantizer %s recompiled too often (torch._dynamo.config.recompile_limit); "
                    "it runs the eager reference from here on", key)
        raise _Unfused from None


def _call(name: str, fmt: Any, x: Tensor, *args: Any) -> Any:
    """Run kernel ``name`` on ``x`` (and ``args``), in the variant that x's unit dims and the noise
    arguments (the last three of ``args``) select. x is detached: gradients never flow through a
    quantizer (the layers' autograd functions own that), and requires_grad would be one more guard."""
    x = x.detach()
    keys, _, noise = args[-3:]
    variant = ("k" if keys is not None else "n" if noise is not None else "d") + "".join(
        "1" if s == 1 else "x" for s in x.shape)
    for d, s in enumerate(x.shape):
        if s != 1:
            torch._dynamo.maybe_mark_dynamic(x, d)
    return _run(f"{name}:{variant}", _kernel(name, fmt, variant), x, fmt, *args)


def _call_list(name: str, fmt: Any, tensors: list[Tensor], *args: Any) -> Any:
    """Run a kernel over a list of tensors (parameters): one variant per list of ranks, every dim
    dynamic, so that models of one structure share their kernel."""
    ranks = "".join(str(t.dim()) for t in tensors)
    variant = f"{len(tensors)}_{zlib.crc32(ranks.encode()):08x}"  # stable across processes: the on-disk cache hits
    for t in tensors:
        for d, s in enumerate(t.shape):
            if s != 1:
                torch._dynamo.maybe_mark_dynamic(t, d)
    return _run(f"{name}:{variant}", _kernel(name, fmt, variant), tensors, *args)


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process (every frame: these kernels and
    ``trainer.compile``), for keeping compile time out of throughput. 0 where torch does not say."""
    try:
        from torch._dynamo.utils import cumulative_time_spent_ns

        return float(cumulative_time_spent_ns.get("entire_frame_compile", 0.0)) / 1e9
    except (ImportError, AttributeError):
        return 0.0


def _noise_args(
    x: Tensor, stochastic: bool, generator: torch.Generator | RoundingStream | None, shape: Sequence[int]
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(keys, counter, noise) for a kernel: the counter stream's keys and this draw's counter, or,
    for a ``torch.Generator`` (or the global RNG), the uniforms drawn eagerly in ``shape``."""
    if not stochastic:
        return None, None, None
    if isinstance(generator, RoundingStream):
        return generator.keys, generator.take(), None
    return None, None, torch.rand(tuple(shape), generator=generator, device=x.device, dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# kernel bodies: plain torch, compiled by _kernel. Every constant is a Python value (a format), so
# each format gets its own specialised code.


def _exponent(a: Tensor) -> Tensor:
    """floor(log2(a)) for finite a > 0 from the float's exponent bits; -127 for 0 and subnormals
    (callers clamp it far above that). The same value frexp gives, as plain integer ops."""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


def _pow2(k: Tensor, lo: int, hi: int) -> Tensor:
    """2**k for integer k known to lie in [lo, hi]: straight from the exponent bits where that range
    is all FP32 normals (the common case: no select), else ``formats.exp2i`` (subnormals too)."""
    if lo >= -126 and hi <= 127:
        return ((k + 127) << 23).view(torch.float32)
    return nf.exp2i(k)


def _round_f32(xf: Tensor, fmt: ElementFormat, u: Tensor | None) -> Tensor:
    """``formats.round_arith`` for FP32: saturating RNE (``u`` None) or stochastic rounding.

    Leaner than the reference, with the same result: the exponent is read from the bits, and NaN
    needs no select, since it propagates through every step (only its payload may differ)."""
    a = xf.abs().clamp(max=fmt.max_normal)
    e = _exponent(a).clamp(fmt.emin, fmt.emax)
    scaled = a * _pow2(-e, -fmt.emax, -fmt.emin) * float(2**fmt.mbits)
    if u is None:
        r = torch.round(scaled)
    else:
        down = torch.floor(scaled)
        r = down + (u < scaled - down).float()
    return torch.copysign(r * (2.0**-fmt.mbits) * _pow2(e, fmt.emin, fmt.emax), xf)


def _uniform(shape_index: Tensor, keys: Tensor | None, counter: Tensor | None, noise: Tensor | None) -> Tensor | None:
    if keys is not None:
        ka, kb = draw_keys(keys, counter)  # type: ignore[arg-type]
        return uniform_from_index(shape_index, ka, kb)
    return noise


def _logical_index(shape: Sequence[int], device: torch.device) -> Tensor:
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.int32, device=device).view(*shape)


def _k_round(x: Tensor, fmt: ElementFormat, saturate: bool, keys: Tensor | None, counter: Tensor | None,
             noise: Tensor | None) -> Tensor:
    """``round_to_element`` (FP32 out)."""
    xf = x.float()
    stochastic = keys is not None or noise is not None
    u = _uniform(_logical_index(xf.shape, xf.device), keys, counter, noise) if stochastic else None
    q = _round_f32(xf, fmt, u)
    if not saturate:
        q = torch.where(nf.overflows(xf.abs(), fmt, stochastic), nf.overflow_value(xf, fmt), q)
    return q


def _k_scaled(x: Tensor, fmt: ElementFormat, keys: Tensor | None, counter: Tensor | None,
              noise: Tensor | None) -> Tensor:
    """``fp8.quantize_scaled``: a per-tensor power-of-two scale from amax, round, scale back;
    non-finite values pass through. Returns x's dtype."""
    xf = x.float()
    s = _pow2_scale(xf.abs().amax(), fmt)
    stochastic = keys is not None or noise is not None
    u = _uniform(_logical_index(xf.shape, xf.device), keys, counter, noise) if stochastic else None
    q = _round_f32(xf * s, fmt, u) / s
    return torch.where(torch.isfinite(xf), q, xf).to(x.dtype)


def _pow2_scale(amax: Tensor, fmt: ElementFormat) -> Tensor:
    """2**k, the largest power of two with amax * 2**k <= max (k in [-126, 126]); 1 for a zero or
    non-finite amax. ``fp8.tensor_scale`` and ``qgemm.axiswise_round``'s rule, from the bits."""
    ok = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(ok, amax, 1.0)
    k = (fmt.emax - _exponent(safe)).clamp(-126, 126)  # floor(log2 max) - floor(log2 amax): k or k - 1
    k = torch.where(safe * nf.exp2i(k) > fmt.max_normal, k - 1, k)
    k = torch.where(safe * nf.exp2i(k + 1) <= fmt.max_normal, k + 1, k).clamp(-126, 126)
    return torch.where(ok, nf.exp2i(k), 1.0)


def _k_axis(x3: Tensor, fmt: ElementFormat, strides: tuple[int, int, int], keys: Tensor | None,
            counter: Tensor | None, noise: Tensor | None) -> Tensor:
    """``qgemm.axiswise_round`` along dim 1 of (A, n, B). ``strides``: the row-major strides of the
    caller's logical layout along (A, n, B), which is the order its uniforms are drawn in."""
    xf = x3.float()
    s = _pow2_scale(xf.abs().amax(1, keepdim=True), fmt)
    u = None
    if keys is not None or noise is not None:
        a, n, b = xf.shape
        dev = xf.device
        idx = (torch.arange(a, dtype=torch.int32, device=dev).view(a, 1, 1) * strides[0]
               + torch.arange(n, dtype=torch.int32, device=dev).view(1, n, 1) * strides[1]
               + torch.arange(b, dtype=torch.int32, device=dev).view(1, 1, b) * strides[2])  # fmt: skip
        u = _uniform(idx, keys, counter, noise)
    q = _round_f32(xf * s, fmt, u) / s
    return torch.where(torch.isfinite(xf), q, xf)


def _block_scales(amax: Tensor, t_amax: Tensor | None, fmt: mx.BlockFormat) -> tuple[Tensor, Tensor, Tensor | None]:
    """(multiplier onto the element grid, local scale, tensor scale) per block: ``quantize_blocks``'
    E8M0 rule, or NVFP4's two levels."""
    bad = ~torch.isfinite(amax)
    if fmt.two_level:
        t_scale, encode = mx.nvfp4_tensor_scales(t_amax, fmt)  # type: ignore[arg-type]
        s_block = _round_f32((amax / fmt.element.max_normal / t_scale).clamp(max=nf.E4M3.max_normal), nf.E4M3, None)
        s_block = torch.where(bad, math.nan, s_block)
        return torch.where(s_block > 0, encode / s_block, 0.0), s_block, t_scale
    exps = (_exponent(amax) - fmt.element.emax).clamp(-mx.E8M0_BIAS, mx.E8M0_BIAS)
    return nf.exp2i(-exps), torch.where(bad, math.nan, nf.exp2i(exps)), None


def _k_blocks(x3: Tensor, fmt: mx.BlockFormat, keys: Tensor | None, counter: Tensor | None,
              noise: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``quantize_blocks(...).local`` and ``.tensor_scale`` for blocks along dim 1 of (A, n, B).

    The uniforms of stochastic rounding follow the reference's layout, x.movedim(dim, -1) padded:
    element (a, i, b) is draw (a * B + b) * N + i; ``noise`` comes in that layout, (A, B, N)."""
    bs = fmt.block_size
    a, n, b = x3.shape
    xf = x3.float()
    if n % bs:  # a guard, not a mask: lengths that fill their blocks get code without padding
        xf = F.pad(xf, (0, 0, 0, -n % bs))
    big_n = xf.shape[1]
    blocks = xf.view(a, big_n // bs, bs, b)
    amax = blocks.abs().amax(2, keepdim=True)
    t_amax = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax() if fmt.two_level else None
    mult, local_scale, t_scale = _block_scales(amax, t_amax, fmt)
    u = None
    if keys is not None:
        dev = xf.device
        idx = ((torch.arange(a, dtype=torch.int32, device=dev).view(a, 1, 1) * b
                + torch.arange(b, dtype=torch.int32, device=dev).view(1, 1, b)) * big_n
               + torch.arange(big_n, dtype=torch.int32, device=dev).view(1, big_n, 1))  # fmt: skip
        u = _uniform(idx.view(a, big_n // bs, bs, b), keys, counter, None)
    elif noise is not None:
        u = noise.permute(0, 2, 1).reshape(a, big_n // bs, bs, b)
    q = _round_f32(blocks * mult, fmt.element, u)
    local = (q * local_scale).view(a, big_n, b)[:, :n]
    return local, t_scale


def _k_tiles(x3: Tensor, fmt: mx.BlockFormat, keys: Tensor | None, counter: Tensor | None,
             noise: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``quantize_blocks(..., block_2d=True)``: square tiles over the last two dims of (L, r, c).
    Uniforms in the reference's tile layout (L, row tiles, column tiles, bs * bs)."""
    bs = fmt.block_size
    lead, r, c = x3.shape
    xf = x3.float()
    if r % bs or c % bs:
        xf = F.pad(xf, (0, -c % bs, 0, -r % bs))
    rt, ct = xf.shape[1] // bs, xf.shape[2] // bs
    tiles = xf.view(lead, rt, bs, ct, bs)
    amax = tiles.abs().amax((2, 4), keepdim=True)
    t_amax = torch.where(torch.isfinite(tiles), tiles.abs(), 0.0).amax() if fmt.two_level else None
    mult, local_scale, t_scale = _block_scales(amax, t_amax, fmt)
    u = None
    if keys is not None:
        idx = _logical_index((lead, rt, ct, bs, bs), xf.device).permute(0, 1, 3, 2, 4)
        u = _uniform(idx, keys, counter, None)
    elif noise is not None:
        u = noise.view(lead, rt, ct, bs, bs).permute(0, 1, 3, 2, 4)
    q = _round_f32(tiles * mult, fmt.element, u)
    local = (q * local_scale).view(lead, rt * bs, ct * bs)[:, :r, :c]
    return local, t_scale


def _k_params(params: list[Tensor], fmt: ElementFormat, keys: Tensor | None, counter: Tensor | None) -> None:
    """Round every tensor in place onto ``fmt`` (FP8's FP16 master weights): to nearest, or
    stochastically with draw ``counter + i`` for tensor i, as the reference's loop draws."""
    for i, p in enumerate(params):
        u = None
        if keys is not None:
            ka, kb = draw_keys(keys, counter + i)  # type: ignore[operator]
            u = uniform_from_index(_logical_index(p.shape, p.device), ka, kb)
        p.copy_(_round_f32(p.float(), fmt, u).to(p.dtype))


def _k_write_back(dst: list[Tensor], src: list[Tensor], keys: Tensor, counter: Tensor) -> None:
    """Stochastic write-back of FP32 masters into FP16/bf16 parameters (``MasterWeights``): bf16 by
    adding 16 random bits below its mantissa and truncating, FP16 by ``formats``' rounding."""
    for i, (p, m) in enumerate(zip(dst, src, strict=True)):
        ka, kb = draw_keys(keys, counter + i)
        idx = _logical_index(m.shape, m.device)
        if p.dtype == torch.bfloat16:
            bits = m.view(torch.int32)
            rounded = ((bits + bits16_from_index(idx, ka, kb)) & -65536).view(torch.float32)
            p.copy_(torch.where(torch.isfinite(m), rounded, m).to(torch.bfloat16))
        else:
            p.copy_(_round_f32(m, nf.FP16, uniform_from_index(idx, ka, kb)).to(p.dtype))


_BODIES: dict[str, Callable[..., Any]] = {
    "round": _k_round, "scaled": _k_scaled, "axis": _k_axis, "blocks": _k_blocks, "tiles": _k_tiles,
    "params": _k_params, "write_back": _k_write_back,
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# (A, n, B) views


def view3(x: Tensor, dim: int) -> tuple[Tensor, Callable[[Tensor], Tensor], tuple[int, int, int]] | None:
    """x as an (A, n, B) view of its storage with ``dim`` as n, a function taking such a tensor back
    to x's logical layout, and x's row-major strides along (A, n, B). None when no view keeps the
    other dims in their logical order (then the caller copies x to contiguous first)."""
    d = dim % x.dim()
    order = sorted(range(x.dim()), key=lambda i: (-x.stride(i), i)) if not x.is_contiguous() else list(range(x.dim()))
    base = x.permute(order)
    rest = [i for i in order if i != d]
    if not base.is_contiguous() or rest != sorted(rest):
        return None
    bd = order.index(d)
    a, b = math.prod(base.shape[:bd]), math.prod(base.shape[bd + 1:])
    n = base.shape[bd]
    inverse = [order.index(i) for i in range(x.dim())]
    shape = base.shape

    def back(t: Tensor) -> Tensor:
        return t.reshape(shape).permute(inverse)

    # x's logical row-major strides, of the dims that make up A, n and B in the base's order
    logical = [math.prod(x.shape[i + 1:]) for i in range(x.dim())]
    sa = logical[order[bd - 1]] if bd > 0 else 0
    sb = logical[order[-1]] if bd < x.dim() - 1 else 0
    return base.reshape(a, n, b), back, (sa, logical[d], sb)


# --------------------------------------------------------------------------------------------
# the entry points: fused where enabled, else the reference. Outputs equal bit for bit.


def round_to_element(
    x: Tensor, fmt: ElementFormat, *, stochastic: bool = False,
    generator: torch.Generator | RoundingStream | None = None, saturate: bool = True,
) -> Tensor:
    """``formats.round_to_element``, fused (FP32 out). Stochastic rounding with no generator draws
    from the global RNG (FP8's rounding outside a run, as ``fp8.stochastic_round`` does)."""
    if not saturate and not (fmt.has_inf or fmt.has_nan):
        raise ValueError(f"{fmt.name} has no Inf or NaN to overflow to: use saturate=True")
    if enabled(x):
        with contextlib.suppress(_Unfused):
            return _call("round", fmt, x, saturate, *_noise_args(x, stochastic, generator, x.shape))
    if stochastic and generator is None:
        q = nf.round_generic(x, fmt, stochastic=True)
        if not saturate:
            q = torch.where(nf.overflows(x.float().abs(), fmt, True), nf.overflow_value(x.float(), fmt), q)
        return q
    return nf.round_to_element(x, fmt, stochastic=stochastic, generator=generator, saturate=saturate)


def quantize_scaled(x: Tensor, fmt: ElementFormat, *, stochastic: bool = False,
                    generator: torch.Generator | RoundingStream | None = None) -> Tensor:
    """``fp8.quantize_scaled`` (per-tensor power-of-two scale), fused; x's dtype out."""
    if enabled(x):
        with contextlib.suppress(_Unfused):
            return _call("scaled", fmt, x, *_noise_args(x, stochastic, generator, x.shape))
    from mptrain.numerics.fp8 import as_format
    from mptrain.numerics.fp8 import quantize_scaled as ref

    return ref(x, as_format(fmt.torch_dtype), stochastic, generator)  # type: ignore[arg-type]


def axiswise_round(x: Tensor, fmt: ElementFormat, dim: int, *, stochastic: bool = False,
                   generator: torch.Generator | RoundingStream | None = None) -> Tensor:
    """``qgemm.axiswise_round``, fused (FP32 out, x's layout)."""
    if enabled(x):
        v = view3(x, dim) or view3(x.contiguous(), dim)
        assert v is not None  # a contiguous tensor always has its (A, n, B) view
        x3, back, strides = v
        keys, counter, noise = _noise_args(x, stochastic, generator, x.shape)
        if noise is not None:  # drawn in x's logical layout: seen through the (A, n, B) view
            noise = _to_view3(noise, x, dim)
        with contextlib.suppress(_Unfused):
            return back(_call("axis", fmt, x3, strides, keys, counter, noise))
    from mptrain.numerics import qgemm

    return qgemm.axiswise_round(x, fmt, dim, stochastic=stochastic, generator=generator)  # type: ignore[arg-type]


def _to_view3(t: Tensor, like: Tensor, dim: int) -> Tensor:
    """A tensor of ``like``'s logical shape, laid out as ``like``'s (A, n, B) view (a copy)."""
    out = torch.empty_strided(like.shape, like.stride(), dtype=t.dtype, device=t.device)
    out.copy_(t)
    v = view3(out, dim) or view3(out.contiguous(), dim)
    assert v is not None
    return v[0]


def quantize_blocks(
    x: Tensor, fmt: mx.BlockFormat, dim: int = -1, *, stochastic: bool = False,
    generator: torch.Generator | RoundingStream | None = None, block_2d: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``mx.quantize_blocks(...)``'s (local, tensor_scale), fused. Lengths are padded with zeros."""
    if enabled(x) and (not block_2d or x.dim() >= 2):
        with contextlib.suppress(_Unfused):
            return _blocks(x, fmt, dim, stochastic, generator, block_2d)
    q = mx.quantize_blocks(x, fmt, dim, stochastic=stochastic, generator=generator, block_2d=block_2d)
    return q.local, q.tensor_scale


def _blocks(x: Tensor, fmt: mx.BlockFormat, dim: int, stochastic: bool,
            generator: torch.Generator | RoundingStream | None, block_2d: bool) -> tuple[Tensor, Tensor | None]:
    bs = fmt.block_size
    if block_2d:
        x3 = x.contiguous().reshape(-1, *x.shape[-2:])
        rt, ct = -(-x.shape[-2] // bs), -(-x.shape[-1] // bs)
        keys, counter, noise = _noise_args(x, stochastic, generator, (x3.shape[0], rt, ct, bs * bs))
        local, t_scale = _call("tiles", fmt, x3, keys, counter, noise)
        return local.reshape(x.shape), t_scale
    v = view3(x, dim) or view3(x.contiguous(), dim)
    assert v is not None
    x3, back, _ = v
    a, n, b = x3.shape
    keys, counter, noise = _noise_args(x, stochastic, generator, (a, b, n + (-n % bs)))
    local, t_scale = _call("blocks", fmt, x3, keys, counter, noise)
    return back(local), t_scale


def round_params_(params: list[Tensor], fmt: ElementFormat, *, stochastic: bool = False,
                  generator: RoundingStream | None = None) -> None:
    """Round every tensor in place onto ``fmt``, one draw per tensor in order (FP8's FP16 masters).
    The reference: ``p.copy_(quantize(p, fmt))`` or ``stochastic_round`` for each p."""
    if not params:
        return
    if enabled(params[0]) and (not stochastic or isinstance(generator, RoundingStream)):
        keys = counter = None
        if stochastic:
            keys, counter = generator.keys, generator.take(len(params))  # type: ignore[union-attr]
        with contextlib.suppress(_Unfused):
            _call_list("params", fmt, params, fmt, keys, counter)
            return
    from mptrain.numerics import fp8

    fmt8 = fp8.as_format(fmt.torch_dtype)  # type: ignore[arg-type]
    for p in params:
        p.copy_(fp8.stochastic_round(p, fmt8, generator) if stochastic else fp8.quantize(p, fmt8))  # type: ignore[arg-type]


def write_back_(dst: list[Tensor], src: list[Tensor], generator: RoundingStream | None) -> None:
    """Stochastically round FP32 masters ``src`` into FP16/bf16 parameters ``dst``, one draw per
    tensor in order (``MasterWeights.after_step``'s reference loop)."""
    if not dst:
        return
    if enabled(src[0]) and isinstance(generator, RoundingStream):
        with contextlib.suppress(_Unfused):
            _call_list("write_back", "sr", dst, src, generator.keys, generator.take(len(dst)))
            return
    from mptrain.numerics.fp8 import stochastic_round
    from mptrain.numerics.precision import stochastic_round_to_bf16

    for p, m in zip(dst, src, strict=True):
        p.copy_(stochastic_round_to_bf16(m, generator) if p.dtype == torch.bfloat16  # type: ignore[arg-type]
                else stochastic_round(m, torch.float16, generator))  # type: ignore[arg-type]

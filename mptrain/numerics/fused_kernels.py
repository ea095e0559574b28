"""The fused quantizers' kernel bodies: the reference arithmetic of ``formats`` and ``mx`` written
once more as plain torch code, which ``compiled_calls`` hands to torch.compile (inductor fuses each
body into one or two passes over memory: vectorised C++ on a CPU, Triton on a GPU). ``fused`` holds
their entry points, and its docstring says why they are written as they are; the tests hold every
result bit-identical to the reference.

The element format is an argument (``_elem``: a few constants on the device), not compiled in, so
every format shares a handful of kernels. Nothing here runs eagerly in a training step: the
reference is ``formats``, ``mx`` and ``fp8``, not these bodies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mptrain.numerics import formats as nf
from mptrain.numerics import mx
from mptrain.numerics.formats import ElementFormat
from mptrain.numerics.rounding_rng import bits16_from_index, draw_keys, uniform_from_index

_params: dict[tuple[str, str], tuple[Tensor, Tensor]] = {}
# True while compiled_calls.call_graph traces a layer's graph, which reads the cached constants (its
# direct calls feed them in as inputs: compiled_calls._constant)
layer_graph = False


def _elem(fmt: ElementFormat, device: torch.device) -> tuple[Tensor, Tensor]:
    """A format's constants as kernel arguments, made once per device (no copy per call):
    float32 [max, overflow threshold, overflow value, max's code is even] and int32 ``_ints(fmt)``.
    Traced into a whole model's graph (trainer.compile), they are built in it, constants to the
    compiler, and not cached: read from the cache as graph inputs, they made inductor (torch 2.11, a
    CPU) fail to generate a convolution's backward (tests/test_fused.py)."""
    key = (fmt.name, str(device))
    in_model = torch.compiler.is_compiling() and not layer_graph
    found = None if in_model else _params.get(key)
    if found is None:
        threshold = fmt.max_normal + 2.0 ** (fmt.emax - fmt.mbits - 1)
        pf = torch.tensor([fmt.max_normal, threshold, math.inf if fmt.has_inf else math.nan,
                           float(nf.max_code_is_even(fmt))], dtype=torch.float32, device=device)  # fmt: skip
        pi = torch.tensor(_ints(fmt), dtype=torch.int32, device=device)
        found = (pf, pi)
        if not in_model:
            _params[key] = found
    return found


def _exponent(a: Tensor) -> Tensor:
    """floor(log2(a)) for finite a > 0 from the float's exponent bits; -127 for 0 and subnormals
    (callers clamp it far above that). The same value frexp gives, as plain integer ops."""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


def _round(xf: Tensor, pf: Any, pi: Any, u: Tensor | None) -> Tensor:
    """``formats.round_arith`` for FP32 (saturating; to nearest even, or stochastic with uniforms
    ``u``) for a format given by its constants (``_elem``). The exponent comes from the bits, and NaN
    needs no select: it propagates through every step (only its payload may differ)."""
    a = xf.abs().clamp(max=pf[0])
    if u is None:
        # Round to nearest even by one FP32 add and subtract: with c = 2**(e + 23 - mbits), e = a's
        # exponent (at least emin), a + c lies in c's binade, whose spacing is the format's spacing
        # at a, so the add rounds a onto the grid, ties to even, and the subtract is exact. Half the
        # ops of the scale-round-scale path, every step still exact.
        c = ((a.view(torch.int32) & 0x7F800000).clamp(min=pi[2]) + pi[3]).view(torch.float32)
        return _with_sign((a + c) - c, xf)
    # a / spacing and back, each by one power of two built from the exponent bits (2**(mbits - e),
    # 2**(e - mbits)); rounding up is a select of down + 1 (a mask turned into 0/1 took three ops)
    e = torch.clamp(_exponent(a), pi[0], pi[1])
    scaled = a * ((pi[4] - e) << 23).view(torch.float32)
    down = torch.floor(scaled)
    r = torch.where(scaled - down > u, down + 1, down)
    return _with_sign(r * ((e + pi[5]) << 23).view(torch.float32), xf)


def _with_sign(m: Tensor, x: Tensor) -> Tensor:
    """copysign(m, x) for m >= 0 (or NaN), as one OR of x's sign bit: torch.copysign compiled to a
    call into Sleef per vector on a CPU, 11% of an MXFP8 block kernel's time. Bit for bit the same."""
    return (m.view(torch.int32) | (x.view(torch.int32) & -(2**31))).view(torch.float32)


def _overflow(xf: Tensor, q: Tensor, pf: Tensor, stochastic: bool) -> Tensor:
    """``saturate=False``: what leaves the format becomes Inf (or NaN); see ``formats.overflows``."""
    a = xf.abs()
    over = a > pf[0] if stochastic else torch.where(pf[3] > 0, a > pf[1], a >= pf[1])
    return torch.where(over, _with_sign(pf[2].expand_as(xf), xf), q)


def _arange(n: int, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """0..n-1 (int32, on like's device) viewed as ``shape``: n along one dim, 1 along the others."""
    return torch.arange(n, dtype=torch.int32, device=like.device).view(shape)


def _uniform(n: int, device: torch.device, keys: Tensor, counter: Tensor) -> Tensor:
    ka, kb = draw_keys(keys, counter)
    return uniform_from_index(torch.arange(n, dtype=torch.int32, device=device), ka, kb)


def _k_round(x: Tensor, pf: Tensor, pi: Tensor, saturate: bool, keys: Tensor | None,
             counter: Tensor | None) -> Tensor:
    """``formats.round_to_element`` on a flat tensor (FP32 out)."""
    xf = x.float()
    u = _uniform(xf.shape[0], xf.device, keys, counter) if keys is not None else None
    q = _round(xf, pf, pi, u)
    return q if saturate else _overflow(xf, q, pf, u is not None)


def _k_round_(x: Tensor, pf: Tensor, pi: Tensor, keys: Tensor | None, counter: Tensor | None) -> None:
    """In place, saturating: a parameter onto FP16 (FP8's FP16 master weights)."""
    u = _uniform(x.shape[0], x.device, keys, counter) if keys is not None else None
    x.copy_(_round(x.float(), pf, pi, u).to(x.dtype))


def _k_round_fwd_(x: Tensor, pf: Tensor, pi: Tensor, keys: Tensor | None, counter: Tensor | None, pf2: Tensor,
                  pi2: Tensor) -> Tensor:
    """``_k_round_``, and in the same pass the rounded tensor rounded to nearest (saturating) onto a
    second format, out of place in x's dtype: a converted FP8 layer's next forward weight, which
    ``fp8.Fp8State.after_step`` writes while it rounds the master (``_k_round`` of the result, bit for bit)."""
    u = _uniform(x.shape[0], x.device, keys, counter) if keys is not None else None
    r = _round(x.float(), pf, pi, u).to(x.dtype)
    x.copy_(r)
    return _round(r.float(), pf2, pi2, None).to(x.dtype)


def _k_round_all(x: Tensor, which: Tensor | None, starts: Tensor | None, pf: Tensor, pi: Tensor,
                 keys: Tensor | None, first: Tensor | None) -> Tensor:
    """``_k_round_`` on the concatenation of several flat tensors, out of place: element k belongs
    to tensor ``which[k]``, which starts at ``starts[which[k]]`` and draws with counter
    ``first + which[k]``, as each tensor does in its own call."""
    u = None
    if keys is not None:
        ka, kb = draw_keys(keys, first + which)  # type: ignore[operator]
        index = torch.arange(x.shape[0], dtype=torch.int32, device=x.device) - starts[which]  # type: ignore[index]
        u = uniform_from_index(index, ka, kb)
    return _round(x.float(), pf, pi, u).to(x.dtype)


def _k_round_all_fwd(x: Tensor, which: Tensor | None, starts: Tensor | None, pf: Tensor, pi: Tensor,
                     keys: Tensor | None, first: Tensor | None, pf2: Tensor, pi2: Tensor) -> tuple[Tensor, Tensor]:
    """``_k_round_all``, and its result rounded to nearest onto a second format, as ``_k_round_fwd_``."""
    r = _k_round_all(x, which, starts, pf, pi, keys, first)
    return r, _round(r.float(), pf2, pi2, None).to(x.dtype)


def _k_write_all(m: Tensor, which: Tensor, starts: Tensor, pf: Tensor, pi: Tensor, keys: Tensor, first: Tensor,
                 bf16: bool) -> Tensor:
    """``_k_bf16_``, or ``_k_round`` onto FP16 (stochastic, saturating), on the concatenation of
    several flat FP32 masters (``_k_round_all``'s layout): their bf16 / FP16 values."""
    ka, kb = draw_keys(keys, first + which)
    index = torch.arange(m.shape[0], dtype=torch.int32, device=m.device) - starts[which]
    if bf16:
        rounded = ((m.view(torch.int32) + bits16_from_index(index, ka, kb)) & -65536).view(torch.float32)
        return torch.where(torch.isfinite(m), rounded, m).to(torch.bfloat16)
    return _round(m, pf, pi, uniform_from_index(index, ka, kb)).to(torch.float16)


def _k_bf16_(p: Tensor, m: Tensor, keys: Tensor, counter: Tensor) -> None:
    """``stochastic_round_to_bf16`` of flat FP32 ``m`` into bf16 ``p``: 16 random bits added below
    bf16's mantissa, then truncated."""
    ka, kb = draw_keys(keys, counter)
    noise = bits16_from_index(torch.arange(m.shape[0], dtype=torch.int32, device=m.device), ka, kb)
    rounded = ((m.view(torch.int32) + noise) & -65536).view(torch.float32)
    p.copy_(torch.where(torch.isfinite(m), rounded, m).to(torch.bfloat16))


def _magnitude_max(xf: Tensor, bits: bool) -> Tensor:
    """``xf.abs().amax()``. ``bits`` (a CPU's): from the elements' bits less the sign, as integers
    (``_tree_amax`` says why): the same value, or a NaN where ``xf`` holds one, which ``_pow2_scale``
    treats as the float NaN. On an AVX-512 CPU (scratch) FP8's per-tensor calls to nearest took 0.76x
    to 0.86x as long, stochastic ones 0.93x to 0.96x; a ResNet-50/8 step's per-tensor FP8 quantizers
    took 0.4 to 0.7 ms less (docs/benchmarks, 52ce4e7)."""
    if not bits:
        return xf.abs().amax()
    return (xf.view(torch.int32) & 0x7FFFFFFF).amax().view(torch.float32)


def _pow2_scale(amax: Tensor, pf: Tensor, pi: Tensor) -> Tensor:
    """2**k, the largest power of two with amax * 2**k <= max (k in [-126, 126]); 1 for a zero or
    non-finite amax: ``fp8.tensor_scale`` and ``qgemm.axiswise_round``'s rule, from the bits."""
    ok = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(ok, amax, 1.0)
    k = (pi[1] - _exponent(safe)).clamp(-126, 126)  # floor(log2 max) - floor(log2 amax): k or k + 1
    k = torch.where(safe * nf.exp2i(k) > pf[0], k - 1, k)
    k = torch.where(safe * nf.exp2i(k + 1) <= pf[0], k + 1, k).clamp(-126, 126)
    return torch.where(ok, nf.exp2i(k), 1.0)


def _k_scaled(x: Tensor, pf: Tensor, pi: Tensor, keys: Tensor | None, counter: Tensor | None) -> Tensor:
    """``fp8.quantize_scaled`` on a flat tensor: a per-tensor power-of-two scale, round, scale back;
    non-finite values pass through. Returns x's dtype."""
    xf = x.float()
    s = _pow2_scale(_magnitude_max(xf, xf.device.type == "cpu"), pf, pi)
    u = _uniform(xf.shape[0], xf.device, keys, counter) if keys is not None else None
    q = _round(xf * s, pf, pi, u) / s
    return torch.where(torch.isfinite(xf), q, xf).to(x.dtype)


def _k_axis(x3: Tensor, pf: Tensor, pi: Tensor, order: str, keys: Tensor | None, counter: Tensor | None,
            last: bool = False) -> tuple[Tensor, ...]:
    """``qgemm.axiswise_round`` along dim 1 of (A, n, B), or, ``last``, along dim 2 of (A, B, n) (a
    copy with n innermost: ``_axiswise``). ``order``: the caller's logical order of the runs A, n, B
    ("anb", "nab", "abn"), whose row-major index is the order its uniforms are drawn in, whichever
    layout the kernel reads. The strides are worked out here from the sizes: passed in as ints,
    dynamo specialised them on the first call and compiled again on the first other layout."""
    xf = x3.float()
    # Floats, not the bits (``_magnitude_max``): with the bits along a strided dim, row-wise FP8's
    # quantizers took 0.4-0.5 ms longer a ResNet-50/8 step, the step 1.95x and 1.97x FP32 against 1.90x
    # and 1.90x (docs/benchmarks, 52ce4e7), though scratch calls on NCHW activations were faster.
    s = _pow2_scale(xf.abs().amax(2 if last else 1, keepdim=True), pf, pi)
    u = None
    if keys is not None:
        a, m, k = xf.shape
        n, b = (k, m) if last else (m, k)
        sa, sn, sb = (n * b, b, 1) if order == "anb" else (b, a * b, 1) if order == "nab" else (b * n, 1, n)
        idx = (_arange(a, (a, 1, 1), xf) * sa + _arange(m, (1, m, 1), xf) * (sb if last else sn)
               + _arange(k, (1, 1, k), xf) * (sn if last else sb))  # fmt: skip
        ka, kb = draw_keys(keys, counter)  # type: ignore[arg-type]
        u = uniform_from_index(idx, ka, kb)
    q = _round(xf * s, pf, pi, u) / s
    return torch.where(torch.isfinite(xf), q, xf), *_kept(s)


_NV = nf.E2M1  # NVFP4's elements (its block scales are E4M3, its tensor scale FP32)


def _tensor_scale(x: Tensor, kind: str, bits: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """NVFP4's (amax of the finite elements times the shift, decode scale, shift) for the whole
    tensor, the shift ``mx.nvfp4_shift``'s (the reference's order); (None, None, None) for MX.
    ``bits`` (a CPU's): the amax taken over the elements' bits less the sign, as integers
    (``_tree_amax`` says why that order is the floats'), the finite ones those under +inf's bits. Bit
    for bit the same value, with no NaN check in every step of the reduction: an NVFP4 (147, 8192)
    call took 0.84x as long on an AVX-512 CPU. (A GPU keeps the float form: not measured there.)"""
    if kind != "nvfp4":
        return None, None, None
    if bits:
        v = x.view(torch.int32) & 0x7FFFFFFF
        t_amax = torch.where(v < 0x7F800000, v, 0).amax().view(torch.float32)
    else:
        # Reduced as one flat run of the operand's memory (blocks and tiles are views of a dense
        # operand, so the order changes no maximum). Over the blocks' 4-dim view with dynamic sizes,
        # inductor's Triton split reduction rebuilt every element's address with up to five integer
        # divisions and remainders, and judged the load uncoalesced: on the H200 of 2026-11-28, 118 and
        # 155 us a call on the rotated wgrad operands (5.7 ms of a transformer_lm step), against 16-21 us
        # for those with one remainder. Flat, the address is the element's number. (A CPU's bits path
        # keeps the blocks' view: flat, its kernels took 1.3-2.7x as long, scratch timings.)
        x = _merged(x, (x.numel(),))
        t_amax = torch.where(torch.isfinite(x), x.abs(), 0.0).amax()
    shift = mx.nvfp4_shift(t_amax)
    t_amax = t_amax * shift
    return t_amax, mx.nvfp4_tensor_scales(t_amax, mx.BLOCK_FORMATS["nvfp4"])[0] / shift, shift


def _block_scales(amax: Tensor, t_amax: Tensor | None, pi: Tensor, kind: str,
                  shift: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(multiplier onto the element grid, local scale) per block: MX's E8M0 rule (``pi[1]``: the
    element's emax), or NVFP4's E4M3 block scale under the tensor scale (``t_amax`` and the
    multiplier in units of the blocks times ``shift``, as ``_tensor_scale`` gives them)."""
    bad = ~torch.isfinite(amax)
    if kind == "nvfp4":
        amax = amax * shift
        t_scale, encode = mx.nvfp4_tensor_scales(t_amax, mx.BLOCK_FORMATS["nvfp4"])  # type: ignore[arg-type]
        e4m3, e4m3_i = _static(nf.E4M3)
        s_block = _round((amax / _NV.max_normal / t_scale).clamp(max=nf.E4M3.max_normal), e4m3, e4m3_i, None)
        s_block = torch.where(bad, math.nan, s_block)
        return torch.where(s_block > 0, (encode / s_block).clamp(max=mx.FP32_MAX), 0.0), s_block
    exps = (_exponent(amax) - pi[1]).clamp(-mx.E8M0_BIAS, mx.E8M0_BIAS)
    return nf.exp2i(-exps), torch.where(bad, math.nan, nf.exp2i(exps))


def _static(fmt: ElementFormat) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """A format's constants as Python numbers, folded into the kernel (NVFP4's fixed E4M3 scales)."""
    return (fmt.max_normal,), _ints(fmt)


def _ints(fmt: ElementFormat) -> tuple[int, ...]:
    """[emin, emax, emin's FP32 exponent field, (23 - mbits) in the exponent field, 127 + mbits,
    127 - mbits]: ``_round``'s."""
    return fmt.emin, fmt.emax, (fmt.emin + 127) << 23, (23 - fmt.mbits) << 23, 127 + fmt.mbits, 127 - fmt.mbits


def _kept(*per_block: Tensor) -> tuple[Tensor, ...]:
    """Per-block (or per-row) scales, returned as extra outputs that callers drop: an output is
    stored once, and the rounding loop then loads it. Otherwise inductor inlines the scale's ~25 ops
    (exponent, clamps, 2**k with its subnormal branch, the NaN select) into every element: the MXFP8
    block kernel took 1.45x as long on a CPU. Inside a ``call_graph`` graph they are dead code."""
    return per_block


def _tree_amax(blocks: Tensor) -> Tensor:
    """``blocks.abs().amax(2, keepdim=True)`` for (R, nb, k, 1) blocks, as a tree of integer maxima of
    the elements' bits less the sign: non-negative floats order as their bits do, +inf above every
    finite and NaN above +inf, so the result is the same amax, or a NaN where a block holds one (only
    its payload may differ). Why: on a CPU, inductor vectorises a float amax along the block and then
    reduces each vector across its lanes, every step with a NaN check (vcmpunordps and a blend); the
    integer tree compiles to plain max instructions. An NVFP4 (147, 8192) call took 0.79x as long on
    an AVX-512 CPU. (An integer ``amax`` instead reduced each vector through memory: 18x as long.
    MX's 32-element blocks gained nothing, and its stochastic calls lost 6%: MX keeps the float amax.)"""
    v = blocks.view(torch.int32) & 0x7FFFFFFF
    m = [v.narrow(2, i, 1) for i in range(v.shape[2])]
    while len(m) > 1:
        m = [torch.maximum(m[i], m[i + 1]) for i in range(0, len(m), 2)]
    return m[0].view(torch.float32)


def _k_blocks(x3: Tensor, pf: Tensor, pi: Tensor, kind: str, short: bool, keys: Tensor | None,
              counter: Tensor | None, rot: Tensor | None = None,
              out_dtype: torch.dtype | None = None, flat: bool = True, bits: bool = True) -> tuple[Tensor | None, ...]:
    """``quantize_blocks(...).local`` and ``.tensor_scale`` for blocks along dim 1 of (A, N, B), N a
    multiple of the block (the caller pads), or, ``short``, N at most one block: one block, any
    zero padding left out (it changes no amax). Uniforms follow the reference's layout,
    x.movedim(dim, -1) padded: element (a, i, b) is draw (a * B + b) * N' + i, N' the padded N.
    ``rot``: every 16 along N rotated first (``mx.rotate_blocks``), in the same pass over memory.
    ``out_dtype``: ``local`` cast to it (``_cast_in_kernel``). ``flat=False``: B = 1 blocks per row even
    where one run of blocks pays (below; ``scripts/flat_blocks_bench.py`` compares the two). ``bits=False``:
    NVFP4's amaxes as floats where a CPU takes them from the bits (``_tree_amax``, ``_tensor_scale``;
    ``scripts/amax_bits_bench.py`` compares the two)."""
    bs = 16 if kind == "nvfp4" else 32
    a, n, b = x3.shape
    if not short:
        # What the caller guarantees, told to the compiler: without it a (A, N/bs, bs, B) view back
        # to (A, N, B) is not provably a view, and inductor copied the output once more.
        torch._check(n % bs == 0)
    xf = x3.float()
    # Blocks along the contiguous dim (B = 1) inline MX's scales: stored, an MXFP8 (2048, 64) kernel was
    # slower on an AVX-512 CPU. On a CPU, NVFP4's are kept there too: inlined, its scale (an E4M3
    # rounding under the tensor scale, five divisions) ran once per vector of every block. Replayed
    # side by side, an NVFP4 ResNet-50/8 step's B = 1 calls took less time kept in every kind of call,
    # on an AVX2 CPU (scripts/kept_scales_bench.py). Measured on CPU only. (Its draw keys, kept as
    # well, gained nothing measurable there.)
    keep = b != 1 or (kind == "nvfp4" and x3.device.type == "cpu")
    # Kept scales with B = 1 are worked out in a loop of their own, which inductor vectorises along
    # its inner dim: as (A, N / bs, bs, 1) blocks that was a row's N / bs blocks, under one vector in
    # a row under 16 blocks (every ResNet-50/8 activation), so each block's scale ran in the scalar
    # remainder loop. As one run of A * N / bs blocks, they fill vectors: an NVFP4 (2048, 64) call
    # took 110 against 190 us on an AVX-512 CPU. Replayed side by side (scripts/flat_blocks_bench.py),
    # one ResNet-50/8 step's calls to nearest took 0.74x as long flat, stochastic ones 0.93x, rotated
    # ones 0.93x. Stochastic and rotated ones took 1.05x, until the integer amax below (flat only) made
    # them faster flat as well. (MX's inlined scales gain nothing, and its stochastic rounding took
    # 1.7 to 1.9 times as long flat.)
    flat = flat and keep and b == 1 and not short
    if rot is not None:
        k = rot.shape[1]
        # flat blocks rotated as they are: rotated in the (A, N / 16, 16, 1) view and viewed flat
        # after, a (147, 8192) call (ResNet-50/8's stem, wgrad) took about ten times as long. Viewed
        # from the flat run, not from (A, N, 1): that view compared A * (N / 16) with A, and with one
        # block along N (batch 2) dynamo specialised N to 16 and compiled the kernel again for the
        # next operand. (Written as (A * N) / 16, the rows lost their fusion with the draws' index
        # loop: one more loop in inductor's code.)
        if flat and k == bs:
            xf = mx.rotate_blocks(xf.reshape(-1).view(a * (n // k), 1, k, 1), rot, 2)
        else:
            xf = mx.rotate_blocks(xf.view(a, n // k, k, b), rot, 2).view(a, n, b)
    rows, nb, k = (a * (n // bs), 1, bs) if flat else (a, 1, n) if short else (a, n // bs, bs)
    blocks = xf.view(rows, nb, k, b)
    bits = bits and x3.device.type == "cpu"
    # (flat: NVFP4's B = 1 blocks on a CPU. Per row, wgrad's stochastic rotated calls took 1.04x as
    # long with the tree, in scripts/amax_bits_bench.py's replay; flat, they now take less time.)
    amax = _tree_amax(blocks) if bits and flat else blocks.abs().amax(2, keepdim=True)
    t_amax, t_scale, shift = _tensor_scale(blocks, kind, bits)
    mult, local_scale = _block_scales(amax, t_amax, pi, kind, shift)
    u = None
    if keys is not None:
        # Built in the blocks' own shape, the block's length a constant: viewed from an (A, N, B)
        # index, the block dim had the symbolic size n // (n // bs), and the MXFP8 SR kernel took
        # 1.4x as long on an AVX2 CPU. (Inductor still stores the hash's first half in a buffer.)
        # element (a, i, b) is draw (a * B + b) * N' + i (N': N padded, or the block if short); flat,
        # a * N + i is run r = a * N / bs + i // bs's draw r * bs + i % bs
        idx = ((_arange(rows, (rows, 1, 1, 1), x3) * b + _arange(b, (1, 1, 1, b), x3)) * (bs if short else nb * k)
               + _arange(nb, (1, nb, 1, 1), x3) * k + _arange(k, (1, 1, k, 1), x3))  # fmt: skip
        ka, kb = draw_keys(keys, counter)  # type: ignore[arg-type]
        u = uniform_from_index(idx, ka, kb)
    q = _round((blocks if shift is None else blocks * shift) * mult, pf, pi, u)
    local = _cast_in_kernel(q * local_scale, out_dtype)
    # Kept scales with B = 1 return the blocks' shape, which the caller views: viewed as (A, N, 1) here,
    # inductor wrote the result once more into a buffer of that shape (it saw no view), a full pass.
    # The other results merge back here: by ``_merged`` on a GPU and for B > 1, by view for a CPU's
    # B = 1 kernels (merged, torch 2.14's stored the scaled elements in a buffer of their own: an
    # MXFP8 call took 1.4x as long).
    if not (keep and b == 1 and not short):
        local = local.view(a, n, b) if b == 1 and x3.device.type == "cpu" else _merged(local, (a, n, b))
    return local, t_scale, *(_kept(mult, local_scale) if keep else ())


def _k_tiles(x2: Tensor, pf: Tensor, pi: Tensor, kind: str, keys: Tensor | None,
             counter: Tensor | None, out_dtype: torch.dtype | None = None) -> tuple[Tensor | None, ...]:
    """``quantize_blocks(..., block_2d=True)`` on (R, C), both multiples of the block (the caller
    pads, and stacks leading dims into R). Uniforms in the reference's layout (row tiles, column
    tiles, bs * bs). ``out_dtype`` as ``_k_blocks``'."""
    bs = 16 if kind == "nvfp4" else 32
    r, c = x2.shape
    torch._check(r % bs == 0)  # as in _k_blocks: the caller pads, and the compiler should know
    torch._check(c % bs == 0)
    rt, ct = r // bs, c // bs
    tiles = x2.float().view(rt, bs, ct, bs)
    amax = tiles.abs().amax((1, 3), keepdim=True)
    t_amax, t_scale, shift = _tensor_scale(tiles, kind, x2.device.type == "cpu")
    mult, local_scale = _block_scales(amax, t_amax, pi, kind, shift)
    u = None
    if keys is not None:
        idx = torch.arange(r * c, dtype=torch.int32, device=x2.device).view(rt, ct, bs, bs).permute(0, 2, 1, 3)
        ka, kb = draw_keys(keys, counter)  # type: ignore[arg-type]
        u = uniform_from_index(idx, ka, kb)
    q = _round((tiles if shift is None else tiles * shift) * mult, pf, pi, u)
    local = _cast_in_kernel(q * local_scale, out_dtype)
    # merged on a GPU (``_merged``: one kernel less in an NVFP4 Linear's forward graph); on a CPU the
    # view's kernel was the faster (merged, a (1024, 1024) NVFP4 call took 1.07x to 1.4x as long)
    local = local.view(r, c) if x2.device.type == "cpu" else _merged(local, (r, c))
    return local, t_scale, *_kept(mult, local_scale)


def _merged(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``t.view(shape)`` for a result whose blocked dims (n // bs, bs) merge back into n: as_strided on
    a contiguous t, not view. With dynamic sizes the compiler cannot prove bs * (n // bs) == n (even
    after torch._check says n % bs == 0), so a view became a copy: a kernel and a pass over memory
    per GEMM operand inside a compiled graph (``qgemm._gemms``; inductor's Triton for an MXFP8
    Linear: 15 kernels a step, 10 this way), and a second loop over the result in a CPU's B > 1
    kernel. t is contiguous here (an elementwise result of x's dense (A, n, B) view), so
    ``contiguous`` copies nothing."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return t.contiguous().as_strided(shape, strides)


def _cast_in_kernel(local: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``local`` in ``dtype`` (a GEMM's compute dtype), cast in the blocks' own shape, before any view:
    in a compiled graph (``qgemm._gemms``) a cast of the viewed result was a kernel of its own on
    CUDA, and the scaled elements went through memory in FP32 in between (inductor's Triton for an
    MXFP8 Linear with bf16 products: 5 kernels forward, 3 with the cast here)."""
    return local if dtype is None else local.to(dtype)


_BODIES: dict[str, Callable[..., Any]] = {
    "round": _k_round, "round_": _k_round_, "round_fwd_": _k_round_fwd_, "round_all": _k_round_all,
    "round_all_fwd": _k_round_all_fwd, "write_all": _k_write_all, "bf16_": _k_bf16_, "scaled": _k_scaled,
    "axis": _k_axis, "blocks": _k_blocks, "tiles": _k_tiles,
}  # fmt: skip

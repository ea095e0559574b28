"""Block-scaled formats: OCP Microscaling (MX v1.0) and NVIDIA's NVFP4, emulated bit for bit.

**MX** (OCP Microscaling Formats Specification v1.0, section 6.3): a block of 32 consecutive values
along one dimension shares a scale X = 2**shared_exp stored as E8M0 (an exponent, bias 127, codes
0..254 for 2**-127..2**127, 0xFF = NaN), and every value is stored as an element P_i with
V_i ~ X * P_i:

    shared_exp = floor(log2(max_i |V_i|)) - emax_elem        (emax_elem: exponent of the element's max)
    clamped to E8M0's range: below -127 -> -127 (the block's small values flush towards 0);
    above 127, or a NaN/Inf in the block -> NaN (0xFF), and the whole block decodes to NaN
    P_i = round_to_element(V_i / X): round-to-nearest-even, normals clamped to the element's max

An all-zero block has no log2: it gets the smallest scale (as the spec authors' reference code,
microsoft/microxcaling, does) and decodes to zeros. Since floor(log2(amax)) only aligns the top
binade, amax / X can exceed the element's max (E4M3: up to 511.9 > 448) and saturates: that is the
spec's rule, not a bug, and ``QuantizedBlocks.saturated`` counts it.

**NVFP4** (NVIDIA; the recipe of "Pretraining LLMs with NVFP4", arXiv 2509.25149): blocks of 16
E2M1 values, each block with an E4M3 scale, and one FP32 scale per tensor:

    tensor scale   s_t = amax(tensor) / (448 * 6)              (decode direction; 1 for an all-zero tensor)
                   encode scale 1 / s_t, kept finite as NVIDIA's reference keeps it: where 1 / s_t
                   would overflow FP32 (amax below ~8e-36, as gradients of an unscaled run can be),
                   the encode scale is FP32's max and s_t its reciprocal, so the two stay inverse.
                   Before that, a tensor of amax under 2**-64 is scaled by 2**64 (``nvfp4_shift``)
                   and decoded back, so that its decisions are those of x * 2**k: the clamp and a
                   subnormal s_t (amax below ~2**-114.6) are never reached from an FP32 tensor
    block scale    s_b = e4m3(min(amax(block) / 6 / s_t, 448))  (round-to-nearest-even, subnormals kept)
    elements       P_i = e2m1(clamp(V_i * min(encode / s_b, FP32 max), +-6))
    value          V_i ~ P_i * (s_t * s_b)

The operation order is torchao's (``nvfp4_quantize``) so that the two agree bit for bit. One
difference, on purpose: torchao clamps block scales up to E4M3's smallest normal (2**-6), which
forces a block far below the tensor's amax onto a coarser grid than the E4M3 cast gives; here the
scale is the plain E4M3 cast, subnormals included, and a block whose scale rounds to 0 decodes to 0.

Options from the recipe: ``block_2d`` (16x16 tiles for weights, so that W and W^T quantize
identically), ``stochastic`` (gradients), and a random Hadamard transform (``random_hadamard``)
that the layers apply to both operands of the weight-gradient GEMM.

Lengths that are not a multiple of the block are padded with zeros (zeros change no block's amax
and contribute nothing to a dot product); ``pad=False`` refuses them with a ValueError instead.

``quantize_blocks`` is the *reference*: eager, every intermediate materialised, every statistic
available. Training runs ``mptrain.numerics.fused``'s compiled copy of it, held bit-identical by
the tests.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mptrain.numerics.formats import E2M1, E2M3, E3M2, E4M3, E5M2, ElementFormat, exp2i, round_to_element, work_dtype
from mptrain.numerics.rounding_rng import RoundingStream

E8M0_BIAS = 127
E8M0_NAN_EXPONENT = 128  # the exponent that code 0xFF (NaN) would decode to: marks NaN blocks
FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: elements of ``element`` in blocks of ``block_size`` sharing a scale.

    ``scale`` is ``e8m0`` (OCP MX: a power of two per block) or ``e4m3`` (NVFP4: an E4M3 scale per
    block times an FP32 scale per tensor).
    """

    name: str
    element: ElementFormat
    block_size: int
    scale: str

    @property
    def two_level(self) -> bool:
        return self.scale == "e4m3"


BLOCK_FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("mxfp8", E4M3, 32, "e8m0"),
        BlockFormat("mxfp8_e5m2", E5M2, 32, "e8m0"),
        BlockFormat("mxfp6", E2M3, 32, "e8m0"),
        BlockFormat("mxfp6_e3m2", E3M2, 32, "e8m0"),
        BlockFormat("mxfp4", E2M1, 32, "e8m0"),
        BlockFormat("nvfp4", E2M1, 16, "e4m3"),
    )
}


def block_format(name: str | BlockFormat) -> BlockFormat:
    if isinstance(name, BlockFormat):
        return name
    try:
        return BLOCK_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown block format {name!r}; one of {', '.join(BLOCK_FORMATS)}") from None


@dataclass
class QuantizedBlocks:
    """The result of ``quantize_blocks``: what was stored, and what it decodes to.

    Per-block tensors (``scale_exponents``, ``block_scales``) have x's shape with ``dim`` moved last
    and its length replaced by the number of blocks (``block_2d``: leading dims, row tiles, column
    tiles). Counts are 0-dim int64 tensors (no host sync), None unless asked for.
    """

    fmt: BlockFormat
    dequantized: Tensor  # FP32, x's shape: what the stored block decodes to
    local: Tensor  # FP32, x's shape: elements times block scales, without the tensor scale (see bf16_exact)
    elements: Tensor  # FP32 values on the element grid (NaN in NaN blocks), x's shape
    scale_exponents: Tensor | None  # MX: int32 unbiased E8M0 exponents; E8M0_NAN_EXPONENT for NaN blocks
    block_scales: Tensor | None  # NVFP4: the E4M3 block scales as FP32 values
    tensor_scale: Tensor | None  # NVFP4: the FP32 per-tensor scale (0-dim)
    padded: int  # zeros appended along the blocked dim(s) to fill the last block
    flushed: Tensor | None = None  # nonzero finite inputs stored as 0
    saturated: Tensor | None = None  # finite inputs past the block's largest value, clamped to it
    nonzero: Tensor | None = None  # nonzero finite inputs (the flushed fraction's denominator)

    @property
    def e8m0_codes(self) -> Tensor:
        """The stored E8M0 bytes (0xFF = NaN)."""
        if self.scale_exponents is None:
            raise ValueError(f"{self.fmt.name} has no E8M0 scales")
        return (self.scale_exponents + E8M0_BIAS).to(torch.uint8)


def quantize_blocks(
    x: Tensor,
    fmt: BlockFormat | str,
    dim: int = -1,
    *,
    stochastic: bool = False,
    generator: torch.Generator | RoundingStream | None = None,
    block_2d: bool = False,
    pad: bool = True,
    with_stats: bool = False,
) -> QuantizedBlocks:
    """Quantize ``x`` to ``fmt`` in blocks along ``dim`` (``block_2d``: square tiles over the last
    two dims, ``dim`` ignored); see the module docstring for the rules.

    ``stochastic`` rounds the elements stochastically (unbiased) with ``generator``; scales are
    always rounded to nearest, as in the NVFP4 recipe. ``with_stats`` fills the counts.
    """
    fmt = block_format(fmt)
    xf = work_dtype(x)  # float64 stays float64: its elements are rounded once
    bs = fmt.block_size
    if block_2d:
        if xf.dim() < 2:
            raise ValueError(f"block_2d needs a tensor of 2 or more dims, got shape {tuple(x.shape)}")
        blocks, padded, undo = _tiles(xf, bs, pad)
    else:
        blocks, padded, undo = _rows(xf, dim, bs, pad)

    amax = blocks.abs().amax(-1)  # NaN if the block has a NaN, Inf if it has an Inf
    bad = ~torch.isfinite(amax)  # the block decodes to NaN
    if fmt.two_level:
        mags = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0)
        t_amax = mags.amax().float() if mags.numel() else torch.zeros((), device=xf.device)
        # A tensor of tiny amax is scaled up by an exact power of two first (nvfp4_shift), so that
        # its block decisions are those of the same tensor times 2**k; it is undone on decoding.
        shift = nvfp4_shift(t_amax)
        blocks, amax, t_amax = blocks * shift.to(blocks.dtype), amax * shift.to(amax.dtype), t_amax * shift
        t_scale, encode = nvfp4_tensor_scales(t_amax, fmt)
        s_block = round_to_element((amax.float() / fmt.element.max_normal / t_scale).clamp(max=E4M3.max_normal), E4M3)
        s_block = torch.where(bad, math.nan, s_block)
        # scale 0: the block flushes to 0; the block's encode scale is kept finite too (NVIDIA's reference)
        recip = torch.where(s_block > 0, (encode / s_block).clamp(max=FP32_MAX), 0.0)
        scaled = blocks * recip.unsqueeze(-1)
        exps = None
    else:
        _, e = torch.frexp(amax)  # exact floor(log2(amax)) = e - 1, FP32 subnormals too
        floor_log2 = torch.where(amax > 0, e - 1, -126)  # all-zero block: as microxcaling, log2(FP32 min normal)
        exps = (floor_log2 - fmt.element.emax).clamp(min=-E8M0_BIAS)
        bad = bad | (exps > E8M0_BIAS)  # a float64 block past E8M0's 2**127 (FP32 input cannot get there)
        exps = torch.where(bad, E8M0_NAN_EXPONENT, exps).to(torch.int32)
        scaled = blocks * exp2i(-exps.clamp(max=E8M0_BIAS)).unsqueeze(-1)  # exact: a power of two
        t_scale = s_block = shift = None  # type: ignore[assignment]
    q = round_to_element(scaled, fmt.element, stochastic=stochastic, generator=generator)
    q = torch.where(bad.unsqueeze(-1), math.nan, q)
    blocks = blocks.float()
    if s_block is not None:
        local = q * s_block.unsqueeze(-1)
        # torchao's order, so dequantized values agree bit for bit; then the shift undone (mostly / 1)
        deq = q * (t_scale * s_block).unsqueeze(-1) / shift
    else:
        local = deq = q * exp2i(exps.clamp(max=E8M0_BIAS)).unsqueeze(-1)  # type: ignore[union-attr]
    deq_x = undo(deq)
    out = QuantizedBlocks(
        fmt=fmt, dequantized=deq_x, local=undo(local) if s_block is not None else deq_x, elements=undo(q),
        scale_exponents=exps, block_scales=s_block, padded=padded,
        # the decode scale of the tensor as given (an FP32 subnormal, or 0, where it was shifted)
        tensor_scale=t_scale / shift if s_block is not None else None,
    )
    if with_stats:
        finite = torch.isfinite(blocks) & ~bad.unsqueeze(-1)
        ok = finite & (blocks != 0)
        out.nonzero = ok.sum()
        out.flushed = (ok & (q == 0)).sum()
        # Past the largest value the block can hold (the element max times the block's scales),
        # compared in x's units: a reciprocal-scaled 6.0000005 that is really 6 does not count.
        # (NVFP4: in the shifted units of ``blocks``, exact)
        top = fmt.element.max_normal * (t_scale * s_block if s_block is not None else exp2i(exps.clamp(max=E8M0_BIAS)))
        out.saturated = (finite & (blocks.abs() > top.unsqueeze(-1))).sum()
    return out


def fake_quantize(x: Tensor, fmt: BlockFormat | str, dim: int = -1, **kw: object) -> Tensor:
    """``quantize_blocks(x, fmt, dim, **kw).dequantized`` in x's dtype: quantize and decode."""
    return quantize_blocks(x, fmt, dim, **kw).dequantized.to(x.dtype)  # type: ignore[arg-type]


NVFP4_SHIFT = 2.0**64  # see nvfp4_shift
NVFP4_SHIFT_BELOW = 2.0**-64


def nvfp4_shift(t_amax: Tensor) -> Tensor:
    """The power of two an NVFP4 tensor is scaled by before its scales are computed: 2**64 when its
    amax is under 2**-64, else 1 (FP32, 0-dim). Why: s_t = amax / 2688 turns FP32-subnormal below amax
    ~2**-114.6 and loses bits, and 1 / s_t overflows below ~2**-116.6, so the block scales (and with
    them every element) of x and of x * 2**k differed at tiny amax: 18 of 256 elements at 2**-117.
    Scaled by an exact 2**64, every FP32 amax (down to the smallest subnormal, 2**-149) is a normal
    one whose decisions are invariant; amaxes of 2**-64 and above, and so every agreement with torchao,
    are untouched."""
    tiny = (t_amax > 0) & (t_amax < NVFP4_SHIFT_BELOW)
    return torch.where(tiny, NVFP4_SHIFT, 1.0).to(torch.float32)


def nvfp4_tensor_scales(t_amax: Tensor, fmt: BlockFormat) -> tuple[Tensor, Tensor]:
    """NVFP4's per-tensor (decode) scale s_t and encode scale, from the tensor's amax (FP32, 0-dim).

    s_t = amax / (448 * 6) in torchao's order; the encode scale 1 / s_t is kept finite as NVIDIA's
    reference keeps it (TransformerEngine's compute_global_encode_scaling_factor_FP4: clamped to
    FP32's max, 1 for an all-zero tensor): with amax below ~8e-36, 1 / s_t would be Inf, every
    element would saturate to +-6 and zeros would become 0 * Inf = NaN. There s_t becomes the
    clamped encode scale's reciprocal, so that decoding still inverts encoding.
    """
    t_scale = torch.where(t_amax > 0, t_amax / (E4M3.max_normal * fmt.element.max_normal), 1.0)
    encode = 1.0 / t_scale
    huge = encode > FP32_MAX
    encode = torch.where(huge, FP32_MAX, encode)
    return torch.where(huge, 1.0 / encode, t_scale), encode


def bf16_exact_min_scale_exponent(fmt: BlockFormat) -> int:
    """The smallest block-scale exponent k at which every element times 2**k is a bf16 value.

    ``local`` (elements times block scales) feeds the GEMMs of ``emulated_compute=bf16`` cast to bf16.
    bf16's smallest subnormal is 2**-133, so an element grid whose lowest bit is 2**-b stays exact
    for k >= b - 133: MXFP8 (E4M3) for k >= -124, MXFP8 E5M2 for k >= -117; FP6 and FP4 for every
    E8M0 scale; NVFP4's E4M3 block scales times E2M1 always. Below it, bf16 rounds the block's
    smallest values (blocks whose amax is under about 2**-116 and 2**-102): the FP32 compute is exact.
    """
    if fmt.two_level:
        return -E8M0_BIAS  # local = e2m1 * e4m3 block scale: >= 2**-10, at most 6 significant bits
    lowest = int(math.log2(fmt.element.min_subnormal))
    return max(-E8M0_BIAS, -133 - lowest)


def _padding(n: int, bs: int, pad: bool, what: str) -> int:
    extra = -n % bs
    if extra and not pad:
        raise ValueError(f"{what} of length {n} is not a multiple of the block size {bs} (pad=True pads it with zeros)")
    return extra


def _rows(xf: Tensor, dim: int, bs: int, pad: bool):  # type: ignore[no-untyped-def]
    """(..., n_blocks, bs) blocks along ``dim``, and a function mapping such a tensor back to x's layout."""
    dim = dim % max(xf.dim(), 1)
    moved = xf.movedim(dim, -1) if xf.dim() else xf.reshape(1)
    n = moved.shape[-1]
    extra = _padding(n, bs, pad, f"dim {dim}")
    if extra:
        moved = F.pad(moved, (0, extra))
    blocks = moved.reshape(*moved.shape[:-1], -1, bs)

    def undo(t: Tensor) -> Tensor:
        t = t.reshape(*t.shape[:-2], -1)[..., :n]
        return t.movedim(-1, dim) if xf.dim() else t.reshape(())

    return blocks, extra, undo


def _tiles(xf: Tensor, bs: int, pad: bool):  # type: ignore[no-untyped-def]
    """(..., row tiles, column tiles, bs*bs) square tiles over the last two dims, and the inverse."""
    *lead, r, c = xf.shape
    er, ec = _padding(r, bs, pad, "rows"), _padding(c, bs, pad, "columns")
    p = F.pad(xf, (0, ec, 0, er)) if er or ec else xf
    rt, ct = (r + er) // bs, (c + ec) // bs
    tiles = p.reshape(*lead, rt, bs, ct, bs).transpose(-3, -2).reshape(*lead, rt, ct, bs * bs)

    def undo(t: Tensor) -> Tensor:
        t = t.reshape(*lead, rt, ct, bs, bs).transpose(-3, -2).reshape(*lead, rt * bs, ct * bs)
        return t[..., :r, :c]

    return tiles, er * (c + ec) + ec * r, undo


# --------------------------------------------------------------------------------------------
# random Hadamard transform (NVFP4 recipe: both operands of the weight-gradient GEMM)

HADAMARD_SIZE = 16


def hadamard_matrix(n: int = HADAMARD_SIZE) -> Tensor:
    """Sylvester's n x n Hadamard matrix scaled by 1/sqrt(n): orthogonal, entries +-1/sqrt(n)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def random_signs(generator: torch.Generator, n: int = HADAMARD_SIZE) -> Tensor:
    """A random +-1 vector of length n from ``generator`` (on the generator's device)."""
    bits = torch.randint(0, 2, (n,), generator=generator, device=generator.device)
    return bits.float() * 2 - 1


def random_hadamard(x: Tensor, dim: int, signs: Tensor) -> Tensor:
    """Multiply every block of 16 along ``dim`` by H * diag(signs) (an orthogonal matrix).

    Applied along the reduction dim of both operands of a GEMM it cancels in the product:
    (A T)(B T)^T = A B^T for T = blockdiag(H S). The length along ``dim`` must be a multiple of 16
    (the layers pad with zeros first, and keep the padding through the GEMM).
    """
    return rotate(x, dim, hadamard_rotation(tuple(int(v) for v in signs.tolist()), x.device, x.dtype))


@functools.lru_cache(maxsize=64)
def hadamard_rotation(signs: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> Tensor:
    """H * diag(signs) / sqrt(n) as ``rotate`` sums with it, an (n + 1, n) tensor: Sylvester's +-1
    matrix (n rows), then the column factors signs / sqrt(n). Built once per (signs, device, dtype):
    rebuilding it on the host and copying it over on every call cost a blocking host-to-device copy
    per GEMM operand."""
    n = len(signs)
    h = hadamard_matrix(n)
    unit = h * math.sqrt(n)  # exact: +-1/sqrt(n) times sqrt(n), n a power of two
    return torch.cat([unit, h[:1] * torch.tensor(signs, dtype=h.dtype)]).to(device=device, dtype=dtype)


def rotate(x: Tensor, dim: int, r: Tensor) -> Tensor:
    """Every block of n along ``dim`` times the rotation ``r`` (``hadamard_rotation``'s form)."""
    n = r.shape[1]
    if x.shape[dim] % n:
        raise ValueError(f"random_hadamard: length {x.shape[dim]} along dim {dim} is not a multiple of {n}")
    moved = x.movedim(dim, -1)
    out = rotate_blocks(moved.reshape(*moved.shape[:-1], -1, n), r, -1).reshape(moved.shape)
    return out.movedim(-1, dim)


def rotate_blocks(v: Tensor, r: Tensor, axis: int) -> Tensor:
    """v's blocks along ``axis`` (length n) rotated by ``r``: out_j = (sum_i v_i * H_ij) * c_j, the
    sum in index order, each term exact (H_ij = +-1), one rounding per add and one for the factor c_j.

    Why not a matmul: its order of additions is the BLAS kernel's own, which no compiled kernel can
    reproduce, so the rotation had to run as an eager GEMM of its own (a pass over memory per wgrad
    operand). Written as this sum, ``fused`` computes it inside the quantizer's kernel, bit for bit
    as here: compilers keep the order of floating-point adds (inductor turns off unsafe math), and
    products by +-1 are exact, so no contraction into an FMA can change a result either."""
    n = r.shape[1]
    shape = [1] * v.dim()
    shape[axis] = n
    acc = v.narrow(axis, 0, 1) * r[0].view(shape)
    for i in range(1, n):
        acc = acc + v.narrow(axis, i, 1) * r[i].view(shape)
    return acc * r[n].view(shape)

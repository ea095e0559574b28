"""Element formats (FP8, FP6, FP4, and FP16/BF16 for master weights) and rounding onto their grids.

Every format here is sign-magnitude with ``ebits`` exponent bits (bias ``bias``), ``mbits``
mantissa bits, an implicit leading 1 for normals and subnormals at the lowest exponent. They differ
only in what their top exponent encodes:

- ``e4m3`` (OCP FP8 E4M3FN): no Inf; S.1111.111 is NaN, so the top binade is finite up to 448;
- ``e5m2`` (OCP FP8 E5M2): IEEE-like, the top exponent is Inf/NaN; max 57344;
- ``e3m2``, ``e2m3`` (OCP FP6) and ``e2m1`` (OCP FP4): no Inf, no NaN; every pattern is a number
  (max 28, 7.5 and 6).

``round_to_element`` rounds FP32 (or float64, once) values onto a format's grid and returns FP32 values
on it: round-to-nearest-even with subnormals, or unbiased stochastic rounding drawing from a caller's
generator only (a ``torch.Generator``, or the run's counter-based ``RoundingStream``).
``element_grid`` decodes every bit pattern of a format: an independent reference for tests (it
shares no code with the rounding).

This is the *reference* rounding. ``mptrain.numerics.fused`` runs the same rounding compiled (one
pass over memory), and the tests hold the two bit-identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mptrain.numerics.rounding_rng import RoundingStream, rounding_generator


@dataclass(frozen=True)
class ElementFormat:
    """A sign-magnitude binary floating-point element format, as the OCP specs tabulate it."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max_normal: float
    min_normal: float
    min_subnormal: float
    has_inf: bool
    has_nan: bool
    torch_dtype: torch.dtype | None = None  # torch's own storage type, where it has one

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal: min_normal = 2**emin."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest normal (OCP MX's emax_elem): floor(log2(max_normal))."""
        return math.frexp(self.max_normal)[1] - 1

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits


def _fmt(name: str, ebits: int, mbits: int, max_normal: float, has_inf: bool, has_nan: bool,
         dtype: torch.dtype | None = None) -> ElementFormat:
    bias = 2 ** (ebits - 1) - 1
    return ElementFormat(name, ebits, mbits, bias, max_normal, 2.0 ** (1 - bias), 2.0 ** (1 - bias - mbits),
                         has_inf, has_nan, dtype)


E4M3 = _fmt("e4m3", 4, 3, 448.0, False, True, torch.float8_e4m3fn)
E5M2 = _fmt("e5m2", 5, 2, 57344.0, True, True, torch.float8_e5m2)
E3M2 = _fmt("e3m2", 3, 2, 28.0, False, False)
E2M3 = _fmt("e2m3", 2, 3, 7.5, False, False)
E2M1 = _fmt("e2m1", 2, 1, 6.0, False, False)
# Not element formats of MX, but the same rounding serves FP16/BF16 master weights (mptrain.numerics.fp8).
FP16 = _fmt("fp16", 5, 10, 65504.0, True, True, torch.float16)
BF16 = _fmt("bf16", 8, 7, float(torch.finfo(torch.bfloat16).max), True, True, torch.bfloat16)

ELEMENT_FORMATS: dict[str, ElementFormat] = {f.name: f for f in (E4M3, E5M2, E3M2, E2M3, E2M1)}
HALF_FORMATS: dict[str, ElementFormat] = {f.name: f for f in (FP16, BF16)}


# --------------------------------------------------------------------------------------------
# decoding: the reference grid


def decode_all(fmt: ElementFormat) -> Tensor:
    """The value of every bit pattern 0 .. 2**bits - 1 (float64; Inf/NaN where the format has them).

    Written from the format's definition alone (sign, biased exponent, mantissa), not from torch's
    dtypes or from the rounding code, so that tests can check the rounding against it.
    """
    codes = torch.arange(2**fmt.bits, dtype=torch.int64)
    sign = torch.where((codes >> (fmt.ebits + fmt.mbits)) & 1 == 1, -1.0, 1.0).double()
    e = (codes >> fmt.mbits) & (2**fmt.ebits - 1)
    m = (codes & (2**fmt.mbits - 1)).double()
    frac = m / 2**fmt.mbits
    normal = (1 + frac) * torch.pow(2.0, (e - fmt.bias).double())
    sub = frac * 2.0 ** (1 - fmt.bias)
    v = sign * torch.where(e == 0, sub, normal)
    top = e == 2**fmt.ebits - 1
    if fmt.has_inf:  # IEEE-like: the top exponent is Inf (mantissa 0) or NaN
        v = torch.where(top & (m == 0), sign * math.inf, v)
        v = torch.where(top & (m != 0), math.nan, v)
    elif fmt.has_nan:  # E4M3FN: only S.1111.111 is NaN
        v = torch.where(top & (m == 2**fmt.mbits - 1), math.nan, v)
    return v


def element_grid(fmt: ElementFormat) -> Tensor:
    """Every finite value of ``fmt``, sorted ascending, -0 merged with +0 (float64)."""
    v = decode_all(fmt)
    return torch.unique(v[torch.isfinite(v)])


# --------------------------------------------------------------------------------------------
# rounding


def exp2i(k: Tensor) -> Tensor:
    """2**k as float32 for integer k in [-149, 127], built from the bits (exact, unlike torch.exp2).

    Below -126 the result is an FP32 subnormal (OCP MX's smallest scale, 2**-127, is one).
    """
    k = k.to(torch.int32)
    normal = ((k.clamp(-126, 127) + 127) << 23).view(torch.float32)
    sub = (torch.ones_like(k) << (k.clamp(-149, -127) + 149)).view(torch.float32)
    return torch.where(k >= -126, normal, sub)


def round_to_element(
    x: Tensor,
    fmt: ElementFormat,
    *,
    stochastic: bool = False,
    generator: torch.Generator | RoundingStream | None = None,
    saturate: bool = True,
) -> Tensor:
    """Round ``x`` onto ``fmt``'s grid; returns FP32 values on the grid, in x's shape.

    Round-to-nearest-even with subnormals, or (``stochastic``) up with probability equal to the
    distance from the grid point below over the spacing, so E[round(x)] = x. Stochastic rounding
    draws only from ``generator`` (required): a run's other random streams stay untouched.
    float64 input is rounded once, straight onto the grid (every grid value is an FP32 value).

    ``saturate=True``: |x| past max (+-Inf included) becomes +-max, as OCP MX conversions do.
    ``saturate=False``: what an IEEE cast does, only for formats that can say it: values that round
    past max become +-Inf (E5M2, FP16, BF16) or NaN (E4M3); FP6/FP4 have neither and refuse.
    NaN stays NaN (for FP6/FP4, which cannot encode it, the block scale carries it: see mx.py).
    """
    if stochastic and generator is None:
        raise ValueError(
            "stochastic rounding needs a generator: a torch.Generator or a RoundingStream (it never draws from the "
            "global RNG)"
        )
    if not saturate and not (fmt.has_inf or fmt.has_nan):
        raise ValueError(f"{fmt.name} has no Inf or NaN to overflow to: use saturate=True")
    xf = work_dtype(x)
    if stochastic:
        q = round_arith(xf, fmt, uniform(xf.shape, generator, xf.device))  # type: ignore[arg-type]
    elif fmt.torch_dtype is not None and xf.dtype == torch.float32:
        # torch's cast is round-to-nearest-even with subnormals and fast; it overflows (or for
        # E4M3FN, saturates) by its own rule, so the saturation is done here, explicitly. (From
        # float64 torch casts through FP32, a second rounding: the arithmetic below rounds once.)
        q = xf.clamp(-fmt.max_normal, fmt.max_normal).to(fmt.torch_dtype).float()
    else:
        q = round_arith(xf, fmt)
    if not saturate:
        q = torch.where(overflows(xf.abs(), fmt, stochastic), overflow_value(xf, fmt), q)
    return q.float()


def work_dtype(x: Tensor) -> Tensor:
    """The dtype rounding is computed in: FP32 holds every FP8/FP6/FP4/FP16/BF16 value and every
    product of one with a power-of-two scale exactly; float64 stays float64 (rounded once)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def uniform(shape: torch.Size, generator: torch.Generator | RoundingStream, device: torch.device) -> Tensor:
    """One uniform [0, 1) draw per element, row-major, from ``generator``."""
    if isinstance(generator, RoundingStream):
        return generator.uniform(shape)
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float32)


def overflows(a: Tensor, fmt: ElementFormat, stochastic: bool) -> Tensor:
    """|x| that leaves the format (``saturate=False``). Round-to-nearest keeps |x| up to max plus
    half an ulp, and the tie at exactly max + half an ulp goes to the neighbour with the even bit
    pattern: max itself where max's code is even (E4M3's 448 = S.1111.110: 464 rounds to 448), else
    the code above it (E5M2, FP16, BF16: Inf). Stochastic rounding leaves the format as soon as
    |x| > max."""
    if stochastic:
        return a > fmt.max_normal
    threshold = fmt.max_normal + 2.0 ** (fmt.emax - fmt.mbits - 1)
    return a > threshold if max_code_is_even(fmt) else a >= threshold


def max_code_is_even(fmt: ElementFormat) -> bool:
    """Whether the bit pattern of ``fmt``'s largest finite value is even (its last mantissa bit 0)."""
    mantissa = round(fmt.max_normal / 2.0**fmt.emax * 2**fmt.mbits)  # 1.m as an integer, 2**mbits..2**(mbits+1)-1
    return mantissa % 2 == 0


def overflow_value(xf: Tensor, fmt: ElementFormat) -> Tensor:
    """What a value past the format becomes: +-Inf where the format has Inf, else NaN."""
    if fmt.has_inf:
        return torch.copysign(torch.full_like(xf, math.inf), xf)
    return torch.full_like(xf, math.nan)


def round_generic(
    x: Tensor, fmt: ElementFormat, *, stochastic: bool = False, generator: torch.Generator | None = None
) -> Tensor:
    """The rounding of ``round_to_element`` by arithmetic alone (saturating), for any format.

    ``round_to_element`` casts where torch can; this is the same round-to-nearest-even without the
    cast (the tests compare the two). With ``stochastic`` and no generator it draws from the global
    RNG: only for mptrain.numerics.fp8's Mellempudi recipe outside a run.
    """
    xf = work_dtype(x)
    u = None
    if stochastic:
        u = uniform(xf.shape, generator, xf.device) if generator is not None else torch.rand(xf.shape, device=xf.device)
    return round_arith(xf, fmt, u).float()


def round_arith(xf: Tensor, fmt: ElementFormat, u: Tensor | None = None) -> Tensor:
    """Round FP32/float64 ``xf`` onto ``fmt``'s grid by arithmetic (saturating at max), to nearest
    even or, given uniforms ``u`` in [0, 1), stochastically. Returns xf's dtype.

    Written by hand: torch has no FP6/FP4 cast (float4_e2m1fn_x2 is storage only) and no
    stochastic-rounding cast at all. Every step is exact: a is scaled by powers of two so that the
    format's spacing at a becomes 1, rounded to an integer, and scaled back.
    """
    a = xf.abs().clamp(max=fmt.max_normal)  # +-Inf saturates; NaN stays NaN
    _, e = torch.frexp(a)  # a = m * 2**e, m in [0.5, 1): floor(log2(a)) = e - 1 (exact, subnormals too)
    e = (e - 1).clamp(min=fmt.emin)  # below the smallest normal the spacing is the subnormal one
    scaled = a * exp2i(-e) * float(2**fmt.mbits)  # two exact steps: 2**(mbits - e) may exceed FP32
    if u is None:
        r = torch.round(scaled)  # ties to even: "even integer" is "even mantissa"
    else:
        down = torch.floor(scaled)
        r = down + (u < scaled - down).to(scaled.dtype)  # up with probability (a - down) / spacing
    q = r * (2.0**-fmt.mbits) * exp2i(e)  # on the grid, <= max (max is a grid point)
    return torch.where(torch.isnan(xf), xf, torch.copysign(q, xf))


# --------------------------------------------------------------------------------------------
# power-of-two scaled rounding (FP8 per tensor and per row) and bf16 stochastic rounding


def pow2_scale(amax: Tensor, fmt: ElementFormat) -> Tensor:
    """2**k, the largest power of two with amax * 2**k <= max (k in [-126, 126]); 1 where amax is 0
    or non-finite. Exact and on the device: floor(log2 max) - floor(log2 amax) from frexp, settled by
    power-of-two products (a ratio max / amax would overflow for amax below ~1e-36)."""
    ok = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(ok, amax, 1.0)
    k = (math.frexp(fmt.max_normal)[1] - torch.frexp(safe)[1]).clamp(-126, 126)
    k = torch.where(safe * exp2i(k) > fmt.max_normal, k - 1, k)
    k = torch.where(safe * exp2i(k + 1) <= fmt.max_normal, k + 1, k).clamp(-126, 126)
    return torch.where(ok, exp2i(k), 1.0)


def round_scaled(
    x: Tensor, fmt: ElementFormat, scale: Tensor, *, stochastic: bool = False,
    generator: torch.Generator | RoundingStream | None = None,
) -> Tensor:
    """Round ``x * scale`` onto ``fmt`` (saturating) and divide back, exactly (a power-of-two scale);
    non-finite values pass through, so an overflow still reaches a loss scaler. x's dtype out."""
    xf = work_dtype(x)
    q = round_to_element(xf * scale, fmt, stochastic=stochastic, generator=generator) / scale
    return torch.where(torch.isfinite(xf), q, xf).to(x.dtype)


def axiswise_round(
    x: Tensor, fmt: ElementFormat, dim: int, *, stochastic: bool = False,
    generator: torch.Generator | RoundingStream | None = None,
) -> Tensor:
    """Round x to ``fmt`` with a power-of-two scale per vector along ``dim`` (torchao's ``rowwise``
    recipe): ``pow2_scale`` of each vector's amax, so nothing saturates and scaling is exact;
    non-finite values pass through. Returns FP32 values."""
    xf = work_dtype(x)
    s = pow2_scale(xf.abs().amax(dim, keepdim=True), fmt)
    return round_scaled(xf, fmt, s, stochastic=stochastic, generator=generator).float()


def stochastic_round_to_bf16(x: Tensor, generator: torch.Generator | RoundingStream | None = None) -> Tensor:
    """Round FP32 ``x`` to bf16, up or down with probability given by the distance (unbiased).

    bf16 is the top 16 bits of FP32, so adding a uniform random 16-bit integer to the bit
    pattern and truncating rounds up exactly with probability (x - down) / ulp. No generator: the
    run's rounding stream (``rounding_rng``), or outside a run the global RNG.
    """
    bits = x.float().contiguous().view(torch.int32)
    if generator is None:  # the run's own rounding stream, not the global one (issue 18)
        generator = rounding_generator(x.device)
    if isinstance(generator, RoundingStream):
        noise = generator.bits16(bits.shape)
    else:
        noise = torch.randint(0, 1 << 16, bits.shape, device=x.device, dtype=torch.int32, generator=generator)
    rounded = (bits + noise) & -65536  # clear the low 16 bits (0xFFFF0000 as int32)
    out = rounded.view(torch.float32)
    # Inf/NaN must not be perturbed into other bit patterns.
    return torch.where(torch.isfinite(x), out, x.float()).to(torch.bfloat16)

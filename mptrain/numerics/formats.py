"""Element formats (FP8, FP6, FP4, and FP16/BF16 for master weights) and rounding onto their grids.

Every format here is sign-magnitude with ``ebits`` exponent bits (bias ``bias``), ``mbits``
mantissa bits, an implicit leading 1 for normals and subnormals at the lowest exponent. They differ
only in what their top exponent encodes:

- ``e4m3`` (OCP FP8 E4M3FN): no Inf; S.1111.111 is NaN, so the top binade is finite up to 448;
- ``e5m2`` (OCP FP8 E5M2): IEEE-like, the top exponent is Inf/NaN; max 57344;
- ``e3m2``, ``e2m3`` (OCP FP6) and ``e2m1`` (OCP FP4): no Inf, no NaN; every pattern is a number
  (max 28, 7.5 and 6).

``round_to_element`` rounds FP32 values onto a format's grid and returns FP32 values on it:
round-to-nearest-even with subnormals, or unbiased stochastic rounding drawing from a caller's
``torch.Generator`` only. ``element_grid`` decodes every bit pattern of a format: an independent
reference for tests (it shares no code with the rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


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
    generator: torch.Generator | None = None,
    saturate: bool = True,
) -> Tensor:
    """Round ``x`` onto ``fmt``'s grid; returns FP32 values on the grid, in x's shape.

    Round-to-nearest-even with subnormals, or (``stochastic``) up with probability equal to the
    distance from the grid point below over the spacing, so E[round(x)] = x. Stochastic rounding
    draws only from ``generator`` (required): a run's other random streams stay untouched.

    ``saturate=True``: |x| past max (+-Inf included) becomes +-max, as OCP MX conversions do.
    ``saturate=False``: what an IEEE cast does, only for formats that can say it: values that round
    past max become +-Inf (E5M2, FP16, BF16) or NaN (E4M3); FP6/FP4 have neither and refuse.
    NaN stays NaN (for FP6/FP4, which cannot encode it, the block scale carries it: see mx.py).
    """
    if stochastic and generator is None:
        raise ValueError("stochastic rounding needs a torch.Generator (it never draws from the global RNG)")
    if not saturate and not (fmt.has_inf or fmt.has_nan):
        raise ValueError(f"{fmt.name} has no Inf or NaN to overflow to: use saturate=True")
    xf = x.float()
    if not stochastic and fmt.torch_dtype is not None:
        # torch's cast is round-to-nearest-even with subnormals and fast; it overflows (or for
        # E4M3FN, saturates) by its own rule, so the saturation is done here, explicitly.
        q = xf.clamp(-fmt.max_normal, fmt.max_normal).to(fmt.torch_dtype).float()
    else:
        q = _round_generic(xf, fmt, stochastic, generator)
    if not saturate:
        a = xf.abs()
        # Past max + half an ulp, round-to-nearest leaves the format (the tie goes up: the even
        # neighbour is 2**(emax+1)); stochastic rounding leaves it as soon as |x| > max.
        half_ulp = 2.0 ** (fmt.emax - fmt.mbits - 1)
        over = (a > fmt.max_normal) if stochastic else (a >= fmt.max_normal + half_ulp)
        overflow = torch.copysign(torch.full_like(q, math.inf), xf) if fmt.has_inf else torch.full_like(q, math.nan)
        q = torch.where(over, overflow, q)
    return q


def round_generic(
    x: Tensor, fmt: ElementFormat, *, stochastic: bool = False, generator: torch.Generator | None = None
) -> Tensor:
    """The rounding of ``round_to_element`` by arithmetic alone (saturating), for any format.

    ``round_to_element`` casts where torch can; this is the same round-to-nearest-even without the
    cast (the tests compare the two). With ``stochastic`` and no generator it draws from the global
    RNG: only for mptrain.numerics.fp8's Mellempudi recipe, whose rounding always did.
    """
    return _round_generic(x.float(), fmt, stochastic, generator)


def _round_generic(xf: Tensor, fmt: ElementFormat, stochastic: bool, generator: torch.Generator | None) -> Tensor:
    # Written by hand: torch has no FP6/FP4 cast (float4_e2m1fn_x2 is storage only) and no
    # stochastic-rounding cast at all. Every step is exact in FP32: a is scaled by powers of two
    # so that the format's spacing at a becomes 1, rounded to an integer, and scaled back.
    a = xf.abs().clamp(max=fmt.max_normal)  # +-Inf saturates; NaN stays NaN
    _, e = torch.frexp(a)  # a = m * 2**e, m in [0.5, 1): floor(log2(a)) = e - 1 (exact, subnormals too)
    e = (e - 1).clamp(min=fmt.emin)  # below the smallest normal the spacing is the subnormal one
    scaled = a * exp2i(-e) * float(2**fmt.mbits)  # two exact steps: 2**(mbits - e) may exceed FP32
    if not stochastic:
        r = torch.round(scaled)  # ties to even: "even integer" is "even mantissa"
    else:
        down = torch.floor(scaled)
        u = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
        r = down + (u < scaled - down).float()  # up with probability (a - down) / spacing
    q = r * (2.0**-fmt.mbits) * exp2i(e)  # on the grid, <= max (max is a grid point)
    return torch.where(torch.isnan(xf), xf, torch.copysign(q, xf))

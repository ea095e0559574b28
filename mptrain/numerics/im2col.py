"""The im2col columns of a quantized convolution's weight gradient.

wgrad contracts over (batch, output pixel), so its input operand is x unfolded: (C_in*kh*kw, N*L),
each row one channel at one filter tap, blocked along N*L by the quantizer (``qgemm``). Every way
of building it here is an exact copy of ``F.unfold``'s values (``tests/test_mx.py`` checks each one
against the unfold GEMM); they differ only in what a CPU spends on the copy, which on small layers
is the loop overhead of a 6-dim strided copy rather than its bytes. Measured on a 2-core AVX-512 CPU,
per ResNet-50/8 layer (scratch timings, one thread):

- rows of 8 pixels or more, or an unpadded 1x1: one strided copy of (padded) x, against aten's
  im2col, which loops over the batch before a permute copies again (0.2 against 1.4 ms for a
  (32, 16, 8, 8) input and a 3x3 filter);
- those rows with a stride: the copy's inner loop steps over every other pixel. Split x into its
  stride x stride phases first (one copy of x), and each phase's windows are runs of contiguous
  pixels again: 0.51-0.61 against 0.61-0.89 ms for ResNet's 7x7 stem;
- narrower rows (a 3x3 filter on 2x2 to 4x4 pixels): the strided copy's inner loop runs over 2-4
  pixels, and unfold plus its permute cost 93-171 us a layer. One gather with a cached int32 index
  (the same windows taken of x's element numbers) took 48-88 us;
- traced by dynamo (a user's torch.compile around converted layers): unfold, whose strides are
  symbolic there (as_strided on them failed to trace, an error rather than a graph break).

Off the CPU the strided copy and unfold keep serving: one kernel each, not measured otherwise.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

# The gather's index holds one int32 per column element. Past this many elements (a 4 MiB index)
# the layer's copy is long enough that loop overhead no longer sets its cost.
GATHER_MAX = 2**20


def wgrad_columns(x: Tensor, k: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
                  dilation: tuple[int, int]) -> Tensor:
    """x's im2col columns in the wgrad GEMM's layout, (C_in*kh*kw, N*L): ``F.unfold(x)`` with its
    batch dim moved in."""
    n, c, h, w = x.shape
    kh, kw = k
    ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    pointwise = k == (1, 1) and padding == (0, 0)
    cpu = x.device.type == "cpu" and not torch.compiler.is_compiling()
    if torch.compiler.is_compiling() or (wo < 8 and not pointwise):
        if cpu and c * kh * kw * n * ho * wo <= GATHER_MAX:
            xp = _pad(x, padding)
            index = _gather_index(tuple(xp.shape), k, stride, dilation, x.device)
            return xp.reshape(-1).index_select(0, index).view(c * kh * kw, n * ho * wo)
        cols = F.unfold(x, k, dilation=dilation, padding=padding, stride=stride)
        return cols.permute(1, 0, 2).reshape(c * kh * kw, -1)
    if cpu and stride != (1, 1) and dilation == (1, 1) and not pointwise:
        return _phased(x, k, stride, padding, ho, wo)
    return _windows(_pad(x, padding), k, stride, dilation, ho, wo).reshape(c * kh * kw, n * ho * wo)


def _pad(x: Tensor, padding: tuple[int, int]) -> Tensor:
    return F.pad(x, (padding[1], padding[1], padding[0], padding[0])) if any(padding) else x


def _windows(xp: Tensor, k: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int], ho: int,
             wo: int) -> Tensor:
    """Padded x's windows as a (C, kh, kw, N, Ho, Wo) view."""
    sn, sc, sh, sw = xp.stride()
    return xp.as_strided((xp.shape[1], *k, xp.shape[0], ho, wo),
                         (sc, sh * dilation[0], sw * dilation[1], sn, sh * stride[0], sw * stride[1]),
                         xp.storage_offset())  # fmt: skip


@functools.lru_cache(maxsize=64)
def _gather_index(padded: tuple[int, ...], k: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int],
                  device: torch.device) -> Tensor:
    """The padded input's element numbers in the columns' order, once per layer shape."""
    n, c, hp, wp = padded
    ho = (hp - dilation[0] * (k[0] - 1) - 1) // stride[0] + 1
    wo = (wp - dilation[1] * (k[1] - 1) - 1) // stride[1] + 1
    numbers = torch.arange(n * c * hp * wp, dtype=torch.int32, device=device).view(padded)
    return _windows(numbers, k, stride, dilation, ho, wo).reshape(-1)


def _phased(x: Tensor, k: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int], ho: int,
            wo: int) -> Tensor:
    """The strided copy, taken from x's stride phases: tap (i, j) reads phase (i % sh, j % sw) at
    offset (i // sh, j // sw), so the taps of one phase are one window view with unit pixel steps."""
    n, c, h, w = x.shape
    (kh, kw), (s0, s1) = k, stride
    # padded on the far side too, up to a multiple of the stride, so that the phases are one view
    hp, wp = -(-(h + 2 * padding[0]) // s0) * s0, -(-(w + 2 * padding[1]) // s1) * s1
    xp = F.pad(x, (padding[1], wp - w - padding[1], padding[0], hp - h - padding[0]))
    phases = xp.view(n, c, hp // s0, s0, wp // s1, s1).permute(1, 3, 5, 0, 2, 4).contiguous()
    sc, si, sj, sn, sh, sw = phases.stride()
    out = x.new_empty(c, kh, kw, n, ho, wo)
    for i in range(min(s0, kh)):
        for j in range(min(s1, kw)):
            taps = (c, len(range(i, kh, s0)), len(range(j, kw, s1)), n, ho, wo)
            out[:, i::s0, j::s1].copy_(phases.as_strided(taps, (sc, sh, sw, sn, sh, sw), i * si + j * sj))
    return out.view(c * kh * kw, n * ho * wo)

"""The im2col columns of a quantized convolution's weight gradient.

wgrad contracts over (batch, output pixel), so its input operand is x unfolded: (C_in*kh*kw, N*L),
each row one channel at one filter tap, blocked along N*L by the quantizer (``qgemm``). Every way
of building it here is an exact copy of ``F.unfold``'s values (``tests/test_mx.py`` checks each one
against the unfold GEMM); they differ only in what a CPU spends on the copy, which on small layers
is the loop overhead of a 6-dim strided copy rather than its bytes:

- rows of 8 pixels or more, or an unpadded 1x1: one strided copy of (padded) x, against aten's
  im2col, which loops over the batch before a permute copies again (0.2 against 1.4 ms for a
  (32, 16, 8, 8) input and a 3x3 filter, a scratch timing on one CPU thread);
- narrower rows (a 3x3 filter on 2x2 to 4x4 pixels): the strided copy's inner loop runs over 2-4
  pixels, and unfold plus its permute copy are two passes. One gather with a cached int32 index
  (the same windows taken of x's element numbers) took half as long (``scripts/im2col_bench.py``,
  docs/benchmarks);
- traced by dynamo (a user's torch.compile around converted layers): unfold, whose strides are
  symbolic there (as_strided on them failed to trace, an error rather than a graph break).

Where the columns repeat whole blocks of a block format (a filter taller than its stride, blocks
within an output row), qgemm quantizes x's row windows instead, once each, and copies them out to
the columns' layout (``shares_rows``, ``row_windows``, ``columns_of_rows``).

Off the CPU the strided copy and unfold keep serving: one kernel each, not measured otherwise.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

# The gather's index holds one int32 per column element, cached per layer shape: at most 4 MiB a
# shape and 16 shapes (an MXFP8 ResNet-50/8 step gathers 6), so at most 64 MiB held for the process.
# Larger layers (wide ones, big batches) keep unfold; the gather was measured on ResNet-50/8's
# layers, all under it.
GATHER_MAX = 2**20


def wgrad_columns(x: Tensor, k: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
                  dilation: tuple[int, int], fast: bool = True) -> Tensor:
    """x's im2col columns in the wgrad GEMM's layout, (C_in*kh*kw, N*L): ``F.unfold(x)`` with its
    batch dim moved in. ``fast=False``: without the CPU's gather, as before it (what
    ``scripts/im2col_bench.py`` holds it against)."""
    n, c, _, _ = x.shape
    kh, kw = k
    ho, wo = _out_size(x.shape, k, stride, padding, dilation)
    way = _way(x, k, padding, ho, wo, fast)
    if way == "gather":
        # x's elements and one zero after them, which every padded position reads: not a padded copy of
        # x, which F.pad fills and then copies x into in rows of W pixels (16-37 us of a 54-92 us
        # gather on ResNet-50/8's 2x2 and 4x4 maps, one CPU thread)
        index = _gather_index(tuple(x.shape), k, stride, padding, dilation, x.device)
        return torch.cat((x.reshape(-1), x.new_zeros(1))).index_select(0, index).view(c * kh * kw, n * ho * wo)
    if way == "unfold":
        cols = F.unfold(x, k, dilation=dilation, padding=padding, stride=stride)
        return cols.permute(1, 0, 2).reshape(c * kh * kw, -1)
    return _windows(_pad(x, padding), k, stride, dilation, ho, wo).reshape(c * kh * kw, n * ho * wo)


def shares_rows(shape: torch.Size | tuple[int, ...], k: tuple[int, int], stride: tuple[int, int],
                padding: tuple[int, int], dilation: tuple[int, int], block: int) -> bool:
    """Whether the columns' blocks of ``block`` along (N, Ho, Wo) repeat, so that quantizing x's row
    windows (``row_windows``) and copying them out (``columns_of_rows``) quantizes fewer elements
    than the columns hold, with the same result.

    A column row (c, i, j) at output row (n, ho) reads padded row stride_h * ho + i of image n: rows
    overlap when the filter is taller than its stride (a 7x7 stride-2 stem reads each row for about
    3.5 output rows, a 3x3 stride-1 conv for 3). When a block never crosses an output row (Wo a
    multiple of it), each block of the columns is a block of some row window, and a block's
    quantized values depend on its elements and the tensor's amax alone (every window appears in
    the columns, so the amax is theirs too). Not when traced by dynamo (``_way``'s reason)."""
    ho, wo = _out_size(shape, k, stride, padding, dilation)
    return (dilation == (1, 1) and wo % block == 0 and stride[0] * (ho - 1) + k[0] < k[0] * ho
            and not torch.compiler.is_compiling())


def row_windows(x: Tensor, k: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int]) -> Tensor:
    """Every (image, channel, padded row, filter column j) window of Wo pixels x[.., j + stride_w * wo],
    as (N * C * R, kw * Wo) rows, R the padded rows some output row reads: each block of the
    columns, once (``shares_rows``)."""
    n, c = x.shape[:2]
    ho, wo = _out_size(x.shape, k, stride, padding, (1, 1))
    xp = _pad(x, padding)
    sn, sc, sh, sw = xp.stride()
    rows = stride[0] * (ho - 1) + k[0]
    return xp.as_strided((n, c, rows, k[1], wo), (sn, sc, sh, sw, sw * stride[1]),
                         xp.storage_offset()).reshape(n * c * rows, k[1] * wo)  # fmt: skip


def columns_of_rows(rows: Tensor, shape: torch.Size | tuple[int, ...], k: tuple[int, int], stride: tuple[int, int],
                    padding: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """``wgrad_columns``' (C * kh * kw, N * Ho * Wo) layout of (quantized) ``row_windows``, in ``dtype``:
    column row (c, i, j) at (n, ho, wo) is window (n, c, stride_h * ho + i, j)'s pixel wo."""
    n, c = shape[:2]
    ho, wo = _out_size(shape, k, stride, padding, (1, 1))
    r = k[1] * wo  # one padded row's windows
    rows_n = stride[0] * (ho - 1) + k[0]
    view = rows.as_strided((c, *k, n, ho, wo), (rows_n * r, r, wo, c * rows_n * r, stride[0] * r, 1))
    return view.to(dtype).contiguous().view(c * k[0] * k[1], n * ho * wo)


def column_way(x: Tensor, k: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
               dilation: tuple[int, int], fast: bool = True) -> str:
    """How ``wgrad_columns`` takes x's columns: "windows", "gather" or "unfold" (the
    module docstring says when, and why)."""
    return _way(x, k, padding, *_out_size(x.shape, k, stride, padding, dilation), fast)


def _way(x: Tensor, k: tuple[int, int], padding: tuple[int, int], ho: int, wo: int, fast: bool) -> str:
    if torch.compiler.is_compiling():
        return "unfold"
    if wo < 8 and not (k == (1, 1) and padding == (0, 0)):
        n, c = x.shape[:2]
        cpu = fast and x.device.type == "cpu"
        return "gather" if cpu and c * k[0] * k[1] * n * ho * wo <= GATHER_MAX else "unfold"
    return "windows"


def _out_size(shape: torch.Size | tuple[int, ...], k: tuple[int, int], stride: tuple[int, int],
              padding: tuple[int, int], dilation: tuple[int, int]) -> tuple[int, int]:
    return tuple((shape[2 + d] + 2 * padding[d] - dilation[d] * (k[d] - 1) - 1) // stride[d] + 1
                 for d in (0, 1))  # type: ignore[return-value]


def _pad(x: Tensor, padding: tuple[int, int], value: float = 0.0) -> Tensor:
    return F.pad(x, (padding[1], padding[1], padding[0], padding[0]), value=value) if any(padding) else x


def _windows(xp: Tensor, k: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int], ho: int,
             wo: int) -> Tensor:
    """Padded x's windows as a (C, kh, kw, N, Ho, Wo) view."""
    sn, sc, sh, sw = xp.stride()
    return xp.as_strided((xp.shape[1], *k, xp.shape[0], ho, wo),
                         (sc, sh * dilation[0], sw * dilation[1], sn, sh * stride[0], sw * stride[1]),
                         xp.storage_offset())  # fmt: skip


@functools.lru_cache(maxsize=16)
def _gather_index(shape: tuple[int, ...], k: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
                  dilation: tuple[int, int], device: torch.device) -> Tensor:
    """x's element numbers in the columns' order, once per layer shape; a padded position reads
    number x.numel(), the zero ``wgrad_columns`` appends to x."""
    numel = math.prod(shape)
    numbers = _pad(torch.arange(numel, dtype=torch.int32, device=device).view(shape), padding, numel)
    return _windows(numbers, k, stride, dilation, *_out_size(shape, k, stride, padding, dilation)).reshape(-1)

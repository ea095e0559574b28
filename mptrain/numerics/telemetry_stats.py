"""Gradient telemetry's statistics (``mptrain.numerics.telemetry`` hooks the layers and reports): the
per-tensor binade histogram, what it says against a format, and the records that hold it per
step (on the device) and per run (on the host).

For each gradient g (shared/science.md, "Gradient telemetry"), with a = |g| in FP32 and a format
whose smallest subnormal is u, smallest normal n and largest value M::

    zero_frac      = mean(a == 0)
    underflow_frac = mean(0 < a < u)          # would flush to zero in that format
    subnormal_frac = mean(u <= a < n)         # survives with reduced precision
    overflow       = any(!isfinite(g)) or any(a > M)
    log2_amax      = log2(max a)              # over the finite values (see below)
    headroom_bits  = log2(M) - log2_amax      # how many doublings of the scale are left

All of it comes from one device-side histogram per tensor, read off the FP32 bit pattern: the
count of each binade floor(log2 a) from 2^-126 up, the FP32 subnormals split at 2^-133, a zero
bin and a non-finite bin, plus the finite max. Every threshold of every format is a power of two,
so each fraction is an exact sum of bins, and one pass serves FP16, BF16, E5M2 and E4M3 alike.
Non-finite values are counted by ``overflow``; ``log2_amax`` is over the finite ones, so that one
Inf does not hide the range of the rest. (A NaN counts as non-finite, not as zero.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mptrain.config import TELEMETRY_FORMATS
from mptrain.errors import MptrainError
from mptrain.numerics.fp8 import BF16, E4M3, E5M2, FP16, Fp8Format
from mptrain.numerics.precision import Precision

# --------------------------------------------------------------------------------------------
# the formats the thresholds are measured against (telemetry.formats)


FORMATS: dict[str, Fp8Format] = {"fp16": FP16, "bf16": BF16, "e5m2": E5M2, "e4m3": E4M3}


def resolve_formats(names: Iterable[str], precision: Precision) -> list[tuple[str, Fp8Format]]:
    """The formats thresholds are measured against; the first is the primary one.

    ``auto``: the run's half format (bf16 for bf16 runs, else FP16: for fp32 runs the question is
    "would this survive FP16", and emulated FP8 keeps FP16 masters), plus E5M2 and E4M3 for FP8.
    """
    out: list[str] = []
    for name in names:
        if name == "auto":
            out.append("bf16" if precision.half_dtype == torch.bfloat16 else "fp16")
            if precision.fp8 is not None:
                out += ["e5m2", "e4m3"]
        elif name in FORMATS:
            out.append(name)
        else:
            raise MptrainError(f"telemetry.formats: {name!r} must be one of {', '.join(TELEMETRY_FORMATS)}")
    return [(n, FORMATS[n]) for n in dict.fromkeys(out)]


# --------------------------------------------------------------------------------------------
# the per-tensor statistic: a binade histogram over FP32's whole range

# Bins of |g| (FP32): 0: exact zeros; 1: 0 < a < 2^-133; 2: 2^-133 <= a < 2^-126 (the FP32
# subnormals, split at bf16's smallest subnormal); 3..256: binades -126..127 (bin = binade + 129);
# 257: Inf/NaN. Every threshold of FP16, BF16, E5M2 and E4M3 is a bin edge.
N_BINS = 258
_NONFINITE = N_BINS - 1
_FINE = 1 << 15  # sign-less FP32 bit patterns >> 16: 8 exponent bits and bf16's 7 mantissa bits
HIST_LO, HIST_HI = -40, 16  # the TensorBoard/report histogram's range of log2|g|, one bin per binade


def _edge(binade: int) -> int:
    """Index of the first bin whose values are >= 2^binade."""
    if binade == -133:
        return 2
    if -126 <= binade <= 128:
        return binade + 129
    raise ValueError(f"2^{binade} is not a bin edge")


# Lower edge (log2) of each finite nonzero bin, for shifting histograms by the loss scale.
_LOWER_BINADE = np.array([-149, -133, *range(-126, 128)])


def _count_bins(idx: Tensor, n: int) -> Tensor:
    """Counts of each value 0..n-1 in ``idx`` (int64, exact, no host sync)."""
    if idx.device.type == "cpu":
        return torch.bincount(idx, minlength=n)
    return _count_bins_indexed(idx, n)


def _count_bins_indexed(idx: Tensor, n: int) -> Tensor:
    # CUDA's bincount reads min/max(idx) on the host; index_add_ into int64 does not (and counts
    # stay exact past 2^24, which float histc would not).
    ones = torch.ones((), dtype=torch.int64, device=idx.device).expand(idx.numel())
    return torch.zeros(n, dtype=torch.int64, device=idx.device).index_add_(0, idx.long(), ones)


def grad_stats(g: Tensor) -> tuple[Tensor, Tensor]:
    """(histogram over N_BINS bins, finite max of |g| in FP32) of one gradient, on its device.

    The bins come from the bit pattern, exactly and in a few passes: |g| >> 16 is the exponent
    field and bf16's mantissa bits, so one count gives every binade and, inside the FP32
    subnormals, the split at 2^-133 (= 2^16 * 2^-149).
    """
    a = g.detach().float().abs().flatten()
    if a.numel() == 0:
        return torch.zeros(N_BINS, dtype=torch.int64, device=a.device), torch.zeros((), device=a.device)
    fine = _count_bins(a.view(torch.int32) >> 16, _FINE)
    by_exponent = fine.view(256, 128).sum(1)  # exponent field 0 (zeros, subnormals) .. 255 (Inf/NaN)
    zeros = (a.numel() - torch.count_nonzero(a)).reshape(1)
    hist = torch.cat([zeros, fine[:1] - zeros, by_exponent[:1] - fine[:1], by_exponent[1:]])
    amax = a.nan_to_num_(nan=0.0, posinf=0.0).amax()  # |g| has no -Inf
    return hist, amax


def summarize(hist: np.ndarray, amax: float, numel: int, fmt: Fp8Format) -> dict[str, float]:
    """The science.md statistics of one gradient (or a sum of histograms) against ``fmt``."""
    u = round(math.log2(fmt.min_subnormal))
    n = round(math.log2(fmt.min_normal))
    numel = max(numel, 1)
    log2_amax = math.log2(amax) if amax > 0 else -math.inf
    return {
        "zero_frac": float(hist[0]) / numel,
        "underflow_frac": float(hist[1 : _edge(u)].sum()) / numel,
        "subnormal_frac": float(hist[_edge(u) : _edge(n)].sum()) / numel,
        "overflow": float(hist[_NONFINITE] > 0 or amax > fmt.max),
        "log2_amax": log2_amax,
        "headroom_bits": math.log2(fmt.max) - log2_amax,
    }


@dataclass
class LogHistogram:
    """log2|g| in one bin per binade over [HIST_LO, HIST_HI), with a separate zero bin.

    Finite values outside the range are counted in the edge bins; non-finite ones only in
    ``nonfinite``.
    """

    edges: list[int]  # HIST_LO .. HIST_HI (57 edges, 56 bins)
    counts: list[int]
    zero: int
    nonfinite: int

    @classmethod
    def from_bins(cls, hist: np.ndarray) -> LogHistogram:
        lo, hi = _edge(HIST_LO), _edge(HIST_HI)
        counts = hist[lo:hi].astype(np.int64).copy()
        counts[0] += hist[1:lo].sum()
        counts[-1] += hist[hi:_NONFINITE].sum()
        return cls(list(range(HIST_LO, HIST_HI + 1)), [int(c) for c in counts], int(hist[0]), int(hist[_NONFINITE]))

    def as_dict(self) -> dict[str, Any]:
        return {"log2_edges": self.edges, "counts": self.counts, "zero": self.zero, "nonfinite": self.nonfinite}


def _write_histogram(writer: Any, tag: str, h: LogHistogram, step: int) -> None:
    """TensorBoard histogram from counts: the zero bin is drawn as (HIST_LO-2, HIST_LO-1], with an
    empty bin between it and the first binade so that it stands apart."""
    counts = [h.zero, 0, *h.counts]
    limits = [HIST_LO - 1.0, float(HIST_LO), *(float(e) for e in h.edges[1:])]
    centers = [HIST_LO - 1.5, HIST_LO - 0.5, *(e + 0.5 for e in h.edges[:-1])]
    num = sum(counts)
    if num == 0:
        return
    writer.add_histogram_raw(
        tag,
        min=HIST_LO - 2.0 if h.zero else float(h.edges[0]),
        max=float(HIST_HI),
        num=num,
        sum=sum(c * x for c, x in zip(counts, centers, strict=True)),
        sum_squares=sum(c * x * x for c, x in zip(counts, centers, strict=True)),
        bucket_limits=limits,
        bucket_counts=counts,
        global_step=step,
    )


# --------------------------------------------------------------------------------------------
# per-step device records


@dataclass
class _Acc:
    """Histogram and finite max of one (kind, layer) in one step, summed over its calls."""

    hist: Tensor
    amax: Tensor
    numel: int

    def add(self, hist: Tensor, amax: Tensor, numel: int) -> None:
        self.hist = self.hist + hist
        self.amax = torch.maximum(self.amax, amax)
        self.numel += numel


@dataclass
class _Record:
    """Everything captured on one active step, on the device until ``flush``."""

    step: int
    scale: Tensor | None = None  # the loss-level scale (what the shadow pass multiplies its loss by)
    # (act|weight, layer) -> the scale that layer's gradients carry: the loss scale, or for
    # adaptive scaling the layer's own cumulative scale. Set after backward.
    layer_scales: dict[tuple[str, int], Tensor] = field(default_factory=dict)
    captures: int = 0  # backward passes captured (micro-batches)
    weights_done: bool = False
    # kind: act | weight (as the run stored them), act32 | weight32 (the FP32 shadow pass)
    stats: dict[tuple[str, int], _Acc] = field(default_factory=dict)
    lost: dict[tuple[str, int], Tensor] = field(default_factory=dict)  # (act|weight, layer): count
    lost_numel: dict[tuple[str, int], int] = field(default_factory=dict)

    def add(self, kind: str, layer: int, g: Tensor) -> None:
        hist, amax = grad_stats(g)
        acc = self.stats.get((kind, layer))
        if acc is None:
            self.stats[kind, layer] = _Acc(hist, amax, g.numel())
        else:
            acc.add(hist, amax, g.numel())

    def add_lost(self, kind: str, layer: int, count: Tensor, numel: int) -> None:
        key = (kind, layer)
        self.lost[key] = self.lost[key] + count if key in self.lost else count
        self.lost_numel[key] = self.lost_numel.get(key, 0) + numel


_KINDS = {"act": "act_grad", "weight": "weight_grad"}
_UNSCALED_OFFSET = 400  # host-side run histograms in true (unscaled) binades -400..399


@dataclass
class _RunStats:
    """Host-side totals of one (kind, layer) over the run, for ``report``."""

    hist: np.ndarray = field(default_factory=lambda: np.zeros(N_BINS, dtype=np.int64))  # as seen
    true_hist: np.ndarray = field(default_factory=lambda: np.zeros(2 * _UNSCALED_OFFSET, dtype=np.int64))
    true_log2_amax: float = -math.inf  # max over steps of log2(amax / scale)
    numel: int = 0
    steps: int = 0
    overflow_steps: dict[str, int] = field(default_factory=dict)  # per format
    min_headroom: dict[str, float] = field(default_factory=dict)
    max_underflow: dict[str, float] = field(default_factory=dict)
    lost: int = 0
    lost_numel: int = 0

    def add_true(self, hist: np.ndarray, shift: int) -> None:
        """Add a histogram observed at scale 2^shift in true binades (log2 of its lower edges)."""
        at = _LOWER_BINADE - max(-250, min(250, shift)) + _UNSCALED_OFFSET  # stays inside the array
        self.true_hist[at[0]] += hist[1]
        self.true_hist[at[1]] += hist[2]
        self.true_hist[at[2] : at[2] + 254] += hist[3:_NONFINITE]

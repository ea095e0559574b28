"""What block formats do to a run's tensors: per layer, per tensor, per format.

For every hooked GEMM layer and every format asked for (``telemetry.compare_formats``, plus the
run's own format under ``precision=mx``), on the telemetry's sampled steps, the three tensors a
quantized GEMM layer quantizes are quantized the way that layer's GEMMs block them:

- ``act``: the layer's input, blocked along its forward reduction dim (Linear: features; Conv2d:
  channels, per pixel);
- ``weight``: blocked along the same dim (1D blocks: what forward quantization sees);
- ``grad``: the gradient at the layer's output (the error), blocked along output features (dgrad).

Rounding is to nearest (no stochastic rounding: the loss measured is the format's, not noise).
Per tensor: ``flushed_frac`` (nonzero values stored as 0), ``saturated_frac`` (values past the
largest value their block can hold, clamped to it: MX's floor rule puts a block's amax up to 2x
past the element max; NVFP4's E4M3 block scale, when it rounds down, up to 1/16), ``snr_db`` =
10 log10(sum x^2 / sum (x - q(x))^2), and a histogram of block-scale exponents (MX: the E8M0
exponent; NVFP4: floor(log2) of block scale times tensor scale). The statistics do not depend on
the run's precision: a run in FP32 or bf16 sees what MXFP4 or NVFP4 would lose on its own tensors.
Gradients carry the loss scale, which changes none of these (block scales follow each block's amax).

Hot path: on sampled steps only; everything stays on the device until ``flush`` reads it back in
one transfer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from mptrain.numerics.mx import BLOCK_FORMATS, BlockFormat, quantize_blocks

KINDS = ("act", "weight", "grad")
EXP_LO, EXP_HI = -127, 128  # histogram bins of block-scale exponents; 128 also holds NaN blocks
N_EXP = EXP_HI - EXP_LO + 1
_ZERO_SCALE = N_EXP  # an extra bin: NVFP4 blocks whose scale rounded to 0
N_FIELDS = 6  # nonzero, flushed, finite, saturated, signal energy, error energy


def block_stats(x: Tensor, fmt: BlockFormat, dim: int) -> Tensor:
    """One float64 vector: [nonzero, flushed, finite, saturated, sum x^2, sum (x - q)^2, exp hist...]
    for ``x`` quantized to ``fmt`` along ``dim`` (round-to-nearest). On x's device, no host sync."""
    xf = x.detach().float()
    q = quantize_blocks(xf, fmt, dim, with_stats=True)
    finite = torch.isfinite(xf)
    good = finite & torch.isfinite(q.dequantized)
    err = torch.where(good, xf - q.dequantized, 0.0)
    sig = torch.where(finite, xf, 0.0)
    if q.scale_exponents is not None:
        exps = q.scale_exponents.flatten().long()
        zero_scale = torch.zeros_like(exps, dtype=torch.bool)
    else:
        assert q.block_scales is not None and q.tensor_scale is not None
        s = (q.block_scales * q.tensor_scale).flatten()
        _, e = torch.frexp(s)
        zero_scale = s == 0
        exps = torch.where(torch.isfinite(s), e.long() - 1, EXP_HI)
    idx = torch.where(zero_scale, _ZERO_SCALE, exps.clamp(EXP_LO, EXP_HI) - EXP_LO)
    hist = torch.bincount(idx, minlength=N_EXP + 1) if idx.device.type == "cpu" else _count(idx, N_EXP + 1)
    assert q.nonzero is not None and q.flushed is not None and q.saturated is not None
    head = torch.stack([
        q.nonzero.double(), q.flushed.double(), finite.sum().double(), q.saturated.double(),
        sig.double().square().sum(), err.double().square().sum(),
    ])  # fmt: skip
    return torch.cat([head, hist.double()])


def _count(idx: Tensor, n: int) -> Tensor:
    # CUDA's bincount syncs with the host for its size; index_add_ does not.
    ones = torch.ones((), dtype=torch.int64, device=idx.device).expand(idx.numel())
    return torch.zeros(n, dtype=torch.int64, device=idx.device).index_add_(0, idx, ones)


def summary(v: np.ndarray) -> dict[str, Any]:
    """The statistics of one accumulated ``block_stats`` vector (several captures summed)."""
    nonzero, flushed, finite, saturated, signal, error = (float(a) for a in v[:N_FIELDS])
    hist = v[N_FIELDS:].astype(np.int64)
    bins = [(EXP_LO + i, int(c)) for i, c in enumerate(hist[:N_EXP]) if c]
    snr = math.inf if error == 0 else (10 * math.log10(signal / error) if signal > 0 else -math.inf)
    return {
        "flushed_frac": flushed / nonzero if nonzero else 0.0,
        "saturated_frac": saturated / finite if finite else 0.0,
        "snr_db": snr,
        "scale_exp_min": bins[0][0] if bins else None,
        "scale_exp_max": bins[-1][0] if bins else None,
        "scale_exp_hist": {str(e): c for e, c in bins}
        | ({"zero": int(hist[_ZERO_SCALE])} if hist[_ZERO_SCALE] else {}),
    }


def _reduction_dim(layer: nn.Module, kind: str, ndim: int) -> int:
    """The dim a quantized GEMM layer blocks ``kind`` along (see mptrain.numerics.qgemm)."""
    if isinstance(layer, nn.modules.conv._ConvNd):
        return 1  # channels: C_in for the input and the weight, C_out for the output's gradient
    return ndim - 1 if kind != "weight" else 1


@dataclass
class _Pending:
    step: int
    sums: dict[tuple[str, int, str], Tensor] = field(default_factory=dict)  # (fmt, layer, kind) -> stats

    def add(self, key: tuple[str, int, str], v: Tensor) -> None:
        old = self.sums.get(key)
        self.sums[key] = v if old is None else old + v


class FormatProbe:
    """Hooks on GEMM layers that measure what each block format does to their tensors.

    Driven by the gradient telemetry: ``arm(step)`` before a sampled step's forward, ``disarm()``
    after its backward, ``flush(logger, tag)`` on logging steps, ``report()`` at the end.
    """

    def __init__(self, layers: Iterable[tuple[str, nn.Module]], formats: Iterable[str]) -> None:
        self.formats = [BLOCK_FORMATS[f] for f in dict.fromkeys(formats)]
        # Linear and (non-transposed) convolutions: the layers mptrain's quantized GEMMs cover.
        self.layers = [
            (n, m) for n, m in layers
            if isinstance(m, nn.Linear) or (isinstance(m, nn.modules.conv._ConvNd) and not m.transposed)
        ]  # fmt: skip
        self._handles: list[RemovableHandle] = []
        for i, (_, m) in enumerate(self.layers):
            self._handles.append(m.register_forward_hook(self._hook(i)))
        self._pending: _Pending | None = None
        self._done: list[_Pending] = []
        self._totals: dict[tuple[str, int, str], np.ndarray] = {}
        self.steps_sampled = 0

    def _measure(self, layer: int, kind: str, x: Tensor, module: nn.Module) -> None:
        p = self._pending
        if p is None or x.numel() == 0 or not x.is_floating_point():
            return
        dim = _reduction_dim(module, kind, x.dim())
        with torch.no_grad():
            for fmt in self.formats:
                p.add((fmt.name, layer, kind), block_stats(x, fmt, dim))

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if self._pending is None or not torch.is_grad_enabled():
                return
            if inputs and isinstance(inputs[0], Tensor):
                self._measure(i, "act", inputs[0], module)
            self._measure(i, "weight", module.weight, module)
            if isinstance(output, Tensor) and output.requires_grad:
                # Registered now, fires in backward with this version of the output's gradient.
                output.register_hook(lambda g: self._measure(i, "grad", g, module))

        return hook

    def arm(self, step: int) -> None:
        self.disarm()
        self._pending = _Pending(step)

    def disarm(self) -> None:
        if self._pending is not None and self._pending.sums:
            self._done.append(self._pending)
        self._pending = None

    def flush(self, logger: Any, tag: str) -> None:
        """Fold the finished captures into the run totals and write them to TensorBoard
        (``{tag}/formats/{format}/{layer}/{kind}/...``). One device-to-host transfer."""
        done, self._done = self._done, []
        if not done:
            return
        keys = [(p.step, k) for p in done for k in p.sums]
        host = torch.stack([p.sums[k].cpu() if p.sums[k].device.type != "cpu" else p.sums[k]
                            for p in done for k in p.sums]).numpy()  # fmt: skip
        self.steps_sampled += len(done)
        writer = getattr(logger, "writer", None) if logger is not None else None
        for (step, key), v in zip(keys, host, strict=True):
            self._totals[key] = self._totals.get(key, 0) + v
            if logger is None:
                continue
            fmt, layer, kind = key
            s = summary(v)
            where = f"{tag}/formats/{fmt}/{self.layers[layer][0] or 'model'}/{kind}"
            for name in ("flushed_frac", "saturated_frac", "snr_db"):
                if math.isfinite(s[name]):
                    logger.scalar(f"{where}/{name}", s[name], step)
            if writer is not None:
                _write_exp_histogram(writer, f"{where}/scale_exp", v[N_FIELDS:], step)

    def report(self) -> dict[str, Any]:
        """Run totals: per format, per layer and tensor, and all layers pooled per tensor kind."""
        self.disarm()
        self.flush(None, "")
        out: dict[str, Any] = {"every_sampled_step": self.steps_sampled, "formats": {}}
        for fmt in self.formats:
            rows, pooled = [], {}
            for (fname, layer, kind), v in sorted(self._totals.items(), key=lambda kv: (kv[0][1], kv[0][2])):
                if fname != fmt.name:
                    continue
                rows.append({"layer": self.layers[layer][0], "kind": kind, **summary(v)})
                pooled[kind] = pooled.get(kind, 0) + v
            out["formats"][fmt.name] = {
                "layers": rows,
                "all_layers": {
                    k: {n: x for n, x in summary(v).items() if n != "scale_exp_hist"} for k, v in pooled.items()
                },
            }
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending = None


def _write_exp_histogram(writer: Any, tag: str, hist: np.ndarray, step: int) -> None:
    counts = hist[:N_EXP]
    nz = np.nonzero(counts)[0]
    if len(nz) == 0:
        return
    lo, hi = int(nz[0]), int(nz[-1]) + 1
    c = [int(x) for x in counts[lo:hi]]
    centers = [EXP_LO + i for i in range(lo, hi)]
    writer.add_histogram_raw(
        tag, min=float(centers[0]), max=float(centers[-1]), num=sum(c),
        sum=float(sum(n * e for n, e in zip(c, centers, strict=True))),
        sum_squares=float(sum(n * e * e for n, e in zip(c, centers, strict=True))),
        bucket_limits=[e + 0.5 for e in centers], bucket_counts=c, global_step=step,
    )  # fmt: skip


def probe_formats(compare: Iterable[str], run_format: str | None) -> list[str]:
    """The formats to measure: the run's own (precision=mx) first, then ``compare_formats``."""
    return list(dict.fromkeys([*([run_format] if run_format else []), *compare]))

"""Gradient telemetry: the paper's histogram of gradient magnitudes, per layer, live, for any model.

Opt-in (``telemetry=gradients``). Every ``telemetry.every`` steps the engine captures, per hooked
layer (Conv/ConvTranspose/Linear/RNN/Embedding modules, at most ``telemetry.max_layers``):

- ``act_grad``: the gradient arriving at the layer's output (a tensor hook registered in the
  forward pass), as the run's backward stores it, loss scale included;
- ``weight_grad``: the layer's own parameter gradients (weight and bias together) after backward
  and before unscaling, so also with the current scale applied.

The statistics (their formulas, and the one histogram per tensor they are read from) live in
``mptrain.numerics.telemetry_stats``; this module hooks the layers, runs the FP32 shadow pass, logs, and
writes the end-of-run report.

What a threshold means depends on where the gradient was computed. In a run that stores the
gradient in the format itself (activation gradients under FP16 autocast), values below u (the
format's smallest subnormal) have already become zeros: ``underflow_frac`` is ~0 by construction
and the loss shows up in ``zero_frac``. That is what ``telemetry.shadow`` is for: it recomputes
the same batch in FP32 and counts ``lost_frac``, the fraction nonzero in FP32 but zero in the
run. In FP32 runs (and for the FP32 weight gradients of autocast runs) ``underflow_frac`` is the
fraction that *would* underflow.

Hot path: the hooks only queue device ops; per-step results stay on the device until ``flush``,
the engine's logging step, reads everything back in one transfer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from rich.table import Table
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from mptrain.config import TELEMETRY_FORMATS, TelemetryConfig  # noqa: F401 - schemas live in config.py
from mptrain.numerics.convert import MxConv2d, MxLinear
from mptrain.numerics.format_stats import FormatProbe, probe_formats
from mptrain.numerics.fp8 import BF16, Fp8Conv2d, Fp8ConvTranspose2d, Fp8Format, Fp8Linear
from mptrain.numerics.loss_scaling import LossScaler
from mptrain.numerics.precision import Precision
from mptrain.numerics.telemetry_stats import (
    _KINDS,
    _UNSCALED_OFFSET,
    N_BINS,
    LogHistogram,
    _Record,
    _RunStats,
    _write_histogram,
    resolve_formats,
    summarize,
)

# --------------------------------------------------------------------------------------------
# layers

_HOOKED = (nn.modules.conv._ConvNd, nn.Linear, nn.RNNBase, nn.Embedding)
_FP8_PLAIN: dict[type[nn.Module], type[nn.Module]] = {
    Fp8Linear: nn.Linear,
    Fp8Conv2d: nn.Conv2d,
    Fp8ConvTranspose2d: nn.ConvTranspose2d,
    MxLinear: nn.Linear,
    MxConv2d: nn.Conv2d,
}


def select_layers(module: nn.Module, max_layers: int | None) -> list[tuple[str, nn.Module]]:
    """The hooked layers in definition order: at most ``max_layers``, evenly spaced, first and
    last always."""
    layers = [(name or type(m).__name__.lower(), m) for name, m in module.named_modules() if isinstance(m, _HOOKED)]
    if max_layers is None or len(layers) <= max_layers:
        return layers
    keep = sorted({round(i * (len(layers) - 1) / (max_layers - 1)) for i in range(max_layers)})
    return [layers[i] for i in keep]


def _fp32_tree(obj: Any) -> Any:
    """``obj`` with every floating-point tensor inside tuples, lists and dicts cast to FP32."""
    if isinstance(obj, Tensor):
        return obj.float() if obj.is_floating_point() else obj
    if isinstance(obj, tuple | list):
        return type(obj)(_fp32_tree(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _fp32_tree(v) for k, v in obj.items()}
    return obj


def _output_tensor(output: Any) -> Tensor | None:
    if isinstance(output, tuple):  # RNNs: (output, hidden)
        output = output[0]
    if isinstance(output, nn.utils.rnn.PackedSequence):
        output = output.data
    return output if isinstance(output, Tensor) else None


# --------------------------------------------------------------------------------------------
# the telemetry object


class GradientTelemetry:
    """Per-layer gradient statistics for one objective's module. Reads ``telemetry.*``: ``every``,
    ``activations``, ``weights``, ``shadow``, ``histogram``, ``max_layers``, ``formats``,
    ``max_underflow``, ``margin_bits``.

    The engine drives it around each step (see ``active``)::

        tel.active(step)                     # before the forward: arms the hooks on sampled steps
        ...forward...
        with tel.capture(step):              # the three calls below are no-ops on other steps
            scaler.scale(loss).backward()
        tel.record_weight_grads()            # before master.before_unscale / scaler.unscale_
        tel.shadow(loss_fn)                  # telemetry.shadow: FP32 recompute of micro-batch 0
        ...
        tel.flush(logger, step)              # on logging steps: the one host sync
        tel.report(); tel.close()            # end of run

    ``modules``: every module the objective's loss runs through (the shadow pass casts them all
    to FP32); defaults to ``[module]``. ``tag``: the TensorBoard prefix.
    """

    def __init__(
        self,
        cfg: Any,
        module: nn.Module,
        precision: Precision,
        scaler: LossScaler,
        *,
        modules: Iterable[nn.Module] | None = None,
        tag: str = "telemetry",
    ) -> None:
        self.cfg = cfg
        self.module = module
        self.precision = precision
        self.scaler = scaler
        self.tag = tag
        # Plain attributes: the hooks read them on every call, and DictConfig access is slow.
        self.every = int(cfg.every)
        self.weights = bool(cfg.weights)
        self.shadow_on = bool(cfg.shadow)
        self.histogram = bool(cfg.histogram)
        self.max_underflow = float(cfg.max_underflow)
        self.margin_bits = float(cfg.margin_bits)
        self.formats = resolve_formats(cfg.formats, precision)
        self.layers = select_layers(module, cfg.max_layers)
        self.names = [n for n, _ in self.layers]
        self.shadow_modules = list(modules) if modules is not None else [module]
        self._handles: list[RemovableHandle] = []
        if cfg.activations:
            for i, (_, layer) in enumerate(self.layers):
                self._handles.append(layer.register_forward_hook(self._make_forward_hook(i)))
        self._armed = False
        self._mode: str | None = None  # capture | shadow | None: what the tensor hooks do
        self._calls = [0] * len(self.layers)  # forward calls per layer since arming
        self._record: _Record | None = None
        self._records: list[_Record] = []
        self._masks: dict[tuple[str, int, int], Tensor] = {}  # run zeros, for the shadow compare
        self._rng: tuple[Tensor, Tensor | None] | None = None
        self._run: dict[tuple[str, int], _RunStats] = {}
        self._run_shadow: dict[tuple[str, int], _RunStats] = {}
        self.steps_sampled = 0
        # telemetry.compare_formats (and precision=mx's own format): mptrain.numerics.format_stats
        fmts = probe_formats(cfg.get("compare_formats") or [], precision.mx)
        self.format_probe = FormatProbe(self.layers, fmts) if fmts else None

    # ---------------------------------------------------------------------------------- hooks

    def _make_forward_hook(self, layer: int) -> Callable[..., None]:
        def forward_hook(_m: nn.Module, _inputs: Any, output: Any) -> None:
            if not self._armed or not torch.is_grad_enabled():
                return
            out = _output_tensor(output)
            if out is None or not out.requires_grad:
                return
            call = self._calls[layer]
            self._calls[layer] += 1
            # A tensor hook fires with the gradient of this version of the output, even when an
            # in-place op (ReLU(inplace=True)) modifies it afterwards.
            out.register_hook(lambda g: self._on_act_grad(layer, call, g))

        return forward_hook

    def _on_act_grad(self, layer: int, call: int, g: Tensor) -> None:
        rec = self._record
        if rec is None or self._mode is None:
            return
        if self._mode == "capture":
            rec.add("act", layer, g)
            if self.shadow_on and rec.captures == 1:
                self._masks["act", layer, call] = g == 0
        elif self._mode == "shadow":
            rec.add("act32", layer, g)
            mask = self._masks.get(("act", layer, call))
            if mask is not None and mask.shape == g.shape:
                rec.add_lost("act", layer, ((g != 0) & mask).sum(), g.numel())

    # ---------------------------------------------------------------------------------- step

    def active(self, step: int) -> bool:
        """Whether ``step`` is captured (step % every == 0). Call it before the step's forward:
        it arms (or disarms) the forward hooks, and starts the step's record."""
        on = step % self.every == 0
        self._armed = on
        self._calls = [0] * len(self.layers)
        self._record = _Record(step) if on else None
        self._masks.clear()
        if self.format_probe is not None:
            self.format_probe.disarm()
            if on:
                self.format_probe.arm(step)
        if self._record is not None:
            self._records.append(self._record)
            if self.shadow_on:
                # The shadow pass must draw the same dropout masks as this step's first forward.
                dev = self.precision.device
                self._rng = (torch.get_rng_state(), torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None)
        return on

    @contextlib.contextmanager
    def capture(self, step: int) -> Iterator[None]:
        """Wraps one backward of the step that ``active(step)`` started: the armed hooks record its
        activation gradients. A no-op on other steps, so it may wrap every backward."""
        rec = self._record
        if rec is None or rec.step != step:
            yield
            return
        if rec.scale is None:
            # A copy: the scaler updates its scale in place later in the step.
            rec.scale = self.scaler.scale_value.detach().float().clone()
        rec.captures += 1
        self._mode = "capture"
        try:
            yield
        finally:
            self._mode = None

    @torch.no_grad()
    def record_weight_grads(self) -> None:
        """After the step's backward(s), before ``master.before_unscale``/``scaler.unscale_``: the
        hooked layers' parameter gradients as stored, scale applied. Also disarms the hooks. A
        no-op on steps that ``active`` did not start."""
        self._armed = False
        if self.format_probe is not None:
            self.format_probe.disarm()
        rec = self._record
        if rec is None or rec.scale is None:
            return
        if not rec.layer_scales:
            # After backward: per-layer scales (adaptive) are known only now, and change next step.
            for i, (_, layer) in enumerate(self.layers):
                rec.layer_scales["act", i], rec.layer_scales["weight", i] = self.scaler.layer_grad_scales(layer)
        if rec.weights_done or not self.weights:
            return
        rec.weights_done = True
        for i, (_, layer) in enumerate(self.layers):
            for j, p in enumerate(layer.parameters(recurse=False)):
                if p.grad is not None:
                    rec.add("weight", i, p.grad)
                    if self.shadow_on and rec.captures == 1:
                        self._masks["weight", i, j] = p.grad == 0

    def shadow(self, loss_fn: Callable[[], Tensor]) -> None:
        """Recompute the step's first micro-batch in FP32 and count, per layer, the gradients that
        are nonzero in FP32 but zero in the run (``lost_frac``). Reads ``telemetry.shadow``.

        ``loss_fn()`` returns the loss exactly as the run backpropagated it before scaling (divided
        by the accumulation count); it may use ``precision.autocast()``/``input_cast``, which are
        FP32 for the duration. The loss is multiplied by the step's scale, so the two passes are
        compared at the same scale. Gradients, buffers (batch-norm statistics), weights and the
        RNG state are restored: training is unaffected.
        """
        rec = self._record
        if not self.shadow_on or rec is None or rec.scale is None:
            return
        params = [p for m in self.shadow_modules for p in m.parameters()]
        saved_grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        devices = [self.precision.device] if self.precision.device.type == "cuda" else []
        try:
            with self._fp32(), torch.random.fork_rng(devices=devices):
                if self._rng is not None:
                    torch.set_rng_state(self._rng[0])
                    if self._rng[1] is not None:
                        torch.cuda.set_rng_state(self._rng[1], self.precision.device)
                self._armed, self._mode = True, "shadow"
                self._calls = [0] * len(self.layers)
                loss = loss_fn()
                (loss.float() * rec.scale).backward()
                self._armed, self._mode = False, None
                self._shadow_weights(rec)
        finally:
            self._armed, self._mode = False, None
            for p, g in zip(params, saved_grads, strict=True):
                p.grad = g
            self._masks.clear()

    @torch.no_grad()
    def _shadow_weights(self, rec: _Record) -> None:
        if not self.weights:
            return
        for i, (_, layer) in enumerate(self.layers):
            for j, p in enumerate(layer.parameters(recurse=False)):
                if p.grad is None:
                    continue
                rec.add("weight32", i, p.grad)
                # Weight gradients sum over all micro-batches; the shadow recomputes only the first.
                mask = self._masks.get(("weight", i, j))
                if rec.captures == 1 and mask is not None and mask.shape == p.grad.shape:
                    rec.add_lost("weight", i, ((p.grad != 0) & mask).sum(), p.numel())

    @contextlib.contextmanager
    def _fp32(self) -> Iterator[None]:
        """FP32 everything, temporarily: no autocast, FP32 weights and buffers, plain layers in
        place of emulated FP8 ones, the module's own forward in place of an instance-level one
        (adaptive loss scaling's instrumented graph: the reference pass has no per-layer scales and
        must not touch the scaler's state); buffers (batch-norm running statistics) restored after."""
        prec = self.precision
        saved_prec = (prec.autocast_dtype, prec.param_dtype)
        swapped: list[tuple[nn.Module, type[nn.Module]]] = []
        saved_data: list[tuple[Tensor, Tensor]] = []
        forwards: list[tuple[nn.Module, Any]] = []
        handles: list[RemovableHandle] = []
        try:
            prec.autocast_dtype, prec.param_dtype = None, torch.float32
            for m in self.shadow_modules:
                if "forward" in m.__dict__:
                    forwards.append((m, m.__dict__.pop("forward")))
                # Inputs too: a carried state (an LSTM's hidden state from an autocast step) is half.
                handles.append(
                    m.register_forward_pre_hook(
                        lambda _m, args, kwargs: (_fp32_tree(args), _fp32_tree(kwargs)), with_kwargs=True
                    )
                )
                for sub in m.modules():
                    plain = _FP8_PLAIN.get(type(sub))
                    if plain is not None:
                        swapped.append((sub, type(sub)))
                        sub.__class__ = plain
                for p in m.parameters():
                    if p.is_floating_point() and p.dtype != torch.float32:
                        saved_data.append((p, p.data))
                        p.data = p.data.float()
                for b in m.buffers():
                    # A copy in every case: the FP32 forward updates running statistics in place.
                    saved_data.append((b, b.data))
                    b.data = b.data.to(torch.float32 if b.is_floating_point() else b.dtype, copy=True)
            with torch.autocast(prec.device.type, enabled=False):
                yield
        finally:
            for h in handles:
                h.remove()
            prec.autocast_dtype, prec.param_dtype = saved_prec
            for t, data in reversed(saved_data):
                if isinstance(t, nn.Parameter):
                    t.grad = None  # an FP32 shadow gradient must not sit on a half parameter
                t.data = data
            for sub, cls in swapped:
                sub.__class__ = cls
            for m, forward in forwards:
                m.forward = forward

    # ---------------------------------------------------------------------------------- output

    def flush(self, logger: Any, step: int) -> None:
        """Write the captured steps to TensorBoard (``logger.scalar``, ``logger.writer``) and into
        the run totals. One device-to-host transfer for everything since the last flush.
        ``logger=None`` only updates the totals."""
        if self.format_probe is not None:
            self.format_probe.flush(logger, self.tag)
        # A step still being captured (hooks armed) waits for the next flush.
        pending = [r for r in self._records if r is self._record and self._armed]
        records = [r for r in self._records if (r.stats or r.lost) and r not in pending]
        self._records = pending
        if not records:
            return
        pieces: list[Tensor] = []
        for r in records:
            scale = r.scale if r.scale is not None else torch.ones((), device=self.precision.device)
            for (kind, i), acc in r.stats.items():
                key_scale = r.layer_scales.get((kind.removesuffix("32"), i), scale)
                pieces += [acc.hist.double(), acc.amax.double().reshape(1), key_scale.double().reshape(1)]
            pieces += [c.double().reshape(1) for c in r.lost.values()]
        host = torch.cat([p.to(self.precision.device) for p in pieces]).cpu().numpy()
        pos = 0
        for r in records:
            stats: dict[tuple[str, int], tuple[np.ndarray, float, int, float]] = {}
            for key, acc in r.stats.items():
                stats[key] = (
                    host[pos : pos + N_BINS].astype(np.int64), float(host[pos + N_BINS]), acc.numel,
                    float(host[pos + N_BINS + 1]),
                )  # fmt: skip
                pos += N_BINS + 2
            lost: dict[tuple[str, int], tuple[int, int]] = {}
            for key in r.lost:
                lost[key] = (int(host[pos]), r.lost_numel[key])
                pos += 1
            self._absorb(r.step, stats, lost, logger)

    def _absorb(
        self,
        step: int,
        stats: dict[tuple[str, int], tuple[np.ndarray, float, int, float]],
        lost: dict[tuple[str, int], tuple[int, int]],
        logger: Any,
    ) -> None:
        """``stats``: (kind, layer) -> (histogram, amax, numel, the scale those gradients carry)."""
        self.steps_sampled += 1
        writer = getattr(logger, "writer", None) if logger is not None else None
        totals: dict[str, tuple[np.ndarray, float, int]] = {}
        for (kind, i), (hist, amax, numel, scale) in sorted(stats.items()):
            # Unscale by the layer's own scale (adaptive scaling gives every layer its own).
            shift = round(math.log2(scale)) if scale > 0 else 0
            log2_scale = math.log2(scale) if scale > 0 else 0.0
            base = kind.removesuffix("32")
            runs = self._run_shadow if kind.endswith("32") else self._run
            run = runs.get((base, i)) or runs.setdefault((base, i), _RunStats())
            run.hist += hist
            run.add_true(hist, shift)
            if amax > 0:
                run.true_log2_amax = max(run.true_log2_amax, math.log2(amax) - log2_scale)
            run.numel += numel
            run.steps += 1
            if kind.endswith("32"):
                continue
            for fname, fmt in self.formats:
                s = summarize(hist, amax, numel, fmt)
                run.overflow_steps[fname] = run.overflow_steps.get(fname, 0) + int(s["overflow"])
                run.min_headroom[fname] = min(run.min_headroom.get(fname, math.inf), s["headroom_bits"])
                run.max_underflow[fname] = max(run.max_underflow.get(fname, 0.0), s["underflow_frac"])
            t = totals.get(kind)
            totals[kind] = (hist.copy(), amax, numel) if t is None else (t[0] + hist, max(t[1], amax), t[2] + numel)
            if logger is not None:
                self._log_stats(logger, writer, f"{self.names[i]}/{_KINDS[kind]}", hist, amax, numel, step)
        for (kind, i), (count, numel) in sorted(lost.items()):
            run = self._run.get((kind, i)) or self._run.setdefault((kind, i), _RunStats())
            run.lost += count
            run.lost_numel += numel
            if logger is not None:
                logger.scalar(f"{self.tag}/{self.names[i]}/{_KINDS[kind]}/lost_frac", count / max(numel, 1), step)
        if logger is not None:
            for kind, (hist, amax, numel) in totals.items():
                self._log_stats(logger, writer, f"all_layers/{_KINDS[kind]}", hist, amax, numel, step)
            if lost:
                for kind in _KINDS:
                    c = sum(v[0] for k, v in lost.items() if k[0] == kind)
                    n = sum(v[1] for k, v in lost.items() if k[0] == kind)
                    if n:
                        logger.scalar(f"{self.tag}/all_layers/{_KINDS[kind]}/lost_frac", c / n, step)

    def _log_stats(
        self, logger: Any, writer: Any, where: str, hist: np.ndarray, amax: float, numel: int, step: int
    ) -> None:
        prefix = f"{self.tag}/{where}"
        for n, (fname, fmt) in enumerate(self.formats):
            s = summarize(hist, amax, numel, fmt)
            if n == 0:
                values = s
            else:  # secondary formats: the format-dependent statistics, suffixed
                values = {
                    f"underflow_{fname}": s["underflow_frac"],
                    f"subnormal_{fname}": s["subnormal_frac"],
                    f"headroom_bits_{fname}": s["headroom_bits"],
                }
            for k, v in values.items():
                if math.isfinite(v):  # no log2 of an all-zero gradient
                    logger.scalar(f"{prefix}/{k}", v, step)
        if self.histogram and writer is not None:
            _write_histogram(writer, f"{prefix}/log2_abs", LogHistogram.from_bins(hist), step)

    # ---------------------------------------------------------------------------------- report

    def report(self) -> dict[str, Any]:
        """End of run, for summary.json: per-layer totals, the layers at risk and the suggested
        static loss scale per format (see ``suggest_scale``). Flushes pending captures first."""
        self.flush(None, -1)
        p, margin = self.max_underflow, self.margin_bits
        primary, pfmt = self.formats[0]
        rows = []
        for (kind, i), run in sorted(self._run.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            if run.steps == 0:
                continue
            row: dict[str, Any] = {"layer": self.names[i], "kind": _KINDS[kind], "steps": run.steps}
            s = summarize(run.hist, 0.0, run.numel, pfmt)  # fractions only: max/headroom are per step
            row.update(
                zero_frac=s["zero_frac"],
                underflow_frac=s["underflow_frac"],
                subnormal_frac=s["subnormal_frac"],
                underflow_frac_max=run.max_underflow.get(primary, 0.0),
                overflow_steps=run.overflow_steps.get(primary, 0),
                min_headroom_bits=run.min_headroom.get(primary, math.inf),
                true_log2_amax=run.true_log2_amax,
            )
            for fname, fmt in self.formats[1:]:
                row[f"underflow_{fname}"] = summarize(run.hist, 0.0, run.numel, fmt)["underflow_frac"]
                row[f"overflow_steps_{fname}"] = run.overflow_steps.get(fname, 0)
            if run.lost_numel:
                row["lost_frac"] = run.lost / run.lost_numel
            reasons = []
            if row["underflow_frac"] > p:
                reasons.append(f"underflow {row['underflow_frac']:.1%}")
            if row.get("lost_frac", 0.0) > p:
                reasons.append(f"lost {row['lost_frac']:.1%}")
            if row["overflow_steps"]:
                reasons.append(f"overflow on {row['overflow_steps']}/{run.steps} steps")
            if row["min_headroom_bits"] < margin:
                reasons.append(f"headroom {row['min_headroom_bits']:.2f} bits")
            row["at_risk"] = reasons
            rows.append(row)
        suggestions = {fname: self.suggest_scale(fmt) for fname, fmt in self.formats}
        act_hist = sum(
            (run.hist for (kind, _), run in self._run.items() if kind == "act"), np.zeros(N_BINS, dtype=np.int64)
        )
        if self.precision.half_dtype == pfmt.dtype:
            note = (
                f"activation gradients are stored in {primary} here, so values that underflowed are "
                "zeros already (zero_frac) and underflow_frac is ~0 by construction"
                + ("; lost_frac counts them" if self.shadow_on else "; telemetry.shadow=true counts them")
            )
        else:
            note = f"gradients here are not stored in {primary}: the fractions say what {primary} would do"
        return {
            "format": primary,
            "formats": [f for f, _ in self.formats],
            "measured_in": self.precision.resolved,
            "note": note,
            "every": self.every,
            "steps_sampled": self.steps_sampled,
            "layers": rows,
            "at_risk": [f"{r['layer']} {r['kind']}: {', '.join(r['at_risk'])}" for r in rows if r["at_risk"]],
            "suggested_scale": suggestions[primary]["scale"] if suggestions[primary] else None,
            "suggestions": suggestions,
            "rule": SCALE_RULE,
            "act_grad_histogram": LogHistogram.from_bins(act_hist).as_dict(),
            "block_formats": self.format_probe.report() if self.format_probe is not None else None,
        }

    def suggest_scale(self, fmt: Fp8Format) -> dict[str, Any] | None:
        """The static loss scale the observed range suggests for ``fmt`` (``SCALE_RULE``)."""
        p, margin = self.max_underflow, self.margin_bits
        u = round(math.log2(fmt.min_subnormal))
        # Pooled over every hooked gradient (activations and weights: all carry the scale), so a
        # few values of a tiny tensor (a conv bias before batch norm, whose true gradient is ~0)
        # cannot drive the suggestion.
        pooled = np.zeros(2 * _UNSCALED_OFFSET, dtype=np.int64)
        log2_amax = -math.inf
        for key, run in self._run.items():
            # The FP32 shadow distribution when there is one: in the run, underflowed values are
            # zeros already and would be missing from the percentile.
            source = self._run_shadow.get(key, run)
            pooled += source.true_hist
            log2_amax = max(log2_amax, run.true_log2_amax, source.true_log2_amax)
        if log2_amax == -math.inf:
            return None
        hi = math.floor(math.log2(fmt.max) - margin - log2_amax)
        below = np.cumsum(pooled) - pooled  # values in binades strictly below each binade
        ok = np.nonzero((below <= p * pooled.sum()) & (pooled > 0))[0]
        lo = u - (int(ok.max()) - _UNSCALED_OFFSET)  # lifts the highest admissible floor binade to u
        cap = 0 if fmt is BF16 else _SCALE_CAP_LOG2
        fits = lo <= hi
        k = int(min(hi, max(lo, cap)) if fits else hi)
        return {"scale": 2.0**k, "log2": k, "log2_range": [lo, hi], "fits": fits}

    def table(self, report: dict[str, Any] | None = None) -> Table:
        """The report as a rich table for the console (layers at risk first)."""
        return render_table(report or self.report(), self.tag)

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._armed, self._mode = False, None
        if self.format_probe is not None:
            self.format_probe.close()


# Apex's default max_loss_scale: a larger static scale buys nothing once the tail is lifted.
_SCALE_CAP_LOG2 = 24

SCALE_RULE = (
    "per format, from the true (unscaled) gradients of all hooked layers pooled over the sampled steps: "
    "hi = floor(log2(format max) - margin_bits - log2 max|g|), the largest power of two that keeps "
    "the largest gradient margin_bits below the format's max; lo = log2(smallest subnormal) - b, "
    "where 2^b is the lower edge of the binade holding the max_underflow quantile of nonzero |g| "
    "(the FP32 shadow pass's when available), the smallest power of two that lifts all but a "
    "max_underflow fraction above the underflow threshold. Suggested: the largest 2^k <= 2^hi, "
    "capped at 2^24 (2^0 for bf16, whose relative precision does not depend on scale) but never "
    "below 2^lo; if lo > hi no static scale fits and 2^hi is suggested (overflow skips steps, "
    "underflow only loses the tail): use dynamic or adaptive scaling."
)


def render_table(report: dict[str, Any], title: str = "telemetry") -> Table:
    """A rich table of a ``GradientTelemetry.report()`` dict."""
    fmt = report["format"]
    table = Table(
        title=f"{title}: gradients against {fmt} ({report['steps_sampled']} sampled steps, "
        f"measured in {report['measured_in']})"
    )
    for col in (
        "layer",
        "grad",
        "zero",
        f"underflow {fmt}",
        "subnormal",
        "lost",
        "log2 max",
        "min headroom",
        "at risk",
    ):
        table.add_column(col, justify="left" if col in ("layer", "grad", "at risk") else "right")
    rows = sorted(report["layers"], key=lambda r: not r["at_risk"])
    for r in rows:
        table.add_row(
            r["layer"],
            r["kind"].removesuffix("_grad"),
            f"{r['zero_frac']:.1%}",
            f"{r['underflow_frac']:.2%}",
            f"{r['subnormal_frac']:.1%}",
            f"{r['lost_frac']:.2%}" if "lost_frac" in r else "-",
            f"{r['true_log2_amax']:.1f}",
            f"{r['min_headroom_bits']:.1f}",
            ", ".join(r["at_risk"]) or "-",
            style="red" if r["at_risk"] else None,
        )
    sug = report["suggestions"].get(fmt)
    if sug:
        lo, hi = sug["log2_range"]
        table.caption = (
            f"suggested static loss scale for {fmt}: 2^{sug['log2']} (range 2^{lo}..2^{hi}"
            f"{'' if sug['fits'] else ': no static scale fits'}); log2 max is unscaled; "
            f"{report['note']}"
        )
    return table


def build_telemetry(
    cfg: Any, module: nn.Module, precision: Precision, scaler: LossScaler, **kwargs: Any
) -> GradientTelemetry | None:
    """A GradientTelemetry for ``telemetry.name=gradients``, None for ``off``."""
    return None if cfg.name == "off" else GradientTelemetry(cfg, module, precision, scaler, **kwargs)

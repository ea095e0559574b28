"""The measuring side of ``mptrain-bench``: cells and variants, timing windows, peak memory, FLOPs, MFU.

``run_cell`` measures one cell (a model, precision and batch size of the grid under one variant):
the engine and the bare loop (``mptrain.bench.runners``) on the same batches, in interleaved timing
windows, and returns its JSON record; ``add_ratios`` then relates the records to each other. The
method is described in ``mptrain.bench``'s docstring and in ``METHOD``.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import io
import json
import math
import pstats
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import cycle
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from mptrain import cudagraphs
from mptrain.bench.common import slug as _slug
from mptrain.bench.runners import _BARE_UNSUPPORTED, EngineRunner, Micro, Runner, build_bare
from mptrain.errors import MptrainError
from mptrain.numerics import compiled_calls, fused
from mptrain.numerics.plan import flop_counter

# Dense (no sparsity) datasheet peaks in TFLOP/s by compute dtype. fp32 is the CUDA-core rate
# (TF32 off); the others are tensor-core rates. Matched against torch.cuda.get_device_name in
# order, so the more specific names come first.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}),
    ("H200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}),
    ("H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}),
    ("H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0}),
    ("H100", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}),  # SXM
    ("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
]

FAST_PATHS = ("channels_last", "compile", "optim", "cudnn_benchmark")

# Numerics telemetry (issue 7): measured on and off when the composed config has this key. It
# captures one step in ``telemetry.every``, so its cost is read from the mean step time (the
# median would skip the captured steps); ``every=1`` gives the cost of one captured step.
TELEMETRY_KEY = "telemetry"
TELEMETRY_ON = ["telemetry=gradients"]
TELEMETRY_EVERY_STEP = [*TELEMETRY_ON, "telemetry.every=1"]


# ------------------------------------------------------------------------------------ specs


@dataclass
class Variant:
    """The base config or one toggle on top of it."""

    name: str  # "base", "channels_last", "compile", "optim_fused", "optim_foreach", ...
    overrides: list[str] = field(default_factory=list)
    setting: str = ""  # what the toggle sets, for tables ("trainer.channels_last=true")
    bare: bool = True  # False: the bare loop is the same as base's (telemetry), not re-measured
    stat: str = "median"  # how it compares with base: median step time, or mean (periodic work)


@dataclass
class Cell:
    """One measurement: a (model, precision, batch size) of the grid under one variant."""

    model: str
    precision: str
    batch_size: int
    variant: Variant
    overrides: list[str]  # the full override list for `mptrain`

    @property
    def key(self) -> str:
        return f"{self.model}/{self.precision}/b{self.batch_size}/{self.variant.name}"


@dataclass
class Timing:
    """Seconds per step of each timed window."""

    windows: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.windows)

    def spread(self) -> float:
        """(max - min) / median over the windows: how much to trust a ratio of two medians."""
        return (max(self.windows) - min(self.windows)) / self.median if self.windows else math.nan


# ------------------------------------------------------------------------------------ device helpers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _release(device: torch.device) -> None:
    gc.collect()  # a model's reference cycles; walks only the benchmark's own objects (frozen_heap)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# CPython 3.12 starts with some of its own objects frozen (375 on 3.12.1 and 3.12.3; none on 3.11 or
# 3.13), which made every benchmark on the GPU machine's Python skip its freeze as if a caller had
# frozen the heap. A count no higher than at import is the interpreter's; thawing those few with the
# rest afterwards only returns them to the oldest generation.
_FROZEN_AT_IMPORT = gc.get_freeze_count()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects alive when a benchmark starts are frozen (``gc.freeze``) while it runs, so that
    its full collections between cells (``_release``) walk only the objects it made. Each used to
    walk every object the process held: torch's own, and in a test process every graph
    torch.compile had built before it (a tiny CPU benchmark took half as long again after the
    suite's kernel tests). The young generations are collected first, so that recent garbage is
    not frozen; a full pass there would walk the whole heap once more. A freeze made by someone
    else is left as it is: ``gc.unfreeze`` would thaw it too."""
    if gc.get_freeze_count() > _FROZEN_AT_IMPORT:
        yield
        return
    gc.collect(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _nbytes(obj: Any) -> int:
    if isinstance(obj, Tensor):
        return obj.untyped_storage().nbytes()
    if isinstance(obj, list | tuple):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    return 0


def compute_dtype(precision: Any) -> str:
    """The dtype the peak (and so MFU) is taken against. torchao float8 converts only some Linear
    layers and runs the rest in bf16, so its MFU is against the bf16 peak, as torchtitan reports it;
    the cell's ``low_precision_flop_fraction`` says how much of the work ran in FP8."""
    resolved = precision.resolved
    if precision.fp8 == "torchao":
        return "bf16"
    if precision.emulated:  # emulated FP8 and the block formats: their products' dtype
        return "bf16" if precision.options.get("emulated_compute") == "bf16" else "fp32"
    if resolved == "tf32":
        return "tf32"
    dtype = precision.autocast_dtype or precision.param_dtype
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")


def peak_tflops(device: torch.device, dtype: str, override: float | None) -> float | None:
    """The device's dense peak for ``dtype`` (``--peak-tflops`` wins); None when unknown (CPU)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS:
        if key in name:
            return peaks.get(dtype)
    return None


# ------------------------------------------------------------------------------------ measuring


def _micro_stream(pool: list[Micro]) -> Iterator[Micro]:
    return cycle(pool)


def time_window(runner: Runner, stream: Iterator[Micro], steps: int, device: torch.device,
                clock: str = "wall") -> float:
    """Seconds per step over ``steps`` steps, starting from an idle device.

    CUDA: device events (wall time of the device work, host gaps included). CPU: ``wall``
    (perf_counter) or ``cpu`` (the process's CPU time, all threads: on a machine shared with other
    jobs, time spent descheduled is not counted, so the figure is the step's own work).
    """
    if isinstance(runner, EngineRunner):
        runner.drop_rows()  # the previous window's rows: read (if at all) outside the timed region
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            runner.step(next(stream))
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end) / 1000.0
    else:
        now = time.process_time if clock == "cpu" else time.perf_counter
        t0 = now()
        for _ in range(steps):
            runner.step(next(stream))
        elapsed = now() - t0
    return elapsed / steps


def step_peak(runner: Runner, stream: Iterator[Micro], device: torch.device) -> int | None:
    """Bytes one steady-state step allocates above what is already resident (CUDA only)."""
    if device.type != "cuda":
        runner.step(next(stream))
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    runner.step(next(stream))
    _sync(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)


def count_syncs(runner: Runner, stream: Iterator[Micro], device: torch.device) -> int | None:
    """Host-device synchronisations in one step (CUDA's sync debug mode); None on CPU."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            runner.step(next(stream))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def count_flops(runner: Runner, micro: Micro) -> int | None:
    """FLOPs of one training step (forward + backward), as FlopCounterMode counts them (SDPA's CPU
    kernel included on every torch: ``flop_counter``)."""
    counter = flop_counter()
    try:
        # Compiled modules run eagerly here: dispatch modes cannot see inside compiled kernels.
        with torch.compiler.set_stance("force_eager"), counter:
            runner.step(micro)
    except Exception:  # a counting failure must not lose the cell's timings
        return None
    return int(counter.get_total_flops()) or None


def warm(runner: Runner, stream: Iterator[Micro], steps: int, seed: int) -> list[float]:
    """Warm-up steps from a fixed RNG state; their losses are the like-for-like check."""
    torch.manual_seed(seed)  # dropout draws the same masks in both runners
    losses = [runner.step(next(stream)) for _ in range(steps)]
    if isinstance(runner, EngineRunner):
        runner.drop_rows()
    return torch.stack([loss.reshape(-1)[0] for loss in losses]).float().tolist() if losses else []


def _rel_diff(a: list[float], b: list[float]) -> float | None:
    if not a or not b:
        return None
    return max(abs(x - y) / max(abs(x), abs(y), 1e-30) for x, y in zip(a, b, strict=False))


@dataclass
class Options:
    """How each cell is measured (the command line's timing flags)."""

    steps: int = 20
    window: int = 5
    warmup: int = 5
    pool: int = 4
    seed: int = 0
    peak_tflops: float | None = None
    profile: int = 0  # steps to profile per runner (0: no profile)
    clock: str = "wall"  # CPU only: wall | cpu (process CPU time)
    out: Path | None = None


def run_cell(cell: Cell, cfg: DictConfig, opts: Options, flops_cache: dict[str, int | None]) -> dict[str, Any]:
    """Measure one cell: engine and bare loop, interleaved. Returns its JSON record."""
    from mptrain.engine import Engine

    rec: dict[str, Any] = {"model": cell.model, "precision": cell.precision, "batch_size": cell.batch_size,
                           "variant": cell.variant.name, "setting": cell.variant.setting,
                           "timing_stat": cell.variant.stat, "overrides": cell.overrides}
    device_hint = torch.device("cuda" if torch.cuda.is_available() and cfg.trainer.device != "cpu" else "cpu")
    if cfg.trainer.compile:
        # Fresh dynamo caches: each cell compiles new module instances, and past the recompile
        # limit dynamo would fall back to eager without a word.
        torch._dynamo.reset()
    _release(device_hint)
    base = _allocated(device_hint)
    compiled_before = fused.compile_seconds()
    skips_before = cudagraphs.watch()
    with tempfile.TemporaryDirectory(prefix="mptrain-bench-") as tmp:
        engine = Engine(cfg, Path(tmp))
        engine.logger.close()  # no TensorBoard writer or live progress bar in the process
        device = engine.device
        accum = int(cfg.trainer.grad_accum)
        batches = engine.task.train_batches(0)
        pool = []
        with contextlib.suppress(StopIteration):
            for _ in range(opts.pool):
                pool.append([next(batches) for _ in range(accum)])
        if not pool:
            raise MptrainError(f"{cell.key}: the task yields no batches")
        del batches
        step_bytes = _nbytes(pool[0])
        units = sum(engine.task.batch_size(b) for b in pool[0])
        init_state = {name: {k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()}
                      for name, m in engine.task.modules.items()}
        precision = engine.precision
        optimizer = engine.slots[0].optimizer
        rec.update({
            "precision_resolved": precision.resolved,
            "compute_dtype": compute_dtype(precision),
            "loss_scale": engine.policy,
            "image_size": engine.image_size,
            "units_per_step": units,
            "unit": engine.task.unit,
            "optimizer": type(optimizer).__name__ + _impl_label(optimizer, device),
            # What ran in low precision: the plan the engine measured (null with precision_plan off).
            "low_precision_flop_fraction": engine.plan.low_precision_flop_fraction if engine.plan else None,
            "low_precision_layers": [layer.name for layer in engine.plan.layers if layer.low_precision]
            if engine.plan else None,
        })

        eng = EngineRunner(engine)
        eng.train()
        e_stream = _micro_stream(pool)
        e_losses = warm(eng, e_stream, opts.warmup, opts.seed)
        _sync(device)
        # torch.compile's time in the engine's build and warm-up (trainer.compile, the fused quantizers),
        # which no timed window holds
        rec["compile_s"] = round(fused.compile_seconds() - compiled_before, 2)
        e_resident = _allocated(device) - base - _nbytes(pool) if device.type == "cuda" else None

        bare: Runner | None = None
        b_losses: list[float] = []
        b_resident = None
        reason = _BARE_UNSUPPORTED.get(precision.resolved)
        if cell.variant.bare and reason is None:
            before = _allocated(device)
            bare = build_bare(engine, init_state, cfg)
            bare.train()
            b_stream = _micro_stream(pool)
            b_losses = warm(bare, b_stream, opts.warmup, opts.seed)
            _sync(device)
            b_resident = _allocated(device) - before if device.type == "cuda" else None
        rec["bare_note"] = reason if reason else (None if cell.variant.bare else "same loop as the base cell")
        del init_state

        # Every group of steps starts both runners from the same RNG state (dropout masks) on the
        # same batches, so they stay on one trajectory and do the same work (same skipped steps).
        torch.manual_seed(opts.seed + 1)
        e_peak = step_peak(eng, e_stream, device)
        rec["peak_memory_bytes"] = None if e_peak is None else e_resident + e_peak + step_bytes
        torch.manual_seed(opts.seed + 2)
        rec["host_syncs_per_step"] = count_syncs(eng, e_stream, device)
        eng.drop_rows()
        e_time, b_time = Timing(), Timing()
        if bare is not None:
            torch.manual_seed(opts.seed + 1)
            b_peak = step_peak(bare, b_stream, device)
            rec["bare_peak_memory_bytes"] = None if b_peak is None else b_resident + b_peak + step_bytes
            torch.manual_seed(opts.seed + 2)
            rec["bare_host_syncs_per_step"] = count_syncs(bare, b_stream, device)
        else:
            rec["bare_peak_memory_bytes"] = rec["bare_host_syncs_per_step"] = None

        windows = max(1, opts.steps // opts.window)
        gc.collect()
        for w in range(windows):
            # Alternate which runner goes first, so neither always follows the other.
            order = [(eng, e_stream, e_time)] + ([(bare, b_stream, b_time)] if bare is not None else [])
            for runner, stream, timing in order if w % 2 == 0 else order[::-1]:
                torch.manual_seed(opts.seed + 3 + w)
                timing.windows.append(time_window(runner, stream, opts.window, device, opts.clock))

        # The last timed step's loss of each runner: equal when both stayed on one trajectory; a
        # non-finite one means the run diverged and the cell timed skipped steps and NaN arithmetic.
        rec["last_loss"] = float(eng.rows[-1][0][0]) if eng.rows else None
        rec["bare_last_loss"] = float(bare.last.reshape(-1)[0]) if bare is not None and bare.last is not None else None
        rec["diverged"] = any(v is not None and not math.isfinite(v) for v in (rec["last_loss"], rec["bare_last_loss"]))
        eng.drop_rows()
        rec.update(_figures("", e_time, units, opts.window))
        rec.update(_figures("bare_", b_time if bare is not None else None, units, opts.window))
        rec["losses"] = e_losses
        rec["bare_losses"] = b_losses
        # The emulated formats' compiled GEMM graphs so far in this process, and any given up (their
        # layers then ran per-quantizer kernels): what to look at when a formats cell is slow.
        rec["fused_graphs"] = {"compiled": len(compiled_calls._graphs), "given_up": sorted(compiled_calls._given_up)}
        # CUDA graphs inductor did not record (a *_cudagraphs cell's graphs run as plain launches), first lines
        rec["cudagraph_skips"] = [m.splitlines()[0] for m in cudagraphs.since(skips_before)]
        rec["loss_max_rel_diff"] = _rel_diff(e_losses, b_losses)

        if opts.profile and opts.out is not None:
            rec["profile"] = profile_cell(cell, eng, e_stream, bare, b_stream if bare else None,
                                          device, opts.profile, opts.out)

        flops_key = json.dumps([OmegaConf.to_container(cfg.model), cell.batch_size, engine.image_size, accum,
                                cfg.data.name], sort_keys=True, default=str)
        if flops_key not in flops_cache:
            counter_runner = bare if bare is not None else eng
            stream = b_stream if bare is not None else e_stream
            flops_cache[flops_key] = count_flops(counter_runner, next(stream))
        flops = flops_cache[flops_key]
        peak = peak_tflops(device, rec["compute_dtype"], opts.peak_tflops)
        rec["flops_per_step"] = flops
        rec["peak_tflops"] = peak
        rec["mfu"] = _mfu(flops, rec["step_time_s"], peak)
        rec["bare_mfu"] = _mfu(flops, rec["bare_step_time_s"], peak)
        rec["overhead"] = (rec["step_time_s"] / rec["bare_step_time_s"]) if rec["bare_step_time_s"] else None
        # Each engine window against the bare window next to it: robust to slow drift of the machine.
        pairs = [e / b for e, b in zip(e_time.windows, b_time.windows, strict=False)]
        rec["overhead_paired"] = statistics.median(pairs) if pairs else None
        # Fastest window over fastest window: other jobs only ever add time, so on a shared machine
        # this is the least disturbed estimate (timeit's reasoning).
        rec["overhead_min"] = (rec["step_time_min_s"] / rec["bare_step_time_min_s"]
                               if rec["bare_step_time_min_s"] else None)
        del eng, bare, engine, pool
    _release(device)
    return rec


def _impl_label(opt: torch.optim.Optimizer, device: torch.device) -> str:
    d = opt.defaults
    if d.get("fused"):
        return "(fused)"
    if d.get("foreach"):
        return "(foreach)"
    if d.get("foreach") is False:
        return "(for_loop)"
    # Unset: torch picks foreach for CUDA tensors and the per-parameter loop otherwise.
    return "(default: foreach)" if device.type == "cuda" else "(default: for_loop)"


def _figures(prefix: str, timing: Timing | None, units: int, window: int) -> dict[str, Any]:
    if timing is None or not timing.windows:
        return {f"{prefix}step_time_s": None, f"{prefix}step_time_mean_s": None, f"{prefix}step_time_min_s": None,
                f"{prefix}throughput": None,
                f"{prefix}step_time_windows_s": [], f"{prefix}spread": None}
    t = timing.median
    return {f"{prefix}step_time_s": t, f"{prefix}step_time_mean_s": statistics.fmean(timing.windows),
            f"{prefix}step_time_min_s": min(timing.windows),
            f"{prefix}throughput": units / t, f"{prefix}step_time_windows_s": timing.windows,
            f"{prefix}spread": timing.spread()}


def _mfu(flops: int | None, step_time: float | None, peak: float | None) -> float | None:
    if not flops or not step_time or not peak:
        return None
    return flops / step_time / (peak * 1e12)


# ------------------------------------------------------------------------------------ profiling


def device_ms_per_step(table: Any, steps: int) -> float:
    """The kernels' time a step, from a profiler's ``key_averages()``: the rows of device events alone,
    as torch's own table totals them. An op's row (``aten::mm``) carries its kernels' time as well, so
    a sum over every row counted each kernel twice (the H100 profiles of 2026-11-27 say 2x); and a
    ``record_function`` range has a row on the device's timeline too (a user annotation) that spans
    its kernels (2.03 against torch's 1.45 ms on an H100, the same day)."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in table
               if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)) / steps / 1e3


def profile_cell(cell: Cell, eng: EngineRunner, e_stream: Iterator[Micro], bare: Runner | None,
                 b_stream: Iterator[Micro] | None, device: torch.device, steps: int, out: Path) -> dict[str, Any]:
    """torch.profiler op tables and a cProfile of both runners; what the engine runs that bare does not.

    Writes ``profiles/profile-<cell>.txt`` under ``out``; returns per-step op-count and self-time differences.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    ops: dict[str, dict[str, tuple[float, float]]] = {}
    text = io.StringIO()
    runners = [("engine", eng, e_stream)] + ([("bare", bare, b_stream)] if bare is not None else [])
    for name, runner, stream in runners:
        assert stream is not None
        _sync(device)
        with profile(activities=activities) as prof:
            for _ in range(steps):
                runner.step(next(stream))
            _sync(device)
        table = prof.key_averages()
        ops[name] = {e.key: (e.count / steps, e.self_cpu_time_total / steps) for e in table}
        text.write(f"=== {name}: torch.profiler, {steps} steps, sorted by self CPU time ===\n")
        text.write(table.table(sort_by="self_cpu_time_total", row_limit=40))
        text.write("\n")
        if device.type == "cuda":
            # The kernels' own time against the step's (the bench table): a step whose kernels take
            # far less than it is paced by the host, and the table shows which kernels dominate.
            busy = device_ms_per_step(table, steps)
            text.write(f"=== {name}: torch.profiler, sorted by self device time; kernels {busy:.2f} ms a step ===\n")
            text.write(table.table(sort_by="self_device_time_total", row_limit=40))
            text.write("\n")
        pr = cProfile.Profile()
        _sync(device)
        pr.enable()
        for _ in range(steps):
            runner.step(next(stream))
        _sync(device)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        text.write(f"=== {name}: cProfile, {steps} steps, sorted by own time ===\n{s.getvalue()}\n")
        if isinstance(runner, EngineRunner):
            runner.drop_rows()
    extra: list[dict[str, Any]] = []
    if "bare" in ops:
        e, b = ops["engine"], ops["bare"]
        for key in set(e) | set(b):
            (ec, et), (bc, bt) = e.get(key, (0.0, 0.0)), b.get(key, (0.0, 0.0))
            if ec != bc:
                extra.append({"op": key, "engine_calls": ec, "bare_calls": bc,
                              "engine_self_us": et, "bare_self_us": bt, "extra_us": et - bt})
        extra.sort(key=lambda r: -r["extra_us"])
        text.write("=== ops called a different number of times per step (engine - bare) ===\n")
        for r in extra:
            text.write(f"{r['op']:<45} calls {r['engine_calls']:>7.1f} vs {r['bare_calls']:>7.1f}  "
                       f"self {r['engine_self_us']:>9.1f} us vs {r['bare_self_us']:>9.1f} us\n")
    path = out / "profiles" / f"profile-{_slug(cell.key)}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue())
    return {"file": str(path.relative_to(out)), "ops_engine_only_or_more": extra[:25]}


# ------------------------------------------------------------------------------------ variants and ratios


def variants_for(cfg: DictConfig, paths: list[str], compile_mode: str, telemetry: bool) -> list[Variant]:
    """The base variant and one toggle per fast path (and telemetry), each relative to ``cfg``."""
    out = [Variant("base")]
    cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
    for path in paths:
        if path == "channels_last":
            on = not cfg.trainer.channels_last
            out.append(Variant("channels_last", [f"trainer.channels_last={str(on).lower()}"],
                               f"channels_last {'on' if on else 'off'}"))
        elif path == "compile":
            if cfg.trainer.compile:
                out.append(Variant("compile", ["trainer.compile=false"], "compile off"))
            else:
                out.append(Variant("compile", ["trainer.compile=true", f"trainer.compile_mode={compile_mode}"],
                                   f"compile {compile_mode}"))
        elif path == "optim":
            for impl in ("fused", "foreach"):
                if cfg.optim.impl != impl:
                    out.append(Variant(f"optim_{impl}", [f"optim.impl={impl}"], f"optim.impl={impl}"))
        elif path == "cudnn_benchmark" and cuda:  # cuDNN exists on CUDA only
            on = not cfg.trainer.cudnn_benchmark
            out.append(Variant("cudnn_benchmark", [f"trainer.cudnn_benchmark={str(on).lower()}"],
                               f"cudnn.benchmark {'on' if on else 'off'}"))
    if telemetry and TELEMETRY_KEY in cfg:
        # The label gets telemetry.every from the composed variant (see plan).
        out.append(Variant("telemetry", list(TELEMETRY_ON), "telemetry on (mean)", bare=False, stat="mean"))
        out.append(Variant("telemetry_every_step", list(TELEMETRY_EVERY_STEP), "telemetry on, every step (mean)",
                           bare=False, stat="mean"))
    return out


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Speedup over fp32 (and tf32, and amp_bf16: what FP8 and the emulated formats are measured
    against), memory relative to fp32, fast path on/off: by matching cells."""
    index = {(r["model"], r["precision"], r["batch_size"], r["variant"]): r for r in records if "error" not in r}

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    for r in records:
        if "error" in r:
            continue
        fp32 = index.get((r["model"], "fp32", r["batch_size"], r["variant"]))
        tf32 = index.get((r["model"], "tf32", r["batch_size"], r["variant"]))
        bf16 = index.get((r["model"], "amp_bf16", r["batch_size"], r["variant"]))
        base = index.get((r["model"], r["precision"], r["batch_size"], "base"))
        r["speedup_vs_fp32"] = ratio(fp32 and fp32["step_time_s"], r["step_time_s"])
        r["bare_speedup_vs_fp32"] = ratio(fp32 and fp32["bare_step_time_s"], r["bare_step_time_s"])
        on_cuda = torch.cuda.is_available() and r.get("peak_memory_bytes") is not None
        r["speedup_vs_tf32"] = ratio(tf32 and tf32["step_time_s"], r["step_time_s"]) if on_cuda else None
        r["speedup_vs_bf16"] = ratio(bf16 and bf16["step_time_s"], r["step_time_s"])
        r["memory_vs_fp32"] = ratio(r["peak_memory_bytes"], fp32 and fp32["peak_memory_bytes"])
        r["bare_memory_vs_fp32"] = ratio(r["bare_peak_memory_bytes"], fp32 and fp32["bare_peak_memory_bytes"])
        # Periodic work (telemetry) compares mean step times; everything else medians.
        key = "step_time_mean_s" if r.get("timing_stat") == "mean" else "step_time_s"
        toggled = r["variant"] != "base"
        r["speedup_vs_base"] = ratio(base and base[key], r[key]) if toggled else None
        r["bare_speedup_vs_base"] = ratio(base and base[f"bare_{key}"], r[f"bare_{key}"]) if toggled else None


METHOD = ("engine = Engine._train_step on the engine's own synthetic batches (a pool reused by both "
          "runners); bare = plain autocast + GradScaler (FP16 only) loop, same initial weights, layout, "
          "optimizer, schedule; windows interleaved engine/bare, median window; step time from CUDA events "
          "after synchronize (CUDA) or the CPU clock named above; both runners start each group of steps from "
          "one RNG state, so they stay on one trajectory; engine/bare > 1 is engine overhead (ratio of the "
          "medians; paired = median of each engine window over its neighbouring bare window; min = fastest "
          "window over fastest window, the least disturbed on a shared machine); spread = "
          "(max-min)/median of the windows, the noise to read ratios against; peak memory = resident + "
          "peak of one steady-state step + its batch (CUDA only); MFU = FlopCounterMode FLOPs per step / "
          "step time / dense datasheet peak of the compute dtype; loss diff = max relative difference of the "
          "first warm-up losses (engine vs bare, same seed)")

"""``mptrain-bench``: speed and memory of the engine, against a bare PyTorch loop, cell by cell.

    mptrain-bench --models resnet50,alexnet --precisions fp32,amp_bf16 --batch-sizes 32,64 \\
        --steps 20 --warmup 5 --image-size 64 --width-divisor 4 --out docs/benchmarks
    mptrain-bench --models resnet50 --precisions fp32,tf32,amp_fp16,amp_bf16,fp16_master \\
        --batch-sizes 256 --overrides trainer.channels_last=true --fast-paths --out docs/benchmarks
    mptrain-bench data --workers 0,1,2 --out docs/benchmarks   # the input pipeline alone: bench_data.py

A cell is one (model, precision, batch size, variant). A variant is the base config (the grid plus
``--overrides``) or the base with one fast path toggled (``--fast-paths``: channels_last, compile,
fused / foreach optimizer, cudnn.benchmark) or with the numerics telemetry on. For each cell, in one
process and on the same synthetic batches:

- the **engine**: a real ``Engine`` built from the composed Hydra config (in a temporary run
  directory, logger closed: no TensorBoard, console or checkpoint work), timed through
  ``Engine._train_step`` exactly as ``Engine.fit`` calls it;
- the **bare loop**: plain ``torch.autocast`` + ``torch.amp.GradScaler`` (enabled for FP16 only),
  written here, on a model built by ``mptrain.models.create_model`` and loaded with the engine's
  initial weights, with the same memory layout, optimizer (same param groups, lr, impl), schedule
  (the same function over plain Python values), gradient clipping and accumulation. fp16_master
  gets the textbook FP16-weights + FP32-masters loop; bf16_pure and fp8 have no bare loop.

Timing: warm-up steps (whose losses are the like-for-like check), then ``--steps`` timed steps per
runner in windows of ``--window`` steps, engine and bare windows interleaved so that drift and
other processes hit both alike. Both runners start every group of steps from the same RNG state
on the same batches, so they stay on one trajectory and do the same work. A window is bracketed by
CUDA events after a synchronize on CUDA; on CPU by ``perf_counter`` (``--clock wall``) or by the
process's CPU time (``--clock cpu``: for a machine shared with other jobs). The step time is the
median window's; ``overhead`` = engine / bare step time.

Peak memory (CUDA only) is each runner's resident memory plus the peak of one extra steady-state
step over it (``reset_peak_memory_stats`` / ``max_memory_allocated``) plus one step's batches, so
the two runners living side by side do not count against each other. MFU: FLOPs of one training
step counted by ``torch.utils.flop_counter.FlopCounterMode`` (matmuls and convolutions, forward
and backward) over the datasheet dense peak of the cell's compute dtype (``PEAK_TFLOPS``) or
``--peak-tflops``; null on CPU unless that is given. ``--profile N`` writes torch.profiler and
cProfile tables of N steps of each runner, and the ops the engine calls that the bare loop does not.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import math
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import cycle
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from mptrain.bench_common import device_name, stamp
from mptrain.bench_common import slug as _slug
from mptrain.errors import MptrainError

if TYPE_CHECKING:
    from mptrain.engine import Engine

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

# Precisions the bare loop can express with plain torch (autocast, or FP16 storage + FP32 masters).
_BARE_UNSUPPORTED = {"bf16_pure": "pure-bf16 storage with stochastic rounding has no plain-torch loop",
                     "fp8": "FP8 layers have no plain-torch loop"}

Batch = Any
Micro = list[Batch]


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
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


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
    if precision.fp8 == "emulated":
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


# ------------------------------------------------------------------------------------ runners


class Runner:
    """One way of training: ``step(micro)`` does one optimizer step and returns a device tensor
    whose first element is the first objective's loss (no host sync)."""

    name: str

    def step(self, micro: Micro) -> Tensor:
        raise NotImplementedError

    def train(self) -> None:
        """Put every module in train mode (the engine's fit does it before its loop)."""


class EngineRunner(Runner):
    """The real engine path: ``Engine._train_step`` with the step counter advanced as ``fit`` does.

    The per-step rows stay on the device until the end of the window, as in ``fit``'s buffer;
    reading them (the logging step) is outside the timed region.
    """

    name = "engine"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.rows: list[list[Tensor]] = []

    def step(self, micro: Micro) -> Tensor:
        rows = self.engine._train_step(micro)
        self.engine.step += 1
        self.rows.append(rows)
        return rows[0]  # [loss, scale, overflow, ...]: indexed only outside the timed region

    def train(self) -> None:
        for slot in self.engine.slots:
            slot.module.train()

    def drop_rows(self) -> None:
        self.rows.clear()


class BareRunner(Runner):
    """A plain PyTorch loop: autocast + GradScaler (FP16 only), and nothing else.

    ``objectives``: one ``(module, loss_fn)`` per objective, ``loss_fn(batch) -> loss`` run under
    autocast; each has its own optimizer, schedule and GradScaler, like the engine's slots.
    fp16_master keeps FP16 weights (norm layers FP32) and an FP32 master copy that the optimizer
    updates: the paper's recipe in a dozen plain lines.
    """

    name = "bare"

    def __init__(self, cfg: DictConfig, device: torch.device, precision: Any,
                 objectives: list[tuple[nn.Module, Callable[[Batch], Tensor]]], total_steps: int,
                 steps_per_epoch: int) -> None:
        from mptrain.optim import build_optimizer, lr_factor, param_groups

        self.device = device
        self.autocast_dtype = precision.autocast_dtype
        half_storage = precision.param_dtype == torch.float16
        fp16 = self.autocast_dtype == torch.float16 or half_storage
        self.grad_clip = cfg.trainer.grad_clip
        self.objectives = []
        for module, loss_fn in objectives:
            groups = param_groups(module, cfg.optim.weight_decay, cfg.optim.no_decay_bn_bias)
            pairs: list[tuple[Tensor, Tensor]] = []
            if half_storage:  # the optimizer owns FP32 masters of the FP16 weights
                swap = {}
                for g in groups:
                    for p in g["params"]:
                        if p.dtype == torch.float16:
                            m = p.detach().float().requires_grad_()
                            swap[id(p)] = m
                            pairs.append((p, m))
                groups = [{**g, "params": [swap.get(id(p), p) for p in g["params"]]} for g in groups]
            # The engine's optimizer builder (same class, groups, lr and impl: the comparison is of
            # the loop, not the optimizer) and the same schedule, but over plain Python values:
            # a DictConfig read per step is mptrain's cost, not plain PyTorch's.
            opt = build_optimizer(cfg.optim, groups, device)
            plain = SimpleNamespace(**OmegaConf.to_container(cfg.sched, resolve=True))
            factor = lr_factor(plain, total_steps, steps_per_epoch)  # type: ignore[arg-type]  # reads attributes
            sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
            scaler = torch.amp.GradScaler(device.type, enabled=fp16)
            self.objectives.append((module, loss_fn, opt, sched, scaler, pairs))

    last: Tensor | None = None

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        # fp32: no autocast context at all, as a hand-written FP32 loop has none.
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def step(self, micro: Micro) -> Tensor:
        first: Tensor | None = None
        accum = len(micro)
        for _module, loss_fn, opt, sched, scaler, pairs in self.objectives:
            opt.zero_grad(set_to_none=True)
            total: Tensor | None = None
            for batch in micro:
                with self._autocast():
                    loss = loss_fn(batch)
                if accum == 1:
                    scaler.scale(loss).backward()
                    total = loss.detach()
                else:
                    scaler.scale(loss / accum).backward()
                    total = loss.detach() / accum + (0.0 if total is None else total)
            if first is None:
                first = total
            if pairs:
                with torch.no_grad():
                    for p, m in pairs:
                        m.grad, p.grad = p.grad.float(), None
            if self.grad_clip:
                scaler.unscale_(opt)
                params = [p for g in opt.param_groups for p in g["params"]]
                torch.nn.utils.clip_grad_norm_(params, self.grad_clip, foreach=True)
            scaler.step(opt)
            scaler.update()
            if pairs:
                with torch.no_grad():
                    for p, m in pairs:
                        p.copy_(m)
            sched.step()  # torch's "scheduler before optimizer" warning is filtered once, in run()
        assert first is not None
        self.last = first
        return first

    def train(self) -> None:
        for module, *_ in self.objectives:
            module.train()


def _cast_half_storage(module: nn.Module) -> nn.Module:
    """fp16_master storage: FP16 weights, norm layers kept FP32 (their statistics need the range)."""
    module.half()
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm | nn.GroupNorm | nn.LayerNorm):
            m.float()
    return module


def build_bare(engine: Engine, init_state: dict[str, dict[str, Tensor]], cfg: DictConfig) -> BareRunner:
    """The bare loop for ``engine``'s run, starting from the engine's initial weights."""
    from mptrain.models import create_model

    device, precision = engine.device, engine.precision
    fp32 = precision.param_dtype == torch.float32
    channels_last = bool(cfg.trainer.channels_last)
    objectives: list[tuple[nn.Module, Callable[[Batch], Tensor]]] = []
    if cfg.model.get("task", "classification") == "classification":
        model = create_model(cfg.model, engine.task.num_classes).to(device)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        if not fp32:
            _cast_half_storage(model)
        model.load_state_dict(init_state["model"])
        aux_weight = float(cfg.model.get("aux_weight", 0.0))
        half = None if fp32 else precision.param_dtype

        def loss_fn(batch: Batch, model: nn.Module = model) -> Tensor:
            images, labels = batch
            out = model(images if half is None else images.to(half))
            if isinstance(out, tuple):  # GoogLeNet / Inception v3 auxiliary heads in train mode
                logits, *aux = (o for o in out if o is not None)
                return F.cross_entropy(logits.float(), labels) + aux_weight * sum(
                    F.cross_entropy(a.float(), labels) for a in aux)
            return F.cross_entropy(out.float(), labels)

        modules = {"model": model}
        objectives.append((model, loss_fn))
    else:
        # Other families (LM, GAN): a second task instance supplies fresh modules and the
        # family's forward + loss; the loop around it stays bare.
        from mptrain.tasks import build_task

        task = build_task(cfg, device, precision, engine.image_size)
        modules = task.modules
        for name, module in modules.items():
            if channels_last:
                module.to(memory_format=torch.channels_last)
            if not fp32:
                _cast_half_storage(module)
            module.load_state_dict(init_state[name])
        for obj in engine.task.objectives:
            objectives.append((modules[obj.module], lambda b, obj=obj, task=task: task.loss(obj, b)[0]))
    if cfg.trainer.compile:
        mode = None if cfg.trainer.compile_mode == "default" else cfg.trainer.compile_mode
        for module in modules.values():
            module.compile(mode=mode)
    return BareRunner(cfg, device, precision, objectives, engine.total_steps, engine.steps_per_epoch)


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
    """FLOPs of one training step (forward + backward), as FlopCounterMode counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
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


# ------------------------------------------------------------------------------------ grid


def parse_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


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


# Precision names the harness accepts beyond the config group's: a mode with a non-default option,
# so one grid can hold both FP8 backends.
PRECISION_ALIASES = {
    "fp8_torchao": ["precision=fp8", "precision.backend=torchao", "precision.recipe=tensorwise"],
    "fp8_torchao_rowwise": ["precision=fp8", "precision.backend=torchao", "precision.recipe=rowwise"],
}


def base_overrides(model: str, precision: str, batch: int, args: argparse.Namespace) -> list[str]:
    chosen = PRECISION_ALIASES.get(precision, [f"precision={precision}"])
    out = [f"model={model}", *chosen, f"data.batch_size={batch}"]
    if args.device != "auto":
        out.append(f"trainer.device={args.device}")
    return out


def plan(args: argparse.Namespace) -> tuple[list[tuple[Cell, DictConfig]], list[dict[str, str]], bool]:
    """Compose and validate every cell's config before any is run.

    Returns (cells, skipped models with the reason, whether the telemetry key exists).
    """
    from mptrain.cli import compose
    from mptrain.config import register_configs, validate
    from mptrain.models import list_models

    register_configs()
    registered = list_models()
    models = registered if args.models == "all" else parse_list(args.models)
    skipped: list[dict[str, str]] = []
    cells: list[tuple[Cell, DictConfig]] = []
    telemetry_exists = False
    paths = [] if args.fast_paths is None else (
        list(FAST_PATHS) if args.fast_paths == "all" else parse_list(args.fast_paths))
    for p in paths:
        if p not in FAST_PATHS:
            raise MptrainError(f"--fast-paths {p}: unknown; choose from {', '.join(FAST_PATHS)}")
    total = args.warmup + args.steps + 8 + args.profile * 2  # every step either runner takes
    for model in models:
        if model not in registered:
            skipped.append({"model": model, "reason": "not registered in mptrain.models"})
            continue
        try:
            probe = compose([f"model={model}", *args.overrides])
        except MptrainError as exc:
            skipped.append({"model": model, "reason": str(exc)})
            continue
        telemetry_exists = telemetry_exists or TELEMETRY_KEY in probe
        task = probe.model.get("task", "classification")
        for precision in parse_list(args.precisions):
            for batch in [int(b) for b in parse_list(args.batch_sizes)]:
                extra = base_overrides(model, precision, batch, args)
                if task == "classification":
                    if args.image_size:
                        extra.append(f"data.image_size={args.image_size}")
                    if args.width_divisor:
                        extra.append(f"model.width_divisor={args.width_divisor}")
                    accum = int(probe.trainer.grad_accum)
                    extra.append(f"data.train_samples={max(1280, batch * accum * args.pool)}")
                extra += [f"trainer.max_steps={total}", *args.overrides]
                cfg = compose(extra)
                validate(cfg)
                for v in variants_for(cfg, paths, args.compile_mode, args.telemetry):
                    overrides = extra + v.overrides
                    vcfg = cfg if not v.overrides else compose(overrides)
                    validate(vcfg)
                    if v.name == "telemetry":
                        v.setting = f"telemetry on, every {vcfg.telemetry.every} steps (mean)"
                    cells.append((Cell(model, precision, batch, v, overrides), vcfg))
    return cells, skipped, telemetry_exists


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Speedup over fp32 (and tf32), memory relative to fp32, fast path on/off: by matching cells."""
    index = {(r["model"], r["precision"], r["batch_size"], r["variant"]): r for r in records if "error" not in r}

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    for r in records:
        if "error" in r:
            continue
        fp32 = index.get((r["model"], "fp32", r["batch_size"], r["variant"]))
        tf32 = index.get((r["model"], "tf32", r["batch_size"], r["variant"]))
        base = index.get((r["model"], r["precision"], r["batch_size"], "base"))
        r["speedup_vs_fp32"] = ratio(fp32 and fp32["step_time_s"], r["step_time_s"])
        r["bare_speedup_vs_fp32"] = ratio(fp32 and fp32["bare_step_time_s"], r["bare_step_time_s"])
        on_cuda = torch.cuda.is_available() and r.get("peak_memory_bytes") is not None
        r["speedup_vs_tf32"] = ratio(tf32 and tf32["step_time_s"], r["step_time_s"]) if on_cuda else None
        r["memory_vs_fp32"] = ratio(r["peak_memory_bytes"], fp32 and fp32["peak_memory_bytes"])
        r["bare_memory_vs_fp32"] = ratio(r["bare_peak_memory_bytes"], fp32 and fp32["bare_peak_memory_bytes"])
        # Periodic work (telemetry) compares mean step times; everything else medians.
        key = "step_time_mean_s" if r.get("timing_stat") == "mean" else "step_time_s"
        toggled = r["variant"] != "base"
        r["speedup_vs_base"] = ratio(base and base[key], r[key]) if toggled else None
        r["bare_speedup_vs_base"] = ratio(base and base[f"bare_{key}"], r[f"bare_{key}"]) if toggled else None


# ------------------------------------------------------------------------------------ output


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:,.1f}"


def _x(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}x"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"


def _mib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:,.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _diff(v: float | None) -> str:
    return "-" if v is None else f"{v:.1e}"


def tables(result: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The report's tables as (title, header, rows): rendered by rich and as markdown."""
    recs = [r for r in result["cells"] if "error" not in r]
    cuda = result["meta"]["device"] == "cuda"
    main_header = ["model", "precision", "batch", "variant", "step ms", "per s", "bare step ms", "bare per s",
                   "engine/bare", "paired", "min", "spread", "vs fp32"] + (["vs tf32"] if cuda else []) + [
        "peak MiB", "bare MiB", "mem vs fp32", "MFU", "bare MFU", "GFLOP/step", "<16-bit FLOPs", "loss diff"]
    rows = []
    for r in recs:
        spread = max(v for v in (r["spread"], r["bare_spread"]) if v is not None) if r["spread"] is not None else None
        rows.append([r["model"], r["precision"] + ("" if r["precision_resolved"] == r["precision"]
                                                   else f" ({r['precision_resolved']})"),
                     str(r["batch_size"]), r["variant"] + (" (diverged)" if r.get("diverged") else ""),
                     _ms(r["step_time_s"]),
                     _num(r["throughput"]), _ms(r["bare_step_time_s"]), _num(r["bare_throughput"]),
                     _x(r["overhead"], 3), _x(r["overhead_paired"], 3), _x(r.get("overhead_min"), 3), _pct(spread),
                     _x(r["speedup_vs_fp32"])]
                    + ([_x(r["speedup_vs_tf32"])] if cuda else [])
                    + [_mib(r["peak_memory_bytes"]), _mib(r["bare_peak_memory_bytes"]), _x(r["memory_vs_fp32"]),
                       _pct(r["mfu"]), _pct(r["bare_mfu"]),
                       "-" if not r["flops_per_step"] else f"{r['flops_per_step'] / 1e9:,.1f}",
                       _pct(r.get("low_precision_flop_fraction")), _diff(r["loss_max_rel_diff"])])
    out = [("engine vs bare loop: median of timed windows; per s = samples/s (tokens/s for a language model)",
            main_header, rows)]

    base = [r for r in recs if r["variant"] == "base"]
    batches = sorted({r["batch_size"] for r in base})
    if len(batches) > 1:
        groups: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
        for r in base:
            groups.setdefault((r["model"], r["precision"]), {})[r["batch_size"]] = r
        brows = []
        for (model, prec), by_batch in groups.items():
            brows.append([model, prec] + [
                "-" if b not in by_batch else
                f"{_num(by_batch[b]['throughput'])} ({_num(by_batch[b]['bare_throughput'])})" for b in batches])
        out.append(("throughput vs batch size: engine (bare), units/s", ["model", "precision"]
                    + [f"b={b}" for b in batches], brows))

    fast = [r for r in recs if r["variant"] != "base"]
    if fast:
        frows = []
        index = {(r["model"], r["precision"], r["batch_size"]): r for r in base}
        for r in fast:
            b = index.get((r["model"], r["precision"], r["batch_size"]))
            key = "step_time_mean_s" if r.get("timing_stat") == "mean" else "step_time_s"
            frows.append([r["model"], r["precision"], str(r["batch_size"]), r["setting"],
                          _ms(b and b[key]), _ms(r[key]), _x(r["speedup_vs_base"]),
                          _ms(b and b[f"bare_{key}"]), _ms(r[f"bare_{key}"]),
                          _x(r["bare_speedup_vs_base"]), _mib(r["peak_memory_bytes"])])
        out.append(("fast paths and telemetry: toggled vs base (speedup > 1: the toggle is faster; "
                    "ms are medians, or means where marked)",
                    ["model", "precision", "batch", "toggle", "base ms", "toggled ms", "speedup",
                     "bare base ms", "bare toggled ms", "bare speedup", "peak MiB"], frows))
    errors = [r for r in result["cells"] if "error" in r]
    if errors or result["skipped"]:
        erows = [[r["model"], r.get("precision", "-"), str(r.get("batch_size", "-")), r.get("variant", "-"),
                  r["error"]] for r in errors]
        erows += [[s["model"], "-", "-", "-", f"skipped: {s['reason']}"] for s in result["skipped"]]
        out.append(("not measured", ["model", "precision", "batch", "variant", "why"], erows))
    return out


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(200, Console().width))
    meta = result["meta"]
    console.print(f"[bold]mptrain-bench[/bold] {meta['device_name']} ({meta['device']}) | torch "
                  f"{meta['versions']['torch']} | cuda {meta['versions']['cuda']} | {meta['date']} | "
                  f"threads {meta['torch_threads']} | clock {meta['clock']}")
    for title, header, rows in tables(result):
        table = Table(title=title, title_justify="left")
        for h in header:
            table.add_column(h, justify="left" if h in ("model", "precision", "variant", "toggle", "why") else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    if meta.get("telemetry"):
        console.print(f"telemetry: {meta['telemetry']}")


def _loads(v: list[float] | None) -> str:
    return "-" if not v else " / ".join(f"{x:.2f}" for x in v)


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    v = meta["versions"]
    lines = [
        f"# mptrain-bench: {meta['device_name']}",
        "",
        *([] if meta.get("complete", True) else ["**Partial: the run stopped before every cell was measured.**", ""]),
        f"- device: {meta['device']} ({meta['device_name']})"
        + (f", capability {meta['cuda_capability']}" if meta.get("cuda_capability") else ""),
        f"- versions: mptrain {v['mptrain']}, torch {v['torch']}, torchvision {v['torchvision']}, "
        f"CUDA {v['cuda']}, cuDNN {v['cudnn']}, Python {v['python']}",
        f"- date: {meta['date']}; torch threads {meta['torch_threads']} of {meta['cpu_count']} CPUs; "
        f"load average (1/5/15 min) at start {_loads(meta.get('load_average_start'))}, "
        f"at end {_loads(meta.get('load_average_end'))}",
        f"- command: `{meta['command']}`",
        f"- clock: {meta['clock']}",
        f"- method: {meta['method']}",
    ]
    if meta.get("telemetry"):
        lines.append(f"- telemetry: {meta['telemetry']}")
    if result.get("notes"):
        lines += ["", *result["notes"]]
    for title, header, rows in tables(result):
        lines += ["", f"## {title}", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


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


# ------------------------------------------------------------------------------------ entry


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mptrain-bench",
        description="Throughput, step time, peak memory and MFU of mptrain's engine against a bare "
                    "PyTorch loop, over a grid of models x precisions x batch sizes (synthetic data).")
    p.add_argument("--models", default="resnet50", help="comma list of model names, or 'all' (default resnet50)")
    p.add_argument("--precisions", default=None,
                   help="comma list (default: fp32,amp_bf16 on CPU; fp32,tf32,amp_fp16,amp_bf16,fp16_master on CUDA)")
    p.add_argument("--batch-sizes", default=None, help="comma list (default: 32 on CPU, 256 on CUDA)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per runner (default 20)")
    p.add_argument("--window", type=int, default=5, help="steps per timed window (default 5)")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps per runner (default 5, >= 1)")
    p.add_argument("--pool", type=int, default=4, help="distinct synthetic batches cycled through (default 4)")
    p.add_argument("--image-size", type=int, default=None, help="data.image_size (default: the model's for the device)")
    p.add_argument("--width-divisor", type=int, default=None, help="model.width_divisor (CNNs)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="CPU timing: wall (perf_counter) or cpu (process CPU time: for a machine shared "
                        "with other jobs; with --threads 1 it is the step's own work). CUDA always uses events")
    p.add_argument("--overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="extra mptrain overrides applied to every cell, e.g. trainer.channels_last=true")
    p.add_argument("--fast-paths", nargs="?", const="all", default=None, metavar="LIST",
                   help=f"also measure each fast path toggled ({', '.join(FAST_PATHS)}; default all)")
    p.add_argument("--compile-mode", default="default", choices=("default", "reduce-overhead", "max-autotune"),
                   help="trainer.compile_mode for the compile fast path")
    p.add_argument("--telemetry", action="store_true",
                   help=f"also measure with {' '.join(TELEMETRY_ON)} (when the config has '{TELEMETRY_KEY}')")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: table; CPU: none)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="profile STEPS steps of each runner per cell (torch.profiler + cProfile) into --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-process-warmup", action="store_true",
                   help="skip the throwaway run of the first cell before the measured ones")
    p.add_argument("--out", type=Path, default=None, help="write <device>-<date>.json and .md here")
    p.add_argument("--name", default=None, help="file stem for --out (default <device>-<date>)")
    return p


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Measure the grid; returns the result dict (also written under ``args.out``)."""
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with warnings.catch_warnings():
            # A skipped first FP16 step makes torch warn that the scheduler stepped first; filtered
            # once for the whole run, so the bare loop pays for no warnings context per step.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            return _run(args, argv)
    finally:
        torch.set_num_threads(threads)  # callers in the same process (tests) keep their setting


def _run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    if args.precisions is None:
        args.precisions = "fp32,tf32,amp_fp16,amp_bf16,fp16_master" if cuda else "fp32,amp_bf16"
    if args.batch_sizes is None:
        args.batch_sizes = "256" if cuda else "32"
    for name in ("steps", "window", "warmup", "pool"):
        if getattr(args, name) < 1:
            raise MptrainError(f"--{name}={getattr(args, name)}: must be >= 1")
    if args.window > args.steps:
        args.window = args.steps
    cells, skipped, telemetry_exists = plan(args)
    meta = stamp(device, argv, torch.get_num_threads())
    meta["method"] = METHOD
    meta["options"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    if args.telemetry:
        meta["telemetry"] = ("measured on/off: variants 'telemetry' (its default every) and 'telemetry_every_step' "
                             "(every=1: the cost of one captured step), by mean step time" if telemetry_exists else
                             f"not measured: the config has no '{TELEMETRY_KEY}' key yet "
                             f"(hook: mptrain.bench.TELEMETRY_KEY / TELEMETRY_ON)")
    if cuda and args.clock == "cpu":
        raise MptrainError("--clock cpu: CUDA work is timed with device events; use --clock wall")
    meta["clock"] = "cuda events" if cuda else {"wall": "wall (perf_counter)", "cpu": "process CPU time"}[args.clock]
    opts = Options(steps=args.steps, window=args.window, warmup=args.warmup, pool=args.pool, seed=args.seed,
                   peak_tflops=args.peak_tflops, profile=args.profile, out=args.out, clock=args.clock)
    records: list[dict[str, Any]] = []
    flops_cache: dict[str, int | None] = {}
    result: dict[str, Any] = {"meta": meta, "cells": records, "skipped": skipped}
    stem = args.name or "-".join([_slug("cpu" if device.type == "cpu" else device_name(device).replace("NVIDIA", "")),
                                  meta["date"][:10]])
    if cells and not args.no_process_warmup:
        # A throwaway run of the first cell: the first cell a process measures on CPU showed a
        # transient (one runner 40% slower for dozens of steps, then the other: allocator and page
        # placement settling) that later cells never showed.
        print(f"[0/{len(cells)}] process warm-up (discarded): {cells[0][0].key}", file=sys.stderr, flush=True)
        warm_opts = Options(steps=2 * opts.window, window=opts.window, warmup=opts.warmup, pool=opts.pool,
                            seed=opts.seed, clock=opts.clock)
        with contextlib.suppress(MptrainError, RuntimeError, torch.cuda.OutOfMemoryError):
            run_cell(cells[0][0], cells[0][1], warm_opts, {})
    for i, (cell, cfg) in enumerate(cells, 1):
        print(f"[{i}/{len(cells)}] {cell.key}", file=sys.stderr, flush=True)
        try:
            rec = run_cell(cell, cfg, opts, flops_cache)
        except (MptrainError, RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            rec = {"model": cell.model, "precision": cell.precision, "batch_size": cell.batch_size,
                   "variant": cell.variant.name, "overrides": cell.overrides,
                   "error": f"{type(exc).__name__}: {first[:300]}"}
            _release(device)
        records.append(rec)
        print(f"    {_one_line(rec)}", file=sys.stderr, flush=True)
        add_ratios(records)
        meta["complete"] = i == len(cells)
        if hasattr(os, "getloadavg"):
            meta["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
        if args.out is not None:  # after every cell: a run cut short (a time limit) keeps what it measured
            result["files"] = write_result(result, args.out, stem)
    if not cells:
        meta["complete"] = True
        if args.out is not None:
            result["files"] = write_result(result, args.out, stem)
    return result


def _one_line(rec: dict[str, Any]) -> str:
    if "error" in rec:
        return rec["error"]
    return (f"engine {_ms(rec['step_time_s'])} ms, bare {_ms(rec['bare_step_time_s'])} ms, "
            f"engine/bare {_x(rec['overhead'], 3)}, {_num(rec['throughput'])} {rec['unit']}/s"
            + (f", peak {_mib(rec['peak_memory_bytes'])} MiB" if rec["peak_memory_bytes"] is not None else ""))


def write_result(result: dict[str, Any], out: Path, stem: str) -> list[str]:
    """Write ``<stem>.json`` and ``<stem>.md`` (atomically: a reader never sees half a file)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    texts = [json.dumps({k: v for k, v in result.items() if k != "files"}, indent=2, default=str) + "\n",
             markdown(result)]
    for path, text in zip(paths, texts, strict=True):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return [str(p) for p in paths]


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``mptrain-bench``. Exit status 2 on bad input, with one line on stderr."""
    args_list = sys.argv[1:] if argv is None else list(argv)
    if args_list[:1] == ["data"]:  # the input pipeline alone: its own module
        from mptrain import bench_data

        return bench_data.main(args_list[1:])
    args = build_parser().parse_args(args_list)
    try:
        result = run(args, args_list)
    except MptrainError as exc:
        print(f"mptrain-bench: error: {exc}", file=sys.stderr)
        return 2
    print_tables(result)
    for path in result.get("files", []):
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

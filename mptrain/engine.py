"""The one training loop. Every model family and every precision mode runs through ``Engine.fit``.

One optimizer step, for each objective of the task (one for a classifier, two for a GAN)::

    zero grads
    for each micro-batch:                           # trainer.grad_accum
        with precision.autocast(): loss = task.loss(...)
        scaler.scale(loss / accum).backward()
    master.before_unscale()                         # FP16/bf16 weights: grads to the FP32 masters
    scaler.unscale_(optimizer)                      # true gradients from here on...
    clip_grad_norm_(...)                            # ...so clipping sees real norms
    scaler.step(optimizer); scaler.update()         # skipped on Inf/NaN; the policy's state machine
    master.after_step(); precision.after_step()     # masters back into the model's storage dtype
    scheduler.step()

The hot path never waits for the device: per-step values (loss, scale, overflow flag) stay on the
device and are read back once per logging window (``trainer.log_every``), where throughput is
measured over the whole window.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import logging
import os
import platform
import random
import signal
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from mptrain import __version__, checkpoint, cudagraphs, distributed, sharded_checkpoint
from mptrain.errors import DivergedError, MptrainError
from mptrain.logger import RunLogger
from mptrain.memory import PeakMemory, host_memory
from mptrain.models.vision import image_size_for
from mptrain.numerics import compiled_calls, fused, rounding_rng
from mptrain.numerics.loss_scaling import LossScaler
from mptrain.numerics.plan import PrecisionPlan, build_plan
from mptrain.numerics.precision import MasterWeights, Precision, build_precision
from mptrain.numerics.scalers import build_scaler, resolve_policy
from mptrain.numerics.telemetry import GradientTelemetry, build_telemetry
from mptrain.optim import build_optimizer, build_scheduler, param_groups
from mptrain.parallel import Fsdp2, parallel_record, reshard, state_bytes
from mptrain.tasks import Objective, Task, build_task

log = logging.getLogger("mptrain")

# A run whose steps spend more than this fraction of their time waiting for batches is input-bound.
DATA_WAIT_WARN = 0.10


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``trainer.device``: auto (CUDA when available), cpu or cuda (this rank's GPU)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise MptrainError("trainer.device=cuda: no CUDA device is available (use auto or cpu)")
    return torch.device("cuda", distributed.cuda_index(local_rank)) if name == "cuda" else torch.device("cpu")


class Interrupted(Exception):
    """A stop signal (SIGTERM/SIGUSR1/SIGUSR2) arrived; a checkpoint was written at this step."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"stopped by signal {signum} at step {step}")
        self.signum, self.step = signum, step


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel wrapper (checkpoints hold unwrapped names)."""
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    rounding_rng.seed_rounding(seed)  # stochastic rounding draws from its own stream


def set_deterministic(on: bool) -> None:
    """``trainer.deterministic``: kernels that give the same bits on every run (cuDNN's default
    weight-gradient convolutions, for one, accumulate with atomics). torch flags some ops that
    are in fact deterministic for common shapes (global average pooling's backward), so an op with
    no deterministic kernel warns rather than stops the run. Set by every run, off too, because it
    is a process-wide torch flag."""
    if on:
        # cuBLAS needs a fixed workspace split to be deterministic (CUDA >= 10.2); read at its start.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on, warn_only=True)
    torch.backends.cudnn.deterministic = on


@dataclass
class Slot:
    """Everything one objective owns: its module, optimizer, schedule, loss scaler, masters."""

    objective: Objective
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: LossScaler
    master: MasterWeights | None
    extra_names: list[str] = field(default_factory=list)  # task metrics logged beside the loss
    telemetry: GradientTelemetry | None = None  # telemetry=gradients

    @functools.cached_property
    def params(self) -> list[Tensor]:
        """What the optimizer updates (masters included); fixed for the run, so built once."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]


class Engine:
    """Builds a run from the composed config and trains it. Reads every config group."""

    def __init__(self, cfg: DictConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        t = cfg.trainer
        wanted = resolve_device(t.device)
        self.dist = distributed.init(wanted.type)
        self.device = resolve_device(t.device, self.dist.local_rank)
        if not self.dist.is_main:
            logging.getLogger().setLevel(logging.WARNING)  # one voice per job: rank 0's
        # Every rank starts from the same weights (same seed); data shards differ by rank.
        seed_everything(t.seed)
        set_deterministic(t.deterministic)
        if self.device.type == "cuda":
            # Autotuning picks the fastest kernel per shape, which may differ between runs.
            torch.backends.cudnn.benchmark = t.cudnn_benchmark and not t.deterministic

        # Before the loaders' workers fork: they inherit the setting. Process-wide, never undone.
        self.host_memory = host_memory(t.keep_host_memory)
        log.info("host memory: %s", self.host_memory)
        self.compile_start = fused.compile_seconds()  # compile time is reported apart from throughput
        self.cudagraph_mark = cudagraphs.watch()
        self.peak = PeakMemory(self.device)
        self.precision: Precision = build_precision(cfg.precision, self.device)
        self.precision.configure_backends()
        # parallel=fsdp2: the mesh and how this precision maps onto FSDP2 (mptrain.parallel).
        self.sharding = Fsdp2(cfg.parallel, self.device, self.dist, self.precision) \
            if cfg.parallel.name == "fsdp2" else None
        self.policy = resolve_policy(cfg.loss_scale.name, self.precision.resolved, self.precision.fp8)
        if self.precision.note:
            log.info("precision: %s", self.precision.note)
        if self.precision.emulated:
            log.info("quantizers: %s", fused.status(self.device))

        image_size = None
        if cfg.model.get("task", "classification") in ("classification", "gan") and cfg.data.name != "custom":
            image_size = cfg.data.image_size
            if image_size is None and cfg.model.get("route") in ("torchvision", "timm"):
                image_size = image_size_for(cfg.model, self.device.type)  # null sizes: the architecture's own
            elif image_size is None:
                image_size = cfg.model.image_size if self.device.type == "cuda" else cfg.model.cpu_image_size
        self.task: Task = build_task(cfg, self.device, self.precision, image_size)
        self.image_size = getattr(self.task, "image_size", image_size)  # data=custom: its items' size

        self.steps_per_epoch = self.task.steps_per_epoch() // t.grad_accum
        if self.steps_per_epoch < 1:
            raise MptrainError(
                f"trainer.grad_accum={t.grad_accum}: more micro-batches per step than the "
                f"{self.task.steps_per_epoch()} batches in an epoch"
            )
        self.total_steps = t.max_steps or t.epochs * self.steps_per_epoch
        self.grad_clip = t.grad_clip  # read every step: keep it out of the DictConfig
        if t.compile:
            # A fresh dynamo for this job's model: Hydra's basic launcher runs a sweep's jobs in one
            # process, each model running the last one's forward code, and dynamo's state from those
            # compiles would make this job's differing constants symbolic (automatic dynamic: NVFP4's
            # element max after MXFP8's failed to trace) and count its compiles against their limit.
            torch._dynamo.reset()
        self.slots = [self._build_slot(obj) for obj in self.task.objectives]
        self.precision.check_patterns()
        if cfg.telemetry.shadow and self.dist.enabled and cfg.telemetry.name != "off":
            raise MptrainError("telemetry.shadow=true: not supported under torchrun/DDP (run one plain process)")
        for slot in self.slots:
            slot.telemetry = build_telemetry(
                cfg.telemetry, unwrap(slot.module), self.precision, slot.scaler,
                modules=[unwrap(m) for m in self.task.modules.values()], tag=f"telemetry{self._suffix(slot)}",
            )

        # Taken before any step: equal digests say two runs of one seed start from the same weights
        # and the same global RNG stream (dropout), whatever their precision (issue 18).
        self.pairing = pairing_digests(self.task.modules.values())
        self.plan = self._precision_plan() if t.precision_plan else None

        self.step = 0
        self.skipped = torch.zeros((), device=self.device)
        self.nonfinite_run = torch.zeros((), device=self.device)
        self.metrics: dict[str, float] = {}
        self.resumed_from: Path | None = None
        resume = checkpoint.resolve_resume(t.resume, run_dir)
        if resume is not None:
            self._load(resume)
        self.logger = RunLogger(run_dir, self.total_steps, self.task.unit, start_step=self.step,
                                enabled=self.dist.is_main)
        self.guard: distributed.PreemptionGuard | None = None
        self.memory: list[dict[str, int]] | None = None  # every rank's state bytes, at the end of training

    # ---------------------------------------------------------------------------------- setup

    def _build_slot(self, objective: Objective) -> Slot:
        cfg = self.cfg
        module = self.precision.prepare_model(self.task.modules[objective.module], sharded=self.sharding is not None,
                                              compiled=cfg.trainer.compile)
        scaler = build_scaler(cfg.loss_scale, self.policy, self.device)
        module = scaler.attach(module)
        if cfg.trainer.compile:
            compiled_calls.remember_isa_checks()
            if self.device.type == "cpu":
                compiled_calls.pin_cpu_vector_isa()
            module.compile(**compiled_calls.model_compile_args(cfg.trainer.compile_mode, self.precision.emulated))
        if self.sharding is not None:
            # Each rank checks only its shards for Inf/NaN: the flag is all-reduced (max) so that all skip.
            module = self.sharding.shard(objective.module, module)
            scaler.reduce_found_inf = True
        elif self.dist.enabled:
            # Gradients are averaged across ranks inside backward, so every rank sees the same
            # Inf/NaN flags and makes the same skip and scale decision.
            ids = [self.device.index] if self.device.type == "cuda" else None
            module = nn.parallel.DistributedDataParallel(module, device_ids=ids)
        self.task.modules[objective.module] = module
        groups = param_groups(module, cfg.optim.weight_decay, cfg.optim.no_decay_bn_bias)
        # Under FSDP2 the FP32 shards are the master copy: no MasterWeights.
        groups, master = self.precision.master_weights(groups) if self.sharding is None else (groups, None)
        if master is not None:
            scaler.alias_params(master.model_params, master.masters)
        optimizer = build_optimizer(cfg.optim, groups, self.device)
        scheduler = build_scheduler(cfg.sched, optimizer, self.total_steps, self.steps_per_epoch)
        return Slot(objective, module, optimizer, scheduler, scaler, master)

    def _precision_plan(self) -> PrecisionPlan:
        """Per GEMM layer: its format, why, and its FLOPs, from one forward pass of a real batch
        (eval mode, RNG forked, the task's carried state restored: the run itself is unchanged)."""
        state = self.task.state_dict()

        def forward() -> None:
            batch = next(self.task.train_batches(0))
            with self.precision.autocast():
                self.task.loss(self.slots[0].objective, batch)

        try:
            return build_plan(self.task.modules, forward, self.precision.plan_default(),
                              uncovered=self.precision.fp8 is not None or self.precision.mx is not None)
        finally:
            self.task.load_state_dict(state)

    def _suffix(self, slot: Slot) -> str:
        return "" if len(self.slots) == 1 else f"_{slot.objective.name}"

    # ---------------------------------------------------------------------------------- train

    def _train_step(self, micro_batches: list[Any]) -> list[Tensor]:
        """One optimizer step per objective. Returns per-objective device rows for logging."""
        accum = len(micro_batches)
        rows = []
        finite: Tensor | None = None
        for slot in self.slots:
            slot.optimizer.zero_grad(set_to_none=True)
            loss_sum: Tensor | None = None
            extras: dict[str, Tensor] = {}
            # Telemetry (every telemetry.every steps) arms its hooks before the forward.
            tel = slot.telemetry
            watch = tel is not None and tel.active(self.step + 1)
            shadow_state = self.task.state_dict() if watch and tel.shadow_on else None
            for i, batch in enumerate(micro_batches):
                # DDP: all-reduce gradients once per step, on the last micro-batch only.
                sync = i == accum - 1 or not isinstance(slot.module, nn.parallel.DistributedDataParallel)
                with contextlib.nullcontext() if sync else slot.module.no_sync():
                    with self.precision.autocast():
                        loss, extras = self.task.loss(slot.objective, batch)
                    with tel.capture(self.step + 1) if watch else contextlib.nullcontext():
                        slot.scaler.scale(loss / accum if accum > 1 else loss).backward()
                loss_sum = loss.detach().float() if loss_sum is None else loss_sum + loss.detach().float()
            if watch:
                tel.record_weight_grads()  # as stored: the loss scale still applied
                if shadow_state is not None:
                    tel.shadow(functools.partial(self._shadow_loss, slot, micro_batches[0], shadow_state, accum))
            if slot.master is not None:
                slot.master.before_unscale()
            slot.scaler.unscale_(slot.optimizer)
            if self.grad_clip:
                torch.nn.utils.clip_grad_norm_(slot.params, self.grad_clip, foreach=True)
            slot.scaler.step(slot.optimizer)
            slot.scaler.update()
            if slot.master is not None:
                slot.master.after_step()
            if self.sharding is not None:
                self.sharding.after_step(slot.module)
            self.precision.after_step()
            slot.scheduler.step()
            loss_mean = loss_sum / accum if accum > 1 else loss_sum
            self.skipped += slot.scaler.found_inf
            finite = torch.isfinite(loss_mean) if finite is None else finite & torch.isfinite(loss_mean)
            # One small stack per step: it also snapshots the scale before the next in-place update.
            rows.append(torch.stack([loss_mean, slot.scaler.scale_value.float(), slot.scaler.found_inf,
                                     *(v.float() for v in extras.values())]))
            slot.extra_names = list(extras)
        # A step counts as non-finite when any objective's loss is (a GAN has two).
        self.nonfinite_run = torch.where(finite, torch.zeros_like(self.nonfinite_run), self.nonfinite_run + 1)
        return rows

    def _shadow_loss(self, slot: Slot, batch: Any, state: dict[str, Any], accum: int) -> Tensor:
        """The loss of the step's first micro-batch again, from the task state it started from
        (the LM's carried hidden state); telemetry runs it with FP32 in place of the precision."""
        after = self.task.state_dict()
        self.task.load_state_dict(state)
        try:
            with self.precision.autocast():
                return self.task.loss(slot.objective, batch)[0] / accum
        finally:
            self.task.load_state_dict(after)

    def fit(self) -> None:
        with warnings.catch_warnings(), _gc_paused(self.cfg.trainer.gc_every):
            # A skipped first step makes torch warn that the scheduler stepped before the
            # optimizer; the schedule is indexed by trainer step on purpose (see optim.py).
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self._fit()

    def _fit(self) -> None:
        t = self.cfg.trainer
        logger = self.logger
        windows: list[float] = []
        buffer: list[tuple[int, list[Tensor]]] = []
        t0, samples, window_steps = time.perf_counter(), 0, 0
        c0 = fused.compile_seconds()  # torch.compile's time inside a window is not training time
        # Host time spent in next(batches), per window: two perf_counter calls per step, no device sync.
        wait, self.data_wait_windows, warned = 0.0, [], False
        skipped_logged = float(self.skipped)
        for slot in self.slots:
            slot.module.train()
        cuda = self.device.type == "cuda"
        # Peak memory is this run's: a sweep's earlier jobs in this process must not count.
        self.peak.reset()
        first_step = self.step + 1
        while self.step < self.total_steps:
            epoch, in_epoch = divmod(self.step, self.steps_per_epoch)
            batches = self.task.train_batches(epoch, start=in_epoch * t.grad_accum)
            for _ in range(in_epoch, self.steps_per_epoch):
                w0 = time.perf_counter()
                micro = [next(batches) for _ in range(t.grad_accum)]
                wait += time.perf_counter() - w0
                samples += sum(self.task.batch_size(b) for b in micro)
                buffer.append((self.step + 1, self._train_step(micro)))
                self.step += 1
                if cuda and self.step == first_step and torch.backends.cudnn.benchmark:
                    # cuDNN autotuning tries algorithms with large workspaces on the first step only:
                    # a transient spike that is not the run's working set, so measure from here.
                    torch.cuda.synchronize(self.device)
                    self.peak.reset()
                window_steps += 1
                if t.gc_every and self.step % t.gc_every == 0:
                    gc.collect(1)  # at a step boundary, on every rank alike (see _gc_paused)
                end_of_epoch = self.step % self.steps_per_epoch == 0
                done = self.step >= self.total_steps

                log_step = self.step % t.log_every == 0 or done
                if log_step:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    compiling = fused.compile_seconds() - c0
                    elapsed = max(time.perf_counter() - t0 - compiling, 1e-9)
                    rate = samples * self.dist.world_size / elapsed  # global throughput
                    windows.append(rate)
                    self.data_wait_windows.append((wait / window_steps, wait / elapsed))
                    skipped_logged = self._flush(buffer, rate, elapsed / window_steps, skipped_logged, done)
                    warned = warned or self._warn_data_wait(len(windows))
                    buffer.clear()
                    t0, samples, window_steps = time.perf_counter(), 0, 0
                    c0, wait = fused.compile_seconds(), 0.0
                evaluate = (t.eval_every and self.step % t.eval_every == 0) or (
                    t.eval_every is None and end_of_epoch) or done
                checkpoint_now = bool(t.checkpoint_every and self.step % t.checkpoint_every == 0) or done
                if evaluate or checkpoint_now:
                    self.peak.end_train()
                if evaluate:
                    # FSDP2: gathered once, so that ranks with one validation batch more than others
                    # do not wait in an all-gather the others never join.
                    gather = self.sharding.gathered if self.sharding else lambda _: contextlib.nullcontext()
                    with gather(self.task.modules.values()):
                        self.metrics = self.task.evaluate(self.precision)
                    self.peak.end_eval()
                    logger.eval(self.step, self.metrics)
                if checkpoint_now:
                    self.save()
                    self.peak.reset()  # the checkpoint's host copies are neither training nor eval
                if evaluate or checkpoint_now:
                    # Keep eval and checkpoint time out of the throughput window.
                    t0, samples, window_steps = time.perf_counter(), 0, 0
                    c0, wait = fused.compile_seconds(), 0.0
                if self._stop_requested(log_step):
                    self.throughput_windows = windows
                    if not checkpoint_now:
                        self.peak.end_train()
                        self.save()
                    raise Interrupted(self.guard.signum or signal.SIGTERM, self.step)
                if done:
                    break
        self.throughput_windows = windows
        self.memory = distributed.all_gather_object(self.state_bytes())
        skips = cudagraphs.since(self.cudagraph_mark)
        if skips and self.dist.is_main:
            log.warning("CUDA graphs skipped %d time(s) (trainer.compile_mode=%s): its graphs ran as plain "
                        "kernel launches; first: %s", len(skips), t.compile_mode, skips[0])

    def _warn_data_wait(self, n_windows: int) -> bool:
        """One line when a window (past the warm-up ones: worker start-up) was input-bound; rank 0's
        view, like every other console line (warnings would otherwise come from every rank)."""
        per_step, fraction = self.data_wait_windows[-1]
        if not self.dist.is_main or n_windows <= self.cfg.trainer.warmup_windows or fraction <= DATA_WAIT_WARN:
            return False
        d = self.cfg.data
        hint = "a faster data source"  # the in-memory datasets have no workers to add
        if d.name in ("image_folder", "cifar10"):
            hint = f"more data.num_workers (now {d.num_workers})"
        if d.name == "image_folder" and d.get("decode") == "pil":
            hint += ", data.decode=cpu"
        if d.name == "image_folder" and d.get("decode") != "gpu" and self.device.type == "cuda":
            hint += ", data.decode=gpu"
        log.warning("input-bound: steps spent %.0f%% of their time waiting for data (%.1f ms/step) at step %d; "
                    "try %s", 100 * fraction, 1e3 * per_step, self.step, hint)
        return True

    def _stop_requested(self, log_step: bool) -> bool:
        """A stop signal seen by any rank. Alone, every step (a host flag); with several ranks,
        on logging steps, where the ranks agree through one small all-reduce."""
        if self.guard is None:
            return False
        if not self.dist.enabled:
            return self.guard.requested
        if not log_step:
            return False
        flag = torch.tensor(float(self.guard.requested), device=self.device)
        if bool(distributed.all_reduce(flag, "max")):
            self.guard.signum = self.guard.signum or signal.SIGTERM
            return True
        return False

    def _flush(self, buffer: list[tuple[int, list[Tensor]]], rate: float, step_time: float,
               skipped_before: float, final: bool = False) -> float:
        """The logging step: one host sync for the whole window, then TensorBoard and console.

        Raises DivergedError when the loss has been non-finite for ``max_nonfinite_steps``
        consecutive steps, or, on the run's last step (``final``), when the last loss is non-finite
        at all: a short run must not report ``completed`` with a NaN loss.
        """
        logger = self.logger
        steps = [s for s, _ in buffer]
        window = torch.stack([torch.cat(rows) for _, rows in buffer])
        # Ranks log the mean over the global batch (scale and overflow flags agree anyway).
        host = distributed.all_reduce(window, "mean").tolist()
        skipped_total = skipped_before
        for step, values in zip(steps, host, strict=True):
            i = 0
            for slot in self.slots:
                sfx = self._suffix(slot)
                loss, scale, inf = values[i : i + 3]
                logger.scalar(f"train/loss{sfx}", loss, step)
                logger.scalar(f"train/loss_scale{sfx}", scale, step)
                logger.scalar(f"train/overflow{sfx}", inf, step)
                names = slot.extra_names
                for name, v in zip(names, values[i + 3 : i + 3 + len(names)], strict=True):
                    logger.scalar(f"train/{name}{sfx}", v, step)
                skipped_total += inf
                i += 3 + len(names)
            logger.scalar("train/skipped_steps", skipped_total, step)
        step = steps[-1]
        last = host[-1]
        for slot in self.slots:
            logger.scalar(f"train/lr{self._suffix(slot)}", slot.optimizer.param_groups[0]["lr"], step)
            for name, value in slot.scaler.telemetry().items():
                if value.numel() == 1:
                    logger.scalar(f"loss_scale/{name}{self._suffix(slot)}", float(value), step)
                else:
                    logger.histogram(f"loss_scale/{name}{self._suffix(slot)}", value.float().cpu(), step)
            slot.scaler.check()
            if slot.telemetry is not None:
                slot.telemetry.flush(logger, step)
        logger.scalar("train/throughput", rate, step)
        logger.scalar("train/step_time", step_time, step)
        wait_s, wait_frac = self.data_wait_windows[-1]
        logger.scalar("train/data_wait", wait_s, step)
        logger.scalar("train/data_wait_fraction", wait_frac, step)
        if self.peak.stats is not None:
            logger.scalar("train/peak_memory", self.peak.train_peak(), step)
        first = self.slots[0]
        extra = {}
        if len(self.slots) > 1:
            i = 3 + len(first.extra_names)
            for slot in self.slots[1:]:
                extra[f"loss_{slot.objective.name}"] = last[i]
                i += 3 + len(slot.extra_names)
        logger.window(step, {"loss": last[0], "lr": first.optimizer.param_groups[0]["lr"], "scale": last[1],
                             "skipped": int(skipped_total), "throughput": rate, "extra": extra,
                             "data_wait": (wait_s, wait_frac)})
        self.task.log_media(logger, step)
        self.last_loss = last[0]
        run = int(distributed.all_reduce(self.nonfinite_run.clone(), "max"))
        limit = self.cfg.trainer.max_nonfinite_steps
        if run >= limit:
            raise DivergedError(
                f"loss was non-finite for {run} consecutive steps (trainer.max_nonfinite_steps={limit}); "
                f"{int(skipped_total)} of {step} steps skipped for overflow; the last good checkpoint is kept"
            )
        if final and run > 0:
            raise DivergedError(
                f"the final loss is {last[0]} (non-finite for the last {run} of {step} steps, fewer than "
                f"trainer.max_nonfinite_steps={limit}); {int(skipped_total)} steps skipped for overflow; "
                "the last good checkpoint is kept"
            )
        return skipped_total

    # ---------------------------------------------------------------------------------- state

    def state_dict(self, rng: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The checkpoint; ``rng``: every rank's RNG streams, in rank order (default: this rank's)."""
        return {
            **self.run_state(rng),
            "modules": {k: unwrap(m).state_dict() for k, m in self.task.modules.items()},
            "optimizers": {s.objective.name: s.optimizer.state_dict() for s in self.slots},
            "masters": {s.objective.name: s.master.state_dict() for s in self.slots if s.master},
        }

    def run_state(self, rng: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The checkpoint less the weights and optimizer state (a sharded checkpoint's meta.pt)."""
        return {
            "format": 1,
            "mptrain_version": __version__,
            "task": self.cfg.model.get("task", "classification"),
            "model_name": self.cfg.model.name,
            "step": self.step,
            "schedulers": {s.objective.name: s.scheduler.state_dict() for s in self.slots},
            "scalers": {s.objective.name: s.scaler.state_dict() for s in self.slots},
            "task_state": self.task.state_dict(),
            "precision": self.precision.state_dict(),
            "counters": {"skipped": float(self.skipped), "nonfinite_run": float(self.nonfinite_run)},
            "rng": rng if rng is not None else [checkpoint.rng_state(self.device)],
            "config": OmegaConf.to_container(self.cfg, resolve=True),
        }

    def save(self, gather: bool = True) -> None:
        """Checkpoint atomically (rank 0); never over a good checkpoint with non-finite weights.

        Every rank calls it: rank 0 gathers each rank's RNG streams (its dropout masks and its own
        GPU's stream differ), unless ``gather`` is off (a Ctrl-C, where other ranks may not be here).
        """
        own = checkpoint.rng_state(self.device)
        if self.sharding is not None:
            if not gather:  # a sharded save is a collective, and the other ranks may be elsewhere
                log.warning("step %d: interrupted; a sharded checkpoint needs every rank, none written", self.step)
                return
            sharded_checkpoint.save(self, distributed.all_gather_object(own))
            return
        rng = distributed.all_gather_object(own) if gather else [own]
        if not self.dist.is_main:
            return
        params = [p for m in self.task.modules.values() for p in m.parameters()]
        if params and not bool(torch.stack([p.detach().isfinite().all() for p in params]).all()):
            log.warning("step %d: weights are not finite; checkpoint not written", self.step)
            return
        checkpoint.save_atomic(self.state_dict(rng), checkpoint.checkpoint_path(self.run_dir, self.step))
        checkpoint.prune(self.run_dir, self.cfg.trainer.keep_checkpoints)

    def _load(self, path: Path) -> None:
        sharded = checkpoint.is_sharded(path)
        state = sharded_checkpoint.read_meta(path) if sharded else checkpoint.load(path)
        cfg = self.cfg
        task = cfg.model.get("task", "classification")
        if state["model_name"] != cfg.model.name or state["task"] != task:
            raise MptrainError(
                f"trainer.resume={path}: checkpoint belongs to model={state['model_name']}, "
                f"this run is model={cfg.model.name}"
            )
        try:
            if sharded or self.sharding is not None:  # a layout or a world size to cross (mptrain.sharded_checkpoint)
                sharded_checkpoint.restore(self, path, state)
            else:
                for name, module in self.task.modules.items():
                    unwrap(module).load_state_dict(state["modules"][name])
            for s in self.slots:
                name = s.objective.name
                if not sharded and self.sharding is None:
                    s.optimizer.load_state_dict(state["optimizers"][name])
                s.scheduler.load_state_dict(state["schedulers"][name])
                s.scaler.load_state_dict(state["scalers"][name])
                if s.master is not None and not sharded:
                    s.master.load_state_dict(state["masters"][name])
        except MptrainError:
            raise
        except (RuntimeError, KeyError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0][:200]
            raise MptrainError(
                f"trainer.resume={path}: checkpoint does not fit this run's model/precision ({first})"
            ) from exc
        self.task.load_state_dict(state["task_state"])
        self.precision.load_state_dict(state.get("precision"))
        self.step = int(state["step"])
        self.skipped.fill_(state["counters"]["skipped"])
        self.nonfinite_run.fill_(state["counters"]["nonfinite_run"])
        if not checkpoint.set_rng_state(state["rng"], self.dist.rank, self.device):
            log.warning("rank %d: the checkpoint holds RNG streams for %d ranks; this rank's start from its seed",
                        self.dist.rank, len(state["rng"]))
        self.resumed_from = path
        log.info("resumed from %s at step %d", path, self.step)

    def state_bytes(self) -> dict[str, int]:
        """This rank's parameter (masters included), gradient and optimizer-state bytes."""
        if self.sharding is not None:
            for m in self.task.modules.values():
                reshard(m)
        return {"rank": self.dist.rank, **state_bytes(
            list(self.task.modules.values()), [s.optimizer for s in self.slots],
            [s.master.masters for s in self.slots if s.master is not None])}

    # ---------------------------------------------------------------------------------- run

    def summary(self, status: str, wall: float, error: str | None = None) -> dict[str, Any]:
        cfg = self.cfg
        windows = getattr(self, "throughput_windows", [])
        kept = windows[cfg.trainer.warmup_windows:] or windows[-1:]
        first = self.slots[0]
        return {
            "status": status,
            "error": error,
            "model": cfg.model.name,
            "data": cfg.data.name,
            "precision": cfg.precision.name,
            "precision_resolved": self.precision.resolved,
            "precision_detail": self.precision.describe(),
            "device_capability": self.precision.capability.describe() if self.precision.capability else None,
            "loss_scale": self.policy,
            "loss_scale_state": {s.objective.name: s.scaler.summary() for s in self.slots},
            "device": str(self.device),
            "device_name": _device_name(self.device),
            "world_size": self.dist.world_size,
            "dist_backend": distributed.backend(),
            "parallel": parallel_record(cfg.parallel.name, self.dist, self.sharding,
                                        any(s.master is not None for s in self.slots),
                                        self.memory or [self.state_bytes()]),
            "batch_size": cfg.data.batch_size,
            "global_batch_size": cfg.data.batch_size * cfg.trainer.grad_accum * self.dist.world_size,
            "image_size": self.image_size,
            "steps": self.step,
            "total_steps": self.total_steps,
            "final_loss": getattr(self, "last_loss", None),
            "metrics": self.metrics,
            "primary_metric": self.task.primary_metric,
            "throughput": statistics.median(kept) if kept else None,
            "throughput_unit": self.task.unit,
            **_data_wait_summary(getattr(self, "data_wait_windows", []), cfg.trainer.warmup_windows),
            "peak_memory_bytes": self.peak.train_peak(),
            "eval_peak_memory_bytes": self.peak.eval_bytes,
            "skipped_steps": int(float(self.skipped)),
            "final_loss_scale": float(first.scaler.scale_value),
            "wall_time_s": wall,
            # torch.compile's time in this run (fused quantizers, trainer.compile), kept out of throughput
            "compile_time_s": round(fused.compile_seconds() - self.compile_start, 3),
            "quantizers": fused.status(self.device) if self.precision.emulated else None,
            # the CUDA graphs compile_mode=reduce-overhead did not get (inductor's reasons)
            "cudagraph_skips": cudagraphs.since(self.cudagraph_mark),
            "host_memory": self.host_memory,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "telemetry": {s.objective.name: s.telemetry.report() for s in self.slots if s.telemetry} or None,
            "precision_plan": self.plan.to_dict() if self.plan is not None else None,
            "task": self.task.describe(),
            "versions": versions(),
            "pairing": getattr(self, "pairing", None),
            "run_dir": str(self.run_dir),
        }


@contextlib.contextmanager
def _gc_paused(every: int) -> Any:
    """Python's automatic garbage collection off while training (``every`` > 0); the loop collects
    generations 0 and 1 every ``every`` steps instead (torchtitan's ``GarbageCollection``). A full
    collection walks every object the process holds, torch.compile's included: half a million here,
    a 250 ms stall once in 20 steps of ResNet-50/8 in MXFP8 on a CPU (torch 2.11), and under DDP
    or FSDP2 one rank's stall holds up all the others."""
    if not every:
        yield
        return
    was = gc.isenabled()
    gc.collect(1)  # not a full pass: that walks every object the process holds (a test suite: many runs' worth)
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def pairing_digests(modules: Any) -> dict[str, str]:
    """Digests of the initial weights and of the global RNG state, to tell paired runs apart.

    Weights are hashed as FP16 (round to nearest even): an FP32 run's weights cast to FP16 and an
    fp16_master or FP8 run's FP16-stored weights then hash alike when they came from the same
    draw. The global RNG state is what dropout draws from next: equal, so are the masks.
    """
    h = hashlib.sha256()
    for module in modules:
        for name, p in unwrap(module).state_dict().items():
            if torch.is_tensor(p) and hasattr(p, "full_tensor"):
                p = p.full_tensor()  # parallel=fsdp2: the whole weight (a collective; every rank is here)
            if torch.is_tensor(p) and p.is_floating_point():
                h.update(name.encode())
                h.update(p.detach().to("cpu", torch.float16).contiguous().numpy().tobytes())
    return {
        "init_digest": h.hexdigest()[:16],
        "rng_digest": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16],
    }


def _data_wait_summary(windows: list[tuple[float, float]], warmup: int) -> dict[str, float | None]:
    """Median over the logging windows past the warm-up ones, like the throughput."""
    kept = windows[warmup:] or windows[-1:]
    return {"data_wait_s": statistics.median(w for w, _ in kept) if kept else None,
            "data_wait_fraction": statistics.median(f for _, f in kept) if kept else None}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def versions() -> dict[str, str | None]:
    """The versions a run record names: mptrain, torch, torchvision, CUDA, cuDNN and Python."""
    import torchvision

    return {
        "mptrain": __version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda,
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    """``data`` as JSON at ``path``, atomically: a reader sees the old file or the new one, never half."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str, allow_nan=True) + "\n")
    os.replace(tmp, path)

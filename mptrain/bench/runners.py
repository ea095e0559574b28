"""The two ways of training one step that ``mptrain-bench`` compares, as ``Runner`` objects.

``EngineRunner``: the real engine's ``Engine._train_step``. ``BareRunner``: a plain autocast +
GradScaler loop, built by ``build_bare`` with the engine's config and initial weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from mptrain.optim import discard_skipped_state, fresh_params

if TYPE_CHECKING:
    from mptrain.engine import Engine

# Precisions the bare loop can express with plain torch (autocast, or FP16 storage + FP32 masters).
_BARE_UNSUPPORTED = {"bf16_pure": "pure-bf16 storage with stochastic rounding has no plain-torch loop",
                     "fp8": "FP8 layers have no plain-torch loop",
                     "mx": "MX/NVFP4 layers have no plain-torch loop"}

Batch = Any
Micro = list[Batch]


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
            # torch's fused SGD keeps the uninitialised momentum of a skipped first step, and a plain
            # loop then trains on it: on an H200 (torch 2.11, 2026-11-26) this loop's FP16 cells went
            # NaN after their overflowing first steps while the engine did not. The engine's own
            # remedy (mptrain.optim), so that both loops do the same work; one sync, first steps only.
            fresh = fresh_params(opt) if scaler.is_enabled() else []
            scaler.step(opt)
            if fresh:
                discard_skipped_state(opt, fresh, sum(scaler._found_inf_per_device(opt).values()))
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


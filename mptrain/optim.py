"""Optimizers and LR schedules (config groups ``optim`` and ``sched``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

_NO_DECAY_TYPES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.Embedding)


def param_groups(module: nn.Module, weight_decay: float, no_decay_bn_bias: bool) -> list[dict[str, Any]]:
    """Split parameters so that weight decay stays off norm layers and biases (when asked).

    Reads ``optim.weight_decay`` and ``optim.no_decay_bn_bias`` (passed in). A parameter shared by
    several modules (a transformer's tied embedding and head) is listed once, without decay if any
    of its owners says so (the embedding does), whatever order the modules come in.
    """
    if not no_decay_bn_bias or weight_decay == 0:
        return [{"params": [p for p in module.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    params: dict[int, nn.Parameter] = {}  # insertion order: deterministic groups
    exempt: set[int] = set()
    for mod in module.modules():
        for name, p in mod.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            params.setdefault(id(p), p)
            if isinstance(mod, _NO_DECAY_TYPES) or name.endswith("bias") or p.ndim <= 1:
                exempt.add(id(p))
    decay = [p for i, p in params.items() if i not in exempt]
    no_decay = [p for i, p in params.items() if i in exempt]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _impl_kwargs(impl: str, device: torch.device, groups: list[dict[str, Any]]) -> dict[str, bool]:
    """fused: one kernel for the whole update, and with GradScaler the step is skipped on the
    device (no host sync). auto picks it on CUDA when every parameter is a floating CUDA tensor,
    foreach for FSDP2's sharded parameters."""
    if impl == "fused":
        return {"fused": True}
    if impl == "foreach":
        return {"foreach": True}
    if impl == "for_loop":
        return {"foreach": False}
    params = [p for g in groups for p in g["params"]]
    if device.type != "cuda" or not all(p.is_floating_point() for p in params):
        return {}
    if any(_is_dtensor(p) for p in params):
        # FSDP2's shards are DTensors, and torch 2.11 has no DTensor rule for fused SGD's kernel
        # (NotImplementedError for aten._fused_sgd_ on an H200); its foreach kernels have rules.
        return {"foreach": True}
    return {"fused": True}


def _is_dtensor(p: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(p, DTensor)


def fresh_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters about to get their first optimizer state, when the optimizer skips on the device.

    A fused optimizer receives GradScaler's ``found_inf`` and skips the update inside its kernel,
    but torch's Python wrapper still creates and stores the state of a first step: fused SGD keeps
    momentum buffers made with ``empty_like`` (uninitialised memory), which the next step then reads
    as momentum. Non-fused optimizers are never called on an overflowing step, so they need nothing.
    """
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return []
    if len(optimizer.state) >= sum(len(g["params"]) for g in optimizer.param_groups):
        return []  # every parameter has its state: the steady state, checked without a loop
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None and not optimizer.state.get(p)]


def discard_skipped_state(optimizer: torch.optim.Optimizer, fresh: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Forget the state that a skipped first step created, so the next clean step is a first step.

    After this, whatever impl ran, the step after an overflow computes what a never-skipped run
    computes (tests/test_skipped_steps.py). One host sync, only on a step that created state: the
    first step(s) of a run, until one is not skipped (never for momentum-free SGD, which keeps none).
    """
    created = [p for p in fresh if optimizer.state.get(p)]
    if created and bool(found_inf.item()):
        for p in created:
            optimizer.state.pop(p, None)


def build_optimizer(cfg: DictConfig, groups: list[dict[str, Any]], device: torch.device) -> torch.optim.Optimizer:
    """Reads ``optim.name``, ``optim.lr``, ``optim.impl`` and the optimizer's own keys."""
    kwargs = _impl_kwargs(cfg.impl, device, groups)
    if cfg.name == "sgd":
        return torch.optim.SGD(
            groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **kwargs
        )
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kwargs)
    raise ValueError(f"unknown optimizer {cfg.name!r}")


def lr_factor(cfg: DictConfig, total_steps: int, steps_per_epoch: int) -> Callable[[int], float]:
    """The multiplier of the base lr at a given optimizer step.

    Reads ``sched.name`` (constant | step | cosine), ``sched.warmup_steps``,
    ``sched.warmup_start_factor``, ``sched.step_size``, ``sched.step_unit``, ``sched.gamma`` and
    ``sched.min_lr_ratio``. The schedule is indexed by the trainer step, skipped steps included,
    so a step skipped for overflow does not shift it (and knowing needs no host sync).
    """
    # Plain locals: this runs every step, and DictConfig lookups cost tens of microseconds.
    name, warmup, start = str(cfg.name), int(cfg.warmup_steps), float(cfg.warmup_start_factor)
    gamma, floor = float(cfg.gamma), float(cfg.min_lr_ratio)
    step_size = cfg.step_size * (steps_per_epoch if cfg.step_unit == "epoch" else 1)

    def factor(step: int) -> float:
        if step < warmup:
            return start + (1 - start) * step / warmup
        if name == "step":
            return gamma ** (step // step_size)
        if name == "cosine":
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return factor


def build_scheduler(
    cfg: DictConfig, optimizer: torch.optim.Optimizer, total_steps: int, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, total_steps, steps_per_epoch))

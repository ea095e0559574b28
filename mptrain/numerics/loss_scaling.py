"""Loss scaling: one interface, one class per policy.

Micikevicius et al. 2017: multiply the loss by S before backward so that small gradients survive
FP16 (smallest subnormal 2^-24), divide the weight gradients by S in FP32 before clipping and the
update, and skip the update when any gradient overflowed. The engine drives every policy through
the same five calls, FP32 included (with ``NoScaler``)::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)      # gradients are true values from here on (clip now)
    scaler.step(optimizer)          # skipped when a gradient is Inf/NaN
    scaler.update()                 # the policy's state machine
    scaler.scale_value, scaler.found_inf   # device scalars, logged without a host sync

Scaling, unscaling, the Inf/NaN check and step-or-skip come from torch.amp.GradScaler: its fused
kernels check and unscale every gradient in one pass, and with fused optimizers the skip happens on
the device. What GradScaler cannot do, we write by hand in ``update``: hysteresis, floors, caps,
rising floors and per-layer scales.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor, nn

from mptrain import distributed
from mptrain.errors import DivergedError, MptrainError
from mptrain.optim import discard_skipped_state, fresh_params


class LossScaler(ABC):
    """The interface every policy implements. ``policy`` names it in logs and summary.json."""

    policy: str = "base"
    # parallel=fsdp2: each rank checks only its shards for Inf/NaN, so the flag is all-reduced (max)
    # before the skip decision; every rank then skips, or steps, together.
    reduce_found_inf: bool = False

    def attach(self, module: nn.Module) -> nn.Module:
        """Called once with the module whose loss this scaler scales; returns the module to train.

        Per-layer policies (``adaptive``) install their backward hooks or rewrite the module here.
        """
        return module

    def alias_params(self, model_params: list[Tensor], optimizer_params: list[Tensor]) -> None:  # noqa: B027
        """The optimizer updates ``optimizer_params`` (FP32 masters) in place of ``model_params``.

        Per-layer policies need this to know which layer's scale a master's gradient carries.
        """

    @abstractmethod
    def scale(self, loss: Tensor) -> Tensor: ...

    @abstractmethod
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None: ...

    @abstractmethod
    def step(self, optimizer: torch.optim.Optimizer) -> None: ...

    @abstractmethod
    def update(self) -> None: ...

    @property
    @abstractmethod
    def scale_value(self) -> Tensor:
        """The current (loss-level) scale as a device scalar."""

    @property
    @abstractmethod
    def found_inf(self) -> Tensor:
        """1.0 if the last step was skipped for Inf/NaN gradients, else 0.0 (device scalar)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def check(self) -> None:  # noqa: B027 - optional
        """Raise DivergedError if the policy has given up (syncs: called on logging steps only)."""

    def summary(self) -> dict[str, Any]:
        """Final state for summary.json (may sync; called once at the end)."""
        return {"policy": self.policy, "scale": float(self.scale_value)}

    def telemetry(self) -> dict[str, Tensor]:
        """Extra per-step device scalars/vectors to log (per-layer scales for ``adaptive``)."""
        return {}

    @classmethod
    def from_config(cls, device: torch.device, params: dict[str, Any]) -> LossScaler:
        """Build from ``loss_scale.*`` without ``name`` (empty when ``auto`` chose this policy)."""
        return cls(device, **params)  # type: ignore[call-arg]

    def layer_grad_scales(self, module: nn.Module) -> tuple[Tensor, Tensor]:
        """The scales a layer's gradients carry in this step (after backward, before ``unscale_``):
        (gradient at its output, its parameter gradients). One loss-level scale for both here;
        ``adaptive`` gives each layer its own. Telemetry divides by these to find true values."""
        s = self.scale_value.detach().float().clone()
        return s, s


class NoScaler(LossScaler):
    """No scaling and no Inf/NaN check: the plain FP32 (or bf16) path, with nothing hidden."""

    policy = "none"

    def __init__(self, device: torch.device) -> None:
        self._one = torch.ones((), device=device)
        self._zero = torch.zeros((), device=device)

    def scale(self, loss: Tensor) -> Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        pass

    @property
    def scale_value(self) -> Tensor:
        return self._one

    @property
    def found_inf(self) -> Tensor:
        return self._zero

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_policy(self.policy, state)


def _check_policy(expected: str, state: dict[str, Any]) -> None:
    found = state.get("policy")
    if found != expected:
        raise MptrainError(
            f"checkpoint has loss_scale={found!r} state but this run uses loss_scale={expected!r}"
        )


class _GradScalerBase(LossScaler):
    """Scale/unscale/check/step through torch.amp.GradScaler; ``update`` is the policy's own.

    GradScaler's own growth logic is never used: we feed it the new scale through
    ``update(new_scale=...)``, a device-to-device copy with no host sync.

    ``inject_overflow`` (``loss_scale.inject_overflow``): optimizer steps, counted from 1 as the
    logs count them, at which the gradients are treated as overflowed whatever they hold: the step
    is skipped and the policy reacts as to a real Inf. A positive control for the policies (issue
    27): a floor only shows what it prevents when overflows happen, and a run where none does
    cannot tell a floor from none. No library offers this, so it is written here.
    """

    def __init__(self, device: torch.device, init_scale: float, inject_overflow: list[int] | tuple[int, ...] = ()
                 ) -> None:
        self.device = device
        self._scaler = torch.amp.GradScaler(device.type, init_scale=init_scale)
        self._scale = torch.full((), float(init_scale), device=device)
        self._found_inf = torch.zeros((), device=device)
        self.inject_overflow = frozenset(int(s) for s in inject_overflow)
        self.updates = 0  # optimizer steps completed (skipped ones included): the injection clock
        self.injected = 0

    def scale(self, loss: Tensor) -> Tensor:
        return self._scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self._scaler.unscale_(optimizer)
        # GradScaler keeps the per-device Inf/NaN flags it just computed; sum them on the device.
        flags = self._scaler._found_inf_per_device(optimizer)
        if self.updates + 1 in self.inject_overflow:
            # in place: GradScaler.step reads these very tensors to decide the skip
            for f in flags.values():
                f.fill_(1.0)
            self.injected += 1
        if self.reduce_found_inf:
            # In place: GradScaler.step reads these very tensors. (torch's DTensor dispatch reduces
            # them too in recent releases; this is what makes it so on every release, and for any grads.)
            for flag in flags.values():
                distributed.all_reduce(flag, "max")
        self._found_inf = torch.stack([f.to(self.device) for f in flags.values()]).sum().clamp_(max=1.0)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        # Fused optimizers skip on the device; others cost one host sync here (GradScaler's choice).
        fresh = fresh_params(optimizer)
        self._scaler.step(optimizer)
        discard_skipped_state(optimizer, fresh, self._found_inf)

    def update(self) -> None:
        self._update_scale(self._found_inf)
        self._scaler.update(new_scale=self._scale)
        self.updates += 1

    def _update_scale(self, found_inf: Tensor) -> None:
        """Change ``self._scale`` in place from this step's overflow flag (device ops only)."""

    @property
    def scale_value(self) -> Tensor:
        return self._scale

    @property
    def found_inf(self) -> Tensor:
        return self._found_inf

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "scale": self._scale.item(), "updates": self.updates,
                "injected": self.injected}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_policy(self.policy, state)
        self._scale.fill_(state["scale"])
        # absent from checkpoints written before issue 27: only the injection clock reads them
        self.updates, self.injected = int(state.get("updates", 0)), int(state.get("injected", 0))
        # A fresh GradScaler starts from the restored scale (its own state is per-step only).
        self._scaler = torch.amp.GradScaler(self.device.type, init_scale=state["scale"])

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        if self.inject_overflow:
            out["injected_overflows"] = self.injected
        return out


class StaticScaler(_GradScalerBase):
    """A constant scale S; steps with Inf/NaN gradients are skipped and S stays the same."""

    policy = "static"

    def __init__(self, device: torch.device, scale: float = 128.0, inject_overflow: list[int] | tuple[int, ...] = ()
                 ) -> None:
        super().__init__(device, scale, inject_overflow)

    @classmethod
    def from_config(cls, device: torch.device, params: dict[str, Any]) -> LossScaler:
        return cls(device, scale=float(params.get("scale", 128.0)),
                   inject_overflow=list(params.get("inject_overflow") or ()))


class DynamicScaler(_GradScalerBase):
    """GradScaler's dynamic policy, plus what it lacks.

    On overflow: skip the step; spend one unit of hysteresis, and once it is spent multiply the
    scale by ``backoff_factor`` on this and every further overflow until the budget refills (when
    the scale grows, or on every clean step with ``consecutive_hysteresis``: DeepSpeed's rule).
    After ``growth_interval`` consecutive clean steps multiply it by ``growth_factor``. With
    hysteresis=1 and no floor or cap this is GradScaler's rule, and torch's fused
    ``_amp_update_scale_`` runs it; the rest is written by hand because GradScaler has no
    hysteresis, floor or cap (tests/test_loss_scaling.py checks the hand-written path reproduces
    GradScaler's trajectory when those features are configured not to bite, and DeepSpeed's
    when hysteresis bites).
    """

    policy = "dynamic"

    def __init__(
        self,
        device: torch.device,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: float | None = None,
        on_min_scale: str = "clamp",
        max_scale: float | None = None,
        inject_overflow: list[int] | tuple[int, ...] = (),
    ) -> None:
        super().__init__(device, init_scale, inject_overflow)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = min_scale
        self.on_min_scale = on_min_scale
        self.max_scale = max_scale
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self._hysteresis_left = torch.full((), hysteresis, dtype=torch.int32, device=device)
        # Set when the floor was hit with on_min_scale=error; checked on logging steps (no sync here).
        self._hit_floor = torch.zeros((), dtype=torch.bool, device=device)
        # Updates at which the floor raised the scale (it binds): enhanced scaling is only tested
        # where this is nonzero, otherwise it is plain dynamic scaling (issue 18).
        self._floor_binds = torch.zeros((), dtype=torch.int32, device=device)

    def current_floor(self) -> float | None:
        return self.min_scale

    def _update_scale(self, found_inf: Tensor) -> None:
        if self.hysteresis == 1 and self.current_floor() is None and self.max_scale is None:
            # GradScaler's own rule: torch's fused kernel does it in one launch.
            torch._amp_update_scale_(self._scale, self._growth_tracker, found_inf, self.growth_factor,
                                     self.backoff_factor, self.growth_interval)
            return
        overflow = found_inf > 0
        hysteresis_spent = self._hysteresis_left <= 1
        back_off = overflow & hysteresis_spent
        tracker = torch.where(overflow, torch.zeros_like(self._growth_tracker), self._growth_tracker + 1)
        grow = tracker >= self.growth_interval
        # Hysteresis, DeepSpeed's rule (DynamicLossScaler.update_scale): an overflow spends one unit
        # of budget while more than one is left; once it is spent, every further overflow backs off
        # (a storm halves the scale each time). The budget refills only when the scale grows, or
        # after every clean step with consecutive_hysteresis; never on back-off.
        refill = ~overflow & (grow | self.consecutive_hysteresis)
        self._hysteresis_left.copy_(
            torch.where(
                refill,
                torch.full_like(self._hysteresis_left, self.hysteresis),
                torch.where(overflow & ~hysteresis_spent, self._hysteresis_left - 1, self._hysteresis_left),
            )
        )
        new_scale = torch.where(
            back_off,
            self._scale * self.backoff_factor,
            torch.where(grow, self._scale * self.growth_factor, self._scale),
        )
        # torch refuses to grow into Inf; keep that.
        new_scale = torch.where(torch.isfinite(new_scale), new_scale, self._scale)
        self._growth_tracker.copy_(torch.where(grow, torch.zeros_like(tracker), tracker))
        floor = self.current_floor()
        if floor is not None:
            self._hit_floor |= new_scale < floor
            self._floor_binds += (new_scale < floor).to(torch.int32)
            new_scale = new_scale.clamp(min=floor)
        if self.max_scale is not None:
            new_scale = new_scale.clamp(max=self.max_scale)
        self._scale.copy_(new_scale)

    def check(self) -> None:
        """Raise if the scale hit its floor with on_min_scale=error. Syncs: call on logging steps."""
        if self.on_min_scale == "error" and bool(self._hit_floor):
            raise DivergedError(
                f"loss scale fell to loss_scale.min_scale={self.current_floor()} "
                "(on_min_scale=error): gradients keep overflowing"
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "growth_tracker": int(self._growth_tracker),
            "hysteresis_left": int(self._hysteresis_left),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._growth_tracker.fill_(state["growth_tracker"])
        self._hysteresis_left.fill_(state["hysteresis_left"])

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "growth_tracker": int(self._growth_tracker)}


# The enhanced policy's defaults (configs/loss_scale/enhanced.yaml states the same; a test checks
# they agree), used as they are when loss_scale=auto picks enhanced for FP8: a floor that rises.
ENHANCED_DEFAULTS: dict[str, Any] = {
    "init_scale": 65536.0,
    "growth_interval": 1000,
    "min_scale_schedule": {0: 1.0, 1000: 64.0, 5000: 512.0},
}


class EnhancedScaler(DynamicScaler):
    """Mellempudi et al. 2019's enhanced loss scaling for FP8.

    Dynamic scaling whose minimum-scale floor rises during training, following
    ``min_scale_schedule`` ({step: floor}, the last entry at or before the current step applies),
    so that occasional spurious overflows cannot drive the scale down into the range where FP8's
    small subnormal range (E5M2: 2^-16) loses gradients.
    """

    policy = "enhanced"

    def __init__(self, device: torch.device, min_scale_schedule: dict[int, float], **kwargs: Any) -> None:
        kwargs["on_min_scale"] = "clamp"
        super().__init__(device, **kwargs)
        self.schedule = sorted((int(k), float(v)) for k, v in min_scale_schedule.items())
        self.steps_done = 0

    def current_floor(self) -> float | None:
        floor = self.min_scale
        for step, value in self.schedule:
            if step <= self.steps_done:
                floor = value if floor is None else max(floor, value)
        return floor

    def update(self) -> None:
        super().update()
        self.steps_done += 1

    def telemetry(self) -> dict[str, Tensor]:
        # the floor and how often it bound, logged beside the scale: where the floor binds shows in
        # the loss-scale curve (loss_scale/floor against train/loss_scale)
        return {**super().telemetry(), "floor": torch.tensor(float(self.current_floor() or 0.0)),
                "floor_binds": self._floor_binds}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "steps_done": self.steps_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.steps_done = int(state["steps_done"])

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "min_scale": self.current_floor(), "floor_binds": int(self._floor_binds)}

    @classmethod
    def from_config(cls, device: torch.device, params: dict[str, Any]) -> LossScaler:
        params = dict(params) if params else dict(ENHANCED_DEFAULTS)
        schedule = dict(params.pop("min_scale_schedule"))
        return cls(device, min_scale_schedule=schedule, **params)

"""The registry of loss-scaling policies: ``loss_scale=NAME`` -> its class, and ``auto``'s choice.

One place that knows every policy, so that the policy modules need not import each other
(``adaptive_scaling`` builds on ``loss_scaling``'s interface; neither imports this module).
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from mptrain.errors import MptrainError
from mptrain.numerics.adaptive_scaling import AdaptiveScaler
from mptrain.numerics.loss_scaling import DynamicScaler, EnhancedScaler, LossScaler, NoScaler, StaticScaler

POLICIES: dict[str, type[LossScaler]] = {
    cls.policy: cls for cls in (NoScaler, StaticScaler, DynamicScaler, EnhancedScaler, AdaptiveScaler)
}


def resolve_policy(loss_scale: str, precision_resolved: str, fp8_backend: str | None = None) -> str:
    """``auto`` picks the policy a precision needs: dynamic for FP16 compute, enhanced (with its
    rising floor) for emulated FP8, none for fp32/tf32/bf16 (bf16 has FP32's exponent range) and for
    mx: every MX/NVFP4 block gets its own scale from its own amax, so a loss scale cannot move a
    gradient into range (a power-of-two loss scale changes no MX value at all; NVFP4's block scales
    are ratios to the tensor's amax, in which it cancels up to FP32 rounding)."""
    if loss_scale != "auto":
        return loss_scale
    if precision_resolved in ("amp_fp16", "fp16_master"):
        return "dynamic"
    if precision_resolved == "fp8" and fp8_backend == "emulated":
        return "enhanced"
    return "none"  # fp32, tf32, bf16 modes and mx


def build_scaler(cfg: DictConfig, policy: str, device: torch.device) -> LossScaler:
    """Make the scaler for one loss. Reads ``loss_scale.*`` (policy already resolved from auto:
    then the policy's own defaults apply)."""
    cls = POLICIES.get(policy)
    if cls is None:
        raise MptrainError(f"loss_scale={policy!r}: unknown policy; one of {', '.join(POLICIES)}")
    params = {k: v for k, v in cfg.items() if k != "name"} if cfg.name == policy else {}
    return cls.from_config(device, params)

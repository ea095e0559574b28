"""Every precision mode x loss-scaling policy through the real config composition, the combinations
a device cannot run refused with one line, and scaling rescuing a network whose FP16 gradients
underflow."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import run_cli, run_job, tiny
from omegaconf import OmegaConf
from torch import nn

from mptrain.errors import MptrainError
from mptrain.hardware import DeviceCapability
from mptrain.numerics import precision as precision_mod
from mptrain.numerics.adaptive_scaling import AdaptiveScaler
from mptrain.numerics.loss_scaling import DynamicScaler, NoScaler, StaticScaler

PRECISIONS = ["fp32", "tf32", "amp_fp16", "amp_bf16", "mixed", "fp16_master", "bf16_pure", "fp8"]
POLICIES = ["none", "auto", "static", "dynamic", "enhanced", "adaptive"]
AUTO = {"amp_fp16": "dynamic", "fp16_master": "dynamic", "fp8": "enhanced"}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_and_policy_runs(tmp_path, precision, policy):
    s = run_job(tmp_path, *tiny("alexnet", f"precision={precision}", f"loss_scale={policy}", "trainer.max_steps=2"))
    assert s["status"] == "completed" and s["steps"] == 2
    assert s["loss_scale"] == (AUTO.get(precision, "none") if policy == "auto" else policy)
    assert s["loss_scale_state"]["model"]["policy"] == s["loss_scale"]
    assert math.isfinite(s["final_loss"])
    if precision == "fp8":
        detail = s["precision_detail"]
        assert detail["fp8"] == "emulated" and "emulated" in detail["note"]  # says plainly it is not real FP8
        assert detail["fp8_layers"]["converted"]  # which layers were converted


def test_torchao_fp8_on_cpu_is_refused_with_one_line(tmp_path):
    r = run_cli(*tiny("resnet50", "precision=fp8", "precision.backend=torchao"), f"hydra.run.dir={tmp_path}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (
        "mptrain: error: precision=fp8 precision.backend=torchao needs a CUDA GPU; use backend=emulated"
    )


def test_bf16_on_a_gpu_without_bf16_is_refused(monkeypatch):
    v100 = DeviceCapability("cuda", "sm70", native_fp16=True, native_bf16=False, detail="Tesla V100")
    monkeypatch.setattr(precision_mod, "device_capability", lambda device: v100)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    for name in ("amp_bf16", "bf16_pure"):
        with pytest.raises(MptrainError, match=f"precision={name}: this GPU \\(Tesla V100\\) has no bf16 support"):
            precision_mod.build_precision(OmegaConf.create({"name": name}), torch.device("cuda"))


# ---------------------------------------------------------------------------------------------
# Micikevicius et al.: without scaling, small FP16 gradients flush to zero and training stalls.


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 2, (256,), generator=g)
    x = torch.randn(256, 16, generator=g) + 1.5 * (2 * y[:, None] - 1)
    return x, y


# The loss is a mean over a very large count (as per-token losses summed then normalised), so every
# gradient is ~2^-22 of its usual size: far below FP16's smallest subnormal, 2^-24, for most values.
TINY_LOSS = 2.0**-22


def _train(scaler_factory, steps: int = 60) -> tuple[float, float, float]:
    """Returns (zero fraction of weight grads at step 0, first loss, last loss) under FP16 autocast."""
    net, (x, y) = _net(), _data()
    scaler = scaler_factory()
    net = scaler.attach(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)  # Adam: tiny but nonzero gradients still move weights
    zero_frac = None
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(net(x).float(), y)
        scaler.scale(loss * TINY_LOSS).backward()
        if zero_frac is None:
            grads = torch.cat([p.grad.flatten() for p in net.parameters() if p.ndim > 1])
            zero_frac = (grads == 0).float().mean().item()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return zero_frac, losses[0], losses[-1]


CPU = torch.device("cpu")


def test_fp16_gradients_underflow_without_scaling_and_training_stalls():
    zero_frac, first, last = _train(lambda: NoScaler(CPU))
    assert zero_frac > 0.5  # most weight gradients flushed to zero in FP16
    assert last > 0.9 * first  # so the loss barely moves


@pytest.mark.parametrize(
    "name,factory",
    [
        ("static", lambda: StaticScaler(CPU, scale=2.0**20)),
        ("dynamic", lambda: DynamicScaler(CPU, init_scale=2.0**24, growth_interval=20)),
        # The per-layer rule cannot lift a gradient that is already zero when it leaves the loss,
        # so adaptive starts from a modest loss-level scale; accum_cap is raised to allow the rest.
        ("adaptive", lambda: AdaptiveScaler(CPU, init_scale=2.0**8, accum_cap=2.0**24)),
    ],
)
def test_loss_scaling_recovers_the_gradients_and_trains(name, factory):
    unscaled_zero, _, _ = _train(lambda: NoScaler(CPU), steps=1)
    zero_frac, first, last = _train(factory)
    assert zero_frac < unscaled_zero / 4, (name, zero_frac, unscaled_zero)
    assert last < 0.5 * first, (name, first, last)


def test_adaptive_per_layer_scales_recover_more_than_its_loss_level_scale_alone():
    loss_level_only, _, _ = _train(lambda: StaticScaler(CPU, scale=2.0**8), steps=1)
    adaptive, _, _ = _train(lambda: AdaptiveScaler(CPU, init_scale=2.0**8, accum_cap=2.0**24), steps=1)
    assert adaptive < loss_level_only / 2, (adaptive, loss_level_only)

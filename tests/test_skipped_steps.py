"""A skipped (overflowing) step leaves nothing behind, for every optimizer impl and scaling policy.

torch's fused SGD stores the momentum buffers of a first step, made with ``empty_like``, even
when GradScaler's ``found_inf`` makes its kernel skip the update; the next step read that
uninitialised memory as momentum and the weights went NaN (issue 17). Every run here begins with
k overflowing steps, the case where that happened.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import run_job
from omegaconf import OmegaConf
from torch import nn

from mptrain.numerics.adaptive_scaling import AdaptiveScaler
from mptrain.numerics.loss_scaling import DynamicScaler, EnhancedScaler, StaticScaler
from mptrain.optim import build_optimizer

CPU = torch.device("cpu")
OPTIMS = {
    "sgd_momentum": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": False},
    "sgd": {"name": "sgd", "lr": 0.05, "momentum": 0.0, "nesterov": False},
    "adamw": {"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8},
}
SCALERS = {
    "static": lambda: StaticScaler(CPU, scale=2.0**10),
    "dynamic": lambda: DynamicScaler(CPU, init_scale=2.0**10, growth_interval=2),
    "enhanced": lambda: EnhancedScaler(CPU, min_scale_schedule={0: 1.0, 3: 4.0}, init_scale=2.0**10),
    "adaptive": lambda: AdaptiveScaler(CPU, init_scale=2.0**4),
}


def _train(optim: str, impl: str, policy: str, k: int, clean: int = 4):
    """k overflowing steps (an Inf loss), then ``clean`` steps on fixed batches.

    Returns (weights after the skipped steps, optimizer state then, final weights, found_inf per step).
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    scaler = SCALERS[policy]()
    module = scaler.attach(model)
    cfg = OmegaConf.create({**OPTIMS[optim], "impl": impl})
    opt = build_optimizer(cfg, [{"params": list(model.parameters()), "weight_decay": 1e-4}], CPU)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 16, generator=gen) for _ in range(clean)]
    flags, after_skips, state_after_skips = [], None, None
    for step in range(k + clean):
        x = batches[max(0, step - k)]
        loss = module(x).square().mean()
        if step < k:
            loss = loss * math.inf
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        flags.append(float(scaler.found_inf))
        if step == k - 1:
            after_skips = [p.detach().clone() for p in model.parameters()]
            state_after_skips = opt.state_dict()["state"]
    return after_skips, state_after_skips, [p.detach().clone() for p in model.parameters()], flags


@pytest.mark.parametrize("policy", list(SCALERS))
@pytest.mark.parametrize("optim", list(OPTIMS))
@pytest.mark.parametrize("impl", ["fused", "foreach", "for_loop"])
@pytest.mark.parametrize("k", [1, 3])
def test_first_steps_overflow_and_the_run_ends_as_if_never_skipped(policy, optim, impl, k):
    torch.manual_seed(0)
    init = [p.detach().clone() for p in nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).parameters()]
    after_skips, state, final, flags = _train(optim, impl, policy, k)
    assert flags == [1.0] * k + [0.0] * 4
    # Whatever the impl, the overflowing steps changed no weight and left no optimizer state.
    assert all(torch.equal(a, b) for a, b in zip(after_skips, init, strict=True))
    assert state == {}, f"state left by skipped steps: {sorted(next(iter(state.values())))}"
    # The clean steps then compute exactly what the same impl computes when nothing was skipped.
    _, _, never_skipped, _ = _train(optim, impl, policy, 0)
    assert all(torch.equal(a, b) for a, b in zip(final, never_skipped, strict=True))
    # And what the plain for-loop update computes: bit for bit where torch's CPU kernels agree with
    # it on clean steps (foreach always; fused SGD without momentum), else to rounding (fused SGD
    # with momentum and fused AdamW differ from for_loop by an ulp or so even with no skip at all).
    _, _, reference, _ = _train(optim, "for_loop", policy, k)
    if impl == "foreach" or impl == "for_loop" or optim == "sgd":
        assert all(torch.equal(a, b) for a, b in zip(final, reference, strict=True))
    else:
        for a, b in zip(final, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("impl", ["fused", "for_loop"])
def test_issue_recipe_stays_finite_with_fused_sgd(tmp_path, impl):
    # The recipe of issue 17, whose first steps overflow at dynamic's starting scale of 2^16.
    # Before the fix, fused SGD read uninitialised momentum: 11 of 12 steps skipped, loss NaN.
    s = run_job(tmp_path, "model=resnet50", "model.width_divisor=8", "precision=amp_fp16", "loss_scale=dynamic",
                f"optim.impl={impl}", "data.batch_size=8", "data.image_size=32", "data.train_samples=96",
                "data.val_samples=8", "trainer.max_steps=12", "trainer.log_every=1")
    assert s["status"] == "completed" and math.isfinite(s["final_loss"])
    assert 1 <= s["skipped_steps"] < 12
    first = json_overflows(tmp_path)
    assert first[0] == 1.0, "the recipe's first step must overflow, or this test tests nothing"


def json_overflows(run_dir) -> list[float]:
    """train/overflow per step, from the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in acc.Scalars("train/overflow")]

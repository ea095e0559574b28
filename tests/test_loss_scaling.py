"""Each loss-scaling policy's state machine, on scripted overflow sequences, through the real
optimizer path (scale -> backward -> unscale_ -> step -> update)."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from mptrain.errors import DivergedError, MptrainError
from mptrain.numerics.loss_scaling import (
    DynamicScaler,
    EnhancedScaler,
    NoScaler,
    StaticScaler,
)
from mptrain.numerics.scalers import build_scaler, resolve_policy

CPU = torch.device("cpu")


def drive(scaler, overflows: list[bool], *, grad: float = 1.0):
    """Run one parameter through the scaler for each step; inject Inf where asked.

    Returns (scales after each update, found_inf per step, parameter after each step)."""
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.SGD([p], lr=0.1)
    scales, infs, values = [], [], []
    for overflow in overflows:
        opt.zero_grad()
        loss = (p * grad).sum()
        scaler.scale(loss).backward()
        if overflow:
            p.grad.fill_(math.inf)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.scale_value))
        infs.append(float(scaler.found_inf))
        values.append(p.item())
    return scales, infs, values


def torch_reference(overflows: list[bool], **kwargs) -> list[float]:
    """torch.amp.GradScaler's own trajectory on the same sequence."""
    gs = torch.amp.GradScaler("cpu", **kwargs)
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.SGD([p], lr=0.1)
    out = []
    for overflow in overflows:
        opt.zero_grad()
        gs.scale(p.sum()).backward()
        if overflow:
            p.grad.fill_(math.inf)
        gs.step(opt)
        gs.update()
        out.append(gs.get_scale())
    return out


def test_none_never_scales_or_skips():
    scales, infs, values = drive(NoScaler(CPU), [False, False])
    assert scales == [1.0, 1.0] and infs == [0.0, 0.0]
    assert values == pytest.approx([0.9, 0.8])


def test_static_skips_overflow_and_keeps_scale():
    scaler = StaticScaler(CPU, scale=8.0)
    scales, infs, values = drive(scaler, [False, True, False])
    assert scales == [8.0, 8.0, 8.0]
    assert infs == [0.0, 1.0, 0.0]
    # The gradient the optimizer saw was unscaled (1.0, not 8.0), and step 2 was skipped.
    assert values == pytest.approx([0.9, 0.9, 0.8])


@pytest.mark.parametrize(
    "pattern",
    [
        [True] * 3 + [False] * 7 + [True] + [False] * 9,
        [False] * 5 + [True, True] + [False] * 12 + [True],
        [i % 3 == 0 for i in range(25)],
    ],
)
def test_dynamic_defaults_match_gradscaler(pattern):
    kw = dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=4)
    ours, _, _ = drive(DynamicScaler(CPU, **kw), pattern)
    assert ours == torch_reference(pattern, **kw)


@pytest.mark.parametrize("pattern", [[True] * 3 + [False] * 7 + [True] + [False] * 9, [i % 3 == 0 for i in range(25)]])
def test_hand_written_update_matches_gradscaler_when_extras_do_not_bite(pattern):
    """A cap far above any reached scale forces the hand-written path; it must equal torch's."""
    kw = dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=4)
    ours, _, _ = drive(DynamicScaler(CPU, **kw, max_scale=2.0**60, consecutive_hysteresis=True), pattern)
    assert ours == torch_reference(pattern, **kw)


def test_dynamic_full_defaults_match_gradscaler_long_run():
    pattern = [False] * 2100 + [True] + [False] * 10
    ours, _, _ = drive(DynamicScaler(CPU), pattern)
    ref = torch_reference(pattern)
    assert ours == ref
    assert ref[2099] == 2.0**17  # it grew once after 2000 clean steps


def deepspeed_reference(overflows: list[bool], init_scale: float, scale_window: int, delayed_shift: int,
                        consecutive_hysteresis: bool = False) -> list[float]:
    """DeepSpeed's DynamicLossScaler.update_scale (deepspeed/runtime/fp16/loss_scaler.py), its rule
    restated without the min-scale error, as the independent reference for hysteresis."""
    cur_scale, last_overflow_iter, cur_hysteresis = init_scale, -1, delayed_shift
    out = []
    for cur_iter, overflow in enumerate(overflows):
        if overflow:
            if delayed_shift == 1 or cur_hysteresis == 1:
                cur_scale /= 2.0
            else:
                cur_hysteresis -= 1
            last_overflow_iter = cur_iter
        else:
            if consecutive_hysteresis:
                cur_hysteresis = delayed_shift
            if (cur_iter - last_overflow_iter) % scale_window == 0:
                if not consecutive_hysteresis:
                    cur_hysteresis = delayed_shift
                cur_scale *= 2.0
        out.append(cur_scale)
    return out


def test_hysteresis_storm_follows_deepspeed():
    # The review's case: hysteresis 2, eight overflows in a row. DeepSpeed spends the budget once,
    # then halves on every further overflow: 65536, 32768, 16384, ..., 512.
    storm = [True] * 8
    ref = deepspeed_reference(storm, 2.0**16, 2000, 2)
    assert ref == [2.0**16 / 2**k for k in range(8)]
    ours, infs, _ = drive(DynamicScaler(CPU, init_scale=2.0**16, hysteresis=2), storm)
    assert ours == ref
    assert infs == [1.0] * 8


@pytest.mark.parametrize("hysteresis", [2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize(
    "pattern",
    [
        [True, True, True, True, False, True],
        [True, False, True, False, True, True, True],
        [True, True] + [False] * 7 + [True, True, True, False, False, False, False, True, True, True],
        [False] * 3 + [True] * 5 + [False] * 4 + [True, False, True, True],
    ],
)
def test_hysteresis_matches_deepspeed(pattern, hysteresis, consecutive):
    # growth_interval 4: the patterns cross growth events, which refill the budget in DeepSpeed.
    ref = deepspeed_reference(pattern, 64.0, 4, hysteresis, consecutive)
    scaler = DynamicScaler(CPU, init_scale=64.0, growth_interval=4, hysteresis=hysteresis,
                           consecutive_hysteresis=consecutive)
    ours, _, _ = drive(scaler, pattern)
    assert ours == ref


def test_dynamic_floor_clamps_and_cap_limits():
    scaler = DynamicScaler(CPU, init_scale=16.0, growth_interval=1, min_scale=4.0, max_scale=64.0)
    scales, _, _ = drive(scaler, [True] * 4 + [False] * 5)
    assert scales == [8.0, 4.0, 4.0, 4.0, 8.0, 16.0, 32.0, 64.0, 64.0]


def test_dynamic_floor_error_stops_the_run():
    scaler = DynamicScaler(CPU, init_scale=4.0, min_scale=2.0, on_min_scale="error")
    drive(scaler, [True])
    scaler.check()  # 2.0 reached exactly: still fine
    drive(scaler, [True])
    with pytest.raises(DivergedError, match=r"min_scale=2\.0"):
        scaler.check()


def test_enhanced_floor_rises_on_schedule():
    scaler = EnhancedScaler(CPU, min_scale_schedule={0: 1.0, 3: 16.0}, init_scale=64.0, growth_interval=100)
    scales, _, _ = drive(scaler, [True] * 6)
    # Before step 3 the floor is 1 (64 -> 32 -> 16 -> 8); from step 3 on it is 16.
    assert scales == [32.0, 16.0, 8.0, 16.0, 16.0, 16.0]
    assert scaler.summary()["min_scale"] == 16.0
    # the floor bound at the last three updates (each back-off would have gone below 16)
    assert scaler.summary()["floor_binds"] == 3 and float(scaler.telemetry()["floor"]) == 16.0


def test_a_rising_floor_binds_without_any_overflow():
    # the study's (d) schedule in small: the scale starts at 1 and the floor lifts it (issue 18)
    scaler = EnhancedScaler(CPU, min_scale_schedule={0: 1.0, 2: 8.0}, init_scale=1.0, growth_interval=100)
    scales, _, _ = drive(scaler, [False] * 4)
    assert scales == [1.0, 1.0, 8.0, 8.0] and scaler.summary()["floor_binds"] == 1


def test_state_dict_roundtrip_continues_trajectory():
    pattern = [False, True, False, False, False, True, False, False]
    full, _, _ = drive(DynamicScaler(CPU, init_scale=256.0, growth_interval=3, hysteresis=2), pattern)
    first = DynamicScaler(CPU, init_scale=256.0, growth_interval=3, hysteresis=2)
    a, _, _ = drive(first, pattern[:4])
    second = DynamicScaler(CPU, init_scale=256.0, growth_interval=3, hysteresis=2)
    second.load_state_dict(first.state_dict())
    b, _, _ = drive(second, pattern[4:])
    assert a + b == full


def test_policy_mismatch_in_checkpoint_is_a_clear_error():
    with pytest.raises(MptrainError, match="loss_scale='static'"):
        DynamicScaler(CPU).load_state_dict(StaticScaler(CPU, 8.0).state_dict())


def test_auto_resolution():
    assert resolve_policy("auto", "amp_fp16") == "dynamic"
    assert resolve_policy("auto", "fp16_master") == "dynamic"
    assert resolve_policy("auto", "amp_bf16") == "none"
    assert resolve_policy("auto", "fp32") == "none"
    assert resolve_policy("auto", "fp8", "emulated") == "enhanced"
    assert resolve_policy("static", "fp32") == "static"


def test_build_from_config():
    cfg = OmegaConf.create({"name": "dynamic", "init_scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                            "growth_interval": 10, "hysteresis": 2, "consecutive_hysteresis": False,
                            "min_scale": None, "on_min_scale": "clamp", "max_scale": None})
    scaler = build_scaler(cfg, "dynamic", CPU)
    assert isinstance(scaler, DynamicScaler) and scaler.hysteresis == 2 and float(scaler.scale_value) == 8.0


def test_auto_on_fp8_uses_enhanced_with_its_rising_floor():
    from mptrain.cli import compose

    auto = build_scaler(OmegaConf.create({"name": "auto"}), resolve_policy("auto", "fp8", "emulated"), CPU)
    cfg = compose(["precision=fp8", "loss_scale=enhanced"])
    enhanced = build_scaler(cfg.loss_scale, "enhanced", CPU)
    assert isinstance(auto, EnhancedScaler) and isinstance(enhanced, EnhancedScaler)
    assert auto.schedule == enhanced.schedule and len(auto.schedule) > 1  # the yaml's schedule
    assert float(auto.scale_value) == float(enhanced.scale_value)
    assert auto.growth_interval == enhanced.growth_interval
    floors = []
    for step in (0, 999, 1000, 4999, 5000):
        auto.steps_done = step
        floors.append(auto.current_floor())
    assert floors == [1.0, 1.0, 64.0, 64.0, 512.0]  # it rises: not a constant floor of 1


# ------------------------------------------------------------------------------------------ injected overflow


def test_an_injected_overflow_is_what_gradscaler_does_with_a_real_inf():
    """loss_scale.inject_overflow (issue 27): the step is skipped and the policy backs off exactly as
    torch.amp.GradScaler does when that step's gradient really is Inf."""
    real = [False, True, False, False, True, False, False, False]
    injected = [i + 1 for i, o in enumerate(real) if o]
    scaler = DynamicScaler(CPU, init_scale=2.0**10, growth_interval=3, inject_overflow=injected)
    scales, infs, values = drive(scaler, [False] * len(real))
    assert scales == torch_reference(real, init_scale=2.0**10, growth_interval=3)
    assert infs == [float(o) for o in real]
    _, _, real_values = drive(DynamicScaler(CPU, init_scale=2.0**10, growth_interval=3), real)
    assert values == pytest.approx(real_values)  # the same steps were skipped
    assert scaler.summary()["injected_overflows"] == 2
    static = StaticScaler(CPU, scale=8.0, inject_overflow=[2])
    assert drive(static, [False, False, False])[1:] == ([0.0, 1.0, 0.0], pytest.approx([0.9, 0.9, 0.8]))


def test_a_floor_holds_the_scale_through_an_injected_storm():
    storm = list(range(3, 11))  # 8 overflows in a row: dynamic halves the scale on each
    floor = EnhancedScaler(CPU, min_scale_schedule={0: 2.0**7}, init_scale=2.0**10, growth_interval=100,
                           inject_overflow=storm)
    bare = DynamicScaler(CPU, init_scale=2.0**10, growth_interval=100, inject_overflow=storm)
    s_floor, _, _ = drive(floor, [False] * 12)
    s_bare, _, _ = drive(bare, [False] * 12)
    assert s_bare[-1] == 2.0**2 and s_floor[-1] == 2.0**7
    assert floor.summary()["floor_binds"] == 5  # the storm's last 5 back-offs would have gone below 2^7


def test_the_injection_clock_survives_a_resume():
    a = DynamicScaler(CPU, init_scale=64.0, inject_overflow=[3])
    drive(a, [False, False])
    b = DynamicScaler(CPU, init_scale=64.0, inject_overflow=[3])
    b.load_state_dict(a.state_dict())
    scales, infs, _ = drive(b, [False, False])
    assert infs == [1.0, 0.0] and scales == [32.0, 32.0]
    c = DynamicScaler(CPU, init_scale=64.0, inject_overflow=[3])
    c.load_state_dict({k: v for k, v in a.state_dict().items() if k not in ("updates", "injected")})
    assert drive(c, [False])[1] == [0.0]  # an older checkpoint restarts the clock from 0


def test_inject_overflow_in_a_run_and_a_bad_step(tmp_path):
    from conftest import run_job, tiny

    from mptrain.cli import compose
    from mptrain.config import validate

    s = run_job(tmp_path / "run", *tiny("alexnet", "trainer.max_steps=3", "trainer.eval_every=3"),
                "precision=amp_fp16", "loss_scale=dynamic", "loss_scale.init_scale=1024",
                "loss_scale.inject_overflow=[2]")
    assert s["skipped_steps"] == 1 and s["final_loss_scale"] == 512.0
    assert s["loss_scale_state"]["model"]["injected_overflows"] == 1
    with pytest.raises(MptrainError, match=r"loss_scale.inject_overflow: 0 is not a step number \(>= 1"):
        validate(compose([*tiny("alexnet"), "loss_scale=static", "loss_scale.inject_overflow=[0]"]))

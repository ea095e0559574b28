"""The host-sync counter (mptrain.syncs) sees every kind of read-back, and nothing else."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny
from torch import nn

from mptrain.syncs import count_host_syncs


def test_counts_each_kind_of_read_back_with_its_call_site() -> None:
    t = torch.arange(4.0)
    with count_host_syncs() as c:
        t.sum().item()
        bool(t.sum() > 0)
        t.tolist()
        float(t.max())
        t.nonzero()
    assert dict(c.by_kind) == {"item": 2, "bool": 1, "tolist": 1, "nonzero": 1}
    assert c.total == 5
    assert "tests/test_syncs.py:" in c.report()


def test_device_work_alone_makes_no_sync() -> None:
    t = torch.randn(64, 64)
    with count_host_syncs() as c:
        y = (t @ t).relu().amax()
        torch.where(y > 0, t, 0.0).mul_(2)
        t.to(torch.float16)  # a dtype cast is no device transfer
    assert c.total == 0, c.report()


def test_nothing_is_counted_outside_the_block() -> None:
    with count_host_syncs() as c:
        pass
    torch.ones(2).sum().item()
    assert c.total == 0


# --------------------------------------------------------------------------------------------
# an emulated training step makes none (issue 24)


def _step_syncs(overrides: list[str], steps: int = 3) -> list[int]:
    """Host syncs of each of ``steps`` training steps of a real engine (no logging step among them)."""
    import tempfile
    from pathlib import Path

    from conftest import compose, on_cpu
    from test_transformer import TINY_TF

    from mptrain.config import validate
    from mptrain.engine import Engine

    cfg = compose(on_cpu([*TINY_TF, *overrides, "trainer.precision_plan=false"]))
    validate(cfg)
    engine = Engine(cfg, Path(tempfile.mkdtemp()))
    batches = engine.task.train_batches(0)
    counts = []
    for _ in range(steps):
        batch = [next(batches)]
        with count_host_syncs() as c:
            engine._train_step(batch)
        counts.append(c.total)
    return counts



@pytest.mark.kernels("blocks")
@pytest.mark.parametrize("fused_on", [False, True], ids=["reference", "fused"])
def test_an_emulated_step_makes_no_host_sync(fused_on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """NVFP4 with its whole recipe (the Hadamard transform, 2D tiles, stochastic rounding) and FP8
    (stochastic rounding, FP16 masters, enhanced loss scaling) step without reading anything back,
    fused or not. (FP8's scaler needs a fused optimizer for that: torch's GradScaler reads its
    overflow flag on the host for any other, one sync a step. The fused optimizer's first step
    reads once, where it creates its state: mptrain.optim's skipped-step guard.) The Hadamard
    rotation is built once, not on the host for every GEMM operand."""
    from mptrain.numerics import fused, mx

    built = []
    monkeypatch.setattr(mx, "hadamard_matrix", lambda n=16, f=mx.hadamard_matrix: built.append(n) or f(n))
    mx.hadamard_rotation.cache_clear()
    with fused.forced(fused_on):
        assert _step_syncs(["precision=mx", "precision.format=nvfp4"]) == [0, 0, 0]
        assert len(built) == 1  # one rotation for the run (one device, one dtype)
        assert _step_syncs(["precision=fp8", "optim.impl=fused"]) == [1, 0, 0]
        assert _step_syncs(["precision=fp8"]) == [1, 1, 1]  # the GradScaler sync, documented


# ---------------------------------------------------------------------------------------------
# The engine's step, per precision and optimizer implementation: no host sync beyond the one that
# torch's own GradScaler makes for a non-fused optimizer (it reads found_inf to decide whether to
# call step()); a fused optimizer takes the flag inside its kernel, so that path makes none.

IMPLS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}


def _torch_gradscaler_syncs(impl: str) -> int:
    """The reference: a plain autocast-free loop with torch.amp.GradScaler, steady state."""
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **IMPLS[impl])
    scaler = torch.amp.GradScaler("cpu")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        scaler.scale(model(torch.ones(2, 4)).square().mean()).backward()
        scaler.step(opt)
        scaler.update()

    step()
    with count_host_syncs() as c:
        step()
    return c.total


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize(("precision", "scaled"), [
    (["precision=fp32"], False), (["precision=amp_fp16"], True), (["precision=fp16_master"], True),
    (["precision=fp8"], True), (["precision=mx"], False), (["precision=amp_fp16", "loss_scale=adaptive"], True),
], ids=["fp32", "amp_fp16", "fp16_master", "fp8", "mx", "adaptive"])
def test_engine_step_makes_no_host_sync_beyond_torchs_gradscaler(tmp_path, precision, scaled, impl) -> None:
    from mptrain.cli import compose
    from mptrain.config import validate
    from mptrain.engine import Engine

    cfg = compose([*tiny("alexnet", *precision, f"optim.impl={impl}", "model.width_divisor=16",
                         "optim.momentum=0.9", "trainer.precision_plan=false"), "trainer.device=cpu"])
    validate(cfg)
    engine = Engine(cfg, tmp_path)
    batches = engine.task.train_batches(0)
    for slot in engine.slots:
        slot.module.train()
    for _ in range(2):  # past the first step, whose optimizer creates its state
        engine._train_step([next(batches)])
        engine.step += 1
    batch = next(batches)
    with count_host_syncs() as c:
        engine._train_step([batch])
    want = _torch_gradscaler_syncs(impl) if scaled else 0
    assert c.total == want, c.report()
    if impl == "fused":
        assert want == 0
    elif scaled:  # the one read of found_inf, in the scaler's step
        scaler = "adaptive_scaling" if "loss_scale=adaptive" in precision else "loss_scaling"
        assert want == 1 and dict(c.by_kind) == {"item": 1}
        assert next(iter(c.sites)).startswith(f"item at numerics/{scaler}.py:"), c.report()

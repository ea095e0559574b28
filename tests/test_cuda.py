"""The CUDA paths, each a few steps of a tiny model on the GPU (skipped without CUDA).

Precision x loss-scale policy with the loss falling; fused and foreach optimizers under every
scaler with an injected overflow; channels_last and torch.compile; peak memory; the GAN and the
LM; resume; DDP over NCCL; torchao float8.

``MPTRAIN_TEST_DEVICE=cpu python -m pytest tests/test_cuda.py`` runs the same tests on the CPU
(the CUDA-only checks skip): a way to check their logic on a machine without a GPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_job
from test_engine import scalars

from mptrain.cli import compose
from mptrain.config import validate

DEVICE = os.environ.get("MPTRAIN_TEST_DEVICE", "cuda")
CUDA = DEVICE == "cuda"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(CUDA and not torch.cuda.is_available(), reason="needs a CUDA device"),
]
cuda_only = pytest.mark.skipif(not CUDA, reason="checks a CUDA-only behaviour")

PRECISIONS = ["fp32", "tf32", "amp_fp16", "amp_bf16", "mixed", "fp16_master", "bf16_pure", "fp8"]
POLICIES = ["none", "auto", "static", "dynamic", "enhanced", "adaptive"]

# A 1/8-width ResNet-50 on 4 learnable synthetic classes. At batch 64 and lr 0.02 the training loss
# falls from ln 4 to near 0 within 30 steps in fp32 and in emulated FP8 (tried on the CPU); at batch
# 16 the per-batch noise hides the trend for 16 steps and more.
SMALL = ["model=resnet50", "model.width_divisor=8", "data.image_size=32", "data.batch_size=64", "data.num_classes=4",
         "data.train_samples=512", "data.val_samples=16", "data.num_workers=0", "trainer.log_every=1",
         "sched=constant", "optim.lr=0.02", f"trainer.device={DEVICE}"]


def losses(run_dir: Path) -> list[float]:
    return [v for _, v in scalars(run_dir)["train/loss"]]


def falls(values: list[float], k: int = 4) -> bool:
    finite = [v for v in values if math.isfinite(v)]
    return len(finite) >= 2 * k and sum(finite[-k:]) / k < sum(finite[:k]) / k


# ---------------------------------------------------------------------------------------------
# An overflowing step must leave weights and optimizer state exactly as they were, with fused
# optimizers too (they take GradScaler's found_inf inside the kernel), and the scale must back off.


def _engine(tmp_path: Path, *overrides: str):
    from mptrain.engine import Engine

    cfg = compose([*SMALL, "precision=amp_fp16", "trainer.max_steps=10", *overrides])
    validate(cfg)
    return Engine(cfg, tmp_path)


@pytest.mark.parametrize("policy", ["static", "dynamic", "enhanced", "adaptive"])
@pytest.mark.parametrize("optim,impl", [("sgd", "fused"), ("sgd", "foreach"), ("adamw", "fused"),
                                        ("adamw", "foreach")])
def test_overflow_leaves_weights_and_optimizer_state_untouched(tmp_path, optim, impl, policy):
    # A modest initial scale, so that only the injected step overflows.
    start = ["loss_scale.init_scale=256"] if policy in ("dynamic", "enhanced") else []
    eng = _engine(tmp_path, f"optim={optim}", f"optim.impl={impl}", f"loss_scale={policy}", *start)  # SGD: momentum
    slot = eng.slots[0]
    assert all(g[impl] for g in slot.optimizer.param_groups)
    batches = eng.task.train_batches(0)
    for _ in range(2):  # clean steps: momentum / Adam moments exist
        eng._train_step([next(batches)])
    assert float(eng.skipped) == 0
    weights = [p.detach().clone() for p in slot.params]
    state = {(i, k): v.clone() for i, p in enumerate(slot.params) for k, v in slot.optimizer.state[p].items()
             if isinstance(v, torch.Tensor)}
    assert len(state) >= len(weights)  # a momentum buffer (SGD) or two moments (AdamW) per parameter
    scale_before = float(slot.scaler.scale_value)
    skipped_before = float(eng.skipped)

    loss_fn = eng.task.loss

    def overflowing(objective, batch):
        loss, extras = loss_fn(objective, batch)
        return loss * torch.tensor(float("inf"), device=loss.device), extras

    eng.task.loss = overflowing
    eng._train_step([next(batches)])
    assert float(eng.skipped) == skipped_before + 1
    for before, p in zip(weights, slot.params, strict=True):
        assert torch.equal(before, p.detach())
    after = {(i, k): v for i, p in enumerate(slot.params) for k, v in slot.optimizer.state[p].items()
             if isinstance(v, torch.Tensor)}
    assert after.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(v, after[k]), k
    if policy in ("dynamic", "enhanced"):
        assert float(slot.scaler.scale_value) == scale_before * 0.5
    elif policy == "static":
        assert float(slot.scaler.scale_value) == scale_before

    eng.task.loss = loss_fn  # and training goes on from the same weights
    eng._train_step([next(batches)])
    assert any(not torch.equal(b, p.detach()) for b, p in zip(weights, slot.params, strict=True))


def _skip_then_train(tmp_path: Path, optim: str, impl: str, k: int) -> list[torch.Tensor]:
    """k overflowing steps, then 4 clean steps on batches k..k+3 (k=0: the never-skipped run)."""
    # static: the overflow leaves the scale alone, so the clean steps see the same scaled gradients.
    eng = _engine(tmp_path, f"optim={optim}", f"optim.impl={impl}", "loss_scale=static", "loss_scale.scale=256",
                  "trainer.deterministic=true")
    slot = eng.slots[0]
    init = [p.detach().clone() for p in slot.params]
    loss_fn, batches = eng.task.loss, eng.task.train_batches(0)

    def overflowing(objective, batch):
        loss, extras = loss_fn(objective, batch)
        return loss * torch.tensor(float("inf"), device=loss.device), extras

    eng.task.loss = overflowing
    for _ in range(k):
        eng._train_step([next(batches)])
    assert float(eng.skipped) == k
    assert all(torch.equal(a, p.detach()) for a, p in zip(init, slot.params, strict=True))
    assert not slot.optimizer.state_dict()["state"], f"{impl}: a skipped step left optimizer state"
    eng.task.loss = loss_fn
    if k == 0:
        for _ in range(3):  # the batches the skipping runs spent on their overflowing steps
            next(batches)
    for _ in range(4):
        eng._train_step([next(batches)])
    assert float(eng.skipped) == k
    return [p.detach().float().clone() for p in slot.params]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("impl", ["fused", "foreach", "for_loop"])
def test_first_steps_overflow_and_the_run_ends_as_if_never_skipped(tmp_path, optim, impl, k):
    # Issue 17: fused SGD stored the empty_like momentum of a skipped first step and read it as
    # momentum next step (NaN weights). The first k steps here overflow, the case where it happened.
    final = _skip_then_train(tmp_path / "skip", optim, impl, k)
    reference = _skip_then_train(tmp_path / "ref", optim, impl, 0) if k == 3 else None
    if reference is not None:  # batches k..k+3 after 3 skipped steps, exactly as with none skipped
        assert all(torch.equal(a, b) for a, b in zip(final, reference, strict=True))
    if optim == "sgd" and impl != "for_loop":
        # Against the plain for-loop update; fused kernels round differently (Adam's normalised step
        # turns those ulps into large relative differences of near-zero weights, so SGD only).
        for a, b in zip(final, _skip_then_train(tmp_path / "loop", optim, "for_loop", k), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# fast paths, memory, the other model families, resume


@pytest.mark.parametrize("fast", [["trainer.channels_last=true"],
                                  ["trainer.channels_last=true", "trainer.compile=true"]])
def test_channels_last_and_compile_train(tmp_path, fast):
    s = run_job(tmp_path, *SMALL, "model=alexnet", "data.image_size=64", "precision=mixed", "trainer.max_steps=12",
                "optim=adamw", "optim.lr=1e-3", *fast)
    assert s["status"] == "completed" and falls(losses(tmp_path), k=3), losses(tmp_path)


@cuda_only
def test_peak_memory_is_recorded_and_half_precision_uses_less(tmp_path):
    # Both jobs in one process, the larger first: the engine resets the peak at the start of each
    # run (it used to carry fp32's peak into the half run), and after cuDNN's autotuning step.
    common = [*SMALL, "data.batch_size=64", "data.image_size=64", "trainer.max_steps=3"]
    fp32 = run_job(tmp_path / "fp32", *common, "precision=fp32")
    half = run_job(tmp_path / "half", *common, "precision=amp_fp16")
    assert fp32["peak_memory_bytes"] > 0 and half["peak_memory_bytes"] > 0
    assert half["peak_memory_bytes"] < fp32["peak_memory_bytes"]  # activations saved in FP16
    tags = scalars(tmp_path / "fp32")
    assert tags["train/peak_memory"][-1][1] > 0


@cuda_only
def test_peak_memory_leaves_evaluation_out(tmp_path):
    # The same training with evaluation batches of 16 and of 1024 (another shape, which cuDNN
    # autotunes again): the training peak must not move, evaluation's is recorded apart.
    common = [*SMALL, "data.image_size=64", "data.val_samples=1024", "trainer.max_steps=3"]
    small = run_job(tmp_path / "small", *common, "data.val_batch_size=16")
    large = run_job(tmp_path / "large", *common, "data.val_batch_size=1024")
    assert large["eval_peak_memory_bytes"] > large["peak_memory_bytes"]
    assert large["eval_peak_memory_bytes"] > small["eval_peak_memory_bytes"]
    assert large["peak_memory_bytes"] == pytest.approx(small["peak_memory_bytes"], rel=0.05)


@pytest.mark.parametrize("precision", ["fp32", "amp_fp16", "amp_bf16"])
def test_gan_and_lm_train_on_the_device(tmp_path, precision):
    gan = run_job(tmp_path / "gan", "model=dcgan", "model.ngf=16", "model.ndf=16", "data.batch_size=16",
                  "data.train_samples=64", "data.num_workers=0", "trainer.max_steps=4", "trainer.log_every=2",
                  f"trainer.device={DEVICE}", f"precision={precision}")
    assert gan["status"] == "completed" and math.isfinite(gan["final_loss"])
    lm = run_job(tmp_path / "lm", "model=lstm_lm_tiny", "data.batch_size=8", "data.bptt=16", "trainer.max_steps=20",
                 "trainer.log_every=1", f"trainer.device={DEVICE}", f"precision={precision}", "optim.lr=0.01")
    assert lm["status"] == "completed" and lm["device"].startswith(DEVICE)
    assert falls(losses(tmp_path / "lm")), losses(tmp_path / "lm")


def test_resume_continues_the_loss_and_scale_curves(tmp_path):
    # Deterministic kernels: cuDNN's default weight-gradient convolutions differ run to run, which
    # would make the comparison a test of cuDNN's noise rather than of resume.
    common = [*SMALL, "precision=amp_fp16", "loss_scale=dynamic", "loss_scale.growth_interval=2",
              "trainer.max_steps=8", "trainer.deterministic=true"]
    run_job(tmp_path / "full", *common, "trainer.checkpoint_every=4", "trainer.keep_checkpoints=5")
    first = sorted((tmp_path / "full" / "checkpoints").glob("step_*.pt"))[0]
    s = run_job(tmp_path / "resumed", *common, f"trainer.resume={first}")
    assert s["steps"] == 8 and s["resumed_from"].endswith("step_00000004.pt")
    full, resumed = scalars(tmp_path / "full"), scalars(tmp_path / "resumed")
    # With deterministic kernels both curves are exact.
    assert dict(resumed["train/loss_scale"]) == {k: v for k, v in full["train/loss_scale"] if k > 4}
    assert dict(resumed["train/loss"]) == {k: v for k, v in full["train/loss"] if k > 4}


@cuda_only
def test_resume_from_a_checkpoint_of_more_ranks_restores_this_devices_stream(tmp_path):
    # A checkpoint from 2 GPUs resumed on 1: rank 0 takes entry 0, for its own device only (every
    # rank used to restore rank 0's states onto all visible GPUs, and fewer GPUs raised).
    common = [*SMALL, "precision=amp_fp16", "trainer.max_steps=2"]
    run_job(tmp_path / "a", *common)
    ckpt = sorted((tmp_path / "a" / "checkpoints").glob("step_*.pt"))[-1]
    state = torch.load(ckpt, weights_only=True)
    other = {**state["rng"][0], "cuda": torch.zeros_like(state["rng"][0]["cuda"])}
    state["rng"] = [state["rng"][0], other]
    torch.save(state, ckpt)
    s = run_job(tmp_path / "b", *common, "trainer.max_steps=3", f"trainer.resume={ckpt}")
    assert s["status"] == "completed" and s["steps"] == 3


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_torchrun_one_process(tmp_path, parallel):
    # What a user launches: torchrun, then NCCL on a GPU (gloo on the CPU), DDP or FSDP2 (issue 26).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "mptrain",
         *SMALL, "precision=mixed", f"parallel={parallel}", "trainer.max_steps=6", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "completed" and s["world_size"] == 1 and s["parallel"]["name"] == parallel
    assert s["dist_backend"] == ("nccl" if CUDA else "gloo")


@cuda_only
@pytest.mark.skipif(CUDA and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="torchao float8 needs sm89+")
def test_torchao_float8_converts_and_trains(tmp_path):
    pytest.importorskip("torchao")
    # AlexNet's classifier is Linear 512 -> 512 -> 16 at 1/8 width: dims divisible by 16, as
    # float8 matmuls need.
    s = run_job(tmp_path, *SMALL, "model=alexnet", "data.image_size=64", "data.num_classes=16",
                "precision=fp8", "precision.backend=torchao", "trainer.max_steps=6", "optim=adamw", "optim.lr=1e-3")
    assert s["status"] == "completed" and math.isfinite(s["final_loss"])
    detail = s["precision_detail"]
    assert detail["fp8"] == "torchao" and detail["fp8_layers"]["converted"]


# Last in the file: the longest group (48 runs). The GPU check runs under a time limit, which then
# cuts this well-covered matrix, not the rarer checks above it.
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_and_policy_trains(tmp_path, precision, policy):
    s = run_job(tmp_path, *SMALL, f"precision={precision}", f"loss_scale={policy}", "trainer.max_steps=30")
    assert s["status"] == "completed" and s["device"].startswith(DEVICE)
    if CUDA and precision == "mixed":
        assert s["precision_resolved"] == "amp_fp16"  # the paper's recipe on a GPU
    assert falls(losses(tmp_path), k=5), losses(tmp_path)

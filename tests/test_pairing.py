"""Pairing (issue 18): a low-precision run of a seed starts from its FP32 twin's weights and draws
the same dropout masks, step after step; stochastic rounding has its own random stream."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mptrain.numerics import rounding_rng
from tests.conftest import run_job, tiny

STEPS = ["trainer.max_steps=3", "trainer.eval_every=3", "trainer.seed=3", "trainer.checkpoint_every=null"]


def dropout_record(run_dir: Path, *overrides: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train a tiny AlexNet (two nn.Dropout layers) and record, at every dropout call, the global
    RNG state it draws from and the mask it applied (dropped = input nonzero, output zero)."""
    calls: list[dict[str, Any]] = []

    def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
        if isinstance(module, nn.Dropout) and module.training:
            digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
            calls.append({"rng": digest, "input": args[0].detach().float().clone()})

    def post(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        if isinstance(module, nn.Dropout) and module.training:
            calls[-1]["dropped"] = (out.detach() == 0) & (calls[-1]["input"] != 0)

    handles = [nn.modules.module.register_module_forward_pre_hook(pre),
               nn.modules.module.register_module_forward_hook(post)]
    try:
        summary = run_job(run_dir, *tiny("alexnet", *STEPS), *overrides)
    finally:
        for h in handles:
            h.remove()
    assert summary["status"] == "completed"
    return calls, summary


def same_masks(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Equal where both runs' inputs are nonzero (ReLU zeros say nothing about the mask)."""
    for x, y in zip(a, b, strict=True):
        both = (x["input"] != 0) & (y["input"] != 0)
        if not torch.equal(x["dropped"][both], y["dropped"][both]):
            return False
    return True


def test_an_fp8_runs_dropout_masks_equal_its_fp32_twins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fp32, s32 = dropout_record(tmp_path / "fp32", "precision=fp32")
    fp8, s8 = dropout_record(tmp_path / "fp8", "precision=fp8", "loss_scale=enhanced")
    assert s8["precision_detail"]["fp8_layers"]["stochastic_rounding"] is True
    assert len(fp32) == len(fp8) == 3 * 2  # 3 steps, 2 dropout layers
    assert [c["rng"] for c in fp8] == [c["rng"] for c in fp32]
    assert same_masks(fp8, fp32)
    assert s8["pairing"] == s32["pairing"]  # same initial weights (as FP16) and RNG stream
    # the control: stochastic rounding on the global RNG (before issue 18) shifts step 2's masks
    import mptrain.numerics.fp8 as fp8
    import mptrain.numerics.precision as precision

    for mod in (fp8, precision):
        monkeypatch.setattr(mod, "rounding_generator", lambda device: None)
    drift, _ = dropout_record(tmp_path / "global", "precision=fp8", "loss_scale=enhanced")
    assert [c["rng"] for c in drift[:2]] == [c["rng"] for c in fp32[:2]]
    assert [c["rng"] for c in drift[2:]] != [c["rng"] for c in fp32[2:]]


def test_half_precision_runs_record_their_fp32_twins_digests(tmp_path: Path) -> None:
    digests = {
        p: run_job(tmp_path / p, *tiny("alexnet", "trainer.max_steps=1", "trainer.eval_every=1", "trainer.seed=3"),
                   f"precision={p}")["pairing"]
        for p in ("fp32", "fp16_master")
    }
    assert digests["fp16_master"] == digests["fp32"]
    assert rounding_rng.rounding_generator("cpu") is None  # train() hands the global RNG back
    assert len(digests["fp32"]["init_digest"]) == 16

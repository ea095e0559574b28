"""The precision object: mode resolution, storage casts, master weights, stochastic rounding."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from mptrain.errors import MptrainError
from mptrain.numerics.precision import MasterWeights, build_precision, stochastic_round_to_bf16

CPU = torch.device("cpu")


def prec(name: str, **opts):
    return build_precision(OmegaConf.create({"name": name, **opts}), CPU)


TF32_FLAGS = {"matmul": torch.backends.cuda.matmul, "cudnn": torch.backends.cudnn,
              "conv": torch.backends.cudnn.conv, "rnn": torch.backends.cudnn.rnn}


def test_fp32_turns_tf32_off_and_tf32_on_through_the_documented_api():
    # Something has already used fp32_precision (inductor and torchao do): from then on torch
    # raises when the legacy allow_tf32 flags are read, and setting them leaves conv at "none".
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    p = prec("fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p.configure_backends()
        assert {k: b.fp32_precision for k, b in TF32_FLAGS.items()} == dict.fromkeys(TF32_FLAGS, "ieee")
        assert torch.backends.cudnn.allow_tf32 is False  # the legacy getter answers, and agrees
        prec("tf32").configure_backends()
        assert {k: b.fp32_precision for k, b in TF32_FLAGS.items()} == dict.fromkeys(TF32_FLAGS, "tf32")
        assert torch.backends.cudnn.allow_tf32 is True
    p.configure_backends()  # leave the process as a true FP32 baseline
    # torch's own code that reads the legacy getter (cudnn.flags, torch.export) still works after an
    # fp32 run: it raised in an H100 run of the CUDA tests.
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        pass
    assert torch.backends.cudnn.conv.fp32_precision == "ieee"  # flags() restored it


@pytest.mark.parametrize("name,dtype", [("amp_fp16", torch.float16), ("amp_bf16", torch.bfloat16)])
def test_autocast_computes_matmul_in_half_but_loss_and_bn_statistics_in_fp32(name, dtype):
    p = prec(name)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    bn = nn.BatchNorm1d(8)
    with p.autocast():
        y = x @ w
        loss = nn.functional.cross_entropy(y, torch.zeros(4, dtype=torch.long))
        bn(y)
    assert y.dtype == dtype
    # Reductions stay FP32: the softmax cross-entropy (torch.autocast's FP32 op list on every
    # device) and batch-norm running statistics.
    assert loss.dtype == torch.float32
    assert bn.running_var.dtype == torch.float32 and torch.isfinite(bn.running_var).all()


def test_fp16_master_stores_fp16_weights_but_fp32_batchnorm():
    p = prec("fp16_master")
    model = p.prepare_model(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2)))
    assert model[0].weight.dtype == torch.float16
    assert model[1].weight.dtype == torch.float32 and model[1].running_var.dtype == torch.float32
    groups, master = p.master_weights([{"params": list(model[:2].parameters())}])
    assert master is not None
    # The optimizer owns FP32 masters for the FP16 conv, and the BN parameters themselves.
    assert all(t.dtype == torch.float32 for g in groups for t in g["params"])
    assert groups[0]["params"][0] is not model[0].weight


def test_master_weights_keep_updates_that_fp16_weights_lose():
    """Micikevicius et al.: 1e-4 updates are below half an FP16 ulp at 1.0 (2^-11 ~ 4.9e-4)."""
    fp16_only = torch.tensor([1.0], dtype=torch.float16)
    for _ in range(1000):
        fp16_only -= torch.tensor([1e-4], dtype=torch.float16)
    assert fp16_only.item() == 1.0  # never moves

    w = nn.Parameter(torch.tensor([1.0], dtype=torch.float16))
    master = MasterWeights([w])
    opt = torch.optim.SGD([master.swap(w)], lr=1.0)
    for _ in range(1000):
        w.grad = torch.tensor([1e-4], dtype=torch.float16)
        master.before_unscale()
        opt.step()
        master.after_step()
    assert master.masters[0].item() == pytest.approx(0.9, abs=2e-3)
    assert w.item() == pytest.approx(0.9, abs=1e-3)  # the FP16 copy follows the master


def test_stochastic_rounding_to_bf16_is_unbiased():
    x = torch.full((200_000,), 1.0 + 2.0**-9)  # a quarter of the way between bf16 1.0 and 1+2^-7
    rounded = stochastic_round_to_bf16(x, generator=torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert rounded.mean().item() == pytest.approx(x[0].item(), abs=2e-5)
    assert x.to(torch.bfloat16).float().mean().item() == 1.0  # nearest rounding is biased


def _bf16_pure_walk(stochastic: bool, seed: int, steps: int = 1000, n: int = 4096) -> torch.Tensor:
    """n bf16_pure weights at 1.0, each given ``steps`` SGD updates of -1e-4 (a quarter of bf16's
    spacing below 1, 2^-8 = 0.0039, is 1e-3: every single update is far below half an ulp)."""
    p = prec("bf16_pure", stochastic_rounding=stochastic)
    lin = p.prepare_model(nn.Linear(n, 1, bias=False))
    lin.weight.data.fill_(1.0)
    assert lin.weight.dtype == torch.bfloat16
    groups, master = p.master_weights([{"params": [lin.weight]}])
    opt = torch.optim.SGD(groups, lr=1.0)
    torch.manual_seed(seed)
    for _ in range(steps):
        lin.weight.grad = torch.full_like(lin.weight, 1e-4)
        master.before_unscale()
        opt.step()
        master.after_step()
    return lin.weight.detach().float().flatten()


@pytest.mark.parametrize("seed", range(5))
def test_bf16_pure_with_stochastic_rounding_moves_weights_nearest_would_not(seed):
    w = _bf16_pure_walk(True, seed)
    # Unbiased: the mean of 4096 independent walks is 1 - 1000 * 1e-4 = 0.9 (std of the mean ~3e-4).
    assert w.mean().item() == pytest.approx(0.9, abs=2e-3)
    # No FP32 information survives between steps (the masters are re-read from the bf16 weights):
    # each weight is a random walk of 1000 stochastic roundings, whose spread is the theory's
    # sqrt(steps * p * (1 - p)) * ulp with p = 1e-4 / 2^-8. FP32 masters that persisted would give
    # every weight ~0.9 within one ulp (spread < 0.003).
    ulp = 2.0**-8
    p_up = 1e-4 / ulp
    expected = math.sqrt(1000 * p_up * (1 - p_up)) * ulp
    assert w.std().item() == pytest.approx(expected, rel=0.15)
    # With round-to-nearest every update is lost: the weights stay at 1.0.
    if seed == 0:
        assert torch.equal(_bf16_pure_walk(False, seed, steps=50), torch.ones(4096))


def test_unknown_mode_is_rejected():
    with pytest.raises(MptrainError, match="unknown mode"):
        prec("fp4")


def test_torchao_fp8_needs_cuda():
    with pytest.raises(MptrainError, match="needs a CUDA GPU"):
        prec("fp8", backend="torchao")

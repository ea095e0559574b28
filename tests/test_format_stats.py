"""Block-format telemetry: what MX / NVFP4 would do to each layer's activations, weights, gradients."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose, on_cpu, run_job, tiny
from torch import nn

from mptrain.config import validate
from mptrain.errors import MptrainError
from mptrain.numerics.format_stats import N_FIELDS, FormatProbe, block_stats, summary
from mptrain.numerics.mx import fake_quantize, quantize_blocks


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_block_stats_are_the_quantization_error_counts_and_scales(fmt: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=g) * torch.exp2(torch.randint(-8, 8, (16, 1), generator=g).float())
    x[0, :32] = 0  # an all-zero block
    x[1, 5] = 1e-9  # flushed under every format here
    s = summary(block_stats(x, fmt, 1).numpy())
    deq = fake_quantize(x, fmt, 1).double()
    xd = x.double()
    snr = 10 * math.log10((xd**2).sum().item() / ((xd - deq) ** 2).sum().item())
    assert s["snr_db"] == pytest.approx(snr, rel=1e-9)
    nonzero = (x != 0).sum().item()
    assert s["flushed_frac"] == ((x != 0) & (deq == 0)).sum().item() / nonzero > 0
    q = quantize_blocks(x, fmt, 1, with_stats=True)
    assert s["saturated_frac"] == q.saturated.item() / x.numel()
    hist = {int(k): v for k, v in s["scale_exp_hist"].items() if k != "zero"}
    assert sum(hist.values()) + s["scale_exp_hist"].get("zero", 0) == 16 * 64 // q.fmt.block_size
    if q.scale_exponents is not None:
        exps = q.scale_exponents.flatten().tolist()
        assert hist == {e: exps.count(e) for e in set(exps)}


def test_probe_measures_each_layers_tensors_along_their_gemm_dims() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
    probe = FormatProbe(list(model.named_children()), ["mxfp4", "nvfp4"])
    assert [n for n, _ in probe.layers] == ["0", "3"]
    x = torch.randn(4, 3, 4, 4)
    seen: dict[str, torch.Tensor] = {}

    def keep_grad(_m: nn.Module, _i: object, out: torch.Tensor) -> None:
        out.register_hook(lambda g: seen.__setitem__("grad", g))

    model[3].register_forward_hook(keep_grad)
    probe.arm(step=1)
    model(x).square().sum().backward()
    probe.disarm()
    model(x)  # disarmed: not measured
    report = probe.report()
    assert report["every_sampled_step"] == 1
    rows = {(r["layer"], r["kind"]): r for r in report["formats"]["nvfp4"]["layers"]}
    assert set(rows) == {(n, k) for n in ("0", "3") for k in ("act", "weight", "grad")}
    # the Linear's output gradient, blocked along its output features (dgrad's reduction dim)
    expected = summary(block_stats(seen["grad"], "nvfp4", 1).numpy())
    assert rows["3", "grad"]["snr_db"] == pytest.approx(expected["snr_db"])
    # the conv's input, blocked along channels
    assert rows["0", "act"]["snr_db"] == pytest.approx(summary(block_stats(x, "nvfp4", 1).numpy())["snr_db"])
    pooled = report["formats"]["mxfp4"]["all_layers"]
    assert set(pooled) == {"act", "weight", "grad"} and all(np.isfinite(v["snr_db"]) for v in pooled.values())
    probe.close()
    assert N_FIELDS == 6


def test_compare_formats_in_an_fp32_run_and_mx_measures_its_own(run_dir: Path, tmp_path: Path) -> None:
    summary_ = run_job(run_dir, *tiny("alexnet", "telemetry=gradients", "telemetry.every=2",
                                      "telemetry.compare_formats=[mxfp4,nvfp4]", "trainer.max_steps=2"))  # fmt: skip
    block = summary_["telemetry"]["model"]["block_formats"]
    assert list(block["formats"]) == ["mxfp4", "nvfp4"]
    nv = block["formats"]["nvfp4"]["all_layers"]
    assert 0 <= nv["grad"]["flushed_frac"] < 1 and nv["weight"]["snr_db"] > 10
    mx = run_job(tmp_path / "mx", *tiny("alexnet", "precision=mx", "precision.format=mxfp6", "telemetry=gradients",
                                        "telemetry.every=2", "telemetry.compare_formats=[nvfp4]",
                                        "trainer.max_steps=2"))  # fmt: skip
    assert list(mx["telemetry"]["model"]["block_formats"]["formats"]) == ["mxfp6", "nvfp4"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["telemetry=gradients", "telemetry.compare_formats=[fp4]"], "telemetry.compare_formats: 'fp4' must be one of"),
        (["telemetry.compare_formats=[nvfp4]"], "telemetry.compare_formats needs telemetry=gradients"),
    ],
)
def test_bad_compare_formats(overrides: list[str], message: str) -> None:
    with pytest.raises(MptrainError, match=message):
        validate(compose(on_cpu(overrides)))

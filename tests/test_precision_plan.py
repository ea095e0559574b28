"""The precision plan: per GEMM layer its format, the reason and its FLOPs, and the low-precision
share, checked against torch's own FLOP counter and against what the precision did to the layers."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import run_job, tiny
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mptrain.cli import compose
from mptrain.config import validate
from mptrain.numerics.plan import OUTSIDE, build_plan, layer_format


class Mixed(nn.Module):
    """Every GEMM kind the plan counts, with groups, strides and padding, plus a bare matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=4)
        self.up = nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1)
        self.fc = nn.Linear(4 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.grouped(self.conv(x)))
        y = self.fc(h.flatten(1))
        return y @ y.t()  # a GEMM outside any layer: counted in the total, never converted


def test_layer_flops_match_torchs_flop_counter_per_module():
    model, x = Mixed(), torch.randn(2, 3, 16, 16)
    plan = build_plan({"model": model}, lambda: model(x), ("fp32", "precision=fp32"))
    counter = FlopCounterMode(display=False)
    with counter:
        model(x)
    per_module = counter.get_flop_counts()
    for layer in plan.layers:
        assert layer.flops == sum(per_module[f"Mixed.{layer.name}"].values()), layer.name
    assert plan.total_flops == counter.get_total_flops()
    assert sum(layer.flops for layer in plan.layers) < plan.total_flops  # y @ y.t() is outside
    assert plan.low_precision_flop_fraction == 0.0


def test_lstm_flops_are_four_gates_over_input_and_hidden_per_layer():
    lstm, x = nn.LSTM(16, 32, num_layers=2), torch.randn(5, 3, 16)  # (time, batch, features)
    plan = build_plan({"m": lstm}, lambda: lstm(x), ("fp32", "precision=fp32"))
    # The gate matmuls by hand: [x_t, h_{t-1}] (16+32, then 32+32) times 4*32 gates, per token.
    per_token = 2 * 4 * 32 * (16 + 32) + 2 * 4 * 32 * (32 + 32)
    assert [(layer.kind, layer.flops) for layer in plan.layers] == [("lstm", 15 * per_token)]


def test_torchao_plan_says_which_layers_it_left_and_why():
    # Module conversion runs on the CPU with the real torchao (the test extra): a ResNet-like head.
    pytest.importorskip("torchao.float8")
    from mptrain.numerics.fp8 import convert_model

    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Flatten(), nn.Linear(16 * 6 * 6, 32), nn.Linear(32, 10))
    model, _ = convert_model(model, {"backend": "torchao", "recipe": "rowwise"})
    formats = {name: layer_format(m, ("bf16", "autocast"))
               for name, m in model.named_modules() if name in ("0", "2", "3")}
    assert formats["2"] == ("torchao_rowwise", "Float8Linear", True)
    assert formats["3"][:2] == ("bf16", "kept high: 32x10: not divisible by 16, as float8 GEMMs need")
    assert formats["0"][1] == "kept high: torchao float8 converts nn.Linear only, not Conv2d"


def test_nvfp4_plan_keeps_the_last_layers_high_and_counts_the_rest(tmp_path):
    s = run_job(tmp_path, "model=transformer_lm_tiny", "precision=mx", "precision.format=nvfp4",
                "data.batch_size=4", "trainer.max_steps=1")
    layers = [layer for layer in s["precision_plan"]["layers"] if layer["kind"] == "linear"]
    assert layers[-1]["name"] == "lm_head" and layers[-1]["reason"].startswith("kept high: last layer")
    # the head's weight is the token embedding's (tie_weights): the plan says so
    assert layers[-1]["reason"].endswith("; weight tied to embed.wte")
    low = [layer for layer in layers if layer["low_precision"]]
    assert low and all(layer["format"] == "nvfp4" for layer in low)
    fraction = sum(layer["flops"] for layer in low) / s["precision_plan"]["total_flops"]
    assert s["precision_plan"]["low_precision_flop_fraction"] == pytest.approx(fraction) and fraction < 1


def test_every_run_writes_its_plan(tmp_path):
    s = run_job(tmp_path / "fp32", *tiny("alexnet", "trainer.max_steps=1"))
    plan = s["precision_plan"]
    assert {layer["format"] for layer in plan["layers"]} == {"fp32"}
    assert plan["low_precision_flop_fraction"] == 0.0
    assert [layer["kind"] for layer in plan["layers"]][:1] == ["conv2d"] and plan["layers"][-1]["kind"] == "linear"

    s = run_job(tmp_path / "fp8", *tiny("alexnet", "precision=fp8", "trainer.max_steps=1"))
    plan = s["precision_plan"]
    assert {layer["format"] for layer in plan["layers"]} == {"fp8_e5m2"}
    assert plan["low_precision_flop_fraction"] == pytest.approx(1.0)


@pytest.mark.parametrize(("precision", "fmt"), [("amp_bf16", "bf16"), ("fp16_master", "fp16"), ("bf16_pure", "bf16")])
def test_half_precision_layers_are_labelled_by_their_dtype(tmp_path, precision, fmt):
    s = run_job(tmp_path, *tiny("alexnet", f"precision={precision}", "trainer.max_steps=1"))
    assert {layer["format"] for layer in s["precision_plan"]["layers"]} == {fmt}


def test_transformer_attention_gemms_count_as_not_converted(tmp_path):
    s = run_job(tmp_path, "model=transformer_lm_tiny", "precision=fp8", "data.batch_size=4", "trainer.max_steps=1")
    plan = s["precision_plan"]
    linear = sum(layer["flops"] for layer in plan["layers"] if layer["kind"] == "linear")
    # What FP8 leaves high is listed, not dropped: the two embeddings, and SDPA's QK^T and AV as one
    # row of matmuls outside any layer, which the low-precision share is below 1 by exactly.
    others = {layer["name"]: layer for layer in plan["layers"] if layer["kind"] != "linear"}
    assert set(others) == {"embed.wte", "embed.wpe", OUTSIDE}
    assert others["embed.wte"]["reason"] == "kept high: a table lookup: no GEMM to quantize"
    assert others[OUTSIDE]["flops"] == plan["total_flops"] - linear > 0
    fraction = plan["low_precision_flop_fraction"]
    assert fraction == pytest.approx(linear / plan["total_flops"]) and 0.5 < fraction < 1.0


@pytest.mark.parametrize("model", ["lstm_lm_tiny", "alexnet"])
def test_measuring_the_plan_leaves_the_run_unchanged(tmp_path, model):
    # One forward pass before training must not move the RNG (dropout), the data order or the
    # LSTM's carried state: the losses are bit-identical with and without it.
    args = [*tiny("alexnet")] if model == "alexnet" else ["model=lstm_lm_tiny", "data.batch_size=4"]
    args += ["trainer.max_steps=3", "trainer.log_every=1"]
    a = run_job(tmp_path / "a", *args)
    b = run_job(tmp_path / "b", *args, "trainer.precision_plan=false")
    assert b["precision_plan"] is None and a["precision_plan"]["layers"]
    assert json.dumps(a["final_loss"]) == json.dumps(b["final_loss"])


def test_the_console_plan_groups_layers_that_share_format_and_reason(tmp_path):
    """ResNet-50: one row for its 53 convolutions and its classifier, all in the mode's dtype for
    the same reason; with NVFP4 the kept-high last layers get rows of their own. Per layer on request."""
    from rich.console import Console

    from mptrain.cli import compose
    from mptrain.config import validate
    from mptrain.engine import Engine
    from mptrain.numerics.plan import plan_rows, render

    cfg = compose([*tiny("resnet50", "precision=fp32"), "trainer.device=cpu"])
    validate(cfg)
    plan = Engine(cfg, tmp_path).plan
    assert plan_rows(plan) == [("53 conv2d + 1 linear", "fp32", "precision=fp32", plan.total_flops, "100.0%")]
    assert len(plan_rows(plan, per_layer=True)) == 54
    console = Console(record=True, width=200)
    console.print(render(plan))
    assert "53 conv2d + 1 linear" in console.export_text()

    s = run_job(tmp_path / "nv", "model=transformer_lm_tiny", "precision=mx", "precision.format=nvfp4",
                "trainer.max_steps=1", "trainer.precision_plan_layers=true")
    layers = s["precision_plan"]["layers"]
    from mptrain.numerics.plan import LayerPlan, PrecisionPlan

    nv = PrecisionPlan([LayerPlan(**layer) for layer in layers], s["precision_plan"]["total_flops"])
    rows = plan_rows(nv)
    kept = [r for r in rows if r[1] != "nvfp4"]
    assert kept and all(r[2].startswith("kept high") for r in kept)
    def count(name: str) -> int:  # "3 linear + 1 conv2d" is 4 layers, "head (linear)" one
        return sum(int(n) for n in re.findall(r"(\d+) \w+", name)) if name[0].isdigit() else 1

    assert sum(count(r[0]) for r in rows) == len(layers)


@pytest.mark.parametrize("options", [["precision.emulated_compute=bf16"],
                                     ["precision.emulated_compute=bf16", "precision.autocast=bf16"]],
                         ids=["bf16 products", "bf16 products and autocast"])
def test_layers_kept_high_by_nvfp4_are_planned_in_the_dtype_they_compute_in(tmp_path, options):
    """A layer NVFP4's recipe keeps high computes in FP32, or in bf16 under ``precision.autocast=bf16``
    (attention and norms with it), never in ``emulated_compute``, which is the quantized GEMMs' own.
    The plan says so, checked against the dtype each kept layer's output has in a real forward. (The
    plan used to say bf16 for kept FP32 layers whenever the products were bf16.)"""
    from mptrain.engine import Engine

    cfg = compose(["model=transformer_lm_tiny", "precision=mx", "precision.format=nvfp4", "data.batch_size=2",
                   "trainer.max_steps=1", "trainer.device=cpu", *options])
    validate(cfg)
    engine = Engine(cfg, tmp_path)
    model = engine.task.modules["model"]
    names = {name for name, _ in model.named_modules()}
    planned = {layer.name: layer for layer in engine.plan.layers if layer.name in names}  # modules: not OUTSIDE
    seen: dict[str, torch.dtype] = {}

    def record(name: str):  # a hook that returns None leaves the output as it is
        return lambda module, args, out: seen.setdefault(name, out.dtype) and None

    hooks = [m.register_forward_hook(record(name)) for name, m in model.named_modules() if name in planned]
    try:
        batch = next(engine.task.train_batches(0))
        with engine.precision.autocast():
            engine.task.loss(engine.slots[0].objective, batch)
    finally:
        for h in hooks:
            h.remove()
    kept = {name for name, layer in planned.items() if not layer.low_precision}
    assert "lm_head" in kept and kept != set(planned)
    short = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    assert {name: planned[name].format for name in kept} == {name: short[seen[name]] for name in kept}
    want = "bf16" if "precision.autocast=bf16" in options else "fp32"
    assert {planned[name].format for name in kept if planned[name].kind != "embedding"} == {want}

"""Gradient telemetry: every statistic on gradients whose fractions are known, the hooks, the
FP32 shadow pass, the histogram and the end-of-run report."""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import Tensor, nn

from mptrain.config import TelemetryConfig
from mptrain.config import check_telemetry as check_config
from mptrain.errors import MptrainError
from mptrain.models.lstm import LSTMLanguageModel
from mptrain.numerics.loss_scaling import NoScaler, StaticScaler
from mptrain.numerics.precision import Precision, build_precision
from mptrain.numerics.telemetry import GradientTelemetry, build_telemetry, select_layers
from mptrain.numerics.telemetry_stats import (
    FORMATS,
    HIST_HI,
    HIST_LO,
    N_BINS,
    LogHistogram,
    _count_bins_indexed,
    _write_histogram,
    grad_stats,
    resolve_formats,
    summarize,
)

CPU = torch.device("cpu")


def tcfg(**kw: Any) -> Any:
    return OmegaConf.structured(TelemetryConfig(**{"name": "gradients", "every": 1, **kw}))


def precision(name: str, **opts: Any) -> Precision:
    return build_precision(OmegaConf.create({"name": name, **opts}), CPU)


class FakeWriter:
    def __init__(self) -> None:
        self.hists: dict[tuple[str, int], dict[str, Any]] = {}

    def add_histogram_raw(self, tag: str, global_step: int, **kw: Any) -> None:
        self.hists[tag, global_step] = kw


class FakeLogger:
    def __init__(self) -> None:
        self.scalars: dict[tuple[str, int], float] = {}
        self.writer = FakeWriter()

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars[tag, step] = value


# --------------------------------------------------------------------------------------------
# the statistics, exactly


def known_gradient(name: str, amax_log2: int = 3, seed: int = 0) -> Tensor:
    """1000 values: 10% zeros, 20% in (0, u), 30% in [u, n), 40% normal up to 2^amax_log2."""
    fmt = FORMATS[name]
    u, n = fmt.min_subnormal, fmt.min_normal
    g = np.concatenate(
        [
            np.zeros(100),
            np.repeat([u * 0.5, u * 0.75, u * 2.0**-10, u * 0.999], 50),
            np.repeat([u, u * 1.5, n * 0.75], 100),
            np.repeat([n, 1.0, 2.0 ** (amax_log2 - 1)], 133),
            [2.0**amax_log2],
        ]
    )
    rng = np.random.default_rng(seed)
    g = g * rng.choice([-1.0, 1.0], size=g.size)
    return torch.tensor(rng.permutation(g), dtype=torch.float32)


def stats_of(g: Tensor, fmt: str) -> dict[str, float]:
    hist, amax = grad_stats(g)
    return summarize(hist.numpy(), float(amax), g.numel(), FORMATS[fmt])


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "e5m2", "e4m3"])
def test_statistics_on_known_fractions(fmt: str) -> None:
    g = known_gradient(fmt)
    s = stats_of(g, fmt)
    assert s["zero_frac"] == 0.1
    assert s["underflow_frac"] == 0.2
    assert s["subnormal_frac"] == 0.3
    assert s["overflow"] == 0.0
    assert s["log2_amax"] == 3.0
    assert s["headroom_bits"] == math.log2(FORMATS[fmt].max) - 3.0

    # An Inf (or a NaN) is overflow; log2_amax stays that of the finite values.
    for bad in (math.inf, -math.inf, math.nan):
        g2 = g.clone()
        g2[g2.abs() == 1.0] = bad
        s2 = stats_of(g2, fmt)
        assert s2["overflow"] == 1.0 and s2["log2_amax"] == 3.0
        assert (s2["zero_frac"], s2["underflow_frac"], s2["subnormal_frac"]) == (0.1, 0.2, 0.3)

    # A finite value above the format's max is overflow too, with negative headroom.
    if fmt != "bf16":
        big = FORMATS[fmt].max * 1.5
        g3 = g.clone()
        g3[0] = -big
        s3 = stats_of(g3, fmt)
        assert s3["overflow"] == 1.0
        assert s3["headroom_bits"] == pytest.approx(-math.log2(1.5))


def test_fp16_thresholds_are_the_science_md_constants() -> None:
    g = torch.tensor([0.0, 2.0**-25, 2.0**-24, 2.0**-14 * 0.999, 2.0**-14, 65504.0])
    s = stats_of(g, "fp16")
    assert s["zero_frac"] == 1 / 6 and s["underflow_frac"] == 1 / 6 and s["subnormal_frac"] == 2 / 6
    assert s["overflow"] == 0.0 and s["headroom_bits"] == 0.0
    assert stats_of(torch.tensor([65504.0 * 1.0001]), "fp16")["overflow"] == 1.0
    # The same thresholds for the other formats (smallest subnormal, smallest normal).
    assert [(round(math.log2(f.min_subnormal)), round(math.log2(f.min_normal))) for f in FORMATS.values()] == [
        (-24, -14),
        (-133, -126),
        (-16, -14),
        (-9, -6),
    ]


def test_stats_of_half_and_empty_gradients() -> None:
    g = known_gradient("e4m3", amax_log2=2)
    assert stats_of(g.half(), "e4m3") == stats_of(g, "e4m3")  # every value is exact in FP16
    empty = stats_of(torch.zeros(0), "fp16")
    assert empty["zero_frac"] == 0.0 and empty["log2_amax"] == -math.inf


def test_every_bin_edge_is_exact() -> None:
    for b in range(-126, 128):
        below = float(np.nextafter(np.float32(2.0**b), np.float32(0.0)))  # the FP32 value just below
        hist, _ = grad_stats(torch.tensor([2.0**b, below, -(2.0**b)], dtype=torch.float32))
        assert hist[b + 129] == 2 and hist[b + 128] == 1, b
    # Inside the FP32 subnormals, the split at bf16's smallest subnormal 2^-133.
    tiny = torch.tensor([2.0**-149, 2.0**-133 - 2.0**-149, 2.0**-133, 2.0**-126 - 2.0**-149, 0.0])
    hist, _ = grad_stats(tiny)
    assert hist[:4].tolist() == [1, 2, 2, 0] and int(hist.sum()) == 5


def test_device_counting_path_matches_bincount() -> None:
    idx = torch.randint(0, N_BINS, (10_000,))
    assert torch.equal(_count_bins_indexed(idx, N_BINS), torch.bincount(idx, minlength=N_BINS))


def test_histogram_has_a_zero_bin_and_binades_from_minus_40_to_16() -> None:
    g = torch.tensor([0.0, -0.0, 2.0**-50, 2.0**-30, -(2.0**-30) * 1.5, 1.0, 2.0**20, math.inf])
    hist, _ = grad_stats(g)
    h = LogHistogram.from_bins(hist.numpy())
    assert h.edges == list(range(HIST_LO, HIST_HI + 1)) == list(range(-40, 17))
    assert len(h.counts) == 56
    assert h.zero == 2 and h.nonfinite == 1
    expected = [0] * 56
    expected[0] = 1  # 2^-50: clamped into the first binade
    expected[-30 + 40] = 2
    expected[0 + 40] = 1
    expected[-1] = 1  # 2^20: clamped into the last
    assert h.counts == expected

    writer = FakeWriter()
    _write_histogram(writer, "t", h, step=5)
    raw = writer.hists["t", 5]
    assert raw["bucket_limits"][:3] == [-41.0, -40.0, -39.0]  # zero bin, empty gap, binade -40
    assert raw["bucket_counts"][:3] == [2, 0, 1]
    assert raw["bucket_limits"][-1] == 16.0 and len(raw["bucket_limits"]) == len(raw["bucket_counts"])
    assert raw["num"] == 7


# --------------------------------------------------------------------------------------------
# hooks


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.act = nn.ReLU(inplace=True)  # in place right after a hooked layer, as in VGG
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x: Tensor) -> Tensor:
        x = self.act(self.conv1(x))
        x = F.relu(self.bn(self.conv2(x)))
        return self.fc(self.drop(x.flatten(1)))


def batch(seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 5, (4,), generator=gen)


def train_step(
    tel: GradientTelemetry,
    model: nn.Module,
    prec: Precision,
    scaler: Any,
    step: int,
    mult: float = 1.0,
    shadow: bool = False,
) -> None:
    """The engine's step, as the integration in telemetry.py's docstring describes it."""
    x, y = batch(step)
    model.zero_grad(set_to_none=True)

    def loss_fn() -> Tensor:
        with prec.autocast():
            return F.cross_entropy(model(prec.input_cast(x)).float(), y) * mult

    tel.active(step)
    loss = loss_fn()
    with tel.capture(step):  # capture, record_weight_grads and shadow are no-ops off active steps
        scaler.scale(loss).backward()
    tel.record_weight_grads()
    if shadow:
        tel.shadow(loss_fn)


def test_hooks_see_the_right_layers_with_the_scale_applied() -> None:
    prec = precision("fp32")
    logs = {}
    for scale in (1.0, 2.0**10):
        torch.manual_seed(0)
        model = Net()
        scaler = StaticScaler(CPU, scale)
        tel = GradientTelemetry(tcfg(), model, prec, scaler)
        assert tel.names == ["conv1", "conv2", "fc"]
        train_step(tel, model, prec, scaler, step=1)
        logs[scale] = logger = FakeLogger()
        tel.flush(logger, step=1)
        tel.close()
    for layer in ("conv1", "conv2", "fc", "all_layers"):
        for kind in ("act_grad", "weight_grad"):
            tag = f"telemetry/{layer}/{kind}/log2_amax"
            assert logs[2.0**10].scalars[tag, 1] - logs[1.0].scalars[tag, 1] == 10.0, tag
            zero = f"telemetry/{layer}/{kind}/zero_frac"
            assert logs[2.0**10].scalars[zero, 1] == logs[1.0].scalars[zero, 1]
    # conv1's output gradient is taken before the in-place ReLU: the ReLU's mask shows as zeros.
    assert logs[1.0].scalars["telemetry/conv1/act_grad/zero_frac", 1] > 0.2


def test_activation_statistics_match_a_reference_hook() -> None:
    prec = precision("fp32")
    torch.manual_seed(0)
    model = Net()
    seen: dict[str, Tensor] = {}
    model.fc.register_full_backward_hook(lambda m, gi, go: seen.__setitem__("fc", go[0].clone()))
    scaler = NoScaler(CPU)
    tel = GradientTelemetry(tcfg(), model, prec, scaler)
    train_step(tel, model, prec, scaler, step=1, mult=2.0**-20)
    logger = FakeLogger()
    tel.flush(logger, 1)
    ref = stats_of(seen["fc"], "fp16")
    for k, v in ref.items():
        assert logger.scalars[f"telemetry/fc/act_grad/{k}", 1] == v


def test_only_every_kth_step_is_captured_and_flush_logs_each() -> None:
    prec = precision("fp32")
    model = Net()
    scaler = NoScaler(CPU)
    tel = GradientTelemetry(tcfg(every=3, formats=["fp16", "e5m2", "e4m3"]), model, prec, scaler)
    logger = FakeLogger()
    for step in range(1, 8):
        train_step(tel, model, prec, scaler, step)
    tel.flush(logger, 7)
    steps = {s for (tag, s) in logger.scalars}
    assert steps == {3, 6}
    for kind in ("act_grad", "weight_grad"):
        for stat in (
            "zero_frac",
            "underflow_frac",
            "subnormal_frac",
            "overflow",
            "log2_amax",
            "headroom_bits",
            "underflow_e5m2",
            "underflow_e4m3",
            "subnormal_e4m3",
            "headroom_bits_e5m2",
        ):
            assert (f"telemetry/fc/{kind}/{stat}", 6) in logger.scalars
        assert (f"telemetry/conv1/{kind}/log2_abs", 3) in logger.writer.hists
    assert ("telemetry/all_layers/act_grad/log2_abs", 6) in logger.writer.hists
    assert tel.report()["steps_sampled"] == 2
    tel.flush(logger, 8)  # nothing new: nothing written
    assert {s for (_, s) in logger.scalars} == {3, 6}


def test_layer_cap_keeps_first_and_last() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    names = [n for n, _ in select_layers(model, 4)]
    assert len(names) == 4 and names[0] == "0" and names[-1] == "9"
    assert len(select_layers(model, None)) == 10


def test_formats_resolve_from_the_precision() -> None:
    def names(p: Precision, f: list[str] | None = None) -> list[str]:
        return [n for n, _ in resolve_formats(f or ["auto"], p)]

    assert names(precision("fp32")) == ["fp16"]  # "would it underflow in FP16"
    assert names(precision("amp_fp16")) == ["fp16"]
    assert names(precision("amp_bf16")) == ["bf16"]
    assert names(precision("bf16_pure")) == ["bf16"]
    assert names(precision("fp8")) == ["fp16", "e5m2", "e4m3"]
    assert names(precision("fp32"), ["e4m3", "auto", "e4m3"]) == ["e4m3", "fp16"]


def test_config_checks_and_off() -> None:
    check_config(tcfg())
    for bad in ({"every": 0}, {"formats": ["fp64"]}, {"max_layers": 1}, {"max_underflow": 1.5}):
        with pytest.raises(MptrainError):
            check_config(tcfg(**bad))
    off = OmegaConf.structured(TelemetryConfig())
    assert off.name == "off" and build_telemetry(off, Net(), precision("fp32"), NoScaler(CPU)) is None


# --------------------------------------------------------------------------------------------
# shadow


def lost(logger: FakeLogger) -> dict[str, float]:
    return {
        tag.split("/")[1] + "/" + tag.split("/")[2]: v
        for (tag, _), v in logger.scalars.items()
        if tag.endswith("lost_frac")
    }


def shadow_case(scale: float) -> dict[str, float]:
    """One amp_fp16 step with a tiny loss, the shadow pass checked to change nothing; lost_frac."""
    prec = precision("amp_fp16")
    torch.manual_seed(0)
    model = Net()
    scaler = StaticScaler(CPU, scale)
    tel = GradientTelemetry(tcfg(shadow=True), model, prec, scaler)
    x, y = batch(1)

    def loss_fn() -> Tensor:
        with prec.autocast():
            return F.cross_entropy(model(prec.input_cast(x)).float(), y) * 2.0**-20

    tel.active(1)
    loss = loss_fn()
    with tel.capture(1):
        scaler.scale(loss).backward()
    tel.record_weight_grads()
    grads = [p.grad.clone() for p in model.parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    tel.shadow(loss_fn)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))
    assert torch.equal(rng, torch.get_rng_state())
    assert prec.autocast_dtype == torch.float16  # the precision is itself again
    logger = FakeLogger()
    tel.flush(logger, 1)
    tel.close()
    return lost(logger)


def test_shadow_measures_what_fp16_loses_and_leaves_training_alone() -> None:
    unscaled, scaled = shadow_case(1.0), shadow_case(2.0**20)
    assert set(unscaled) == {
        f"{n}/{k}" for n in ("conv1", "conv2", "fc", "all_layers") for k in ("act_grad", "weight_grad")
    }
    assert unscaled["all_layers/act_grad"] > 0.1 and unscaled["conv1/weight_grad"] > 0.1
    # Same dropout masks in both passes (the RNG is replayed), so a large scale loses nothing.
    assert max(scaled.values()) < 1e-3


def test_shadow_with_fp16_weights_restores_them() -> None:
    prec = precision("fp16_master")
    torch.manual_seed(0)
    model = prec.prepare_model(Net())
    assert model.conv1.weight.dtype == torch.float16 and model.bn.weight.dtype == torch.float32
    scaler = StaticScaler(CPU, 1.0)
    tel = GradientTelemetry(tcfg(shadow=True), model, prec, scaler)
    weights = [p.detach().clone() for p in model.parameters()]
    train_step(tel, model, prec, scaler, step=1, mult=2.0**-20, shadow=True)
    assert [p.dtype for p in model.parameters()] == [w.dtype for w in weights]
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters(), strict=True))
    assert all(p.grad is None or p.grad.dtype == p.dtype for p in model.parameters())
    logger = FakeLogger()
    tel.flush(logger, 1)
    assert lost(logger)["all_layers/weight_grad"] > 0.1


def test_shadow_with_gradient_accumulation_compares_the_first_micro_batch() -> None:
    prec = precision("amp_fp16")
    torch.manual_seed(0)
    model = Net()
    scaler = StaticScaler(CPU, 1.0)
    tel = GradientTelemetry(tcfg(shadow=True), model, prec, scaler)
    batches = [batch(1), batch(2)]

    def loss_of(xy: tuple[Tensor, Tensor]) -> Tensor:
        with prec.autocast():
            return F.cross_entropy(model(prec.input_cast(xy[0])).float(), xy[1]) * 2.0**-20 / 2

    tel.active(1)
    for xy in batches:
        loss = loss_of(xy)
        with tel.capture(1):
            scaler.scale(loss).backward()
    tel.record_weight_grads()
    tel.shadow(lambda: loss_of(batches[0]))
    logger = FakeLogger()
    tel.flush(logger, 1)
    found = lost(logger)
    # Activation gradients are per micro-batch: compared. Weight gradients sum both: not compared.
    assert found["all_layers/act_grad"] > 0.1 and "all_layers/weight_grad" not in found


def test_shadow_swaps_emulated_fp8_layers_back() -> None:
    prec = precision("fp8")
    torch.manual_seed(0)
    net = Net()
    net.act.inplace = False  # emulated FP8 layers do not allow in-place ops on their outputs yet
    model = prec.prepare_model(net)
    classes = [type(m) for m in model.modules()]
    assert type(model.fc).__name__ == "Fp8Linear"
    scaler = StaticScaler(CPU, 1.0)
    tel = GradientTelemetry(tcfg(shadow=True), model, prec, scaler)
    assert [n for n, _ in tel.formats] == ["fp16", "e5m2", "e4m3"]
    train_step(tel, model, prec, scaler, step=1, mult=2.0**-12, shadow=True)
    assert [type(m) for m in model.modules()] == classes
    logger = FakeLogger()
    tel.flush(logger, 1)
    assert ("telemetry/fc/act_grad/underflow_e5m2", 1) in logger.scalars
    assert lost(logger)["all_layers/act_grad"] > 0  # E5M2 errors (stochastic rounding) lose some


def test_shadow_sets_an_instance_forward_aside() -> None:
    """Adaptive loss scaling replaces the module's forward on the instance; the FP32 reference pass
    runs the class's own forward and leaves the instrumented one in place."""
    prec = precision("amp_fp16")
    torch.manual_seed(0)
    model = Net()
    calls = []

    def instrumented(x: Tensor) -> Tensor:
        calls.append(torch.is_autocast_enabled("cpu"))
        return Net.forward(model, x)

    model.forward = instrumented  # type: ignore[method-assign]
    scaler = StaticScaler(CPU, 1.0)
    tel = GradientTelemetry(tcfg(shadow=True), model, prec, scaler)
    train_step(tel, model, prec, scaler, step=1, shadow=True)
    assert calls == [True] and model.forward is instrumented


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.head = nn.Linear(8, 20)

    def forward(self, t: Tensor, hidden: tuple[Tensor, Tensor] | None = None) -> Tensor:
        return self.head(self.lstm(self.emb(t), hidden)[0])


def test_recurrent_and_embedding_layers_are_hooked() -> None:
    model = LM()
    prec = precision("fp32")
    scaler = NoScaler(CPU)
    tel = GradientTelemetry(tcfg(), model, prec, scaler)
    assert tel.names == ["emb", "lstm", "head"]
    t = torch.randint(0, 20, (2, 5))
    tel.active(1)
    with tel.capture(1):
        F.cross_entropy(model(t).flatten(0, 1), t.flatten()).backward()
    tel.record_weight_grads()
    logger = FakeLogger()
    tel.flush(logger, 1)
    for layer in ("emb", "lstm", "head"):
        for kind in ("act_grad", "weight_grad"):
            assert (f"telemetry/{layer}/{kind}/zero_frac", 1) in logger.scalars


def test_shadow_casts_a_carried_low_precision_state_to_fp32() -> None:
    prec = precision("amp_bf16")
    # mptrain's LM, not a bare nn.LSTM: CPUs below AVX512 have no oneDNN bf16 LSTM, and the model
    # routes around that (mptrain.hardware.lstm_path).
    model = LSTMLanguageModel(vocab_size=20, emb_size=8, hidden_size=8, num_layers=1, tie_weights=False)
    scaler = NoScaler(CPU)
    tel = GradientTelemetry(tcfg(shadow=True), model, prec, scaler)
    t = torch.randint(0, 20, (2, 5))
    hidden = (torch.zeros(1, 2, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 8, dtype=torch.bfloat16))

    def loss_fn() -> Tensor:  # truncated BPTT: the state carried in from the last step is bf16
        with prec.autocast():
            return F.cross_entropy(model(t, hidden)[0].float().flatten(0, 1), t.flatten())

    tel.active(1)
    with tel.capture(1):
        scaler.scale(loss_fn()).backward()
    tel.record_weight_grads()
    tel.shadow(loss_fn)
    logger = FakeLogger()
    tel.flush(logger, 1)
    assert "lstm/act_grad" in lost(logger)


# --------------------------------------------------------------------------------------------
# report


class Deep(nn.Module):
    """Linear layers whose gradients sit around 2^-30: FP16 would lose nearly all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


def run_deep(scale: float, steps: int = 2) -> dict[str, Any]:
    prec = precision("fp32")
    torch.manual_seed(0)
    model = Deep()
    scaler = StaticScaler(CPU, scale)
    tel = GradientTelemetry(tcfg(), model, prec, scaler)
    for step in range(1, steps + 1):
        x = torch.randn(8, 16)
        tel.active(step)
        with tel.capture(step):
            scaler.scale(model(x).sum() * 2.0**-30).backward()
        tel.record_weight_grads()
        model.zero_grad()
    report = tel.report()
    tel.close()
    return report


def test_report_flags_underflow_and_suggests_a_scale_that_lifts_it() -> None:
    report = run_deep(1.0)
    assert report["format"] == "fp16" and report["measured_in"] == "fp32"
    rows = {(r["layer"], r["kind"]): r for r in report["layers"]}
    out = rows["b", "act_grad"]
    assert out["underflow_frac"] == 1.0 and out["true_log2_amax"] == -30.0
    assert "b act_grad: underflow 100.0%" in report["at_risk"]
    sug = report["suggestions"]["fp16"]
    lo, hi = sug["log2_range"]
    assert sug["fits"] and lo <= sug["log2"] <= hi
    assert report["suggested_scale"] == sug["scale"] >= 2.0**6
    assert hi == math.floor(math.log2(65504) - 1 - max(r["true_log2_amax"] for r in report["layers"]))
    # The suggestion, applied, leaves nothing at risk.
    again = run_deep(sug["scale"])
    assert again["at_risk"] == []
    assert again["suggestions"]["fp16"]["log2"] == sug["log2"]  # the true range did not move
    h = report["act_grad_histogram"]
    assert h["zero"] == 0 and sum(h["counts"]) > 0 and len(h["log2_edges"]) == 57


def test_report_table_and_overflow_flag() -> None:
    prec = precision("fp32")
    model = Deep()
    scaler = StaticScaler(CPU, 2.0**20)
    tel = GradientTelemetry(tcfg(), model, prec, scaler)
    tel.active(1)
    with tel.capture(1):
        scaler.scale(model(torch.randn(8, 16)).sum()).backward()  # 2^20 * O(1): past FP16's max
    tel.record_weight_grads()
    report = tel.report()
    assert any("overflow on 1/1 steps" in r for r in report["at_risk"])
    assert report["suggestions"]["fp16"]["log2"] < 20
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(tel.table(report))
    text = console.export_text()
    assert "overflow" in text and "suggested static loss scale for fp16" in text


def test_adaptive_gradients_are_unscaled_by_each_layers_own_scale() -> None:
    """Adaptive scaling gives every layer its own cumulative scale (up to accum_cap): the 'true'
    statistics must divide each layer by its own, not by the loss-level init_scale. Reference: the
    same step in FP32 without scaling (powers of two: the comparison is exact)."""
    from mptrain.numerics.adaptive_scaling import AdaptiveScaler

    prec = precision("fp32")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    ref = copy.deepcopy(model)
    x = torch.randn(8, 16)
    mult = 2.0**-20  # small gradients: the per-layer scales grow towards the top of the chain

    ref_act: dict[int, float] = {}

    def watch(i: int) -> Any:
        def hook(_m: nn.Module, _inp: Any, out: Tensor) -> None:
            out.register_hook(lambda g: ref_act.__setitem__(i, g.abs().max().item()))

        return hook

    for i in (0, 2, 4):
        ref[i].register_forward_hook(watch(i))
    (ref(x).square().mean() * mult).backward()

    scaler = AdaptiveScaler(CPU, init_scale=1.0)
    scaler.attach(model)
    tel = GradientTelemetry(tcfg(), model, prec, scaler)
    tel.active(1)
    with tel.capture(1):
        scaler.scale(model(x).square().mean() * mult).backward()
    tel.record_weight_grads()
    report = tel.report()
    tel.close()
    cum = scaler.telemetry()["cum_scale"].tolist()
    assert len(set(cum)) > 1 and max(cum) > 1  # the layers really carry different scales
    rows = {(r["layer"], r["kind"]): r for r in report["layers"]}
    for i in (0, 2, 4):
        true_w = math.log2(max(ref[i].weight.grad.abs().max().item(), ref[i].bias.grad.abs().max().item()))
        assert rows[str(i), "weight_grad"]["true_log2_amax"] == pytest.approx(true_w, abs=1e-6), i
        assert rows[str(i), "act_grad"]["true_log2_amax"] == pytest.approx(math.log2(ref_act[i]), abs=1e-6), i

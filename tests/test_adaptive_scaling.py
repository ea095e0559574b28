"""Adaptive loss scaling (Zhao et al. 2019): the rule, exact unscaling through joins, underflow
rescue in FP16, skipping, state round-trip and torchvision's resnet18. CPU only."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mptrain.errors import MptrainError
from mptrain.numerics.adaptive_scaling import AdaptiveScaler, join_scale, layer_scale

ROOT = Path(__file__).resolve().parents[1]

CPU = torch.device("cpu")
TINY = 2.0**-20  # loss multiplier that makes gradients small enough for per-layer scales > 1


# --------------------------------------------------------------------------------------------
# the rule, by hand


def _erfinv_small(x: float) -> float:
    # Maclaurin series of erfinv; for x = 1e-3 the first omitted term is ~1e-16 relative.
    c = math.sqrt(math.pi) / 2
    return c * (x + (math.pi / 12) * x**3 + (7 * math.pi**2 / 480) * x**5)


def _hand_rule(
    g: list[float],
    w: list[float],
    prev: float,
    fan_in: int,
    *,
    u_min: float = 2.0**-24,
    u_max: float = 65504.0,
    n_uf: float = 1e-3,
    layer_cap: float = 16.0,
    accum_cap: float = 1024.0,
    power_of_two: bool = True,
) -> float:
    """science.md's formula in plain Python floats."""

    def mean_std(v: list[float]) -> tuple[float, float]:
        m = sum(v) / len(v)
        return m, math.sqrt(sum((a - m) ** 2 for a in v) / len(v))

    mg, sg = mean_std(g)
    mw, sw = mean_std(w)
    sigma = math.sqrt((sg**2 + mg**2) * (sw**2 + mw**2)) * math.sqrt(0.5 * fan_in)
    s = u_min / (math.sqrt(2) * _erfinv_small(n_uf) * sigma) if sigma > 0 else 1.0
    s = max(s, 1.0)
    o_max = max(abs(a * b) for a in (min(g), max(g)) for b in (min(w), max(w)))
    if o_max > 0:
        s = min(s, (u_max / fan_in) / o_max)
    s = min(s, accum_cap / prev, layer_cap)
    return 2.0 ** math.floor(math.log2(s)) if power_of_two else s


G = [3e-7, -1e-7, 5e-8, -2.5e-7, 4e-7, 0.0]  # a gradient that half underflows FP16
W = [0.1, -0.2, 0.05, 0.3, -0.15, 0.25]


@pytest.mark.parametrize(
    ("g_mult", "prev", "kwargs", "expect"),
    [
        (1.0, 1.0, {"layer_cap": 1e9, "accum_cap": 1e9, "power_of_two": False}, None),  # raw s, uncapped
        (1.0, 1.0, {"layer_cap": 1e9, "accum_cap": 1e9}, None),  # raw s, rounded down
        (1.0, 1.0, {}, 16.0),  # layer_cap binds
        (1.0, 256.0, {}, 4.0),  # accum_cap / P binds
        (1.0, 1.0, {"layer_cap": 1e9, "accum_cap": 1e9, "u_max": 1e-4}, None),  # overflow bound
        (1e12, 1.0, {}, 0.0625),  # big gradient: (u_max / fan_in) / o_max < 1, even below max(s, 1)
        (1e4, 1.0, {}, 1.0),  # raw s < 1: max(s, 1)
        (0.0, 1.0, {}, 1.0),  # all-zero gradient
    ],
)
def test_layer_scale_matches_hand_computation(
    g_mult: float, prev: float, kwargs: dict[str, float], expect: float | None
) -> None:
    g = [v * g_mult for v in G]
    fan_in = 5
    want = _hand_rule(g, W, prev, fan_in, **kwargs)
    got = layer_scale(
        torch.tensor(g).reshape(2, 3), torch.tensor(W).reshape(3, 2), torch.tensor(prev), fan_in, **kwargs
    )
    if kwargs.get("power_of_two", True):
        assert got.item() == want  # exact: a power of two
        assert math.log2(want) == int(math.log2(want))
    else:
        assert got.item() == pytest.approx(want, rel=1e-5)
    if expect is not None:
        assert want == expect
    if "u_max" in kwargs:  # the overflow bound really was the binding one
        assert want < _hand_rule(g, W, prev, fan_in, **{**kwargs, "u_max": 65504.0})


def test_layer_scale_fp16_gradient_uses_fp32_statistics() -> None:
    g = torch.tensor(G).reshape(2, 3)
    got = layer_scale(g.half(), torch.tensor(W).half(), 1.0, 5, layer_cap=1e9, accum_cap=1e9)
    want = _hand_rule(g.half().float().flatten().tolist(), torch.tensor(W).half().float().tolist(), 1.0, 5,
                      layer_cap=1e9, accum_cap=1e9)  # fmt: skip
    assert got.dtype == torch.float32 and got.item() == want


@functools.cache
def _bench_adaptive() -> Any:
    spec = importlib.util.spec_from_file_location("bench_adaptive", ROOT / "scripts" / "bench_adaptive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _layer_scale_before_fusion(gy: Tensor, weight: Tensor, prev_scale: float, fan_in: int, **rule: Any) -> Tensor:
    """The rule as it was before its statistics were fused (an FP32 copy of gy, std_mean and
    aminmax over it), kept in scripts/bench_adaptive.py, which times the two side by side."""
    return _bench_adaptive().layer_scale_before(gy, weight, prev_scale, fan_in, **rule)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_layer_scale_reads_gy_twice_and_keeps_the_rules_result(dtype: torch.dtype) -> None:
    # Activation gradients of every regime the rule meets: underflowing, ordinary, near overflow,
    # off-centre, sparse (ReLU), all-zero, holding Inf or NaN; under several carried scales.
    gen = torch.Generator().manual_seed(0)
    uncapped = {"layer_cap": 1e9, "accum_cap": 1e9}
    cases = 0
    for magnitude in (1e-7, 1e-5, 1e-3, 1.0, 1e3):
        for shift, sparsity in ((0.0, 0.0), (2.0, 0.0), (0.0, 0.7)):
            g = (torch.randn(64, 32, 7, 7, generator=gen) + shift) * magnitude
            g = g * (torch.rand(g.shape, generator=gen) >= sparsity)
            w = torch.randn(32, 16, 3, 3, generator=gen) * 0.05
            for prev, rule in ((1.0, {}), (256.0, {}), (1.0, uncapped), (1.0, {**uncapped, "power_of_two": False})):
                want = _layer_scale_before_fusion(g.to(dtype), w.to(dtype), prev, 144, **rule)
                got = layer_scale(g.to(dtype), w.to(dtype), prev, 144, **rule)
                assert got.dtype == torch.float32
                if rule.get("power_of_two", True):
                    assert got.item() == want.item(), (magnitude, shift, sparsity, prev, rule)
                else:
                    assert got.item() == pytest.approx(want.item(), rel=1e-5)
                cases += 1
    assert cases == 60
    w = torch.randn(32, 16, 3, 3, generator=gen).to(dtype)
    for bad in (torch.zeros(4, 32, 7, 7), torch.full((4, 32, 7, 7), math.inf), torch.full((4, 32, 7, 7), math.nan)):
        bad = bad.to(dtype)
        assert layer_scale(bad, w, 1.0, 144).item() == _layer_scale_before_fusion(bad, w, 1.0, 144).item()


def test_readme_quotes_the_adaptive_rule_benchmark() -> None:
    data = json.loads((ROOT / "docs/benchmarks/cpu-2026-11-25-adaptive-rule.json").read_text())
    assert all(r["same_scale"] for r in data["rule"])
    speedups = [r["speedup"] for r in data["rule"]]
    quote = (f"the rule alone {math.floor(min(speedups))}-{round(max(speedups))}x faster on this CPU, the whole "
             f"step of ResNet-50/4 in fp32 {data['step']['step_speedup']:.2f}x")
    assert quote in " ".join((ROOT / "README.md").read_text().split())


def test_join_scale_picks_the_largest_scale_that_does_not_overflow() -> None:
    scales = torch.tensor([4.0, 64.0, 16.0])
    assert join_scale(torch.tensor([1.0, 2.0, 3.0]), scales).item() == 64.0
    # 3 * 64 and 3 * 16 overflow a u_max of 40, 3 * 4 does not.
    assert join_scale(torch.tensor([1.0, 2.0, 3.0]), scales, u_max=40.0).item() == 4.0
    # Nothing fits: the smallest scale halved until it does (3 * 4 / 2^4 < 1).
    assert join_scale(torch.tensor([1.0, 2.0, 3.0]), scales, u_max=1.0).item() == 0.25


# --------------------------------------------------------------------------------------------
# models


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x.flatten(1))


class ResidualCNN(nn.Module):
    """Stem, one ResNet basic block (identity skip + conv branch), head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = F.relu(out + x)
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))


class InceptionLike(nn.Module):
    """Parallel branches joined by torch.cat, a tuple (chunk) whose halves take different paths
    and a parameter read directly (get_attr)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = nn.Conv2d(8, 4, 1)
        self.b2 = nn.Sequential(nn.Conv2d(8, 4, 1), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1))
        self.b3 = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(8, 2, 1))
        self.mix = nn.Conv2d(12, 8, 1)
        self.side = nn.Conv2d(4, 4, 3, padding=1)
        self.gamma = nn.Parameter(torch.tensor(0.5))
        self.fc = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        x = torch.cat([self.b1(x), self.b2(x), self.b3(x)], 1)
        x = self.mix(x)
        a, b = torch.chunk(x, 2, dim=1)
        x = torch.cat([self.side(a), b * self.gamma], 1)
        return self.fc(x.mean((2, 3)))


class InplaceJoin(nn.Module):
    """A join whose last consumer is an in-place ReLU (it gets its own copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 8)
        self.fc2 = nn.Linear(8, 4)
        self.fc3 = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x.flatten(1))
        a = h * 2.0
        b = F.relu(h, inplace=True)
        return self.fc2(a) + self.fc3(b)


class Gate(nn.Module):
    """Untraceable by fx, but without a Conv/Linear inside: traced as one leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w if x.sum() > 0 else x * self.w * 0.5


class WithGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 8)
        self.gate = Gate()
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.gate(self.fc1(x.flatten(1))))


def _batch(model: nn.Module, n: int = 4, seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (n, 16) if isinstance(model, (MLP, InplaceJoin, WithGate)) else (n, 3, 8, 8)
    return torch.randn(shape, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def _close(got: Tensor, want: Tensor, rtol: float = 1e-5) -> bool:
    # A join sums its rescaled gradients in its own order: FP32 rounding, relative to the largest entry.
    return torch.allclose(got, want, rtol=rtol, atol=rtol * want.abs().max().item())


def _reference_grads(model: nn.Module, x: Tensor, y: Tensor, mult: float) -> dict[str, Tensor]:
    ref = copy.deepcopy(model)
    (F.cross_entropy(ref(x), y) * mult).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def _adaptive_grads(
    model: nn.Module, x: Tensor, y: Tensor, mult: float, **kwargs: float
) -> tuple[AdaptiveScaler, torch.optim.Optimizer]:
    scaler = AdaptiveScaler(CPU, **{"init_scale": 1.0, **kwargs})
    assert scaler.attach(model) is model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(F.cross_entropy(model(x), y) * mult).backward()
    scaler.unscale_(opt)
    return scaler, opt


# --------------------------------------------------------------------------------------------
# gradient correctness


@pytest.mark.parametrize("make", [MLP, ResidualCNN, InceptionLike, InplaceJoin, WithGate])
def test_unscaled_grads_equal_fp32_grads(make: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = make()
    x, y = _batch(model)
    want = _reference_grads(model, x, y, TINY)
    scaler, _ = _adaptive_grads(model, x, y, TINY)
    tel = scaler.telemetry()
    assert tel["layer_scale_max"].item() > 1  # scales were applied...
    assert tel["cum_scale"].max().item() > 1
    for name, p in model.named_parameters():  # ...and undone exactly
        assert _close(p.grad, want[name]), name
    assert scaler.found_inf.item() == 0
    assert len(scaler.layer_names) == tel["layer_scale"].numel()


def test_joins_get_forks_and_chains_do_not() -> None:
    forks = {}
    for make in (MLP, ResidualCNN, InceptionLike, InplaceJoin):
        scaler = AdaptiveScaler(CPU, init_scale=1.0)
        scaler.attach(make())
        forks[make] = [n for n in scaler._entries if n.startswith("fork:")]
    assert forks[MLP] == []
    assert len(forks[ResidualCNN]) == 1  # the block input: skip + conv1
    assert len(forks[InceptionLike]) == 2  # the stem output (3 branches) and the chunk tuple
    assert len(forks[InplaceJoin]) == 1  # fc1's output: the in-place ReLU gets its own copy


def test_model_without_conv_or_linear_is_scaled_by_init_scale_only() -> None:
    torch.manual_seed(0)
    model = Gate()
    x = torch.randn(4, 8)
    scaler = AdaptiveScaler(CPU, init_scale=2.0**10)
    scaler.attach(model)  # not traced at all: nothing to scale per layer
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(x).square().sum()).backward()
    assert torch.equal(model.w.grad, (2 * (x * model.w) * x).sum(0).detach() * 2.0**10)
    scaler.unscale_(opt)
    assert torch.allclose(model.w.grad, (2 * (x * model.w) * x).sum(0).detach())
    assert scaler.layer_names == [] and scaler.telemetry() == {}


def test_gradient_accumulation_uses_one_scale_per_step() -> None:
    torch.manual_seed(0)
    model = ResidualCNN()
    (x1, y1), (x2, y2) = _batch(model, seed=1), _batch(model, seed=2)
    ref = copy.deepcopy(model)
    for x, y in ((x1, y1), (x2, y2)):
        (F.cross_entropy(ref(x), y) * TINY).backward()
    scaler = AdaptiveScaler(CPU, init_scale=1.0)
    scaler.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in ((x1, y1), (x2, y2)):
        scaler.scale(F.cross_entropy(model(x), y) * TINY).backward()
    scaler.unscale_(opt)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert _close(p.grad, q.grad), name


def test_no_grad_forward_is_the_original_and_module_is_unchanged() -> None:
    torch.manual_seed(0)
    model = InceptionLike()
    keys = list(model.state_dict())
    x, _ = _batch(model)
    with torch.no_grad():
        before = model(x)
    AdaptiveScaler(CPU, init_scale=1.0).attach(model)
    with torch.no_grad():
        assert torch.equal(model(x), before)
    assert torch.equal(model(x).detach(), before)
    assert list(model.state_dict()) == keys
    dup = copy.deepcopy(model)  # a deep copy (an EMA model, say) runs its own plain forward
    assert dup.forward.__self__ is dup and torch.equal(dup(x).detach(), before)


# --------------------------------------------------------------------------------------------
# underflow rescue in FP16


def _fp16_weight_grads(model: nn.Module, x: Tensor, y: Tensor, scaler: AdaptiveScaler | None) -> list[Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if scaler is not None:
        scaler.attach(model)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    loss = F.cross_entropy(out.float(), y) * 2.0**-16
    (loss if scaler is None else scaler.scale(loss)).backward()
    if scaler is not None:
        scaler.unscale_(opt)
    return [p.grad for n, p in model.named_parameters() if n.endswith("weight")]


def test_adaptive_scaling_rescues_fp16_underflow() -> None:
    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
        nn.Linear(128, 10),
    )  # fmt: skip
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    ref = copy.deepcopy(base)
    (F.cross_entropy(ref(x), y) * 2.0**-16).backward()
    want = [p.grad for n, p in ref.named_parameters() if n.endswith("weight")]
    plain = _fp16_weight_grads(copy.deepcopy(base), x, y, None)
    scaler = AdaptiveScaler(CPU, init_scale=1.0)
    rescued = _fp16_weight_grads(copy.deepcopy(base), x, y, scaler)

    def zero_frac(gs: list[Tensor]) -> float:
        return sum((g == 0).sum().item() for g in gs) / sum(g.numel() for g in gs)

    def rel_err(gs: list[Tensor]) -> float:  # mean over layers
        return sum(((g - w).norm() / w.norm()).item() for g, w in zip(gs, want, strict=True)) / len(gs)

    assert zero_frac(want) < 0.1
    assert zero_frac(plain) > 0.8  # FP16 flushes almost every weight gradient to zero
    assert zero_frac(rescued) < 0.15
    assert (plain[0] == 0).all() and (rescued[0] == 0).float().mean() < 0.01  # the first layer
    # The output gradient itself is quantized coarsely in FP16 before the first site can scale it.
    assert rel_err(plain) > 0.9 and rel_err(rescued) < 0.35
    assert scaler.telemetry()["cum_scale"].max().item() == 1024  # accum_cap reached


def test_default_starts_the_chain_at_the_output_and_lifts_dl_dlogits() -> None:
    """The gradient at the logits (a mean over the batch) underflows FP16 before any layer can
    scale it. The default (init_scale=auto) scales it at the outputs, in FP32, before the cast:
    the top layer's weight gradient then matches FP32 (the independent reference)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    ref = copy.deepcopy(base)
    (F.cross_entropy(ref(x), y) * 2.0**-16).backward()
    want = [p.grad for n, p in ref.named_parameters() if n.endswith("weight")]

    def top_error(scaler: AdaptiveScaler) -> tuple[float, float]:
        got = _fp16_weight_grads(copy.deepcopy(base), x, y, scaler)
        lost = ((got[-1] == 0) & (want[-1] != 0)).float().mean().item()
        return lost, ((got[-1] - want[-1]).norm() / want[-1].norm()).item()

    lost_one, err_one = top_error(AdaptiveScaler(CPU, init_scale=1.0))  # the old default
    default = AdaptiveScaler(CPU)
    assert default.init_scale == "auto"
    lost_auto, err_auto = top_error(default)
    assert lost_one > 0.01 and err_one > 0.2  # at scale 1 the top layer's gradient is coarse and loses values
    assert lost_auto < 0.1 * lost_one and err_auto < 2e-3
    assert default.summary()["scale"] == 1024.0  # as far as accum_cap allows: far from overflow here


# --------------------------------------------------------------------------------------------
# skipping, state, integration


@pytest.mark.parametrize("fused", [False, True])
def test_non_finite_gradient_skips_the_step(fused: bool) -> None:
    torch.manual_seed(0)
    model = ResidualCNN()
    x, y = _batch(model)
    scaler = AdaptiveScaler(CPU, init_scale=1.0)
    scaler.attach(model)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    except (RuntimeError, ValueError):
        pytest.skip("fused SGD not available on CPU")
    model.conv2.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    before = copy.deepcopy(model.state_dict())
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.found_inf.item() == 1.0
    for k, v in model.state_dict().items():
        if "running" not in k and "num_batches" not in k:  # BN statistics move in forward
            assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
def test_skip_forces_fresh_scales_with_every_optimizer_implementation(opt_name: str, impl: str) -> None:
    # recompute_every=1000: only the forced recompute after a skipped step can pick new scales.
    # Gradients grow 2^28 at step 5: the cached scales overflow FP16 once; fresh ones fit. lr=0
    # keeps the model (and so the gradients) fixed, so any further skip is a stale scale.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    scaler = AdaptiveScaler(CPU, init_scale=1.0, recompute_every=1000, layer_cap=2.0**20, accum_cap=2.0**40)
    scaler.attach(model)
    kw = {"foreach": False} if impl == "for-loop" else {impl: True}
    cls = torch.optim.SGD if opt_name == "sgd" else torch.optim.AdamW
    opt = cls(model.parameters(), lr=0.0, **kw)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    skipped = []
    for step in range(35):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(F.cross_entropy(out.float(), y) * (2.0**-14 if step < 5 else 2.0**14)).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(int(scaler.found_inf.item()))
        if step == 4:
            assert scaler.telemetry()["cum_scale"].max().item() >= 64  # cached scales that lift
    assert skipped == [0] * 5 + [1] + [0] * 29


# Caps out of the way and gradients shrinking 4x per step, so that every recomputation differs.
RECOMPUTE_3 = {"init_scale": 1.0, "recompute_every": 3, "layer_cap": 2.0**20, "accum_cap": 2.0**40}


def _train(model: nn.Module, scaler: AdaptiveScaler, opt: torch.optim.Optimizer, steps: range) -> list[Tensor]:
    scales = []
    for step in steps:
        x, y = _batch(model, seed=100 + step)
        scaler.scale(F.cross_entropy(model(x), y) * TINY * 4.0**-step).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.telemetry()["layer_scale"])
    return scales


def _resume(saved: tuple[dict[str, Any], ...], steps: range) -> tuple[nn.Module, list[Tensor]]:
    model = InceptionLike()
    scaler = AdaptiveScaler(CPU, **RECOMPUTE_3)
    scaler.load_state_dict(saved[2])  # before attach: attach applies it
    scaler.attach(model)
    model.load_state_dict(saved[0])
    opt = torch.optim.SGD(model.parameters(), lr=1e4, momentum=0.9)
    opt.load_state_dict(saved[1])
    return model, _train(model, scaler, opt, steps)


def test_state_dict_round_trip_continues_identically() -> None:
    torch.manual_seed(0)
    model = InceptionLike()
    scaler = AdaptiveScaler(CPU, **RECOMPUTE_3)
    scaler.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e4, momentum=0.9)
    head = _train(model, scaler, opt, range(2))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), scaler.state_dict()))
    assert saved[2]["step"] == 2 and len(saved[2]["s"]) == len(saved[2]["entries"])
    tail = _train(model, scaler, opt, range(2, 6))
    # recompute_every=3: steps 1 and 2 reuse step 0's scales, step 3 recomputes.
    assert torch.equal(head[1], head[0]) and torch.equal(tail[0], head[0])
    assert not torch.equal(tail[1], tail[0])

    model2, tail2 = _resume(saved, range(2, 6))
    for a, b in zip(tail, tail2, strict=True):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
    assert scaler.summary()["steps"] == 6
    # Without the cached scales the resumed run would have recomputed at step 2.
    forgetful = {**saved[2], "known": []}
    _, tail3 = _resume((saved[0], saved[1], forgetful), range(2, 3))
    assert not torch.equal(tail3[0], tail[0])


def test_fp16_model_with_master_weights_via_alias_params() -> None:
    from mptrain.numerics.precision import MasterWeights

    torch.manual_seed(0)
    model = MLP()
    x, y = _batch(model)
    want = _reference_grads(model, x, y, TINY)
    model.half()
    master = MasterWeights(list(model.parameters()))
    opt = torch.optim.SGD(master.masters, lr=0.1)
    scaler = AdaptiveScaler(CPU, init_scale=1.0)
    scaler.attach(model)
    scaler.alias_params(master.model_params, master.masters)
    scaler.scale(F.cross_entropy(model(x.half()).float(), y) * TINY).backward()
    master.before_unscale()
    scaler.unscale_(opt)
    for (name, _), m in zip(model.named_parameters(), master.masters, strict=True):
        # FP16 arithmetic on tiny gradients: near the FP32 gradient (a wrong P would be off >= 2x).
        assert ((m.grad - want[name]).norm() / want[name].norm()).item() < 0.25, name


def test_resnet18_one_step_matches_fp32() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    want = _reference_grads(model, x, y, TINY)
    scaler, opt = _adaptive_grads(model, x, y, TINY)
    assert len(scaler.layer_names) == 21 and scaler.telemetry()["layer_scale_max"].item() > 1
    for name, p in model.named_parameters():
        assert _close(p.grad, want[name], rtol=1e-4), name
    before = model.fc.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert scaler.found_inf.item() == 0 and not torch.equal(model.fc.weight, before)
    summary = scaler.summary()
    assert set(summary["layer_scales"]) == set(scaler.layer_names)
    assert summary["layer_scale_min"] <= summary["layer_scale_mean"] <= summary["layer_scale_max"]


# --------------------------------------------------------------------------------------------
# what it refuses


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) if x.sum() > 0 else -self.fc(x)  # data-dependent control flow


class InplaceNotLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        b = F.relu(h, inplace=True)  # later readers of h see the ReLU'd values
        return self.fc2(b) + h * 2.0


class SharedWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(self.a(x)))  # a's two calls carry different scales


def test_refuses_what_it_cannot_make_consistent() -> None:
    with pytest.raises(MptrainError, match="Untraceable"):
        AdaptiveScaler(CPU, init_scale=1.0).attach(Untraceable())
    with pytest.raises(MptrainError, match="shared layers"):
        AdaptiveScaler(CPU, init_scale=1.0).attach(SharedWeights())
    with pytest.raises(MptrainError, match="in place"):
        AdaptiveScaler(CPU, init_scale=1.0).attach(InplaceNotLast())
    scaler = AdaptiveScaler(CPU, init_scale=1.0)
    scaler.attach(MLP())
    stray = nn.Parameter(torch.ones(2))
    stray.grad = torch.ones(2)
    scaler._active = next(iter(scaler._variants.values()))
    with pytest.raises(MptrainError, match="alias_params"):
        scaler.unscale_(torch.optim.SGD([stray], lr=0.1))

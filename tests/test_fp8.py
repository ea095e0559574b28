"""FP8 numerics (checked against torch's native float8 casts) and emulated FP8 training."""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from mptrain.errors import MptrainError
from mptrain.numerics import fp8
from mptrain.numerics.fp8 import E4M3, E5M2, FP16, Fp8Format, quantize, quantize_scaled, stochastic_round, tensor_scale
from mptrain.numerics.precision import Precision, build_precision

FP8_FORMATS = [E5M2, E4M3]
ALL_FORMATS = [E5M2, E4M3, FP16]


def make_precision(device: str = "cpu", **overrides: object) -> Precision:
    cfg = {
        "name": "fp8",
        "backend": "emulated",
        "format": "e5m2",
        "master_weights": "fp16",
        "stochastic_rounding": True,
        "recipe": "tensorwise",
        "emulated_compute": "fp32",
        **overrides,
    }
    return build_precision(OmegaConf.create(cfg), torch.device(device))


def grid(fmt: Fp8Format) -> torch.Tensor:
    """Every finite value of the format, sorted, from all its bit patterns."""
    bits = 8 if fmt.dtype.itemsize == 1 else 16
    ints = torch.arange(2**bits, dtype=torch.int32).to(torch.uint8 if bits == 8 else torch.int16)
    values = ints.view(fmt.dtype).float()
    return torch.unique(values[torch.isfinite(values)])  # unique also merges -0 and +0


def representable(x: torch.Tensor, fmt: Fp8Format) -> bool:
    return torch.equal(x.to(fmt.dtype).float(), x.float())


def wide_range(fmt: Fp8Format, n: int, gen: torch.Generator) -> torch.Tensor:
    """Random signed values log-uniform from below half the smallest subnormal up to max."""
    lo, hi = math.log2(fmt.min_subnormal) - 2, math.log2(fmt.max)
    e = lo + (hi - lo) * torch.rand(n, generator=gen)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    return (sign * torch.exp2(e)).clamp(-fmt.max, fmt.max)


# --------------------------------------------------------------------------------------------
# round to nearest


def test_format_constants() -> None:
    assert (E5M2.max, E5M2.min_normal, E5M2.min_subnormal) == (57344.0, 2.0**-14, 2.0**-16)
    assert (E4M3.max, E4M3.min_normal, E4M3.min_subnormal) == (448.0, 2.0**-6, 2.0**-9)
    for fmt in ALL_FORMATS:
        g = grid(fmt)
        assert g.max().item() == fmt.max
        assert g[g > 0].min().item() == fmt.min_subnormal
    assert fp8.as_format(torch.float16) is FP16 and fp8.as_format(torch.float8_e4m3fn) is E4M3


# The formats from their definitions (sign, exponent bias 2^(E-1)-1, implicit leading 1, subnormals
# at the lowest exponent), not from torch: (exponent bits, mantissa bits, "fn" = no Inf, the all-ones
# pattern is NaN, as E4M3fn).
SPECS = {"e5m2": (5, 2, False), "e4m3fn": (4, 3, True)}


def enumerated_grid(fmt: Fp8Format) -> torch.Tensor:
    """Every non-negative finite value of the format, in float64, enumerated from its definition."""
    e_bits, m_bits, fn = SPECS[fmt.name]
    bias = 2 ** (e_bits - 1) - 1
    values = [m / 2**m_bits * 2.0 ** (1 - bias) for m in range(2**m_bits)]  # zero and subnormals
    top = 2**e_bits - 1 if fn else 2**e_bits - 2  # IEEE-like formats reserve the top exponent
    for e in range(1, top + 1):
        for m in range(2**m_bits):
            if fn and e == top and m == 2**m_bits - 1:
                continue  # E4M3fn's only NaN pattern
            values.append((1 + m / 2**m_bits) * 2.0 ** (e - bias))
    return torch.tensor(values, dtype=torch.float64)


def reference_rne(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Round to nearest on the enumerated grid, ties to the even pattern, saturating at max.

    In the sorted non-negative grid consecutive values differ by one in their bit pattern, so
    "even mantissa" is "even index"."""
    g = enumerated_grid(fmt)
    a = x.double().abs().clamp(max=g[-1].item())
    hi_i = torch.searchsorted(g, a).clamp(max=len(g) - 1)
    lo_i = (hi_i - 1).clamp(min=0)
    lo, hi = g[lo_i], g[hi_i]
    d_lo, d_hi = a - lo, hi - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi_i % 2 == 0))
    return torch.copysign(torch.where(pick_hi, hi, lo), x.double()).float()


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
def test_quantize_matches_the_enumerated_grid(fmt: Fp8Format) -> None:
    g = enumerated_grid(fmt)
    assert g[-1].item() == fmt.max and g[1].item() == fmt.min_subnormal
    assert torch.equal(g.float(), grid(fmt)[grid(fmt) >= 0])  # same grid as torch's decoding of the bits
    gen = torch.Generator().manual_seed(0)
    pos = g.float()
    midpoints = (pos[1:] + pos[:-1]) / 2  # ties: round-half-to-even
    x = torch.cat([wide_range(fmt, 200_000, gen), pos, -pos, midpoints, -midpoints, torch.tensor([fmt.max * 1.5])])
    q = quantize(x, fmt)
    assert torch.equal(q, reference_rne(x, fmt))
    assert representable(q, fmt)
    assert q.dtype == x.dtype
    # subnormals are really exercised
    assert ((q.abs() > 0) & (q.abs() < fmt.min_normal)).sum() > 100
    assert torch.equal(quantize(g, fmt), g)


def test_quantize_keeps_dtype_and_is_exact_in_bf16() -> None:
    x = torch.randn(1000).bfloat16()
    q = quantize(x, E5M2)
    assert q.dtype == torch.bfloat16
    assert torch.equal(q.float(), x.float().to(torch.float8_e5m2).float())


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
def test_quantize_saturates_and_propagates_nan(fmt: Fp8Format) -> None:
    big = torch.tensor([fmt.max * 1.1, fmt.max * 1.2, 1e30, math.inf])
    assert torch.equal(quantize(big, fmt), torch.full((4,), fmt.max))
    assert torch.equal(quantize(-big, fmt), torch.full((4,), -fmt.max))
    q = quantize(torch.tensor([math.nan, 1.0]), fmt)
    assert math.isnan(q[0].item()) and q[1].item() == 1.0
    assert torch.isfinite(quantize(torch.tensor([1e6]), E5M2)).all()  # native E5M2 would give inf


# --------------------------------------------------------------------------------------------
# stochastic rounding


def neighbours(x: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    g = grid(fmt).double()
    xd = x.double()
    lo = g[(torch.searchsorted(g, xd, right=True) - 1).clamp(min=0)]
    hi = g[torch.searchsorted(g, xd).clamp(max=len(g) - 1)]
    return lo.float(), hi.float()


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_stochastic_round_gives_a_neighbour(fmt: Fp8Format) -> None:
    gen = torch.Generator().manual_seed(1)
    x = wide_range(fmt, 100_000, gen)
    r = stochastic_round(x, fmt, gen)
    lo, hi = neighbours(x, fmt)
    assert ((r == lo) | (r == hi)).all()
    assert representable(r, fmt)
    assert torch.equal(stochastic_round(grid(fmt), fmt, gen), grid(fmt))  # grid points stay
    big = torch.tensor([fmt.max * 1.5, -math.inf, math.nan])
    out = stochastic_round(big, fmt, gen)
    assert out[0].item() == fmt.max and out[1].item() == -fmt.max and math.isnan(out[2].item())


def _cases(fmt: Fp8Format) -> list[tuple[float, float]]:
    """(grid point below, spacing) in a normal binade and in the subnormal range."""
    normal_eps = 2.0 ** (0 - fmt.mantissa_bits)  # binade [1, 2)
    sub_eps = fmt.min_subnormal
    return [(1.0, normal_eps), (-2.0 - 2 * normal_eps, 2 * normal_eps), (3 * sub_eps, sub_eps)]


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("frac", [0.1, 0.25, 0.5, 0.9])
def test_stochastic_round_is_unbiased(fmt: Fp8Format, frac: float) -> None:
    n = 20_000
    gen = torch.Generator().manual_seed(2)
    for down, eps in _cases(fmt):
        x = down + frac * eps  # exact in fp32
        r = stochastic_round(torch.full((n,), x), fmt, gen).double()
        assert set(r.unique().tolist()) <= {down, down + eps}
        # one rounding is a Bernoulli(frac) step of size eps: std of the mean
        sigma = eps * math.sqrt(frac * (1 - frac) / n)
        assert abs(r.mean().item() - x) < 5 * sigma
        if frac == 0.25:  # round-to-nearest in the same setup: biased by frac * eps >> sigma
            rtn = quantize(torch.full((n,), x), fmt).double()
            assert abs(rtn.mean().item() - x) > 50 * sigma


def test_stochastic_round_fp16_dtype_argument() -> None:
    x = torch.randn(4096) * 3
    r = stochastic_round(x, torch.float16)
    assert r.dtype == torch.float32 and representable(r, FP16)
    assert (r - x).abs().max() <= x.abs().max() * 2.0**-10


# --------------------------------------------------------------------------------------------
# per-tensor scaling


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("amax", [1e-30, 1e-7, 0.3, 1.0, 448.0, 57344.0, 1e6, 2.0**-20, 3e38])
def test_tensor_scale_is_power_of_two_and_fits(fmt: Fp8Format, amax: float) -> None:
    x = torch.tensor([amax, -amax / 3, amax / 1000])
    s = tensor_scale(x, fmt)
    a = x.abs().max()
    mantissa, _ = torch.frexp(s)
    assert mantissa.item() == 0.5  # a power of two
    assert (a * s).item() <= fmt.max
    if abs(math.log2(amax)) < 120:  # not clamped to FP32's exponent range
        assert (a * s * 2).item() > fmt.max  # the largest such power of two
    # amax lands in range: rounded to nearest, not saturated
    q_amax = quantize(x, fmt, s).abs().max().item()
    assert abs(q_amax - a.item()) <= a.item() * 2.0 ** -(fmt.mantissa_bits + 1)


def test_tensor_scale_degenerate() -> None:
    assert tensor_scale(torch.zeros(5), E5M2).item() == 1.0
    assert tensor_scale(torch.tensor([1.0, math.inf]), E5M2).item() == 1.0
    assert tensor_scale(torch.empty(0), E5M2).item() == 1.0
    # scaled quantization lets Inf/NaN through, for the loss scaler to see
    q = quantize_scaled(torch.tensor([1.0, math.inf, math.nan]), E5M2)
    assert q[0].item() == 1.0 and q[1].item() == math.inf and math.isnan(q[2].item())


def test_tiny_tensors_survive_scaled_quantization() -> None:
    gen = torch.Generator().manual_seed(3)
    x = 1e-7 * (1 + torch.rand(1000, generator=gen))
    assert (quantize(x, E5M2) == 0).all()  # below half of 2**-16: flushed unscaled
    for stochastic in (False, True):
        q = quantize_scaled(x, E5M2, stochastic=stochastic, generator=gen)
        rel = ((q - x) / x).abs().max().item()
        assert rel <= (2.0**-3 if not stochastic else 2.0**-2)  # half an ulp / one ulp at 2 bits
        assert representable(q * tensor_scale(x, E5M2), E5M2)


# --------------------------------------------------------------------------------------------
# emulated FP8 layers


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.conv2(self.up(x)))
        return self.head(x)


def test_convert_records_layers_and_keeps_state_dict() -> None:
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    p = make_precision()
    converted = p.prepare_model(model)
    assert converted is model
    state = p.fp8_state
    assert isinstance(state, fp8.Fp8State)
    assert state.backend == "emulated" and state.format == "e5m2"
    assert state.converted == ["conv1", "up", "conv2", "head.1", "head.3"]
    assert isinstance(model.up, fp8.Fp8ConvTranspose2d) and isinstance(model.head[3], fp8.Fp8Linear)
    assert list(model.state_dict()) == list(reference.state_dict())
    model.load_state_dict(reference.state_dict(), strict=True)
    assert "fp8=e5m2/e5m2" in repr(model.head[1])

    x = torch.randn(4, 3, 8, 8)
    out = model(x)
    assert out.shape == (4, 4) and out.dtype == torch.float32
    out.square().mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def _reference_output(layer: nn.Module, x: torch.Tensor, fmt: Fp8Format, scaling: str) -> torch.Tensor:
    """The original fp32 layer applied to quantized weights and inputs (bias unquantized)."""
    q = quantize_scaled if scaling == "tensor" else quantize
    ref = copy.deepcopy(layer)
    with torch.no_grad():
        ref.weight.copy_(q(layer.weight, fmt))
    return ref(q(x, fmt))


@pytest.mark.parametrize("scaling", ["loss", "tensor"])
@pytest.mark.parametrize(("fmt_name", "fmt"), [("e5m2", E5M2), ("hybrid", E4M3)])
@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Linear(12, 5),
        lambda: nn.Conv2d(3, 4, 3, padding=1),
        lambda: nn.ConvTranspose2d(3, 4, 3, stride=2),
    ],
    ids=["linear", "conv", "convT"],
)
def test_forward_equals_fp32_on_quantized_operands(fmt_name: str, fmt: Fp8Format, make, scaling: str) -> None:
    torch.manual_seed(1)
    layer = make()
    p = make_precision(format=fmt_name, master_weights="fp32", scaling=scaling)
    model = p.prepare_model(nn.Sequential(copy.deepcopy(layer)))
    x = torch.randn(2, 12) * 5 if isinstance(layer, nn.Linear) else torch.randn(2, 3, 6, 6) * 5
    with torch.no_grad():
        expected = _reference_output(layer, x, fmt, scaling)
        got = model(x)
        unquantized = layer(x)
    assert torch.equal(got, expected)
    assert not torch.equal(got, unquantized)


def test_bf16_compute() -> None:
    torch.manual_seed(2)
    layer = nn.Linear(16, 8)
    model = make_precision(emulated_compute="bf16", master_weights="fp32", scaling="tensor").prepare_model(
        nn.Sequential(copy.deepcopy(layer))
    )
    x = torch.randn(4, 16)
    y = model(x)
    assert y.dtype == torch.float32
    xq, wq = quantize_scaled(x, E5M2), quantize_scaled(layer.weight, E5M2)
    expected = F.linear(xq.bfloat16(), wq.bfloat16(), layer.bias.bfloat16()).float()
    assert torch.equal(y, expected)


@pytest.mark.parametrize("stochastic", [False, True])
def test_backward_quantizes_error_and_weight_grad_per_tensor(stochastic: bool) -> None:
    torch.manual_seed(3)
    layer = nn.Linear(16, 16)
    with torch.no_grad():  # identity weight (exact in FP8): grad wrt input == quantized error
        layer.weight.copy_(torch.eye(16))
        layer.bias.zero_()
    p = make_precision(master_weights="fp32", stochastic_rounding=stochastic, scaling="tensor")
    model = p.prepare_model(nn.Sequential(layer))
    x = torch.randn(32, 16, requires_grad=True)
    gy = torch.randn(32, 16) * 1e-3
    model(x).backward(gy)

    s = tensor_scale(gy, E5M2)
    assert representable(x.grad * s, E5M2)
    assert not torch.equal(x.grad, gy)
    if not stochastic:
        assert torch.equal(x.grad, quantize_scaled(gy, E5M2))

    # the weight gradient: computed from quantized error and input, then quantized itself
    raw = x.grad.t() @ quantize_scaled(x.detach(), E5M2)
    assert representable(layer.weight.grad * tensor_scale(raw, E5M2), E5M2)
    if not stochastic:
        assert torch.equal(layer.weight.grad, quantize_scaled(raw, E5M2))
    torch.testing.assert_close(layer.bias.grad, x.grad.sum(0))


def _train(p: Precision, steps: int = 40) -> tuple[nn.Module, list[float]]:
    torch.manual_seed(4)
    teacher = torch.randn(16, 4)
    x = torch.randn(256, 16)
    y = (x @ teacher).argmax(1)
    model = p.prepare_model(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        p.after_step()
        losses.append(loss.item())
    return model, losses


def test_training_reduces_loss_with_fp16_masters() -> None:
    p = make_precision()
    model, losses = _train(p)
    assert losses[-1] < 0.5 * losses[0], losses
    for param in model.parameters():
        assert representable(param.detach(), FP16)
        assert param.dtype == torch.float32


@pytest.mark.parametrize("stochastic", [False, True])
def test_after_step_rounds_to_fp16(stochastic: bool) -> None:
    p = make_precision(stochastic_rounding=stochastic)
    model = p.prepare_model(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)))
    assert all(representable(q.detach(), FP16) for q in model.parameters())  # from the start
    with torch.no_grad():
        for q in model.parameters():
            q.add_(torch.randn_like(q) * 1e-3)
    assert not all(representable(q.detach(), FP16) for q in model.parameters())
    p.after_step()
    assert all(representable(q.detach(), FP16) for q in model.parameters())


def test_fp32_masters_are_left_alone() -> None:
    p = make_precision(master_weights="fp32")
    model, _ = _train(p, steps=5)
    assert not all(representable(q.detach(), FP16) for q in model.parameters())


# --------------------------------------------------------------------------------------------
# torchao


def _torchao_precision() -> Precision:
    # build_precision refuses torchao off CUDA, so build the object directly.
    return Precision(
        requested="fp8",
        resolved="fp8",
        device=torch.device("cpu"),
        fp8="torchao",
        options={"recipe": "rowwise"},
    )


def test_build_precision_torchao_on_cpu_is_a_clean_error() -> None:
    with pytest.raises(MptrainError, match="needs a CUDA GPU"):
        make_precision(backend="torchao")


def test_torchao_no_eligible_linear() -> None:
    msg = r"no Linear layer left by the plan has in/out features divisible by 16 \(found 0: 10x3\)"
    with pytest.raises(MptrainError, match=msg):
        _torchao_precision().prepare_model(nn.Sequential(nn.Linear(10, 3)))


def test_torchao_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes the import fail
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(MptrainError, match="needs the torchao package"):
        _torchao_precision().prepare_model(nn.Sequential(nn.Linear(32, 16)))


def test_torchao_call_with_fake_module(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, object] = {}

    class Float8Linear(nn.Linear):
        pass

    @dataclasses.dataclass(frozen=True)
    class Float8LinearConfig:  # the fields mptrain reads or sets, as in torchao
        recipe: str
        pad_inner_dim: bool = False

        @staticmethod
        def from_recipe_name(name: str) -> Float8LinearConfig:
            return Float8LinearConfig(name)

    def convert_to_float8_training(module, *, module_filter_fn, config):
        calls["config"] = config
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and module_filter_fn(child, name):
                child.__class__ = Float8Linear
        return module

    fake = types.ModuleType("torchao.float8")
    fake.Float8LinearConfig = Float8LinearConfig  # type: ignore[attr-defined]
    fake.convert_to_float8_training = convert_to_float8_training  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", fake)
    p = _torchao_precision()
    p.prepare_model(nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10)))
    # pad_inner_dim: the weight-gradient GEMM contracts over the batch, which need not divide by 16.
    assert calls["config"] == Float8LinearConfig("rowwise", pad_inner_dim=True)
    assert p.fp8_state.backend == "torchao" and p.fp8_state.converted == ["0"]


def test_torchao_real_conversion_on_cpu() -> None:
    """Module conversion needs no GPU: the real torchao (the [fp8] extra), when installed."""
    float8 = pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    p = _torchao_precision()
    model = p.prepare_model(nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10), nn.Linear(10, 16)))
    assert p.fp8_state is not None and p.fp8_state.backend == "torchao"
    assert p.fp8_state.converted == ["0"]  # 16x10 and 10x16 are not divisible by 16: left alone
    assert type(model[0]) is Float8Linear and type(model[2]) is nn.Linear and type(model[3]) is nn.Linear
    expected = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name("rowwise"), pad_inner_dim=True)
    assert model[0].config == expected


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torchao float8 needs CUDA sm89+")
def test_torchao_real() -> None:
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs sm89+")
    # Built for the GPU it runs on: torchao refuses a CPU precision (issue 17).
    p = make_precision("cuda", backend="torchao", recipe="tensorwise")
    model = p.prepare_model(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).cuda().bfloat16())
    assert p.fp8_state.converted == ["0"]
    with p.autocast():
        model(torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
        # A batch of 10: the weight-gradient GEMM's inner dim is not a multiple of 16 (issue 17).
        model(torch.randn(10, 64, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    assert torch.isfinite(model[0].weight.grad).all()


def test_emulated_layer_output_can_be_modified_in_place() -> None:
    """conv -> ReLU(inplace=True), as in VGG and AlexNet."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    model = make_precision().prepare_model(model)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# --------------------------------------------------------------------------------------------
# the two recipes: Mellempudi et al.'s (the loss scale does the range work) and per-tensor scaling


def _unscaled_update(scaling: str, loss_scale: float, stochastic: bool = False) -> tuple[list[torch.Tensor], float]:
    """One SGD step of a small FP8 model through a static loss scaler: (updated weights, found_inf)."""
    from mptrain.numerics.loss_scaling import StaticScaler

    torch.manual_seed(5)
    base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    p = make_precision(scaling=scaling, master_weights="fp32", stochastic_rounding=stochastic)
    model = p.prepare_model(base)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = StaticScaler(torch.device("cpu"), loss_scale)
    torch.manual_seed(6)  # the same stochastic-rounding draws for every loss scale
    # A loss whose gradients sit near E5M2's subnormals (2^-16), as a mean over a large batch does.
    scaler.scale(F.cross_entropy(model(x), y) * 2.0**-12).backward()
    scaler.unscale_(opt)
    grads = [q.grad.clone() for q in model.parameters()]
    scaler.step(opt)
    return grads + [q.detach().clone() for q in model.parameters()], float(scaler.found_inf)


def _zero_frac(ts: list[torch.Tensor]) -> float:
    return sum((t == 0).sum().item() for t in ts) / sum(t.numel() for t in ts)


def test_paper_recipe_the_loss_scale_decides_underflow_and_the_update() -> None:
    small, _ = _unscaled_update("loss", 1.0)
    big, _ = _unscaled_update("loss", 2.0**10)
    grads_small, grads_big = small[:4], big[:4]
    # Without per-tensor scales most gradients underflow E5M2 at scale 1; 2^10 lifts them.
    assert _zero_frac(grads_small) > 0.5
    assert _zero_frac(grads_big) < 0.5 * _zero_frac(grads_small)
    assert any(not torch.equal(a, b) for a, b in zip(small[4:], big[4:], strict=True))  # the update differs
    # No rescaling: the scaled weight gradient itself lies on E5M2's grid (the format's own values).
    for g in grads_big[0::2]:
        assert representable(g * 2.0**10, E5M2)


def test_paper_recipe_overflow_reaches_the_loss_scaler() -> None:
    # Past E5M2's max the error becomes Inf instead of saturating: the scaler skips the step.
    before, _ = _unscaled_update("loss", 2.0**10)
    after, found_inf = _unscaled_update("loss", 2.0**40)
    assert found_inf == 1.0
    torch.manual_seed(5)
    init = [q.detach() for q in nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).parameters()]
    for w, w0 in zip(after[4:], init, strict=True):  # skipped: weights unchanged (FP32 masters)
        assert torch.equal(w, w0)
    assert not torch.equal(before[4], init[0])


@pytest.mark.parametrize("stochastic", [False, True])
def test_per_tensor_recipe_the_loss_scale_changes_nothing(stochastic: bool) -> None:
    # E5M2 rounding is invariant under power-of-two rescaling: the unscaled gradients and the update
    # are bit-identical whatever the loss scale (the review tried 2^-20 .. 2^40).
    ref, _ = _unscaled_update("tensor", 1.0, stochastic)
    for scale in (2.0**-20, 2.0**16, 2.0**40):
        got, found_inf = _unscaled_update("tensor", scale, stochastic)
        assert found_inf == 0.0
        assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)), scale


def test_every_network_of_a_task_gets_the_recipe() -> None:
    """A GAN converts two networks: both are rounded to FP16 after a step and both are listed."""

    class Generator(nn.Sequential):
        pass

    class Discriminator(nn.Sequential):
        pass

    p = make_precision(stochastic_rounding=False)
    gen = p.prepare_model(Generator(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)))
    disc = p.prepare_model(Discriminator(nn.Linear(8, 4), nn.Linear(4, 1)))
    nets = [gen, disc]
    with torch.no_grad():
        for q in (q for net in nets for q in net.parameters()):
            q.add_(torch.randn_like(q) * 1e-3)
    p.after_step()
    for net in nets:
        assert all(representable(q.detach(), FP16) for q in net.parameters()), type(net).__name__
    layers = p.describe()["fp8_layers"]
    assert layers["converted"] == ["Generator.0", "Generator.2", "Discriminator.0", "Discriminator.1"]
    assert layers["networks"] == {"Generator": ["0", "2"], "Discriminator": ["0", "1"]}

"""OCP MX and NVFP4 block quantization, the quantized GEMM layers and precision=mx.

References: the spec's rule recomputed per block in float64 on grids decoded from bit patterns
(tests/test_formats.py), hand-built blocks, torchao's mx_formats quantizers where installed, and
plain matmuls / im2col GEMMs of fake-quantized operands for the layers.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import run_job, tiny
from omegaconf import DictConfig, OmegaConf
from test_formats import nearest_even_reference
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mptrain.config import validate
from mptrain.errors import MptrainError
from mptrain.numerics import qgemm
from mptrain.numerics.convert import LayerDecision, convert_model
from mptrain.numerics.formats import E4M3
from mptrain.numerics.mx import (
    BLOCK_FORMATS,
    BlockFormat,
    fake_quantize,
    hadamard_matrix,
    quantize_blocks,
    random_hadamard,
    random_signs,
)
from mptrain.numerics.precision import build_precision
from mptrain.numerics.qgemm import BlockQuantizer, GemmRecipe, QuantConv2dFn, QuantLinearFn, RngStreams

MX = [f for f in BLOCK_FORMATS.values() if not f.two_level]
NVFP4 = BLOCK_FORMATS["nvfp4"]


def ids(f: BlockFormat) -> str:
    return f.name


def reference_mx(x: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's conversion of rows of 32 (x: (rows, 32k)), per block in float64: (exponents, decoded).

    shared_exp = floor(log2(amax)) - emax_elem, clamped to E8M0's [-127, 127] (an all-zero block
    gets -127), NaN (code 0xFF, exponent 128 here) for a block with NaN or Inf; elements rounded to
    nearest-even on the decoded grid, saturating."""
    blocks = x.double().reshape(x.shape[0], -1, fmt.block_size)
    amax = blocks.abs().amax(-1)
    bad = ~torch.isfinite(amax)
    floor_log2 = torch.tensor([math.frexp(a)[1] - 1 if a > 0 else -10_000 for a in amax.flatten().tolist()])
    shared = (floor_log2.reshape(amax.shape) - fmt.element.emax).clamp(min=-127)
    shared = torch.where(bad, 128, shared)
    x_scale = torch.pow(2.0, shared.double()).unsqueeze(-1)
    p = nearest_even_reference(torch.where(bad.unsqueeze(-1), 0.0, blocks / x_scale).float(), fmt.element)
    out = torch.where(bad.unsqueeze(-1), math.nan, p.double() * x_scale)
    return shared, out.reshape(x.shape).float()


def wide_blocks(rows: int, cols: int, seed: int, spread: int = 20) -> torch.Tensor:
    """Rows with very different magnitudes and wide spread inside blocks (subnormals, saturation)."""
    g = torch.Generator().manual_seed(seed)
    row_scale = torch.exp2(torch.randint(-spread, spread, (rows, 1), generator=g).float())
    within = torch.exp2(torch.randn(rows, cols, generator=g) * 3)
    return torch.randn(rows, cols, generator=g) * row_scale * within


# --------------------------------------------------------------------------------------------
# the MX scale rule


@pytest.mark.parametrize("fmt", MX, ids=ids)
def test_mx_matches_the_spec_rule_on_random_blocks(fmt: BlockFormat) -> None:
    x = wide_blocks(32, 128, seed=0)
    q = quantize_blocks(x, fmt, with_stats=True)
    exps, decoded = reference_mx(x, fmt)
    assert torch.equal(q.scale_exponents.long(), exps)
    assert torch.equal(q.dequantized, decoded)
    assert q.dequantized.dtype == torch.float32 and q.dequantized.shape == x.shape
    assert q.flushed is not None and q.saturated is not None
    assert q.flushed.item() == ((x != 0) & (decoded == 0)).sum().item()
    scaled = x.double() / torch.pow(2.0, exps.double()).repeat_interleave(32, 1)
    assert q.saturated.item() == (scaled.abs() > fmt.element.max_normal).sum().item() > 0


@pytest.mark.parametrize("fmt", MX, ids=ids)
def test_mx_hand_built_blocks(fmt: BlockFormat) -> None:
    elem = fmt.element
    zeros = torch.zeros(32)
    outlier = torch.full((32,), 1e-3)
    outlier[5] = 1000.0
    saturating = torch.full((32,), 1.0)
    saturating[0] = 2.0**5 * 1.99  # mantissa 1.99 > max / 2**emax for every MX element type: clamps
    fp32_subnormal = torch.full((32,), 2.0**-140)
    fp32_subnormal[1] = 2.0**-135
    with_nan = torch.ones(32)
    with_nan[3] = math.nan
    with_inf = torch.ones(32)
    with_inf[7] = -math.inf
    x = torch.stack([zeros, outlier, saturating, fp32_subnormal, with_nan, with_inf])
    q = quantize_blocks(x, fmt, with_stats=True)
    e = q.scale_exponents.flatten().tolist()

    assert e[0] == -127 and torch.equal(q.dequantized[0], zeros)  # all zeros: the smallest scale, zeros
    assert e[1] == 9 - elem.emax  # floor(log2(1000)) = 9
    big = nearest_even_reference(torch.tensor([1000.0 / 2 ** e[1]]), elem).item() * 2 ** e[1]
    assert q.dequantized[1, 5].item() == big
    tiny = 1e-3 / 2.0 ** e[1]  # the small values, in element units: flushed where below half the smallest subnormal
    assert (q.dequantized[1, :5] == 0).all().item() == (tiny < elem.min_subnormal / 2)
    assert e[2] == 5 - elem.emax and q.dequantized[2, 0].item() == elem.max_normal * 2.0 ** e[2]  # saturated
    assert e[3] == -127  # floor(log2(2**-135)) - emax < -127: clamped
    assert torch.equal(q.dequantized[3], reference_mx(x[3:4], fmt)[1][0])
    assert e[4] == e[5] == 128 and q.e8m0_codes.flatten()[4:].tolist() == [0xFF, 0xFF]  # NaN scale
    assert torch.isnan(q.dequantized[4:]).all()  # the whole block is NaN
    assert q.saturated.item() >= 1  # the saturating block (NaN blocks are not counted)


def test_mx_blocks_follow_dim_and_pad() -> None:
    x = wide_blocks(40, 24, seed=1)  # 40 along dim 0: one full block of 32 and one of 8 (+24 zeros)
    q0 = quantize_blocks(x, "mxfp8", dim=0)
    qt = quantize_blocks(x.t().contiguous(), "mxfp8", dim=-1)
    assert torch.equal(q0.dequantized, qt.dequantized.t())
    assert q0.padded == 24 and q0.scale_exponents.shape == (24, 2)
    padded = F.pad(x.t(), (0, 24))
    assert torch.equal(q0.dequantized, fake_quantize(padded, "mxfp8")[:, :40].t())
    with pytest.raises(ValueError, match="not a multiple of the block size 32"):
        quantize_blocks(x, "mxfp8", dim=0, pad=False)


# --------------------------------------------------------------------------------------------
# NVFP4


def test_nvfp4_scales_on_hand_built_blocks() -> None:
    fp4 = NVFP4.element
    x = torch.zeros(4, 16)
    x[0] = torch.linspace(-2688.0, 2688.0, 16)  # tensor amax 2688 = 448 * 6: tensor scale 1
    x[1, :3] = torch.tensor([6.0 * 3.0, 1.5 * 3.0, 0.5 * 3.0 * 1.5])  # block scale 3 (an E4M3 value)
    x[2, 0] = 6.0 * 2.0**-8  # block scale 2**-8: an E4M3 subnormal (torchao would clamp it to 2**-6)
    x[3, 0] = 6.0 * 2.0**-11  # block scale 2**-11 rounds to 0 in E4M3: the block flushes
    q = quantize_blocks(x, NVFP4, with_stats=True)
    assert q.tensor_scale.item() == 1.0
    assert q.block_scales.flatten().tolist() == [448.0, 3.0, 2.0**-8, 0.0]
    expected_1 = nearest_even_reference(x[1] / 3.0, fp4) * 3.0
    assert torch.equal(q.dequantized[1], expected_1)
    assert q.dequantized[2, 0].item() == 6.0 * 2.0**-8
    assert (q.dequantized[3] == 0).all() and q.flushed.item() >= 1
    # the tensor scale is amax / (448 * 6) and cancels: scaling the tensor by 2**k scales the result
    q2 = quantize_blocks(x * 2.0**-20, NVFP4)
    assert q2.tensor_scale.item() == 2.0**-20 and torch.equal(q2.dequantized, q.dequantized * 2.0**-20)


def test_nvfp4_block_scale_rounding_can_saturate_elements() -> None:
    """A block scale that rounds down makes the block's amax exceed 6 in element units: it clamps."""
    x = torch.zeros(2, 16)
    x[0, 0] = 2688.0
    x[1, 0] = 6.0 * 13.2  # amax/6 = 13.2 rounds to the E4M3 value 13: 13.2 * 6 / 13 > 6 saturates
    q = quantize_blocks(x, NVFP4, with_stats=True)
    assert q.block_scales[1].item() == 13.0 and q.dequantized[1, 0].item() == 6.0 * 13.0
    assert q.saturated.item() == 1


def test_two_d_tiles_quantize_w_and_w_transposed_alike() -> None:
    w = wide_blocks(48, 40, seed=2, spread=4)
    for fmt in (NVFP4, BLOCK_FORMATS["mxfp8"]):
        q = quantize_blocks(w, fmt, block_2d=True)
        qt = quantize_blocks(w.t().contiguous(), fmt, block_2d=True)
        assert torch.equal(q.dequantized, qt.dequantized.t())
    tiles = quantize_blocks(w, NVFP4, block_2d=True)
    assert tiles.block_scales.shape == (3, 3)  # 48x40 -> 3x3 tiles of 16x16 (40 padded to 48)
    amax = w[16:32, 16:32].abs().max()  # one scale for the whole 16x16 tile
    expected = nearest_even_reference((amax / 6.0 / tiles.tensor_scale).reshape(1), E4M3)
    assert tiles.block_scales[1, 1].item() == expected.item()


# --------------------------------------------------------------------------------------------
# torchao's reference quantizers (CPU)


TORCHAO_MX = {
    "mxfp8": "float8_e4m3fn", "mxfp8_e5m2": "float8_e5m2", "mxfp6": "fp6_e2m3", "mxfp6_e3m2": "fp6_e3m2",
    "mxfp4": "float4_e2m1fn_x2",
}  # fmt: skip


@pytest.mark.parametrize("fmt", MX, ids=ids)
def test_mx_agrees_bit_for_bit_with_torchao(fmt: BlockFormat) -> None:
    pytest.importorskip("torchao")
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    name = TORCHAO_MX[fmt.name]
    elem = getattr(torch, name, name)  # FP6 element dtypes are strings in torchao
    x = wide_blocks(64, 256, seed=3)
    scale, data = mx_tensor.to_mx(x, elem, 32)
    ref = mx_tensor.to_dtype(data, scale, elem, 32, torch.float32)
    q = quantize_blocks(x, fmt)
    assert torch.equal(q.e8m0_codes, scale.view(torch.uint8))
    assert torch.equal(q.dequantized, ref)


def test_nvfp4_agrees_bit_for_bit_with_torchao() -> None:
    pytest.importorskip("torchao")
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-3, 4, (64, 1), generator=g).float())
    t = nv.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=nv.per_tensor_amax_to_scale(x.abs().amax()))
    q = quantize_blocks(x, NVFP4)
    assert (t.scale.float() >= 2.0**-6).all()  # torchao's lower clamp on block scales does not bite here
    assert q.tensor_scale.item() == t.per_tensor_scale.item()
    assert torch.equal(q.block_scales, t.scale.float())
    assert torch.equal(q.dequantized, t.dequantize(torch.float32))


# --------------------------------------------------------------------------------------------
# stochastic rounding of blocks


@pytest.mark.parametrize("fmt", [BLOCK_FORMATS["mxfp4"], NVFP4], ids=ids)
def test_block_stochastic_rounding_is_unbiased_and_uses_its_generator(fmt: BlockFormat) -> None:
    n = 4000
    x = torch.zeros(n, fmt.block_size)
    x[:, 0] = 6.0  # fixes the block scale: elements in units of 1 (MX: 2**(2-2)) or 6/6 (NVFP4)
    x[:, 1] = 2.4  # between the E2M1 grid points 2 and 3
    before = torch.get_rng_state()
    q = quantize_blocks(x, fmt, stochastic=True, generator=torch.Generator().manual_seed(5)).dequantized
    assert torch.equal(torch.get_rng_state(), before)
    unit = q[0, 0].item() / 6.0
    vals = q[:, 1] / unit
    assert set(vals.unique().tolist()) <= {2.0, 3.0}
    sigma = math.sqrt(0.4 * 0.6 / n)
    assert abs(vals.mean().item() - 2.4) < 5 * sigma
    rne = quantize_blocks(x, fmt).dequantized[:, 1] / unit
    assert (rne == 2.0).all()  # round-to-nearest is biased by 0.4 here: far outside the bound


# --------------------------------------------------------------------------------------------
# the quantized layers


def recipe_for(name: str, **kw: object) -> GemmRecipe:
    fmt = BLOCK_FORMATS[name]
    return GemmRecipe(quantizer=BlockQuantizer(fmt, rng=RngStreams(0)), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("weight_2d", [False, True])
def test_linear_grads_are_fp32_gemms_of_quantized_operands(name: str, weight_2d: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    x = (torch.randn(5, 8, 64) * 3).requires_grad_()
    y = QuantLinearFn.apply(x, lin.weight, lin.bias, recipe_for(name, weight_2d=weight_2d))
    dy = torch.randn_like(y)
    y.backward(dy)

    def fq(t: torch.Tensor, dim: int, role: str = "") -> torch.Tensor:
        if role == "weight" and weight_2d:
            return fake_quantize(t.detach(), name, block_2d=True)
        return fake_quantize(t.detach(), name, dim)

    x2, g2 = x.detach().reshape(40, 64), dy.reshape(40, 48)
    y_ref = fq(x2, 1) @ fq(lin.weight, 1, "weight").t() + lin.bias.detach()
    dx_ref = fq(g2, 1) @ fq(lin.weight, 0, "weight")  # dgrad: both along out_features
    dw_ref = fq(g2, 0).t() @ fq(x2, 0)  # wgrad: both along tokens
    exact = not BLOCK_FORMATS[name].two_level  # NVFP4: the tensor scales multiply the product, not the operands
    check = torch.testing.assert_close if not exact else (lambda a, b: torch.equal(a, b) or pytest.fail("differs"))
    kw = {} if exact else {"rtol": 1e-5, "atol": 1e-5}
    check(y.detach().reshape(40, 48), y_ref, **kw)
    check(x.grad.reshape(40, 64), dx_ref, **kw)
    check(lin.weight.grad, dw_ref, **kw)
    assert torch.equal(lin.bias.grad, g2.sum(0))


def test_conv_forward_is_the_im2col_gemm_blocked_along_taps_channels() -> None:
    """Channels-last implicit GEMM: K runs over (kh, kw, C_in); with C_in = 32 a block is one tap's
    channels, so blocking the NCHW input per pixel along C equals blocking im2col along K."""
    torch.manual_seed(1)
    conv = nn.Conv2d(32, 16, 3, stride=2, padding=1, bias=False)
    x = torch.randn(2, 32, 9, 9).requires_grad_()
    y = QuantConv2dFn.apply(x, conv.weight, None, recipe_for("mxfp8"), conv.stride, conv.padding, conv.dilation)
    cols = F.unfold(x.detach(), 3, padding=1, stride=2)  # (N, C*kh*kw, L), K ordered (C, kh, kw)
    n, _, L = cols.shape
    cols_hwc = cols.reshape(n, 32, 9, L).transpose(1, 2).reshape(n, 288, L)  # K ordered (kh, kw, C)
    w_hwc = conv.weight.detach().permute(0, 2, 3, 1).reshape(16, 288)
    ref = fake_quantize(w_hwc, "mxfp8", 1) @ fake_quantize(cols_hwc, "mxfp8", 1)  # (N, C_out, L)
    torch.testing.assert_close(y.detach().reshape(n, 16, L), ref, rtol=1e-5, atol=1e-5)

    # dgrad: the transposed GEMM, blocked along C_out, folded back (an independent path: fold, not conv)
    dy = torch.randn_like(y)
    y.backward(dy)
    g = fake_quantize(dy.reshape(n, 16, L), "mxfp8", 1)
    w_d = fake_quantize(conv.weight.detach().reshape(16, 288), "mxfp8", 0)
    dx_ref = F.fold(w_d.t() @ g, (9, 9), 3, padding=1, stride=2)
    torch.testing.assert_close(x.grad, dx_ref, rtol=1e-5, atol=1e-5)
    # wgrad: along the batch x output-pixel dim
    a = fake_quantize(dy.permute(1, 0, 2, 3).reshape(16, -1), "mxfp8", 1)
    b = fake_quantize(cols.permute(1, 0, 2).reshape(288, -1), "mxfp8", 1)
    torch.testing.assert_close(conv.weight.grad.reshape(16, 288), a @ b.t(), rtol=1e-5, atol=1e-5)


class _Identity:
    """A quantizer that quantizes nothing (to check the Hadamard transform alone)."""

    def __call__(self, x: torch.Tensor, dim: int, role: str,
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, None]:
        return x.to(dtype or torch.float32), None


@pytest.mark.parametrize(("x_layout", "w_layout"), [("nchw", "nchw"), ("cl", "nchw"), ("cl", "cl")])
@pytest.mark.parametrize(("c_in", "c_out", "size", "k", "stride"), [(64, 64, 2, 3, 1), (64, 32, 14, 3, 1),
                                                                    (16, 16, 8, 3, 2), (256, 64, 2, 1, 1)])
def test_conv_dgrad_with_nothing_quantized_is_the_plain_convs(c_in: int, c_out: int, size: int, k: int, stride: int,
                                                             x_layout: str, w_layout: str) -> None:
    """With a quantizer that changes nothing, the layer's input gradient is an FP32 Conv2d's under
    autograd, bit for bit and in the same memory format: dgrad is the same convolution backward, given
    the same operands (an expanded placeholder for x made a channels-last dx NCHW, summed in another
    order). Read off a hook: a leaf's .grad is laid out like the leaf whatever backward returned.
    A 1x1 convolution with stride 1 is a GEMM on a CPU (``qgemm._pointwise``): the same layout, and
    values within FP32 rounding (a GEMM kernel may split the sum along C where the convolution does not)."""
    g = torch.Generator().manual_seed(3)
    fmt = {"nchw": torch.contiguous_format, "cl": torch.channels_last}
    x = torch.randn(8, c_in, size, size, generator=g).contiguous(memory_format=fmt[x_layout])
    w = torch.randn(c_out, c_in, k, k, generator=g).contiguous(memory_format=fmt[w_layout])
    conv = (stride, stride), (k // 2, k // 2), (1, 1)
    dy = torch.randn(F.conv2d(x, w, None, *conv).shape, generator=g).contiguous(memory_format=fmt[x_layout])
    grads = []
    for run in (lambda t: QuantConv2dFn.apply(t, w, None, GemmRecipe(_Identity()), *conv),
                lambda t: F.conv2d(t, w, None, *conv)):
        leaf = x.clone().requires_grad_()
        t = leaf * 1  # a non-leaf: its hook sees the gradient as the layer's backward returned it
        t.register_hook(grads.append)
        run(t).backward(dy)
    quantized, plain = grads
    assert quantized.stride() == plain.stride()
    if (k, stride) == (1, 1):
        torch.testing.assert_close(quantized, plain, rtol=1e-6, atol=1e-5)
    else:
        assert torch.equal(quantized, plain)


def _dx_and_calls(x: torch.Tensor, dy: torch.Tensor, layer: Any) -> tuple[tuple[torch.Tensor, ...], list[str]]:
    """(y, dx) of ``layer`` on a copy of x, and the aten convolution ops it called, forward and backward.
    dx as the layer's backward returned it (a hook on a non-leaf), not as .grad lays it out."""
    seen: list[str] = []

    class Convs(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.overloadpacket.__name__.startswith("convolution"):
                seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    t = x.clone().requires_grad_() * 1
    grads: list[torch.Tensor] = []
    t.register_hook(grads.append)
    with Convs():
        y = layer(t)
        y.backward(dy)
    return (y, *grads), seen


@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_convs_run_as_gemms_on_a_cpu(layout: str, dtype: torch.dtype) -> None:
    """A small quantized 1x1 convolution with stride 1 and no padding makes no convolution call on a
    CPU: fprop and dgrad are matmuls (``qgemm._pointwise``: per image on 6x6 maps, over the batch on
    2x2 and 1x1 ones), with an FP32 convolution's values up to rounding (bf16 products: the
    output's) and its memory format; a 3x3 one, a 1x1 one with stride 2, and one past
    ``_POINTWISE_FLOPS`` still convolve, in the same layout."""
    g = torch.Generator().manual_seed(8)
    fmt = {"nchw": torch.contiguous_format, "cl": torch.channels_last}[layout]
    # (batch, channels, map size, kernel, stride, whether it convolves)
    cases = [(4, 48, 6, 1, 1, False), (4, 48, 2, 1, 1, False), (4, 48, 1, 1, 1, False), (4, 48, 6, 3, 1, True),
             (4, 48, 6, 1, 2, True), (4, 256, 32, 1, 1, True)]  # the last: 2 * 4 * 256 * 32**2 * 40 flops
    assert 2 * 4 * 256 * 32**2 * 40 > qgemm._POINTWISE_FLOPS >= 2 * 4 * 48 * 6**2 * 40
    for n, c, size, k, stride, convolves in cases:
        # values bf16 holds, so that bf16 products differ from FP32's only by rounding the output once
        x = torch.randn(n, c, size, size, generator=g).bfloat16().float().contiguous(memory_format=fmt)
        w = torch.randn(40, c, k, k, generator=g).bfloat16().float()
        conv = (stride, stride), (k // 2, k // 2), (1, 1)
        dy = torch.randn(F.conv2d(x, w, None, *conv).shape, generator=g).bfloat16().float()
        dy = dy.contiguous(memory_format=fmt)
        got, quantized_calls = _dx_and_calls(x, dy, lambda t, w=w, conv=conv: QuantConv2dFn.apply(
            t, w, None, GemmRecipe(_Identity(), dtype), *conv))
        want, _ = _dx_and_calls(x, dy, lambda t, w=w, conv=conv: F.conv2d(t, w, None, *conv))
        assert quantized_calls == (["convolution", "convolution_backward"] if convolves else [])
        assert [a.stride() for a in got] == [b.stride() for b in want]
        if convolves:
            continue  # aten's bf16 convolutions round differently on each CPU kind: not this test's subject
        for a, b in zip(got, want, strict=True):
            if dtype == torch.bfloat16:  # FP32 sums rounded once to bf16: within half its ulp, 2**-8
                assert ((a - b).abs() <= b.abs() * (2**-8 + 1e-6)).all()
            else:  # FP32 sums, perhaps in another order
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(("n", "size", "channels_last"), [(2, 1, False), (2, 1, True), (1, 2, False), (8, 4, True)])
def test_conv_dgrad_with_bf16_products_on_one_thread(n: int, size: int, channels_last: bool) -> None:
    """emulated_compute=bf16: dgrad runs aten's convolution backward on bf16 operands. Given the FP32
    x as well, its CPU path for small maps on one thread refused the mix ("expected scalar type Float
    but found BFloat16": ResNet-50/8 at batch 2, a 1x1 conv on a 1x1 map). dx is an FP32 Conv2d's
    under autograd on the same operands (bf16 holds them: they are rounded to it first), rounded
    once to bf16 as a bf16 GEMM's output is. Stride 2 runs aten's backward; stride 1 is a bf16
    matmul on a CPU (``qgemm._pointwise``), held to the same."""
    g = torch.Generator().manual_seed(4)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(n, 64, size, size, generator=g).contiguous(memory_format=layout)
    w = torch.randn(256, 64, 1, 1, generator=g).bfloat16().float()
    for stride in (1, 2):
        conv = (stride, stride), (0, 0), (1, 1)
        dy = torch.randn(F.conv2d(x, w, None, *conv).shape, generator=g).bfloat16().float()
        dy = dy.contiguous(memory_format=layout)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            grads = []
            for run in (lambda t, c=conv: QuantConv2dFn.apply(t, w, None, GemmRecipe(_Identity(), torch.bfloat16), *c),
                        lambda t, c=conv: F.conv2d(t, w, None, *c)):
                leaf = x.clone().requires_grad_()
                run(leaf).backward(dy)
                grads.append(leaf.grad)
        finally:
            torch.set_num_threads(threads)
        quantized, plain = grads
        assert quantized.dtype == torch.float32 and torch.equal(quantized.bfloat16().float(), quantized)
        # FP32 sums (perhaps in another order), then one rounding to bf16: within half its ulp, 2**-8
        assert ((quantized - plain).abs() <= plain.abs() * (2**-8 + 1e-6)).all()


def test_hadamard_is_orthogonal_and_seeded() -> None:
    h = hadamard_matrix(16)
    assert torch.equal(h @ h.t(), torch.eye(16)) and set(h.abs().unique().tolist()) == {0.25}
    before = torch.get_rng_state()
    s1, s2 = random_signs(torch.Generator().manual_seed(3)), random_signs(torch.Generator().manual_seed(3))
    assert torch.equal(torch.get_rng_state(), before) and torch.equal(s1, s2) and set(s1.tolist()) <= {-1.0, 1.0}
    x = torch.randn(5, 32)
    t = random_hadamard(x, 1, s1)
    torch.testing.assert_close(t.norm(dim=1), x.norm(dim=1))


def wgrad(recipe: GemmRecipe, x: torch.Tensor, dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    w = w.detach().clone().requires_grad_()
    QuantLinearFn.apply(x, w, None, recipe).backward(dy)
    assert w.grad is not None
    return w.grad


def test_hadamard_cancels_in_the_wgrad_gemm() -> None:
    g = torch.Generator().manual_seed(6)
    # integers: every product and sum below is exact in FP32, so "cancels" can be checked exactly
    x = torch.randint(-8, 8, (37, 24), generator=g).float()  # 37 tokens: padded to 48 for the transform
    dy = torch.randint(-8, 8, (37, 20), generator=g).float()
    w = torch.zeros(20, 24)
    signs = GemmRecipe.signs(1)
    plain = wgrad(GemmRecipe(_Identity()), x, dy, w)
    rht = wgrad(GemmRecipe(_Identity(), hadamard_signs=signs), x, dy, w)
    assert torch.equal(plain, dy.t() @ x) and torch.equal(rht, plain)

    # quantized (NVFP4): equal up to quantization error, and the transform does change the operands
    x, dy = torch.randn(256, 64, generator=g), torch.randn(256, 32, generator=g)
    exact = dy.t() @ x
    q_plain = wgrad(recipe_for("nvfp4"), x, dy, torch.zeros(32, 64))
    q_rht = wgrad(recipe_for("nvfp4", hadamard_signs=signs), x, dy, torch.zeros(32, 64))
    err = lambda a: ((a - exact).norm() / exact.norm()).item()  # noqa: E731
    assert not torch.equal(q_plain, q_rht)
    assert err(q_plain) < 0.25 and err(q_rht) < 0.25


# --------------------------------------------------------------------------------------------
# conversion, decisions and precision=mx


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.body = nn.Conv2d(32, 64, 3, padding=1)
        self.up = nn.ConvTranspose2d(64, 32, 2, stride=2)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 16 * 16, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.up(F.relu(self.body(self.dw(self.stem(x))))))


def test_convert_records_a_decision_per_gemm_layer() -> None:
    model, state = convert_model(Net(), {"format": "mxfp8", "keep_high": ["head.*"], "keep_first": 1})
    d = {x.name: x for x in state.decisions}
    assert list(d) == ["stem", "dw", "body", "up", "head.1", "head.3"]
    assert all(isinstance(x, LayerDecision) for x in state.decisions)
    assert (d["stem"].format, d["stem"].reason) == ("high", "first layer (keep_first=1)")
    assert d["dw"].format == "high" and "groups=32" in d["dw"].reason
    assert d["body"].format == "mxfp8" and d["body"].kind == "conv2d"
    assert d["up"].format == "high" and d["up"].kind == "conv_transpose2d"
    assert d["head.1"].reason == "keep_high pattern 'head.*'"
    assert list(model.state_dict()) == list(Net().state_dict())
    out = model(torch.randn(2, 3, 8, 8))
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())

    _, nv = convert_model(Net(), {"format": "nvfp4", "pad_blocks": False})
    d = {x.name: x for x in nv.decisions}
    assert d["stem"].reason == "reduction dim C_in=3 not divisible by block 16 (pad_blocks=false)"
    assert d["head.3"].format == "high" and d["head.3"].reason.startswith("last layer (keep_last=null")
    _, none_kept = convert_model(Net(), {"format": "nvfp4", "keep_last": 0})
    assert {x.name: x.format for x in none_kept.decisions}["head.3"] == "nvfp4"


def test_graph_combo_kernels_reach_the_recipe_and_its_graphs_options() -> None:
    """precision.graph_combo_kernels, from the composed config to every converted layer's recipe, its
    graphs' own variant name and inductor's options for them (scripts/triton_kernels.py counts what
    it does to the launches; only a GPU runs it)."""
    from mptrain.numerics import compiled_calls

    off, on = (graph_option_recipe("nvfp4", "graph_combo_kernels", flag) for flag in (False, True))
    assert (off.combo_kernels, on.combo_kernels) == (False, True)
    assert on.graph_key() == off.graph_key() + ":combo"  # its own graphs, beside the other's in one process
    assert "combo_kernels" not in compiled_calls.graph_options((torch.zeros(1), off))
    assert compiled_calls.graph_options((torch.zeros(1), on))["combo_kernels"] is True
    assert "combo_kernels" in torch._inductor.config.get_config_copy()  # an option this torch's inductor has


def test_graph_static_shapes_reach_the_recipe_and_name_each_shape() -> None:
    """precision.graph_static_shapes, from the composed config to every converted layer's recipe and
    its graphs' variant names: each tensor's whole shape, where without it only its unit dims."""
    from mptrain.numerics import compiled_calls

    off, on = (graph_option_recipe("mxfp8", "graph_static_shapes", flag) for flag in (False, True))
    assert (off.static_shapes, on.static_shapes) == (False, True)
    assert on.graph_key() == off.graph_key() + ":static"
    x = torch.zeros(8, 1, 64)
    assert compiled_calls._graph_sig(x) == "Tx1xfloat32"
    assert compiled_calls._graph_sig(x, static=True) == "T8x1x64float32"


def graph_option_recipe(fmt: str, option: str, value: bool) -> GemmRecipe:
    """The one recipe of a small model's quantized layers, from the composed config with
    ``precision.<option>=<value>``."""
    cfg = make_cfg("model=transformer_lm_tiny", "precision=mx", f"precision.format={fmt}",
                   f"precision.{option}={str(value).lower()}")
    validate(cfg)
    model = build_precision(cfg.precision, torch.device("cpu")).prepare_model(
        nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 4)))
    found = [m.mx_recipe for m in model.modules() if hasattr(m, "mx_recipe")]
    assert found and all(r is found[0] for r in found)  # one recipe for the model's quantized layers
    return found[0]


def make_cfg(*overrides: str) -> DictConfig:
    from conftest import compose, on_cpu

    return compose(on_cpu(list(overrides)))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("precision.format=mxfp3", "precision.format='mxfp3': must be one of mxfp8, mxfp8_e5m2, mxfp6"),
        ("precision.emulated_compute=fp16", "precision.emulated_compute='fp16': must be one of fp32, bf16"),
        ("precision.keep_last=-1", "precision.keep_last=-1: must be an integer >= 0"),
    ],
)
def test_bad_mx_options_are_one_line_errors(override: str, message: str) -> None:
    cfg = make_cfg(*tiny("alexnet", "precision=mx", override))
    with pytest.raises(MptrainError, match=message.replace("(", r"\(")):
        validate(cfg)


def test_mx_is_refused_for_the_lstm_lm() -> None:
    cfg = make_cfg("model=lstm_lm_tiny", "precision=mx")
    with pytest.raises(MptrainError, match=r"precision=mx with model=lstm_lm_tiny: MX converts nn\.Linear/Conv"):
        validate(cfg)


def test_mx_needs_no_loss_scale_and_describes_its_layers() -> None:
    from mptrain.numerics.scalers import resolve_policy

    p = build_precision(OmegaConf.create({"name": "mx", "format": "mxfp6"}), torch.device("cpu"))
    assert resolve_policy("auto", p.resolved, p.fp8) == "none"
    p.prepare_model(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)))
    detail = p.describe()["mx_layers"]
    assert detail["format"] == "mxfp6" and [x["format"] for x in detail["decisions"]] == ["mxfp6", "mxfp6"]
    with pytest.raises(MptrainError, match=r"precision\.format='fp4'"):
        build_precision(OmegaConf.create({"name": "mx", "format": "fp4"}), torch.device("cpu"))


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp6", "mxfp4", "nvfp4"])
def test_tiny_run_per_format(run_dir: Path, fmt: str) -> None:
    summary = run_job(run_dir, *tiny("alexnet", "precision=mx", f"precision.format={fmt}", "trainer.max_steps=3"))
    assert summary["status"] == "completed" and math.isfinite(summary["final_loss"])
    assert summary["loss_scale"] == "none"
    layers = summary["precision_detail"]["mx_layers"]
    assert layers["format"] == fmt and layers["converted"]
    assert len(layers["decisions"]) == 8  # alexnet: 5 convs, 3 linears


def test_tiny_run_fp8_hybrid_rowwise(run_dir: Path) -> None:
    summary = run_job(
        run_dir, *tiny("alexnet", "precision=fp8", "precision.format=hybrid", "precision.scaling=rowwise",
                       "trainer.max_steps=3"),
    )  # fmt: skip
    assert summary["status"] == "completed" and math.isfinite(summary["final_loss"])
    decisions = summary["precision_detail"]["fp8_layers"]["decisions"]
    assert [d["format"] for d in decisions] == ["fp8_hybrid"] * 8


def test_fp8_rowwise_layer_quantizes_each_gemm_along_its_reduction_dim() -> None:
    from mptrain.numerics.formats import E5M2
    from mptrain.numerics.fp8 import convert_model as convert_fp8
    from mptrain.numerics.qgemm import axiswise_round

    torch.manual_seed(3)
    lin = nn.Linear(24, 12)
    model, state = convert_fp8(
        nn.Sequential(copy.deepcopy(lin), nn.ConvTranspose2d(2, 2, 2)),
        {"format": "hybrid", "scaling": "rowwise", "master_weights": "fp32", "stochastic_rounding": False},
    )
    assert [d.format for d in state.decisions] == ["fp8_hybrid", "high"]
    assert state.decisions[1].reason == "no row-wise emulation for ConvTranspose2d"
    x = (torch.randn(10, 24) * torch.exp2(torch.randint(-6, 6, (10, 1)).float())).requires_grad_()
    y = model[0](x)
    dy = torch.randn_like(y) * 1e-3
    y.backward(dy)
    e4 = E4M3
    assert torch.equal(y.detach(), axiswise_round(x.detach(), e4, 1) @ axiswise_round(lin.weight, e4, 1).t() + lin.bias)
    assert torch.equal(x.grad, axiswise_round(dy, E5M2, 1) @ axiswise_round(lin.weight, e4, 0))
    assert torch.equal(model[0].weight.grad, axiswise_round(dy, E5M2, 0).t() @ axiswise_round(x.detach(), e4, 0))


def test_axiswise_scales_are_powers_of_two_that_fit() -> None:
    from mptrain.numerics.qgemm import axiswise_round

    x = torch.randn(8, 40) * torch.exp2(torch.randint(-30, 30, (8, 1)).float())
    x[3] = 0
    q = axiswise_round(x, E4M3, 1)
    assert torch.equal(q[3], x[3])
    for row, qrow in zip(x, q, strict=True):
        amax = row.abs().max().item()
        if amax == 0:
            continue
        k = math.floor(math.log2(E4M3.max_normal / amax))
        scaled = row.double() * 2.0**k
        assert scaled.abs().max() <= E4M3.max_normal < scaled.abs().max() * 2
        assert torch.equal(qrow, (nearest_even_reference(scaled.float(), E4M3).double() / 2.0**k).float())


def test_axiswise_scales_up_rows_of_tiny_values() -> None:
    """A row whose amax is ~1e-38 or an FP32 subnormal gets the largest scale, 2**126, not a
    scale from an overflowed max / amax (which flushed such a row to zero)."""
    from mptrain.numerics.qgemm import axiswise_round

    x = torch.tensor([[1e-38, -3e-39, 5e-40], [2.0**-130, 2.0**-131, 0.0]])
    q = axiswise_round(x, E4M3, 1)
    for row, qrow in zip(x, q, strict=True):
        scaled = row.double() * 2.0**126  # max / amax > 2**126 here: the clamp decides
        assert torch.equal(qrow, (nearest_even_reference(scaled.float(), E4M3).double() / 2.0**126).float())
    assert (q[0] != 0).all() and q[1, 0] != 0


# --------------------------------------------------------------------------------------------
# defects found by the independent check (issue 24): each test fails on the code before its fix


@pytest.mark.parametrize("scale", [1e-36, 1e-40, 1e-44])
def test_nvfp4_survives_a_tensor_of_tiny_amax(scale: float) -> None:
    """Below amax ~8e-36 the FP32 encode scale 1 / s_t overflowed: every element went to +-6 and
    zeros to NaN. With the encode scales clamped to FP32's max (NVIDIA's reference), zeros stay zero
    and nothing grows; values still held by FP32 come back close, and the tinier ones flush to
    zero rather than explode (since nvfp4_shift, the clamp is not reached from FP32 at all)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=g) * scale
    x[:, ::4] = 0.0
    q = quantize_blocks(x, NVFP4).dequantized
    assert not torch.isnan(q).any()
    assert (q[x == 0] == 0).all()
    assert (q.abs() <= x.abs().amax() * 1.125).all()
    if scale >= 1e-36:  # the block maxima: an E4M3 scale (3 mantissa bits) times 6, within 1/16
        blocks, top = x.view(-1, 16), x.view(-1, 16).abs().argmax(-1, keepdim=True)
        assert torch.allclose(q.view(-1, 16).gather(1, top), blocks.gather(1, top), rtol=1 / 16, atol=0)


@pytest.mark.parametrize("block_2d", [False, True])
def test_nvfp4_decisions_are_invariant_to_powers_of_two_down_to_tiny_amax(block_2d: bool) -> None:
    """Issue 76: x and x * 2**k get the same elements and block scales, and decode to the same values
    times 2**k, for tensor amaxes from 2**0 down to 2**-117 (where s_t = amax / 2688 is an FP32
    subnormal and 1 / s_t overflows: 18 of 256 elements changed before nvfp4_shift). The reference
    is the tensor at amax 1, where nothing is near FP32's limits."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 16, generator=g) * torch.logspace(0, -6, 16).unsqueeze(1)  # blocks far apart
    x = x / x.abs().amax()
    ref = quantize_blocks(x, NVFP4, block_2d=block_2d)
    for k in (-1, -30, -64, -65, -100, -114, -115, -117):
        q = quantize_blocks(x * 2.0**k, NVFP4, block_2d=block_2d)
        assert torch.equal(q.elements, ref.elements), k
        assert torch.equal(q.block_scales, ref.block_scales), k
        assert torch.equal(q.dequantized, (ref.dequantized.double() * 2.0**k).float()), k
        assert q.tensor_scale.item() == (ref.tensor_scale.double() * 2.0**k).float().item(), k


def test_float64_is_rounded_once() -> None:
    """1.25 + 2**-30 rounds up to 1.5 in FP4 (E2M1); rounded to FP32 first it is the tie 1.25,
    which goes to the even 1.0. The same value inside a block, with scale 1."""
    x = torch.tensor([1.25 + 2.0**-30, 6.0], dtype=torch.float64)
    assert quantize_blocks(x.repeat(16), "mxfp4").dequantized[0].item() == 1.5
    assert quantize_blocks(x.float().repeat(16), "mxfp4").dequantized[0].item() == 1.0  # the FP32 input's tie


def test_local_values_are_exact_in_bf16_down_to_the_stated_scale() -> None:
    """qgemm computes emulated_compute=bf16 GEMMs on ``local`` (elements times block scales) cast to
    bf16: exact for every element on every scale 2**k with k >= bf16_exact_min_scale_exponent, and
    not below it (checked on the format's whole grid, not on the formula)."""
    from mptrain.numerics.formats import element_grid
    from mptrain.numerics.mx import bf16_exact_min_scale_exponent

    for fmt in MX:
        grid = element_grid(fmt.element)
        exact = [k for k in range(-127, 128)
                 if torch.equal((grid * 2.0**k).float().to(torch.bfloat16).double(), grid * 2.0**k)]  # fmt: skip
        assert exact == list(range(bf16_exact_min_scale_exponent(fmt), 128 - fmt.element.emax)), fmt.name
    assert bf16_exact_min_scale_exponent(BLOCK_FORMATS["mxfp8"]) == -124
    assert bf16_exact_min_scale_exponent(BLOCK_FORMATS["mxfp8_e5m2"]) == -117


@pytest.mark.parametrize("layer", ["mx", "fp8"])
def test_an_outer_autocast_does_not_change_what_emulated_gemms_compute_in(layer: str) -> None:
    """Inside torch.autocast(bf16), forward and backward equal the run outside it: the GEMMs
    compute in emulated_compute (FP32 here), not in autocast's bf16."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    if layer == "mx":
        convert_model(lin, {"format": "mxfp8"})
    else:
        from mptrain.numerics.fp8 import convert_model as fp8_convert

        fp8_convert(lin, {"format": "hybrid", "master_weights": "fp32", "stochastic_rounding": False})
    x = torch.randn(8, 64)

    def run(autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        lin.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = lin(x)
        y.float().square().sum().backward()
        return y.float().detach(), lin.weight.grad.clone()

    (y0, g0), (y1, g1) = run(False), run(True)
    assert torch.equal(y0, y1) and torch.equal(g0, g1)


@pytest.mark.parametrize(("k", "stride", "padding", "size", "channels_last"), [
    (1, 1, 0, 7, False), (1, 2, 0, 7, False), (1, 1, 0, 3, True),  # unpadded 1x1: strided at every size
    (3, 1, 1, 9, False), (3, 1, 1, 9, True), (7, 2, 3, 20, False),  # rows of >= 8 pixels: strided
    (3, 2, 1, 7, False), (3, 1, 1, 4, True),  # narrower rows: a cached gather on a CPU
])
def test_conv_wgrad_columns_are_the_unfold_gemm(k: int, stride: int, padding: int, size: int,
                                                channels_last: bool) -> None:
    """wgrad's im2col columns, taken as one strided copy of x or one gather where that is faster than
    aten's unfold: the same GEMM as the unfold one (the reference here), blocked along batch x pixel."""
    torch.manual_seed(2)
    conv = nn.Conv2d(48, 40, k, stride=stride, padding=padding, bias=False)
    x = torch.randn(3, 48, size, size)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    y = QuantConv2dFn.apply(x, conv.weight, None, recipe_for("mxfp8"), conv.stride, conv.padding, conv.dilation)
    dy = torch.randn_like(y)
    y.backward(dy)
    cols = F.unfold(x.detach(), k, padding=padding, stride=stride)  # (N, C_in*k*k, L)
    a = fake_quantize(dy.permute(1, 0, 2, 3).reshape(40, -1), "mxfp8", 1)
    b = fake_quantize(cols.permute(1, 0, 2).reshape(48 * k * k, -1), "mxfp8", 1)
    assert torch.equal(conv.weight.grad.reshape(40, -1), a @ b.t())


def test_converted_layers_under_a_users_torch_compile() -> None:
    """torch.compile around converted layers (the library API) runs them as graph breaks and gives
    eager's gradients bit for bit. Traced by dynamo, their autograd functions gave zero gradients on
    torch 2.11 (this test fails there without ``torch.compiler.disable`` on the layers' forwards)."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 1), nn.Flatten(),
                        nn.Linear(32 * 64, 10))  # fmt: skip
    model, _ = convert_model(net, {"format": "mxfp8"})
    x = torch.randn(4, 16, 8, 8)
    want = _grads(model, model, x)
    torch._dynamo.reset()
    got = _grads(model, torch.compile(model, backend="eager"), x)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def _grads(model: nn.Module, run: Any, x: torch.Tensor) -> list[torch.Tensor]:
    """``model``'s parameter gradients after one backward of ``run(x)`` (model itself or compiled)."""
    model.zero_grad(set_to_none=True)
    run(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("precision", ["mxfp8", "fp8 hybrid", "fp8 rowwise"])
def test_the_layers_autograd_functions_traced_by_dynamo_give_eagers_gradients(
        precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The converted layers traced by dynamo (MX: ``in_graph``; FP8: ``torch.compiler.disable``
    taken off its forwards): eager's gradients bit for bit. On torch 2.11 an autograd.Function
    whose forward returned the result of a ``.to``, ``.float()`` or ``.contiguous()`` that had
    nothing to do (its input itself: the reference quantizers, which the suite runs, end with one)
    got zero gradients for every input, silently; ``qgemm.traced_output`` returns a copy there.
    Covers a Linear without bias, a one-image 1x1 convolution (a CPU's ``_pointwise`` GEMM), an
    in-place ReLU after a layer and FP8's operand rounding."""
    from mptrain.numerics import fp8

    for cls in (fp8.Fp8Linear, fp8.Fp8Conv2d):
        monkeypatch.setattr(cls, "forward", cls.forward.__wrapped__)  # type: ignore[attr-defined]
    torch.manual_seed(5)
    net = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(32, 32, 1), nn.Flatten(),
                        nn.Linear(32 * 16, 32, bias=False), nn.ReLU(), nn.Linear(32, 10))  # fmt: skip
    if precision == "mxfp8":
        model, _ = convert_model(net, {"format": "mxfp8"}, in_graph=True)
    else:
        scaling = precision.split()[1].replace("hybrid", "loss")
        model, _ = fp8.convert_model(net, {"format": "hybrid", "scaling": scaling, "stochastic_rounding": False})
    x = torch.randn(1, 32, 4, 4)
    want = _grads(model, model, x)
    assert all(w.abs().sum() > 0 for w in want)
    torch._dynamo.reset()
    got = _grads(model, torch.compile(model, backend="eager"), x)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("options", [
    {"format": "mxfp8"},
    {"format": "nvfp4", "stochastic_rounding": False, "keep_last": 0},  # Hadamard on wgrad, 16x16 weight tiles
])
def test_layers_in_the_graph_compile_whole_with_eagers_gradients(options: dict[str, Any]) -> None:
    """``in_graph`` (trainer.compile): dynamo traces the converted layers into the model's graph, one
    graph with no break (without it, they break it), and AOTAutograd's graphs of the whole
    model, run on eager kernels (``aot_eager``), give eager's loss and gradients bit for bit."""
    torch.manual_seed(6)

    def net() -> nn.Module:
        torch.manual_seed(6)
        return nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 16, 64),
                             nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 32, bias=False))  # fmt: skip

    x = torch.randn(2, 16, 4, 4)
    for in_graph in (False, True):
        model, _ = convert_model(net(), options, in_graph=in_graph)
        torch._dynamo.reset()
        seen = torch._dynamo.explain(model)(x)
        assert ((seen.graph_count, seen.graph_break_count) == (1, 0)) == in_graph
    eager, _ = convert_model(net(), options)
    want = _grads(eager, eager, x)
    torch._dynamo.reset()
    got = _grads(model, torch.compile(model, backend="aot_eager"), x)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("fused_on", [False, True], ids=["reference", "fused"])
def test_stochastic_rounding_compiled_whole_draws_what_eager_draws(fused_on: bool) -> None:
    """NVFP4's recipe (stochastic rounding of gradients, Hadamard on wgrad, 2D weight tiles) with
    ``in_graph``: one graph, no break. AOTAutograd's graphs on eager kernels advance the rounding
    stream as eager does and give its gradients bit for bit, step after step, though the draws
    change them from step to step. Rewinding the stream (a resume) repeats a step: the graph reads
    the counter on every call. Its tensors are static inputs, for a CUDA graph that advances it."""
    from mptrain.numerics import fused

    def net() -> nn.Module:
        torch.manual_seed(7)
        return nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 16, 64),
                             nn.ReLU(), nn.Linear(64, 32, bias=False))  # fmt: skip

    x = torch.randn(2, 16, 4, 4)
    options = {"format": "nvfp4", "keep_last": 0}
    with fused.forced(fused_on):
        eager, eager_state = convert_model(net(), options)
        model, state = convert_model(net(), options, in_graph=True)
        stream = state.rng._streams[x.device]  # made at conversion, before any trace
        assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in (stream.keys, stream.counter))
        torch._dynamo.reset()
        seen = torch._dynamo.explain(model)(x)
        assert (seen.graph_count, seen.graph_break_count) == (1, 0)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        steps, draws = [], [0]
        for _ in range(3):
            want, got = _grads(eager, eager, x), _grads(model, compiled, x)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            draws.append(int(stream.counter))
            assert draws[-1] == int(eager_state.rng.get(x.device).counter) > draws[-2]
            steps.append(got)
        assert any(not torch.equal(a, b) for a, b in zip(steps[0], steps[1], strict=True))
        stream.load_state_dict({"draws": draws[1]})
        assert all(torch.equal(g, w) for g, w in zip(_grads(model, compiled, x), steps[1], strict=True))


@pytest.mark.parametrize(("shape", "k", "stride", "padding", "dilation", "channels_last", "way"), [
    ((2, 5, 9, 9), (3, 3), (1, 1), (1, 1), (1, 1), False, "windows"),
    ((2, 5, 8, 8), (1, 1), (2, 2), (0, 0), (1, 1), False, "windows"),  # an unpadded 1x1 with a stride
    ((2, 5, 20, 20), (3, 3), (2, 2), (1, 1), (2, 2), False, "windows"),  # dilated
    ((2, 3, 32, 32), (7, 7), (2, 2), (3, 3), (1, 1), True, "windows"),  # ResNet's stem
    ((2, 5, 26, 19), (5, 3), (3, 2), (2, 1), (1, 1), False, "windows"),
    ((2, 5, 4, 4), (3, 3), (1, 1), (1, 1), (1, 1), False, "gather"),
    ((2, 5, 7, 6), (3, 2), (2, 1), (1, 0), (2, 1), True, "gather"),
    ((40, 64, 7, 7), (3, 3), (1, 1), (1, 1), (1, 1), False, "unfold"),  # past the gather's index size
])
def test_each_way_of_taking_the_columns_is_unfold(shape: tuple[int, ...], k: tuple[int, int], stride: tuple[int, int],
                                                  padding: tuple[int, int], dilation: tuple[int, int],
                                                  channels_last: bool, way: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """im2col.wgrad_columns takes the layer's columns the way its docstring gives for the shape, and
    every way is F.unfold's values in the wgrad GEMM's layout, bit for bit."""
    from mptrain.numerics import im2col

    ways: list[str] = []
    for name, tag in (("_windows", "windows"), ("_gather_index", "gather")):
        real = getattr(im2col, name)
        monkeypatch.setattr(im2col, name, lambda *a, _r=real, _t=tag: ways.append(_t) or _r(*a))
    unfold = F.unfold
    monkeypatch.setattr(im2col.F, "unfold", lambda *a, **kw: ways.append("unfold") or unfold(*a, **kw))
    x = torch.randn(shape)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    got = im2col.wgrad_columns(x, k, stride, padding, dilation)
    cols = F.unfold(x, k, dilation=dilation, padding=padding, stride=stride)
    assert torch.equal(got, cols.permute(1, 0, 2).reshape(cols.shape[1], -1))
    assert ways[0] == way  # (then the reference's unfold, and the gather's index built from windows)


@dataclasses.dataclass
class _Recording(BlockQuantizer):
    """A block quantizer that counts the elements of each "input" operand it quantizes."""

    inputs: list[int] = dataclasses.field(default_factory=list)

    def __call__(self, x: torch.Tensor, dim: int, role: str, *args: Any, **kwargs: Any) -> Any:
        if role == "input":
            self.inputs.append(x.numel())
        return super().__call__(x, dim, role, *args, **kwargs)


@pytest.mark.parametrize(("name", "shape", "k", "stride", "padding", "channels_last"), [
    ("nvfp4", (2, 3, 32, 32), 7, 2, 3, False),  # ResNet's stem: 16 output pixels a row, 1 block
    ("nvfp4", (2, 4, 16, 16), 3, 1, 1, True),
    ("mxfp8", (2, 3, 32, 32), 3, 1, 1, False),  # 32 a row: one MX block
])
def test_shared_row_windows_are_quantized_once(name: str, shape: tuple[int, ...], k: int, stride: int, padding: int,
                                               channels_last: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a filter is taller than its stride and a block never crosses an output row, wgrad's x
    operand is quantized as x's row windows, each once (``qgemm._quantized_rows``), fewer elements
    than the columns hold; the weight gradient is the columns' own bit for bit (the same layer with
    the path turned off), with NVFP4's Hadamard transform, on the fused kernels and on the eager
    reference alike."""
    from mptrain.numerics import fused

    two_level = BLOCK_FORMATS[name].two_level
    g = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=g) * 4
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, shape[1], k, k, generator=g)
    signs = GemmRecipe.signs(1) if two_level else None
    conv = (stride, stride), (padding, padding), (1, 1)

    def wgrad(off: bool) -> tuple[torch.Tensor, list[int]]:
        quantizer = _Recording(BLOCK_FORMATS[name], stochastic_grads=True, rng=RngStreams(0))
        recipe = GemmRecipe(quantizer, torch.bfloat16, hadamard_signs=signs, weight_2d=two_level)
        leaf = w.clone().requires_grad_()
        y = QuantConv2dFn.apply(x, leaf, None, recipe, *conv)
        quantizer.inputs.clear()
        with monkeypatch.context() as m:
            if off:
                m.setattr(qgemm, "_quantized_rows", lambda *a: None)
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(6)))
        return leaf.grad, quantizer.inputs  # type: ignore[return-value]

    n, c, h, _ = shape
    out = (h + 2 * padding - k) // stride + 1
    rows = stride * (out - 1) + k
    for context in (contextlib.nullcontext, fused.reference):
        with context():
            (on, quantized), (off, columns) = wgrad(False), wgrad(True)
        assert torch.equal(on, off)
        assert quantized == [n * c * rows * k * out] and columns == [c * k * k * n * out * out]
        assert quantized[0] < columns[0]


@pytest.mark.parametrize(("name", "size", "k", "stride"),
                         [("nvfp4", 9, 3, 1), ("nvfp4", 32, 2, 2), ("mxfp8", 32, 3, 2)])
def test_row_windows_only_where_blocks_repeat(name: str, size: int, k: int, stride: int) -> None:
    """No row windows where a block crosses output rows (9 pixels a row; MX's 32 against 16 a row) or
    no row is read twice (a 2x2 filter with stride 2)."""
    from mptrain.numerics import im2col

    bs = BLOCK_FORMATS[name].block_size
    assert not im2col.shares_rows((2, 3, size, size), (k, k), (stride, stride), (k // 2, k // 2), (1, 1), bs)
    assert im2col.shares_rows((2, 3, 32, 32), (3, 3), (1, 1), (1, 1), (1, 1), bs)


def test_wgrad_columns_trace_under_dynamo() -> None:
    """wgrad's im2col columns traced with symbolic shapes (QuantConv2dFn under a compile) take the
    unfold path: the strided one failed to trace, an error rather than a graph break."""
    from mptrain.numerics.im2col import wgrad_columns

    x = torch.randn(3, 8, 9, 9)
    args = ((3, 3), (1, 1), (1, 1), (1, 1))
    traced = torch.compile(wgrad_columns, backend="eager", fullgraph=True, dynamic=True)
    assert torch.equal(traced(x, *args), wgrad_columns(x, *args))

"""Quantized GEMM layers (mptrain.numerics.qgemm) with the fused quantizers equal the eager reference
bit for bit: Linear and Conv2d, forward, dgrad and wgrad, with each format's whole recipe (the
Hadamard transform, 2D tiles, stochastic gradients, bf16 products); and a Linear layer's GEMMs run
as one compiled graph per direction (the default on CUDA; ``fused.graphs("cpu")`` here), called
directly from the second step, given up per variant when a graph cannot be built.
(Split from tests/test_fused.py, which holds the quantizers one by one.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from fused_cases import CUDA, as_a_fresh_process, assert_same, both, fused_on

from mptrain.numerics import compiled_calls, fused
from mptrain.numerics import formats as nf
from mptrain.numerics.mx import BLOCK_FORMATS
from mptrain.numerics.qgemm import (
    AxiswiseQuantizer,
    BlockQuantizer,
    GemmRecipe,
    QuantConv2dFn,
    QuantLinearFn,
    RngStreams,
)


@pytest.fixture(autouse=True)
def _fused_on() -> Iterator[None]:
    yield from fused_on()


def linear_step(recipe_of: Callable[[], GemmRecipe], device: str = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(15)
    x = torch.randn(37, 48, generator=g).to(device).requires_grad_()  # 37 tokens: padded for the Hadamard transform
    w = (torch.randn(40, 48, generator=g) * 0.1).to(device).requires_grad_()
    b = torch.randn(40, generator=g).to(device).requires_grad_()
    y = QuantLinearFn.apply(x, w, b, recipe_of())
    y.backward(torch.randn(37, 40, generator=g).to(device))
    return y, x.grad, w.grad, b.grad  # type: ignore[return-value]


def conv_step(recipe_of: Callable[[], GemmRecipe], device: str = "cpu", channels_last: bool = False
              ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(16)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(3, 40, 9, 9, generator=g).to(device, memory_format=layout).requires_grad_()  # 40: padded blocks
    w = (torch.randn(24, 40, 3, 3, generator=g) * 0.1).to(device, memory_format=layout).requires_grad_()
    b = torch.randn(24, generator=g).to(device).requires_grad_()
    y = QuantConv2dFn.apply(x, w, b, recipe_of(), (2, 2), (1, 1), (1, 1))
    y.backward(torch.randn(y.shape, generator=g).to(device))
    return y, x.grad, w.grad, b.grad  # type: ignore[return-value]


def full_recipe(name: str) -> Callable[[], GemmRecipe]:
    """A format's recipe with SR and the Hadamard transform; "FORMAT bf16": products in bf16."""
    fmt, _, compute = name.partition(" ")

    def recipe() -> GemmRecipe:
        q = BlockQuantizer(BLOCK_FORMATS[fmt], stochastic_grads=True, rng=RngStreams(5))
        return GemmRecipe(quantizer=q, hadamard_signs=GemmRecipe.signs(7), weight_2d=fmt == "nvfp4",
                          compute_dtype=torch.bfloat16 if compute == "bf16" else torch.float32)

    return recipe


def rowwise_recipe() -> GemmRecipe:
    return GemmRecipe(quantizer=AxiswiseQuantizer(nf.E4M3, nf.E5M2, True, RngStreams(2)))


def rowwise_bf16_recipe() -> GemmRecipe:
    """Row-wise FP8 to nearest with bf16 products: the row-wise graph tests' recipe (row-wise graphs
    to nearest are the quickest to compile, and one recipe compiles them once for both tests; the
    stochastic-rounding graphs are NVFP4's)."""
    return GemmRecipe(quantizer=AxiswiseQuantizer(nf.E4M3, nf.E5M2), compute_dtype=torch.bfloat16)


# These run a fused kernel per quantizer (the CPU default). The graph path (qgemm._gemms: a layer's
# GEMMs as one compiled graph per direction, the default on CUDA only, turned on for the CPU by
# fused.graphs("cpu")) compiles two graphs a recipe, tens of seconds on a cold cache, the suite's
# largest cost; so its bit-identity is checked in the tests that compile its graphs anyway: NVFP4
# with bf16 products (SR, the Hadamard transform, 2D tiles, per-tensor scales) in
# test_linear_gemms_run_as_graphs_and_a_failing_graph_runs_eagerly, and row-wise FP8 to nearest
# with bf16 products (rowwise_bf16_recipe) in the two tests after it. The CUDA cases run MXFP8's too.
LINEAR_CASES = ["nvfp4", "mxfp4", "mxfp8", "mxfp8 bf16"]


@pytest.mark.kernels("blocks")
@pytest.mark.parametrize("name", LINEAR_CASES)
def test_quantized_linear_with_the_full_recipe(name: str) -> None:
    assert_same(*both(lambda: linear_step(full_recipe(name))))


@pytest.mark.kernels("elements")
def test_rowwise_fp8_linear() -> None:
    assert_same(*both(lambda: linear_step(rowwise_recipe)))


@pytest.mark.kernels("blocks")
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_quantized_conv2d_with_the_full_recipe(name: str, channels_last: bool) -> None:
    """Stride 2, padding 1, 40 channels (padded to blocks) and the whole recipe, fused against the
    reference, in either memory format (the quantizers return different layouts; the convolutions
    must not see that)."""
    assert_same(*both(lambda: conv_step(full_recipe(name), channels_last=channels_last)))


@pytest.mark.kernels("blocks")
def test_linear_gemms_run_as_graphs_and_a_failing_graph_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a graph device a Linear layer makes one compiled call per direction (none given up), with
    the reference's results bit for bit (NVFP4's whole recipe, bf16 products); a graph that cannot
    be built costs its variant the graph, not the result."""
    calls: list[str] = []
    real = compiled_calls.call_graph
    monkeypatch.setattr(compiled_calls, "call_graph", lambda body, *a: calls.append(body.__name__) or real(body, *a))
    with fused.graphs("cpu"):
        got = linear_step(full_recipe("nvfp4 bf16"))
    with fused.reference():
        want = linear_step(full_recipe("nvfp4 bf16"))
    assert_same(got, want)
    assert calls == ["_linear_fwd", "_linear_bwd"]
    mine = [k for k in compiled_calls._graphs if ":rht:2d" in k and k.split("|")[1].startswith("Txx")]
    assert sorted(k.split("|")[0] for k in mine) == ["_linear_bwd", "_linear_fwd"]
    assert not set(mine) & compiled_calls._given_up

    # Steps with one recipe: each draws new numbers from its stream, whose counter the backward graph
    # advances in place; called directly (both directions, dynamo skipped), every step draws what
    # the reference draws.
    direct: list[str] = []
    real_direct = compiled_calls._Direct.__call__
    monkeypatch.setattr(compiled_calls._Direct, "__call__",
                        lambda self, x, args: direct.append(self.key) or real_direct(self, x, args))
    fast, slow = full_recipe("nvfp4 bf16")(), full_recipe("nvfp4 bf16")()
    for _ in range(3):
        del direct[:]
        with fused.graphs("cpu"):
            got = linear_step(lambda: fast)
        with fused.reference():
            assert_same(got, linear_step(lambda: slow))
        assert sorted(k.split("|")[0] for k in direct) == ["_linear_bwd", "_linear_fwd"]
    cpu = torch.device("cpu")
    assert int(fast.stream_tensors(cpu)["counter"]) == int(slow.stream_tensors(cpu)["counter"]) > 0

    def broken(*args: Any) -> Any:
        raise RuntimeError("no compiler")

    graphs = compiled_calls._graphs
    monkeypatch.setattr(compiled_calls, "_graphs", {**graphs, **{k: (broken, graphs[k][1]) for k in mine}})
    monkeypatch.setattr(compiled_calls, "_graph_directs", {})
    monkeypatch.setattr(compiled_calls, "_graph_fast", {})
    monkeypatch.setattr(compiled_calls, "_given_up", set())
    with fused.graphs("cpu"):
        got = linear_step(full_recipe("nvfp4 bf16"))
    assert_same(got, want)
    assert compiled_calls._given_up == set(mine)


@pytest.mark.kernels("elements")
def test_static_shape_graphs_compile_per_layer_shape_with_no_dynamic_dim(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recipe with ``static_shapes`` (precision.graph_static_shapes) compiles a Linear's graphs once
    per layer shape, every size in them a constant, and its layers equal the reference bit for bit."""
    as_a_fresh_process(monkeypatch)

    def recipe() -> GemmRecipe:
        return dataclasses.replace(rowwise_bf16_recipe(), static_shapes=True)

    def step(n_in: int, n_out: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(n_in)
        x = torch.randn(37, n_in, generator=g).requires_grad_()
        w = (torch.randn(n_out, n_in, generator=g) * 0.1).requires_grad_()
        y = QuantLinearFn.apply(x, w, None, recipe())
        y.backward(torch.randn(37, n_out, generator=g))
        return y, x.grad, w.grad  # type: ignore[return-value]

    for shape in ((48, 40), (32, 48), (48, 40)):
        with fused.graphs("cpu"):
            got = step(*shape)
        with fused.reference():
            assert_same(got, step(*shape))
    graphs = {k: backend.graphs for k, (_, backend) in compiled_calls._graphs.items()}
    assert sorted(k.split("|")[0] for k in graphs) == ["_linear_bwd", "_linear_bwd", "_linear_fwd", "_linear_fwd"]
    assert all(":static" in k and len(g) == 1 for k, g in graphs.items())  # the third step compiled nothing
    for gm, _ in (g[0] for g in graphs.values()):
        sizes = [v for n in gm.graph.nodes if n.op == "placeholder" for v in [n.meta.get("example_value")]]
        assert not any(isinstance(v, torch.SymInt) for v in sizes)
        assert all(not isinstance(s, torch.SymInt) for v in sizes if isinstance(v, torch.Tensor) for s in v.shape)


@pytest.mark.kernels("elements")
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_linear_graph_is_called_directly_from_its_second_step(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Linear layer's graphs, as the quantizers' kernels, are called without dynamo from their second
    call on: the reference's results both times (row-wise FP8 to nearest, bf16 products).
    (On CUDA, the graphs' default device, this is the path of every Linear layer.)"""
    direct: list[str] = []
    Direct = compiled_calls._Direct
    real = Direct.__call__
    monkeypatch.setattr(Direct, "__call__", lambda self, x, args: direct.append(self.key) or real(self, x, args))
    with fused.reference():
        want = linear_step(rowwise_bf16_recipe, device)
    with fused.graphs(device):
        assert_same(linear_step(rowwise_bf16_recipe, device), want)  # compiled, through dynamo
        del direct[:]
        got = linear_step(rowwise_bf16_recipe, device)
    assert_same(got, want)
    assert sorted(k.split("|")[0] for k in direct) == ["_linear_bwd", "_linear_fwd"]
    assert all(d.generated for d in compiled_calls._graph_directs.values() if d is not None)


@pytest.mark.kernels("elements")
def test_a_linear_graphs_later_calls_do_not_name_their_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """From a layout's third call on, ``call_graph`` finds its direct call by the arguments' layouts and
    static values (``_graph_fast``), without building the variant's name and key: some 60 Python calls
    fewer a call (scripts/graph_host_bench.py), on the path whose host work paces a GPU's step. The
    reference's results; a recipe built again (as each step here builds one) finds the same entry."""

    class Named(dict):
        gets = 0

        def get(self, *args: Any) -> Any:
            Named.gets += 1
            return super().get(*args)

    with fused.reference():
        want = linear_step(rowwise_bf16_recipe)
    with fused.graphs("cpu"):
        for _ in range(2):
            assert_same(linear_step(rowwise_bf16_recipe), want)
        monkeypatch.setattr(compiled_calls, "_graph_directs", Named(compiled_calls._graph_directs))
        got = linear_step(rowwise_bf16_recipe)
    assert_same(got, want)
    assert Named.gets == 0
    assert {k[0].__name__ for k in compiled_calls._graph_fast} >= {"_linear_fwd", "_linear_bwd"}


@pytest.mark.kernels("elements")
def test_a_given_up_graph_variant_runs_eagerly_in_the_layouts_it_had(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph variant given up on a new layout (its graph cannot be built, or dynamo's recompile limit)
    runs eagerly from then on in the layouts it already had direct calls for, too, as its log line
    says; the other direction keeps its graph."""
    monkeypatch.setattr(compiled_calls, "_graph_fast", dict(compiled_calls._graph_fast))
    monkeypatch.setattr(compiled_calls, "_given_up", set())
    direct: list[str] = []
    real = compiled_calls._Direct.__call__
    monkeypatch.setattr(compiled_calls._Direct, "__call__",
                        lambda self, x, args: direct.append(self.key) or real(self, x, args))
    with fused.reference():
        want = linear_step(rowwise_bf16_recipe)
    with fused.graphs("cpu"):
        for _ in range(3):
            linear_step(rowwise_bf16_recipe)
        variant = {k[0].__name__: d.key for k, d in compiled_calls._graph_fast.items()
                   if rowwise_bf16_recipe().graph_key() in k and k[1][0][0] == 37}  # fmt: skip
        assert set(variant) == {"_linear_fwd", "_linear_bwd"}

        def broken(*args: Any) -> Any:
            raise RuntimeError("no compiler")

        fwd = variant["_linear_fwd"]
        monkeypatch.setitem(compiled_calls._graphs, fwd, (broken, compiled_calls._graphs[fwd][1]))
        g = torch.Generator().manual_seed(3)
        x, w, b = torch.randn(5, 48, generator=g), torch.randn(40, 48, generator=g), torch.randn(40, generator=g)
        QuantLinearFn.apply(x, w, b, rowwise_bf16_recipe())  # the forward's variant, in a layout of 5 rows
        assert compiled_calls._given_up == {fwd}
        del direct[:]
        got = linear_step(rowwise_bf16_recipe)
    assert_same(got, want)
    # the forward ran eagerly (its quantizers as kernels of their own), the backward as its graph
    assert [k for k in direct if k.startswith("_linear")] == [variant["_linear_bwd"]]


@pytest.mark.kernels("elements")
def test_a_linear_graph_hands_its_gemms_the_eager_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 operands a Linear's graph gives its GEMMs are laid out as the eager path lays them out.
    Inductor once wrote wgrad's bf16 copy of x transposed (a cast is laid out row-major in its
    logical shape; ``fused.cast``), against the order its kernel reads x in, and handed the GEMM
    another layout than eager does, which a GPU's GEMM may sum in another order. Row-wise FP8 with
    bf16 products, and no Hadamard transform, whose products leave wgrad's operands row-major anyway."""
    from torch._inductor.select_algorithm import extern_kernels

    recipe = rowwise_bf16_recipe

    def record(into: list[tuple], mm: Callable[..., Any]) -> Callable[..., Any]:
        def call(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if a.dtype == torch.bfloat16:
                into.append((tuple(a.shape), a.stride(), tuple(b.shape), b.stride()))
            return mm(a, b, *args, **kwargs)
        return call

    graph: list[tuple] = []
    eager: list[tuple] = []
    with fused.graphs("cpu"):
        linear_step(recipe)  # compiled before recording
        monkeypatch.setattr(extern_kernels, "mm", record(graph, extern_kernels.mm))
        linear_step(recipe)
    monkeypatch.setattr(torch.Tensor, "__matmul__", record(eager, torch.Tensor.__matmul__))
    linear_step(recipe)
    assert len(graph) == 3 and graph == eager  # fprop, dgrad, wgrad


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("name", ["nvfp4", "mxfp8 bf16"])
def test_quantized_gemms_on_cuda_match_the_reference(name: str, device: str) -> None:
    """On a GPU, Linear's graphs (Triton, cuBLAS) and Conv2d's per-call kernels against the eager
    reference on the same GPU, with the whole recipe: bit for bit. Two cases, as each compiles its
    kernels cold (about 45 s on an H200): NVFP4 (its scales divide) and MXFP8 with bf16 products."""
    assert fused.graph_enabled(torch.zeros(1, device=device))
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):  # one algorithm each time
        assert_same(*both(lambda: linear_step(full_recipe(name), device)))
        assert_same(*both(lambda: conv_step(full_recipe(name), device)))
        assert_same(*both(lambda: conv_step(full_recipe(name), device, channels_last=True)))
        assert_same(*both(lambda: linear_step(rowwise_recipe, device)))


@pytest.mark.parametrize("device", [CUDA])
def test_combo_kernel_graphs_on_cuda_match_the_reference(device: str) -> None:
    """precision.graph_combo_kernels: a Linear's graphs with inductor's combo kernels, NVFP4's whole
    recipe with bf16 products (its graphs have the most kernels to combine), against the eager
    reference on the same GPU, bit for bit."""
    def recipe() -> GemmRecipe:
        return dataclasses.replace(full_recipe("nvfp4 bf16")(), combo_kernels=True)

    assert fused.graph_enabled(torch.zeros(1, device=device))
    assert_same(*both(lambda: linear_step(recipe, device)))


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("name", ["mxfp8 bf16", "nvfp4 bf16"])
def test_static_shape_graphs_on_cuda_match_the_reference(name: str, device: str) -> None:
    """precision.graph_static_shapes: a Linear's graphs compiled for its shapes, each format's whole
    recipe with bf16 products, against the eager reference on the same GPU, bit for bit."""
    def recipe() -> GemmRecipe:
        return dataclasses.replace(full_recipe(name)(), static_shapes=True)

    assert fused.graph_enabled(torch.zeros(1, device=device))
    assert_same(*both(lambda: linear_step(recipe, device)))


@pytest.mark.parametrize("device", [CUDA])
def test_a_linear_forward_graph_is_one_kernel_per_operand_on_cuda(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An MXFP8 Linear's forward graph with bf16 products compiles to three Triton kernels: each
    operand's quantizer writes the GEMM's bf16 operand itself, and the bias is added after the GEMM.
    Inductor's code for sm90 under torch 2.11, generated without a GPU (scripts/triton_kernels.py),
    had five before: the cast and the merge of the blocks by view were kernels of their own."""
    from torch._inductor import metrics
    from torch._inductor.utils import fresh_inductor_cache

    as_a_fresh_process(monkeypatch)
    recipe = GemmRecipe(quantizer=BlockQuantizer(BLOCK_FORMATS["mxfp8"]), compute_dtype=torch.bfloat16)
    x = torch.randn(4, 64, 96, device=device)
    w, b = torch.randn(128, 96, device=device), torch.randn(128, device=device)
    assert fused.graph_enabled(x)  # its probe compiled before counting
    with fresh_inductor_cache():
        metrics.reset()
        QuantLinearFn.apply(x, w, b, recipe)
        assert metrics.generated_kernel_count == 3

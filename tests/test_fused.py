"""The fused quantizers (mptrain.numerics.fused) equal the eager reference bit for bit.

Every format, rounding mode (to nearest; stochastic from the run's counter stream and from the
global RNG) and layout (blocks along each dim, transposed views, padded lengths, 2D tiles,
the Hadamard transform of the weight-gradient GEMM), on random and adversarial tensors: zeros, NaN,
Inf, FP32 subnormals, tensors whose amax is huge or tiny. NaN payloads may differ; NaN-ness may not.
The reference is the same call under ``fused.reference()``. (With a ``torch.Generator`` the fused
entry points run the reference itself: its draws cannot enter a compiled kernel.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from fused_cases import CUDA, adversarial, as_a_fresh_process, assert_same, block_cases, both, fused_on
from torch import nn

from mptrain.numerics import compiled_calls, fused, fused_kernels, mx, rounding_rng
from mptrain.numerics import formats as nf
from mptrain.numerics.mx import BLOCK_FORMATS, BlockFormat
from mptrain.numerics.qgemm import (
    GemmRecipe,
)
from mptrain.numerics.rounding_rng import RoundingStream


@pytest.fixture(autouse=True)
def _fused_on() -> Iterator[None]:
    yield from fused_on()


ELEMENTS = [nf.E4M3, nf.E5M2, nf.E3M2, nf.E2M3, nf.E2M1, nf.FP16, nf.BF16]


def stream_pair(seed: int = 3) -> tuple[RoundingStream, RoundingStream]:
    return RoundingStream(seed), RoundingStream(seed)


# --------------------------------------------------------------------------------------------
# element rounding


@pytest.mark.kernels("elements")
@pytest.mark.parametrize("fmt", ELEMENTS, ids=lambda f: f.name)
def test_element_rounding_to_nearest(fmt: nf.ElementFormat) -> None:
    x = adversarial(64, 96, seed=1) * 2.0 ** (fmt.emax - 8)  # centred on the format's range
    assert_same(*both(lambda: fused.round_to_element(x, fmt)))
    if fmt.has_inf or fmt.has_nan:
        assert_same(*both(lambda: fused.round_to_element(x, fmt, saturate=False)))


def grid(fmt: nf.ElementFormat) -> torch.Tensor:
    """Every non-negative value of ``fmt`` up to its max, from its exponent and mantissa fields."""
    m = torch.arange(2**fmt.mbits, dtype=torch.float64)
    normals = [(1 + m / 2**fmt.mbits) * 2.0**e for e in range(fmt.emin, fmt.emax + 1)]
    values = torch.cat([m * 2.0 ** (fmt.emin - fmt.mbits), *normals]).float()
    return values[values <= fmt.max_normal]


@pytest.mark.kernels("elements")
@pytest.mark.parametrize("fmt", ELEMENTS[:-1], ids=lambda f: f.name)
def test_element_rounding_at_every_tie(fmt: nf.ElementFormat) -> None:
    """Each grid point, each midpoint between neighbours (a tie: to the even one) and the FP32 values
    one and two ulps either side, both signs, and past the max: where rounding to nearest even by an
    add and a subtract (``fused_kernels._round``) would go wrong first."""
    g = grid(fmt)
    points = torch.cat([g, (g[1:] + g[:-1]) / 2, g[-1:] + 2.0 ** (fmt.emax - fmt.mbits - 1)]).view(torch.int32)
    x = torch.cat([points + d for d in (-2, -1, 0, 1, 2)]).view(torch.float32)
    x = torch.cat([x, -x])
    assert_same(*both(lambda: fused.round_to_element(x, fmt)))
    if fmt.has_inf or fmt.has_nan:
        assert_same(*both(lambda: fused.round_to_element(x, fmt, saturate=False)))


@pytest.mark.kernels("elements")
@pytest.mark.parametrize("fmt", ELEMENTS, ids=lambda f: f.name)
def test_element_stochastic_rounding_draws_the_same_numbers(fmt: nf.ElementFormat) -> None:
    x = adversarial(64, 96, seed=2) * 2.0 ** (fmt.emax - 8)
    a, b = stream_pair()
    got = fused.round_to_element(x, fmt, stochastic=True, generator=a)
    with fused.reference():
        want = nf.round_to_element(x, fmt, stochastic=True, generator=b)
    assert_same(got, want)
    a, b = stream_pair(seed=4)
    got = fused.round_to_element(x.t(), fmt, stochastic=True, generator=a)  # a transposed view
    assert_same(got, nf.round_to_element(x.t(), fmt, stochastic=True, generator=b))
    torch.manual_seed(5)  # no generator: a stream keyed by the global RNG, drawn alike
    got = fused.round_to_element(x, fmt, stochastic=True, saturate=not (fmt.has_inf or fmt.has_nan))
    torch.manual_seed(5)
    with fused.reference():
        want = fused.round_to_element(x, fmt, stochastic=True, saturate=not (fmt.has_inf or fmt.has_nan))
    assert_same(got, want)


# --------------------------------------------------------------------------------------------
# blocks


@pytest.mark.kernels("blocks")
@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS.values()), ids=lambda f: f.name)
def test_blocks_to_nearest_in_every_layout(fmt: BlockFormat) -> None:
    for name, x, dim in block_cases(fmt):
        got, want = both(lambda x=x, dim=dim: fused.quantize_blocks(x, fmt, dim))
        assert_same(got, want), name


@pytest.mark.kernels("blocks")
@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS.values()), ids=lambda f: f.name)
def test_blocks_stochastic_in_every_layout(fmt: BlockFormat) -> None:
    for name, x, dim in block_cases(fmt):
        a, b = stream_pair(seed=len(name))
        got = fused.quantize_blocks(x, fmt, dim, stochastic=True, generator=a)
        with fused.reference():
            want = fused.quantize_blocks(x, fmt, dim, stochastic=True, generator=b)
        assert_same(got, want), name
        assert int(a.counter) == int(b.counter) == 1  # one draw each


@pytest.mark.kernels("blocks")
def test_a_narrow_block_call_repeats_through_its_kept_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block call on a 2x2 map (64 channels: unpadded) repeats through its kept path (fused._moved)
    once the call on its moved copy is kept: the reference's values and draws, in x's layout, to
    nearest and stochastic, the draw counter advanced once a call as on the full path."""
    moved: list[torch.Size] = []
    real = fused._moved
    monkeypatch.setattr(fused, "_moved", lambda *a: moved.append(a[2].shape) or real(*a))
    for table in ("_directs", "_fast"):
        monkeypatch.setattr(compiled_calls, table, {})
    fmt = BLOCK_FORMATS["nvfp4"]
    x = adversarial(32, 64 * 4, seed=11).view(32, 64, 2, 2)
    a, b = stream_pair()
    for k in range(4):
        v = x * 2.0**k  # new values each call
        assert_same(*both(lambda v=v: fused.quantize_blocks(v, fmt, 1)))
        got = fused.quantize_blocks(v, fmt, 1, stochastic=True, generator=a)
        with fused.reference():
            want = fused.quantize_blocks(v, fmt, 1, stochastic=True, generator=b)
        assert_same(got, want)
        assert got[0].stride() == v.stride() and int(a.counter) == int(b.counter) == k + 1
    assert moved == [x.shape] * 4  # the last two calls of each rounding


@pytest.mark.kernels("blocks")
def test_exactly_one_block_along_the_dim_compiles_no_second_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exactly one block along the dim (NVFP4's 16 channels at a 4x4 map) runs in the kernel of a dim
    under one block, to nearest and stochastic, as the reference would: viewed as blocks in the
    longer dims' kernel, two of its strides were equal there, and dynamo's guard on their order
    compiled that kernel a second time (fused._plan_blocks)."""
    as_a_fresh_process(monkeypatch)
    fmt = BLOCK_FORMATS["nvfp4"]
    for channels in (32, 16, 8):
        x = adversarial(8, channels * 16, seed=channels).view(8, channels, 4, 4)
        assert_same(*both(lambda x=x: fused.quantize_blocks(x, fmt, 1)))
        a, b = stream_pair()
        got = fused.quantize_blocks(x, fmt, 1, stochastic=True, generator=a)
        with fused.reference():
            want = fused.quantize_blocks(x, fmt, 1, stochastic=True, generator=b)
        assert_same(got, want)
    graphs = {k: len(backend.graphs) for k, (_, backend) in compiled_calls._kernels.items()}
    assert len(graphs) == 4 and set(graphs.values()) == {1}, graphs


# NVFP4's recipe is the one that rotates by default; the MX kernel's rotation is held to the reference
# by the full-recipe Linear and Conv2d tests (their MX cases rotate wgrad's operands too).
@pytest.mark.kernels("blocks")
def test_blocks_rotated_inside_their_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hadamard rotation of wgrad's operands (NVFP4's recipe) runs inside the block kernel, to
    nearest and stochastic, in every layout whose length is a multiple of 16, and equals the
    reference's eager rotation followed by its quantization bit for bit. The fused path never calls
    the eager rotation."""
    fmt = BLOCK_FORMATS["nvfp4"]
    r = mx.hadamard_rotation(tuple(int(v) for v in GemmRecipe.signs(7).tolist()), torch.device("cpu"),
                             torch.float32)  # fmt: skip
    cases = [(name, x, dim) for name, x, dim in block_cases(fmt) if x.shape[dim] % 16 == 0]
    assert len(cases) >= 6
    real = mx.rotate
    for name, x, dim in cases:
        monkeypatch.setattr(mx, "rotate", lambda *a: pytest.fail("rotated eagerly"))
        got = fused.quantize_blocks(x, fmt, dim, rotation=r)
        a, b = stream_pair(seed=len(name))
        got_sr = fused.quantize_blocks(x, fmt, dim, stochastic=True, generator=a, rotation=r)
        monkeypatch.setattr(mx, "rotate", real)
        with fused.reference():
            want = fused.quantize_blocks(x, fmt, dim, rotation=r)
            want_sr = fused.quantize_blocks(x, fmt, dim, stochastic=True, generator=b, rotation=r)
        assert_same(got, want), name
        assert_same(got_sr, want_sr), name
    with pytest.raises(ValueError, match="length of 24"):
        fused.quantize_blocks(torch.randn(4, 24), fmt, 1, rotation=r)


@pytest.mark.kernels("blocks")
def test_exactly_one_rotated_block_along_the_dim_compiles_no_second_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVFP4's recipe rotates wgrad's operands along the dim it reduces, which at batch 2 held exactly one
    block of 16 in a ResNet-50/8 step. A CPU rotates an (A, N, 1) operand as (A * N / 16, 1, 16, 1)
    blocks: viewed from (A, N, 1), that view compared A * (N / 16) with A, and dynamo specialised N to
    16, so the next operand compiled the kernel again (fused_kernels._k_blocks; two kernels in that
    run). Then 32 and 48 along the dim, to nearest and stochastic, all against the reference."""
    as_a_fresh_process(monkeypatch)
    fmt = BLOCK_FORMATS["nvfp4"]
    r = mx.hadamard_rotation(tuple(int(v) for v in GemmRecipe.signs(7).tolist()), torch.device("cpu"),
                             torch.float32)  # fmt: skip
    for n in (16, 32, 48):
        x = adversarial(24, n, seed=n)
        assert_same(*both(lambda x=x: fused.quantize_blocks(x, fmt, 1, rotation=r)))
        a, b = stream_pair(seed=n)
        got = fused.quantize_blocks(x, fmt, 1, stochastic=True, generator=a, rotation=r)
        with fused.reference():
            want = fused.quantize_blocks(x, fmt, 1, stochastic=True, generator=b, rotation=r)
        assert_same(got, want)
    graphs = {k: len(backend.graphs) for k, (_, backend) in compiled_calls._kernels.items() if k.startswith("blocks")}
    assert len(graphs) == 2 and set(graphs.values()) == {1}, graphs


def test_the_rotation_is_the_hadamard_product() -> None:
    """``mx.rotate`` (an ordered sum, so that a kernel can reproduce it) against the dense product
    with H * diag(signs) / 4 (a BLAS GEMM): equal up to FP32 rounding, and orthogonal."""
    signs = GemmRecipe.signs(3)
    r = mx.hadamard_rotation(tuple(int(v) for v in signs.tolist()), torch.device("cpu"), torch.float32)
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(4))
    dense = (x.view(64, 6, 16) @ (mx.hadamard_matrix(16) * signs)).view(64, 96)
    torch.testing.assert_close(mx.rotate(x, 1, r), dense, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mx.rotate(mx.rotate(x, 1, r), 1, r).norm(), x.norm())


@pytest.mark.kernels("blocks")
def test_blocks_read_each_layout_of_one_shape_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block kernel reads its operand where it is, in storage order (a contiguous (A, n, B) view,
    no copy), for one shape in two layouts in turn (a square matrix and its transpose; NCHW and
    channels-last): the plan of a call is worked out per layout, not per shape."""
    fmt = BLOCK_FORMATS["mxfp8"]
    seen: list[torch.Tensor] = []
    real = fused._call

    def record(name: str, options: str, x3: torch.Tensor, *args: object) -> object:
        seen.append(x3)
        return real(name, options, x3, *args)

    monkeypatch.setattr(fused, "_call", record)
    monkeypatch.setattr(fused, "_fast_for", lambda key: None)  # the plan's path (a repeated call's reads x as well)
    sq = adversarial(64, 64, seed=12)
    x4 = adversarial(8, 64 * 16, seed=13).view(8, 64, 4, 4)
    for layouts in ((sq, sq.t()), (x4, x4.contiguous(memory_format=torch.channels_last))):
        for x in layouts * 2:
            got, want = both(lambda x=x: fused.quantize_blocks(x, fmt, 1))
            assert_same(got, want)
            x3 = seen.pop()
            assert x3.is_contiguous() and x3.data_ptr() == x.data_ptr()
            assert got[0].stride() == x.stride()


@pytest.mark.kernels("blocks")
@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("shape", [(512, 96), (8, 64, 6, 6)], ids=["rows", "nchw"])
def test_a_block_kernel_writes_its_result_once(name: str, shape: tuple[int, ...]) -> None:
    """Blocks along a strided dim (B > 1): the kernel's result is the buffer it rounds into, merged back
    to (A, n, B) in place (``fused_kernels._merged``). Merged by view, the dynamic-shape kernel could
    not prove bs * (n // bs) == n and copied its result into a second buffer: x's bytes allocated
    twice a call, and one more pass over them (the same copy was a kernel of its own per GEMM operand
    in a Linear's graph on a GPU)."""
    x = adversarial(shape[0], math.prod(shape[1:]), seed=14).view(shape)
    dim = 0 if len(shape) == 2 else 1

    def call() -> tuple[torch.Tensor, torch.Tensor | None]:
        return fused.quantize_blocks(x, BLOCK_FORMATS[name], dim)

    got, want = both(call)
    assert_same(got, want)
    call()  # its direct call from now on
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    # the result, and per-block buffers of 1/16 of x (NVFP4's blocks of 16): its two kept scales, the
    # amax, and on torch 2.11 one more beside the integer tensor amax. A second result would be 2x.
    assert x.numel() * 4 <= allocated < 1.5 * x.numel() * 4


@pytest.mark.kernels("blocks")
@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS.values()), ids=lambda f: f.name)
def test_2d_tiles(fmt: BlockFormat, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rounding mode on tiles in several layouts, one kernel graph each: a single row of tiles
    (a classifier head's weight, here 10 rows) runs with a row of zero tiles under it rather than
    compiling its kernel again, and, rounded to nearest, a single column (10 inputs) with a column
    of zero tiles beside it. Each layout's second call takes its kept path (``fused._tiled``)."""
    as_a_fresh_process(monkeypatch)
    kept: list[torch.Size] = []
    real = fused._tiled
    monkeypatch.setattr(fused, "_tiled", lambda *a: kept.append(a[2].shape) or real(*a))
    w = adversarial(48, 40, seed=10)  # 3 x 3 tiles of 16, or 2 x 2 of 32, padded
    w4 = adversarial(24, 40, seed=11).view(24, 40, 1, 1).permute(2, 3, 0, 1)  # a conv weight's (kh, kw, out, in) view
    head = adversarial(10, 40, seed=12)  # one row of tiles in either format
    column = adversarial(40, 10, seed=13)  # one column: stochastic rounding compiles it again (fused._blocks)
    for x in (w, w4, head, column):
        for _ in range(2):
            assert_same(*both(lambda x=x: fused.quantize_blocks(x, fmt, block_2d=True)))
            if x is column:
                continue
            a, b = stream_pair()
            got = fused.quantize_blocks(x, fmt, stochastic=True, generator=a, block_2d=True)
            with fused.reference():
                want = fused.quantize_blocks(x, fmt, stochastic=True, generator=b, block_2d=True)
            assert_same(got, want)
    tiles = {k: len(backend.graphs) for k, (_, backend) in compiled_calls._kernels.items() if k.startswith("tiles")}
    assert len(tiles) == 2 and set(tiles.values()) == {1}, tiles
    assert kept == [w.shape] * 2 + [w4.shape] * 2 + [head.shape] * 2 + [column.shape]


def test_the_cpu_isa_check_loads_its_library_in_a_child_once_not_in_every_process(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor checks a vector ISA by loading a test library in a child Python process, which
    imports torch. A check that passed once is not made again: on torch 2.11 every process made its
    checks again, about half of an emulated run's warm start (``compiled_calls.remember_isa_checks``;
    torch 2.14 keeps the same marker itself)."""
    import platform

    from torch._inductor import cpu_vec_isa

    if platform.machine() not in ("x86_64", "AMD64") or torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("an x86 CPU with AVX2 or more: the ISA inductor checks here")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing built or checked yet
    compiled_calls.remember_isa_checks()
    isa, code = cpu_vec_isa.VecAVX2(), cpu_vec_isa.VecISA._avx_code
    children: list[Any] = []
    real = cpu_vec_isa.subprocess.Popen

    def popen(args: Any, *a: Any, **k: Any) -> Any:
        children.append(args)
        return real(args, *a, **k)

    monkeypatch.setattr(cpu_vec_isa.subprocess, "Popen", popen)
    if not isa.check_build(code):
        pytest.skip("no C++ compiler that builds AVX2 code")
    loads = [c for c in children if c[0] == cpu_vec_isa.sys.executable]
    assert len(loads) == 1  # the first check loads the library in a child
    del children[:]
    assert isa.check_build(code)  # as a new process's first check would (the library is built)
    assert children == []
    # A check that failed is not remembered: a library that does not build is built again.
    assert not isa.check_build(code + "\n#error not this time\n") and children


def test_bitcasts_compile_to_vector_casts_with_the_same_bits() -> None:
    """The kernel bodies take exponents, signs and amaxes from the bits (``Tensor.view``). Inductor
    wrote each such bitcast on a CPU as a loop over the vector's lanes, which took an MXFP8 block call
    4.6x as long on a Xeon with AMX; ``compiled_calls.vector_bitcasts`` writes it as ATen's vector
    cast. The bits are eager's, for every value (NaN payloads, -0, Inf, subnormals) and in the
    tail of a length that is no multiple of the vector."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering
    from torch._inductor.utils import fresh_cache

    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("no vector ISA: inductor writes scalar loops")

    def body(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        bits = x.view(torch.int32)
        flipped = (bits ^ -(2**31)).view(torch.float32)  # the sign bit flipped: -x, NaN payloads kept
        return flipped * 2, (bits & 0x7F800000) >> 23  # a float op after it, and the exponent field

    def to_bf16(x: torch.Tensor) -> torch.Tensor:  # with a bf16 output, two FP32 vectors a step
        return ((x.view(torch.int32) + 0x7FFF) & -65536).view(torch.float32).to(torch.bfloat16)

    x = adversarial(16, 37, seed=21).flatten()[:-3]  # 589: 36 vectors of 16 and 13 (73 of 8 and 5)
    # and a NaN with a payload:
    x[7] = torch.tensor(0x7FC0_1234, dtype=torch.int32).view(torch.float32)
    for f in (body, to_bf16):
        code: list[str] = []
        with fresh_cache(), mock.patch.object(GraphLowering, "save_output_code", code.append):
            fn = torch.compile(lambda t, f=f: f(t), fullgraph=True, dynamic=True,  # a fresh trace
                               backend=compiled_calls._Inductor(compiled_calls._EAGER_NUMERICS))
            got, want = fn(x), f(x)
        for g, w in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, want)), strict=True):
            assert g.dtype == w.dtype and torch.equal(g.view(torch.uint8), w.view(torch.uint8))  # bit for bit
        cpp = "\n".join(code)
        assert "at::vec::Vectorized" in cpp  # a vector kernel: the bitcasts in it...
        assert "c10::bit_cast" not in cpp  # ...not cast lane by lane
    assert "VectorizedN<int32_t" in cpp  # to_bf16's: FP32 as two vectors a step


def test_index_vectors_compile_to_a_broadcast_plus_a_constant() -> None:
    """Stochastic rounding hashes each element's index (``torch.arange`` in the kernel body). Inductor
    wrote an index vector as ``Vectorized::arange(base, step)``, built from 16 scalars every loop step:
    on a Xeon with AMX the index alone took longer to write than a copy. ``compiled_calls.vector_iota``
    writes it as the base broadcast plus a constant ``arange(0, step)``: the same lanes, and the
    same random bits, at steps 1 and 3 and in the tail of a length no multiple of the vector."""
    import re
    from unittest import mock

    from torch._inductor.graph import GraphLowering
    from torch._inductor.utils import fresh_cache

    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("no vector ISA: inductor writes scalar loops")

    def body(x: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, ...]:
        index = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
        return rounding_rng.uniform_from_index(index, keys[0], keys[1]) + x, index * 3 + 1

    x = torch.randn(589, generator=torch.Generator().manual_seed(3))  # 36 vectors of 16 and 13
    code: list[str] = []
    with fresh_cache(), mock.patch.object(GraphLowering, "save_output_code", code.append):
        fn = torch.compile(body, fullgraph=True, dynamic=True,
                           backend=compiled_calls._Inductor(compiled_calls._EAGER_NUMERICS))
        keys = torch.tensor([11, -7], dtype=torch.int32)
        got, want = fn(x, keys), body(x, keys)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    bases = re.findall(r"Vectorized<int32_t>::arange\(([^,]+),", "\n".join(code))
    assert bases and set(bases) == {"0"}  # each index vector: a constant plus a broadcast


# One process of test_code_compiled_for_one_vector_isa_is_not_loaded_for_another: the fused
# quantizers' status (their probe, on the kernels' own backend), then a plain torch.compile as
# trainer.compile runs it, the ISA pinned as the engine pins it.
_ISA_CHILD = """
import torch
from mptrain.numerics import compiled_calls, fused
torch.set_num_threads(1)
status = fused.status("cpu")
compiled_calls.pin_cpu_vector_isa()
def f(x):
    return torch.where(x.abs() > 1, x * 3 + 1, x - 2)
x = torch.linspace(-3, 3, 64)
print(status.split()[0], torch.equal(torch.compile(f, dynamic=True)(x), f(x)))
"""


def test_code_compiled_for_one_vector_isa_is_not_loaded_for_another(tmp_path: Any) -> None:
    """Inductor's FX graph cache key lacks the vector ISA its code is written for. Compiled on an
    AVX-512 CPU and loaded in a process capped with ATEN_CPU_CAPABILITY=avx2 (the README's way to
    see an AVX2-only CPU's path), from a shared cache dir, the code was built with AVX2's flags and
    half of every vector came out wrong: the probe sent the quantizers to the reference, and a
    compiled model computed wrong values (``compiled_calls.pin_cpu_vector_isa``)."""
    import os
    import subprocess
    import sys

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("an AVX-512 CPU: two vector ISAs to compile for")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "MPTRAIN_FUSED": "1"}  # the cache: shared
    for isa in ("avx512", "avx2"):
        run = subprocess.run([sys.executable, "-c", _ISA_CHILD], env={**env, "ATEN_CPU_CAPABILITY": isa},
                             capture_output=True, text=True, timeout=600)
        assert run.stdout.split()[-2:] == ["fused", "True"], (isa, run.stdout, run.stderr[-3000:])


@pytest.mark.kernels("blocks")
def test_a_new_trace_of_a_block_kernel_loads_from_the_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a new process pays for a kernel an earlier one compiled: dynamo traces it again, and
    AOTAutograd and inductor load what they built from their on-disk caches. Torch 2.11's AOTAutograd
    cache refused the block and tile kernels, which call torch._check, unless inductor's options name
    it cacheable (compiled_calls._CACHEABLE); later torch caches them either way."""
    from torch._dynamo.utils import counters

    x = adversarial(64, 96, seed=14)
    fmt = BLOCK_FORMATS["nvfp4"]
    fused.quantize_blocks(x, fmt, 1)  # compiled here, or by an earlier test
    as_a_fresh_process(monkeypatch)
    before = dict(counters["aot_autograd"])
    assert_same(*both(lambda: fused.quantize_blocks(x, fmt, 1)))
    after = counters["aot_autograd"]
    assert after["autograd_cache_bypass"] == before.get("autograd_cache_bypass", 0)
    assert after["autograd_cache_hit"] == before.get("autograd_cache_hit", 0) + 1


# --------------------------------------------------------------------------------------------
# FP8: per-tensor and row-wise scales


@pytest.mark.kernels("elements")
@pytest.mark.parametrize("fmt", [nf.E4M3, nf.E5M2], ids=lambda f: f.name)
def test_fp8_per_tensor_and_rowwise(fmt: nf.ElementFormat, monkeypatch: pytest.MonkeyPatch) -> None:
    # A narrow layout's repeated calls take its kept path (fused._transposed); the kernels compiled by
    # earlier tests stay, their kept paths are made afresh here.
    narrow: list[torch.Size] = []
    real = fused._transposed
    monkeypatch.setattr(fused, "_transposed", lambda *a: narrow.append(a[2].shape) or real(*a))
    for table in ("_directs", "_fast"):
        monkeypatch.setattr(compiled_calls, table, {})
    x = adversarial(64, 96, seed=12)
    finite = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    for t in (x, finite, finite * 1e-30, torch.zeros_like(x)):
        assert_same(*both(lambda t=t: fused.quantize_scaled(t, fmt)))
        a, b = stream_pair()
        got = fused.quantize_scaled(t, fmt, stochastic=True, generator=a)
        with fused.reference():
            want = fused.quantize_scaled(t, fmt, stochastic=True, generator=b)
        assert_same(got, want)
        t3 = t.reshape(8, 8, 96)
        # each logical order of the runs A, n, B that the kernel reads in place (fused.view3):
        # (A, n, B), (n, A, B) stored as (A, n, B), (A, B, n) stored as (A, n, B)
        for dim, view in ((1, t), (0, t), (1, t.t()), (0, t.t()), (0, t3.transpose(0, 1)), (2, t3.transpose(1, 2)),
                          (1, t.reshape(-1, 16, 2, 2)), (0, t.reshape(-1, 16, 2, 2))):  # fmt: skip
            assert_same(*both(lambda dim=dim, view=view: fused.axiswise_round(view, fmt, dim)))
            a, b = stream_pair()
            got = fused.axiswise_round(view, fmt, dim, stochastic=True, generator=a)
            with fused.reference():
                want = fused.axiswise_round(view, fmt, dim, stochastic=True, generator=b)
            assert_same(got, want)
    # the 2x2 map's calls after the first of each rounding, through the kept path
    assert narrow == [(96, 16, 2, 2)] * 6
    # which leaves the result in x's own layout, as the first call: here (n, A, B) stored as (A, n, B)
    view = x.reshape(16, 96, 4).transpose(0, 1)
    for _ in range(2):
        got, want = both(lambda: fused.axiswise_round(view, fmt, 0))
        assert_same(got, want)
        assert got.stride() == view.stride()
    assert len(narrow) == 7


# --------------------------------------------------------------------------------------------
# master weights


def assert_rounded_as_the_reference(params: list[torch.Tensor], stochastic: bool) -> None:
    """round_params_ onto FP16, fused and reference, from streams alike: same values, same draws."""
    a, b = RoundingStream(3, params[0].device), RoundingStream(3, params[0].device)
    got = [p.clone() for p in params]
    fused.round_params_(got, nf.FP16, stochastic=stochastic, generator=a)
    want = [p.clone() for p in params]
    with fused.reference():
        fused.round_params_(want, nf.FP16, stochastic=stochastic, generator=b)
    for x, y in zip(got, want, strict=True):
        assert_same(x, y)
    assert int(a.counter) == int(b.counter) == (len(params) if stochastic else 0)


@pytest.mark.kernels("elements")
@pytest.mark.parametrize("group,alone", [(2**24, 2**15), (2000, 1000)], ids=["one group", "groups, some alone"])
def test_fp16_master_rounding_of_a_parameter_list(group: int, alone: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small parameters in one kernel (or a few, each up to ``fused._GROUP`` elements), large ones
    (``fused._ALONE``) each in a call of its own, rounded and drawn as the reference rounds each in
    turn: one draw per tensor, the empty one included. The split groups build their element index
    each call, as groups past ``fused._KEEP_WHICH`` elements do; one group keeps it."""
    monkeypatch.setattr(fused, "_GROUP", group)
    monkeypatch.setattr(fused, "_ALONE", alone)
    monkeypatch.setattr(fused, "_KEEP_WHICH", 2**20 if group > 4000 else 0)
    g = torch.Generator().manual_seed(13)
    params = [torch.randn(s, generator=g) * 10.0 ** torch.randint(-9, 5, (), generator=g).item()
              for s in ((64, 32), (32,), (0,), (3, 5, 7), (40, 60), (9,))]  # fmt: skip
    params[0][0, :4] = torch.tensor([math.nan, math.inf, 1e6, 2.0**-30])
    assert (len(list(fused._groups([p.numel() for p in params], group))) > 1) == (group < 4000)
    for stochastic in (False, True):
        assert_rounded_as_the_reference(params, stochastic)


@pytest.mark.kernels("elements")
def test_fp16_master_rounding_given_up_runs_the_same_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past dynamo's recompile limit the parameters' kernel runs eagerly: same values, same draws."""
    real = fused._call

    def refuse(name: str, *args: object) -> object:
        if name == "round_all":
            raise compiled_calls._Unfused
        return real(name, *args)

    monkeypatch.setattr(fused, "_call", refuse)
    g = torch.Generator().manual_seed(15)
    assert_rounded_as_the_reference([torch.randn(s, generator=g) for s in ((16, 8), (0,), (5,))], True)


@pytest.mark.kernels("elements")
@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("stream", [True, False], ids=["run's stream", "no stream"])
def test_fp16_master_rounding_writes_the_next_forward_operand(stream: bool, device: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``round_params_(forward=...)``: every tensor that asks for it (in a call of its own, or in a
    small ones' group, whose copies are views of one buffer) also gets its new value rounded to
    nearest onto its forward format, as ``formats.round_to_element`` rounds it; the masters themselves
    round and draw as without it. A group that asks for two formats gets none."""
    monkeypatch.setattr(fused, "_ALONE", 1000)
    g = torch.Generator().manual_seed(17)
    params = [torch.randn(s, generator=g) * 10.0 ** torch.randint(-6, 3, (), generator=g).item()
              for s in ((40, 30), (7, 9), (50, 25), (33, 40), (9,), (5, 6), (4,), (3, 3))]  # fmt: skip
    params[0][0, :5] = torch.tensor([math.nan, -math.inf, 1e6, 2.0**-30, 0.0])  # past E4M3's max, under its subnormals
    # Just past a tie of the forward format, within an FP16 ulp: rounded to FP16 first (as the forward
    # sees the master), they fall on the tie and round down to even; rounded as they were, up.
    params[0][1, :4] = torch.tensor([1.0625, 2.125, -4.25, 8.5]) * (1 + 2.0**-20)  # E4M3's ties
    params[1][1, :4] = torch.tensor([1.0625, 2.125, -4.25, 8.5]) * (1 + 2.0**-20)
    params[2][1, :2] = torch.tensor([1.125, -2.25]) * (1 + 2.0**-20)  # E5M2's
    # alone, alone, a group (E4M3 and none), alone, a group asking for two formats
    forward = [nf.E4M3, nf.E4M3, nf.E5M2, None, None, nf.E4M3, nf.E4M3, nf.E5M2]
    params = [p.to(device) for p in params]
    for stochastic in (False, True):
        got, want = [p.clone() for p in params], [p.clone() for p in params]
        a, b = (RoundingStream(5, device), RoundingStream(5, device)) if stream else (None, None)
        torch.manual_seed(0)  # no stream: each tensor's key comes from the global RNG, in both
        out = fused.round_params_(got, nf.FP16, stochastic=stochastic, generator=a, forward=forward)
        torch.manual_seed(0)
        fused.round_params_(want, nf.FP16, stochastic=stochastic, generator=b)
        for x, y in zip(got, want, strict=True):
            assert_same(x, y)
        grouped = stream or not stochastic  # else each tensor has a call of its own
        kept = [0, 1, 2, *((5, 6, 7) if not grouped else ())]
        assert [i for i, q in enumerate(out) if q is not None] == kept
        for i in kept:
            assert out[i].shape == params[i].shape  # type: ignore[union-attr]
            assert_same(out[i], nf.round_to_element(want[i], forward[i]))  # type: ignore[arg-type]


def _hybrid_steps(steps: int, kept: bool, monkeypatch: pytest.MonkeyPatch,
                  between: Callable[[nn.Module], None] | None = None,
                  conv: bool = False) -> tuple[list[torch.Tensor], list[float], int]:
    """FP8 hybrid (FP16 masters, stochastic rounding, the run's stream) on an MLP whose first weight
    rounds alone (``conv``: a small convolutional net whose weights all round in one group): its
    weights and losses after ``steps`` steps, and how often a forward rounded the first weight itself.
    ``kept=False``: the forward never takes what ``after_step`` wrote. ``between(model)`` runs after
    each step."""
    from omegaconf import OmegaConf

    from mptrain.config import FP8PrecisionConfig
    from mptrain.numerics import fp8
    from mptrain.numerics.precision import build_precision

    monkeypatch.setattr(fused, "_ALONE", 2048)  # the 64 x 64 weight has a call of its own
    if not kept:
        monkeypatch.setattr(fp8, "_kept_weight", lambda w, spec: None)
    rounded = 0
    real = fp8.Fp8LayerSpec.round_operand

    def count(spec: Any, x: torch.Tensor) -> torch.Tensor:
        nonlocal rounded
        rounded += x is model[0].weight
        return real(spec, x)

    monkeypatch.setattr(fp8.Fp8LayerSpec, "round_operand", count)
    rounding_rng.seed_rounding(0)
    torch.manual_seed(0)
    model = (nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2),
                           nn.ReLU(), nn.Flatten(), nn.Linear(8 * 2 * 2, 10)) if conv
             else nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))  # fmt: skip
    precision = build_precision(OmegaConf.structured(FP8PrecisionConfig(name="fp8", format="hybrid")),
                                torch.device("cpu"))
    model = precision.prepare_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = (torch.randn(16, 3, 8, 8) if conv else torch.randn(32, 64)), torch.randint(0, 10, (16 if conv else 32,))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        precision.after_step()
        losses.append(loss.item())
        if between is not None:
            between(model)
    monkeypatch.undo()
    return [p.detach().clone() for p in model.parameters()], losses, rounded


@pytest.mark.kernels("elements")
@pytest.mark.parametrize("conv", [False, True], ids=["a weight alone", "weights in a group"])
def test_fp8_forward_takes_the_weight_that_master_rounding_wrote(conv: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 hybrid rounds each FP16 master and writes its next E4M3 forward weight in one pass: the
    forward rounds the weight only on the first step, and training is bit for bit what it is when
    every forward rounds the weight itself (Linear and Conv2d, their weights alone or in a group)."""
    got, got_losses, got_rounded = _hybrid_steps(3, True, monkeypatch, conv=conv)
    want, want_losses, want_rounded = _hybrid_steps(3, False, monkeypatch, conv=conv)
    assert (got_rounded, want_rounded) == (1, 3)
    assert got_losses == want_losses
    for a, b in zip(got, want, strict=True):
        assert_same(a, b)


@pytest.mark.kernels("elements")
def test_fp8_forward_rounds_a_weight_written_since(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight written after ``after_step`` (load_state_dict, an in-place op) is rounded again by the
    next forward: the kept rounding of the old weight is not used."""
    g = torch.Generator().manual_seed(18)
    other = torch.randn(64, 64, generator=g) * 0.1

    def overwrite(model: nn.Module) -> None:
        state = model.state_dict()
        model.load_state_dict({**state, "0.weight": other.clone()})

    def scale(model: nn.Module) -> None:
        with torch.no_grad():
            model[0].weight.mul_(-0.5)

    for between in (overwrite, scale):
        got, got_losses, got_rounded = _hybrid_steps(2, True, monkeypatch, between)
        want, want_losses, _ = _hybrid_steps(2, False, monkeypatch, between)
        assert got_rounded == 2
        assert got_losses == want_losses
        for a, b in zip(got, want, strict=True):
            assert_same(a, b)


@pytest.mark.kernels("elements")
@pytest.mark.parametrize("group,alone", [(2**24, 2**15), (1000, 1000)], ids=["one group a dtype", "groups, some alone"])
def test_stochastic_write_back_into_fp16_and_bf16_parameters(group: int, alone: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of small parameters of one dtype in one kernel call each (or a few, up to
    ``fused._GROUP`` elements), large ones (``fused._ALONE``) in a call each, drawn as the reference
    draws tensor by tensor."""
    monkeypatch.setattr(fused, "_GROUP", group)
    monkeypatch.setattr(fused, "_ALONE", alone)
    g = torch.Generator().manual_seed(14)
    masters = [torch.randn(64, 33, generator=g), torch.randn(17, generator=g) * 1e-6, torch.randn(5, 5, generator=g),
               torch.randn(0, generator=g), torch.randn(40, 30, generator=g), torch.randn(7, generator=g)]
    masters[0][0, :3] = torch.tensor([math.nan, -math.inf, 3e38])
    dtypes = [torch.bfloat16, torch.float16, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16]
    runs = len(list(fused._groups([m.numel() for m in masters], group, dtypes)))
    assert runs == (3 if group > 4000 else 5)
    a, b = stream_pair()
    got = [torch.empty(m.shape, dtype=d) for m, d in zip(masters, dtypes, strict=True)]
    fused.write_back_(got, masters, a)
    want = [torch.empty(m.shape, dtype=d) for m, d in zip(masters, dtypes, strict=True)]
    with fused.reference():
        fused.write_back_(want, masters, b)
    for x, y in zip(got, want, strict=True):
        assert_same(x.float(), y.float())
    assert int(a.counter) == int(b.counter) == len(masters)


@pytest.mark.kernels("elements")
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_parameter_rounding_on_each_device(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8's FP16 masters and the stochastic bf16 write-back, batched and alone, against the reference
    on the same device (on a GPU: Triton kernels with indirect loads)."""
    monkeypatch.setattr(fused, "_GROUP", 2000)
    monkeypatch.setattr(fused, "_ALONE", 1000)
    g = torch.Generator().manual_seed(16)
    params = [torch.randn(s, generator=g).to(device) for s in ((64, 32), (32,), (0,), (40, 60), (9,))]
    for stochastic in (False, True):
        assert_rounded_as_the_reference(params, stochastic)
    a, b = RoundingStream(3, device), RoundingStream(3, device)
    got = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    fused.write_back_(got, params, a)
    want = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    with fused.reference():
        fused.write_back_(want, params, b)
    for x, y in zip(got, want, strict=True):
        assert_same(x.float(), y.float())
    assert int(a.counter) == int(b.counter) == len(params)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("fmt", [BLOCK_FORMATS["mxfp8"], BLOCK_FORMATS["nvfp4"]], ids=lambda f: f.name)
def test_blocks_on_cuda_in_every_layout(fmt: BlockFormat, device: str) -> None:
    for name, x, dim in block_cases(fmt):
        x = x.to(device)
        assert_same(*both(lambda x=x, dim=dim: fused.quantize_blocks(x, fmt, dim))), name
        a, b = RoundingStream(3, device), RoundingStream(3, device)
        got = fused.quantize_blocks(x, fmt, dim, stochastic=True, generator=a)
        with fused.reference():
            want = fused.quantize_blocks(x, fmt, dim, stochastic=True, generator=b)
        assert_same(got, want), name


# torch 2.14 has a config called numerics too, without "strict_pointwise" (it changes nothing there)
@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 15),
                    reason="torch < 2.15 has no strict_pointwise numerics")
def test_kernels_compile_with_inductors_own_eager_pointwise_numerics() -> None:
    """Every fused kernel and graph compiles with what torch itself calls eager-compatible pointwise
    math (inductor's numerics="strict_pointwise"): without one of its settings a Triton kernel rounds
    otherwise than eager (an FMA for NVFP4's scaled output plus bias: 403 of 1,480 outputs off on an
    H100, caught by tests/test_fused_gemms.py's test_quantized_gemms_on_cuda_match_the_reference, which
    only a GPU runs)."""
    import functools

    config = torch._inductor.config

    def read(key: str) -> Any:
        return functools.reduce(getattr, key.split("."), config)

    keys = [k for k in config.get_config_copy() if k != "numerics" and "mixed_mm" not in k]  # those two: deprecated
    default = {k: read(k) for k in keys}
    with config.patch(numerics="strict_pointwise"):
        strict = {k: v for k in keys if (v := read(k)) != default[k]}
    assert strict, "strict_pointwise changed no setting: this test reads inductor's config wrongly"
    assert {k: compiled_calls._EAGER_NUMERICS.get(k) for k in strict} == strict


@pytest.mark.kernels("blocks")
def test_fused_kernels_really_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The training path runs compiled kernels (it does not quietly fall back to the reference)."""
    as_a_fresh_process(monkeypatch)
    fused.quantize_blocks(torch.randn(3, 64), BLOCK_FORMATS["mxfp6_e3m2"], -1)
    assert [k.split("_")[0] for k in compiled_calls._kernels] == ["blocks"]  # MX formats share one block kernel
    assert not compiled_calls._given_up


@pytest.mark.kernels("blocks")
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_repeated_calls_skip_dynamo_and_match_the_reference(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """From a call's second time on (same shape, strides, dtype, options), the quantizers call their
    compiled function directly (``compiled_calls._Direct``), with new values: the same results as the
    reference, bit for bit, in every layout, rounding to nearest and stochastically, and for the
    element, per-tensor, row-wise and 2D-tile kernels. A bf16 operand of a seen shape, or a
    transposed one, is a call of its own, not the FP32 one's function; ``through_dynamo`` makes none."""
    direct: list[str] = []
    Direct = compiled_calls._Direct
    real, real_fast = Direct.__call__, compiled_calls._Fast.__call__
    monkeypatch.setattr(Direct, "__call__", lambda self, x, args: direct.append(self.key) or real(self, x, args))
    read: list[bool] = []  # a whole call's fast path (_Fast) read x in place

    def fast(self: compiled_calls._Fast, x: torch.Tensor, per_call: Any) -> Any:
        read.append(x.as_strided(*self.three).data_ptr() == x.data_ptr())
        direct.append("fast")
        return real_fast(self, x, per_call)

    monkeypatch.setattr(compiled_calls._Fast, "__call__", fast)
    # No direct call or kept path from earlier tests (the assertions below are over all of them); the
    # compiled kernels stay: their first calls here go through dynamo, which is what a direct call is
    # built from, without compiling them again (a fresh process took 19 s more here).
    for table in ("_directs", "_fast"):
        monkeypatch.setattr(compiled_calls, table, {})
    fmts = (BLOCK_FORMATS["mxfp8"], BLOCK_FORMATS["nvfp4"])
    calls: list[tuple[str, Callable[..., Any], torch.Tensor]] = []
    for fmt in fmts:
        for name, x, dim in block_cases(fmt):
            calls.append((name, lambda x, fmt=fmt, dim=dim: fused.quantize_blocks(x, fmt, dim), x))
            calls.append((name + " sr", lambda x, fmt=fmt, dim=dim: fused.quantize_blocks(
                x, fmt, dim, stochastic=True, generator=RoundingStream(7, x.device)), x))
        calls.append(("tiles", lambda x, fmt=fmt: fused.quantize_blocks(x, fmt, block_2d=True), adversarial(48, 40, 3)))
    x = adversarial(64, 96, seed=4)
    calls += [("e4m3", lambda x: fused.round_to_element(x, nf.E4M3), x),
              ("e5m2 sr", lambda x: fused.round_to_element(x, nf.E5M2, stochastic=True,
                                                           generator=RoundingStream(1, x.device)), x),
              ("per tensor", lambda x: fused.quantize_scaled(x, nf.E4M3), x),
              ("rowwise", lambda x: fused.axiswise_round(x, nf.E4M3, 0), x),
              ("bf16 operand", lambda x: fused.quantize_blocks(x.bfloat16(), fmts[0], 1), x),
              ("transposed", lambda x: fused.quantize_blocks(x.t().contiguous().t(), fmts[0], 1), x)]
    for name, fn, x in calls:
        x = x.to(device)
        fn(torch.randn_like(x))  # the first call goes through dynamo, and keeps its function
        del direct[:]
        got, want = both(lambda fn=fn, x=x: fn(x))
        assert_same(got, want), name
        assert direct, f"{name}: the repeated call went through dynamo"
    assert {k for k, d in compiled_calls._directs.items() if d is None} == set()
    # and each calls inductor's generated code, outside AOTAutograd's wrappers (torch 2.11 to 2.15)
    assert {k for k, d in compiled_calls._directs.items() if not d.generated} == set()  # type: ignore[union-attr]
    # the plain block and row-wise calls (no copy, no padding) and the tile calls repeat without the
    # entry points' planning
    assert {k[0] for k in compiled_calls._fast} == {"blocks", "axis", "tiles"} and len(read) >= 2 * len(fmts) * 5
    assert all(read)
    del direct[:]
    with compiled_calls.through_dynamo():  # the benchmarks' other side: every call through torch.compile's entry
        got, want = both(lambda: calls[0][1](calls[0][2].to(device)))
    assert_same(got, want)
    assert not direct


@pytest.mark.kernels("blocks")
def test_a_direct_call_is_the_graph_dynamo_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct call of a kernel call is built from the graph that dynamo ran for it, among the
    variant's graphs (here two: with every size static, a second size compiles a graph of its own),
    and only when that graph, called directly, returns what dynamo's call returned."""
    as_a_fresh_process(monkeypatch)
    # static sizes: no dim marked dynamic, and none made dynamic by what earlier tests ran
    monkeypatch.setattr(torch._dynamo, "maybe_mark_dynamic", lambda *a, **k: None)
    fmt = BLOCK_FORMATS["nvfp4"]
    rot = mx.hadamard_rotation(tuple(int(v) for v in GemmRecipe.signs(7).tolist()), torch.device("cpu"),
                               torch.float32)  # fmt: skip
    args = (*fused_kernels._elem(fmt.element, torch.device("cpu")), "nvfp4", False, None, None, rot)
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        for cols in (96, 64):  # a graph for each
            x = adversarial(64, cols, seed=cols)
            for _ in range(2):  # dynamo's call, then the direct one
                got, want = both(lambda x=x: fused.quantize_blocks(x, fmt, -1, rotation=rot))
                assert_same(got, want)
        x3 = x.view(64, 64, 1)
        entry = compiled_calls._entries["blocks", "nvfp4ffr", x3.shape, x3.dtype, x3.device]
        assert compiled_calls._directs["blocks", "nvfp4ffr", x3.shape, x3.stride(), x3.dtype, x3.device, args[0].shape,
                                  args[1].shape, "nvfp4", False, None, None, rot.shape]  # fmt: skip
        with torch.no_grad():  # as _call runs it: grad mode is one of dynamo's guards
            out = entry.kernel(x3, *args)
    (gm_96, fn_96), (gm, fn) = entry.backend.graphs
    assert entry.backend.ran == 1
    of, body = compiled_calls._Direct.of, fused_kernels._k_blocks
    assert of(gm, fn, body, "k", x3, args, out) is not None
    assert of(gm_96, fn_96, body, "k", x3, args, out) is None  # not the graph that ran
    wrong = (out[0] + 1, *out[1:])
    assert of(gm, fn, body, "k", x3, args, wrong) is None  # not what dynamo returned


@pytest.mark.kernels("elements")
def test_an_element_kernel_compiles_once_for_a_runs_sizes_layouts_and_grad_modes(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Each variant of the element kernels compiles one graph for what a run hands it: a second
    size, layout, group length or grad mode runs the same graph. Each once cost a second compile:
    the row-wise draws' strides were int arguments (dynamo specialised them), a group of one tensor
    had offsets of one entry (a size dynamo specialises), the bf16 write-back's masters were not
    marked dynamic, and a forward calls with grad mode on where the optimizer's calls have it off."""
    as_a_fresh_process(monkeypatch)
    monkeypatch.setattr(fused, "_ALONE", 64)
    g = torch.Generator().manual_seed(16)
    x, y = torch.randn(64, 96, generator=g), torch.randn(48, 40, generator=g)
    stream = RoundingStream(1)
    for t, dim in ((x, 1), (x.t(), 0), (y, 1), (y.t(), 0)):  # "anb", then "nab", each in two sizes
        fused.axiswise_round(t, nf.E5M2, dim, stochastic=True, generator=stream)
    with torch.no_grad():
        fused.round_to_element(x, nf.E4M3)
    fused.round_to_element(y, nf.E4M3)
    for sizes in ((40,), (30, 20)):  # groups of one tensor, then two
        fused.round_params_([torch.randn(s, generator=g) for s in sizes], nf.FP16, stochastic=True, generator=stream)
    for n in (100, 300):  # each alone: the bf16 write-back's own kernel
        fused.write_back_([torch.empty(n, dtype=torch.bfloat16)], [torch.randn(n, generator=g)], stream)
    graphs = {k: len(backend.graphs) for k, (_, backend) in compiled_calls._kernels.items()}
    for kernel in ("axis_tfanb_", "axis_tfnab_", "round_tf_", "round_all_t_", "bf16___"):
        assert any(k.startswith(kernel) for k in graphs), (kernel, graphs)
    assert all(n == 1 for n in graphs.values()), graphs


@pytest.mark.parametrize("mode", [pytest.param("fp8 tensor", marks=pytest.mark.kernels("elements")),
                                  pytest.param("mxfp6", marks=pytest.mark.kernels("blocks"))])
def test_a_converted_model_trains_identically(mode: str) -> None:
    """Two steps of an MLP, fused and reference: the same weights, bit for bit (every quantizer,
    every draw of the rounding streams, the FP16 master rounding). FP8 with per-tensor scales and
    MXFP6; NVFP4's recipe and FP8 hybrid go the same way (``build_precision``, ``prepare_model``)
    through the engine in the next test, which compiles their kernels in a fresh process's tables
    anyway: run here too, they cost the suite ~60 s of compiling (a cold two-worker run) for no path
    of their own."""
    from omegaconf import OmegaConf

    from mptrain.config import FP8PrecisionConfig, MXPrecisionConfig
    from mptrain.numerics import rounding_rng
    from mptrain.numerics.precision import build_precision

    def train(cfg: Any) -> list[torch.Tensor]:
        rounding_rng.seed_rounding(0)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 10))
        precision = build_precision(OmegaConf.structured(cfg), torch.device("cpu"))
        model = precision.prepare_model(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        for _ in range(2):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            precision.after_step()
        rounding_rng.seed_rounding(None)
        return [p.detach().clone() for p in model.parameters()]

    cfg = {"fp8 tensor": FP8PrecisionConfig(name="fp8", scaling="tensor"),
           "mxfp6": MXPrecisionConfig(name="mx", format="mxfp6")}[mode]
    got, want = both(lambda: train(cfg))
    for a, b in zip(got, want, strict=True):
        assert_same(a, b)


# --------------------------------------------------------------------------------------------
# through the engine


@pytest.mark.parametrize("name", [pytest.param("nvfp4", marks=pytest.mark.kernels("blocks")),
                                  pytest.param("hybrid", marks=pytest.mark.kernels("elements"))])
def test_runs_through_the_engine_match_the_reference_and_report_compile_time(
    name: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transformer LM in NVFP4 (its whole recipe) and FP8 hybrid (stochastic rounding, FP16
    masters, enhanced loss scaling), run fused and on the reference: the same loss at every step,
    and the same final weights. The fused run says so, and reports its compile time apart."""
    from conftest import run_job
    from test_engine import scalars
    from test_transformer import TINY_TF

    from mptrain import checkpoint

    as_a_fresh_process(monkeypatch)  # a fresh process would compile: so does this one
    mode = ["precision=mx", "precision.format=nvfp4"] if name == "nvfp4" else ["precision=fp8",
                                                                                "precision.format=hybrid"]
    common = [*TINY_TF, *mode, "trainer.max_steps=4", "trainer.log_every=1", "trainer.precision_plan=false"]
    fast = run_job(tmp_path / "fused", *common)
    with fused.reference():
        ref = run_job(tmp_path / "ref", *common)
    assert fast["quantizers"] == "fused" and ref["quantizers"] == "reference (MPTRAIN_FUSED=0)"
    assert fast["compile_time_s"] > 0 and ref["compile_time_s"] == 0
    assert scalars(tmp_path / "fused")["train/loss"] == scalars(tmp_path / "ref")["train/loss"]
    a = checkpoint.load(checkpoint.list_checkpoints(tmp_path / "fused")[-1])["modules"]
    b = checkpoint.load(checkpoint.list_checkpoints(tmp_path / "ref")[-1])["modules"]
    for net in a:
        for key in a[net]:
            assert_same(a[net][key].float(), b[net][key].float())


def test_a_conv_compiled_whole_builds_its_format_constants_in_the_graph() -> None:
    """trainer.compile traces the fused quantizers into the model's graph (``convert._MxMixin.in_graph``).
    There the format constants (``fused_kernels._elem``) are built in the graph, not read from the
    cache that eager calls fill: read as graph inputs, they made inductor (torch 2.11, a CPU) fail to
    generate this convolution's backward ("unexpected group"), which stopped ResNet-50's first step.
    Compiled, the layer gives eager's output and gradients to FP32's rounding (inductor's
    convolution adds its products in another order than eager's)."""
    from mptrain.numerics.convert import convert_model

    torch.manual_seed(0)
    model, _ = convert_model(nn.Conv2d(64, 64, 2, bias=False), {"format": "mxfp8"}, in_graph=True)
    x = torch.randn(4, 64, 2, 2, requires_grad=True)
    want = model(x)  # eager: fills the constants' cache
    want.sum().backward()
    wants = [t.grad for t in (x, model.weight)]
    x.grad = model.weight.grad = None
    torch._dynamo.reset()
    got = torch.compile(model, **compiled_calls.model_compile_args("default", True))(x)
    got.sum().backward()
    torch.testing.assert_close(got, want)
    for t, w in zip((x, model.weight), wants, strict=True):
        torch.testing.assert_close(t.grad, w)


def test_compile_seconds_count_a_compiled_models_backward() -> None:
    """``fused.compile_seconds`` (summary.json's compile_time_s, kept out of throughput) counts the
    backward graph that a compiled model compiles at its first backward, not only its frame's compile."""
    torch._dynamo.reset()  # no compiled code from another test to reuse
    model = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), backend="aot_eager")
    y = model(torch.randn(4, 8))
    before = fused.compile_seconds()
    y.sum().backward()
    assert fused.compile_seconds() > before

"""The GPU's fused quantizers, checked without a GPU: the arithmetic its kernels run where a CPU's
differ (NVFP4's amaxes as floats), against the eager reference on this CPU, and the Triton code
inductor writes for an sm90 device (scripts/triton_kernels.py). The CUDA tests in
tests/test_fused.py and tests/test_fused_gemms.py run the kernels themselves where a GPU is."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fused_cases import as_a_fresh_process, assert_same, block_cases, both, fused_on

from mptrain.numerics import fused, fused_kernels, mx
from mptrain.numerics.mx import BLOCK_FORMATS
from mptrain.numerics.qgemm import GemmRecipe
from mptrain.numerics.rounding_rng import RoundingStream

ROOT = Path(__file__).resolve().parents[1]
NVFP4 = BLOCK_FORMATS["nvfp4"]
# scripts/triton_kernels.py fakes an sm90 device against torch 2.11's internals, in a process of its
# own; where a real GPU is, the CUDA tests run the kernels themselves
FAKE_SM90 = pytest.mark.skipif(torch.__version__.split("+")[0].rsplit(".", 1)[0] != "2.11"
                               or torch.cuda.is_available(), reason="generates sm90 code on torch 2.11 without a GPU")


@pytest.fixture(autouse=True)
def _fused_on() -> Iterator[None]:
    yield from fused_on()


@pytest.mark.kernels("blocks")
def test_nvfp4_float_amaxes_as_a_gpu_takes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU takes NVFP4's block and tensor amaxes from the elements' bits; a GPU takes them as floats,
    the tensor's over one flat run of the operand (``fused_kernels._tensor_scale``). Compiled here
    that way, the kernels equal the reference bit for bit on adversarial values: blocks along a row
    (B = 1), along columns, rotated and stochastic (B > 1), under one block, and 2D tiles."""
    as_a_fresh_process(monkeypatch)  # kernels compiled the CPU's way must not serve these calls
    scale = fused_kernels._tensor_scale
    monkeypatch.setattr(fused_kernels, "_tensor_scale", lambda x, kind, bits: scale(x, kind, False))
    monkeypatch.setattr(fused_kernels, "_tree_amax", lambda blocks: blocks.abs().amax(2, keepdim=True))
    cases = dict((name, (x, dim)) for name, x, dim in block_cases(NVFP4))
    for name in ("rows", "3 channels"):
        x, dim = cases[name]
        assert_same(*both(lambda x=x, dim=dim: fused.quantize_blocks(x, NVFP4, dim))), name
    x, dim = cases["columns"]
    r = mx.hadamard_rotation(tuple(int(v) for v in GemmRecipe.signs(7).tolist()), x.device, torch.float32)
    a, b = RoundingStream(3), RoundingStream(3)
    got = fused.quantize_blocks(x, NVFP4, dim, stochastic=True, generator=a, rotation=r)
    with fused.reference():
        want = fused.quantize_blocks(x, NVFP4, dim, stochastic=True, generator=b, rotation=r)
    assert_same(got, want)
    w = x[:48, :40]  # 3 x 3 tiles, padded
    assert_same(*both(lambda: fused.quantize_blocks(w, NVFP4, block_2d=True)))


@FAKE_SM90
def test_nvfp4_tensor_amax_reductions_load_by_the_elements_number() -> None:
    """The Triton code of an NVFP4 Linear's forward graph (x and the weight's tiles, each with a
    tensor amax): no kernel loads through an address that divides or takes a remainder of an
    element's index. Over the blocks' view, each tensor-amax reduction did (one remainder in the
    forward, up to five divisions and remainders on wgrad's rotated operands), and on the H200 such
    kernels took 118-155 us a call against 16-21 us (docs/benchmarks/README.md)."""
    found = forward_graph_code()
    assert sum("amax" in k and k.startswith("triton_red") for k in found["kernels"]) == 2, found["kernels"]
    assert found["divmod_loads"] == [], found["divmod_loads"]


@FAKE_SM90
def test_static_shape_graphs_divide_no_element_index_by_a_run_time_size() -> None:
    """precision.graph_static_shapes: NVFP4's forward graph compiled for its shapes has no kernel that
    divides an element's index by a size passed in at run time; with dynamic dims (the default), half
    its kernels do, by the int64 sizes inductor passes them (scripts/triton_kernels.py)."""
    dynamic, static = forward_graph_code(), forward_graph_code("--static")
    assert len(dynamic["runtime_divisions"]) >= len(dynamic["kernels"]) // 2, dynamic
    assert static["runtime_divisions"] == [] and len(static["kernels"]) <= len(dynamic["kernels"]), static


@functools.cache
def forward_graph_code(*flags: str) -> dict[str, list[str]]:
    """scripts/triton_kernels.py's report on an NVFP4 Linear's forward graph with bf16 products (once a
    process for each flag)."""
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "triton_kernels.py"), "--cell", "nvfp4", "bf16",
                          "fwd", *flags], capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])

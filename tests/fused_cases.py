"""What the fused-quantizer tests share (tests/test_fused.py, tests/test_fused_gemms.py): the fused
path turned on as a run has it, bit-for-bit comparison against the eager reference, and the
tensors and layouts they compare on."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from mptrain.engine import set_deterministic
from mptrain.numerics import compiled_calls, fused
from mptrain.numerics.mx import BlockFormat
from mptrain.numerics.precision import build_precision

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA device")])


def fused_on() -> Iterator[None]:
    """The body of each file's autouse fixture: the fused quantizers on, under a run's flags; a
    failed probe fails the test where it is a miscompile, else skips it."""
    # Torch's process-wide flags as a run sets them (trainer.deterministic=false, TF32 off): inductor's
    # cache keys include them, so a kernel these tests compile is one that a later engine run in this
    # process (tests/test_fused.py's, tests/test_syncs.py's) loads from the cache rather than compiles again:
    # ~40 s of a cold two-worker run (docs/benchmarks/cpu-2026-11-27-avx2-suite.md).
    set_deterministic(False)
    build_precision(OmegaConf.create({"name": "fp32"}), torch.device("cpu")).configure_backends()
    with fused.forced(True):
        if not fused.enabled(torch.zeros(1)):
            why = fused._why_not.get("cpu", "")
            if why == fused.WRONG:  # a kernel that compiles and rounds wrongly is a failure, not a skip
                pytest.fail(f"fused quantizers disabled: {why}")
            pytest.skip(f"torch.compile cannot build kernels here: {why}")
        yield


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (so +0 and -0 differ), except that any NaN equals any NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    ia = a.float().view(torch.int32)
    ib = b.float().view(torch.int32)
    return torch.equal(ia[~nan_a], ib[~nan_b])


def both(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``fn`` fused, then under the reference."""
    got = fn()
    with fused.reference():
        want = fn()
    return got, want


def assert_same(got: Any, want: Any) -> None:
    if isinstance(got, tuple):
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    elif got is None:
        assert want is None
    else:
        assert bits_equal(got, want), f"fused differs from the reference in {int((got != want).sum())} values"


def as_a_fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiled kernel, graph or direct call from earlier tests: what a new process starts with."""
    for table in ("_kernels", "_entries", "_directs", "_graphs", "_graph_directs", "_graph_fast", "_fast"):
        monkeypatch.setattr(compiled_calls, table, {})


def adversarial(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Rows 32 binades apart, wide spread inside blocks, and rows of special values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randn(rows, cols, generator=g) * 4)
    x *= torch.exp2(torch.randint(-40, 40, (rows, 1), generator=g).float())
    x[0] = 0.0  # an all-zero row
    x[1, ::3] = math.nan
    x[2, ::5] = math.inf
    x[2, 1::5] = -math.inf
    x[3] = torch.randn(cols, generator=g) * 2.0**-140  # FP32 subnormals
    x[4] = torch.randn(cols, generator=g) * 1e38  # huge amax
    x[5] = torch.randn(cols, generator=g) * 1e-37  # tiny amax
    x[6, :: 2] = -0.0
    return x


def block_cases(fmt: BlockFormat) -> list[tuple[str, torch.Tensor, int]]:
    """(name, tensor, dim): every layout the block kernels take, on ``adversarial`` values."""
    x = adversarial(64, 96, seed=5)
    odd = adversarial(40, 24, seed=6)  # 40 and 24: not multiples of 16 or 32 along either dim
    x4 = adversarial(8, 64 * 9, seed=7).view(8, 64, 3, 3)
    narrow = adversarial(8, 40 * 4, seed=8).view(8, 40, 2, 2)  # a 2x2 map, 40 channels: padded
    # under one block (an RGB stem, a narrow layer's 8 channels at a 3x3 filter's taps): one short block
    rgb = adversarial(8, 3 * 25, seed=9).view(8, 3, 5, 5)
    taps = adversarial(12, 8 * 9, seed=10).view(12, 8, 3, 3)
    # a whole tensor of tiny amax (about 2**-117: NVFP4 shifts it by 2**64), FP32 subnormals inside
    g = torch.Generator().manual_seed(11)
    tiny = torch.randn(64, 96, generator=g) * torch.exp2(torch.randn(64, 96, generator=g) * 4) * 2.0**-133
    tiny[0] = 0.0
    tiny[1, ::3] = math.nan
    return [
        ("tiny tensor", tiny, -1),
        ("rows", x, -1), ("columns", x, 0), ("transposed rows", x.t(), 1), ("transposed columns", x.t(), 0),
        ("padded rows", odd, 1), ("padded columns", odd, 0), ("channels", x4, 1),
        ("channels_last", x4.contiguous(memory_format=torch.channels_last), 1), ("padded 2x2 channels", narrow, 1),
        ("3 channels", rgb, 1), ("8 channels at 3x3 taps", taps, 1),
    ]  # fmt: skip

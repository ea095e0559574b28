"""What the fused-quantizer tests share (tests/test_fused.py, tests/test_fused_gemms.py): the fused
path turned on as a run has it, and bit-for-bit comparison against the eager reference."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from mptrain.engine import set_deterministic
from mptrain.numerics import compiled_calls, fused
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

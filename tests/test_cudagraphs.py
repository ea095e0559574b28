"""mptrain.cudagraphs: the CUDA graphs inductor skipped reach summary.json and the benchmark cells."""

from __future__ import annotations

from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

from mptrain import cudagraphs


def test_inductors_cudagraph_skips_are_collected() -> None:
    """What inductor says when it runs a graph without recording its CUDA graph reaches ``since``
    (called here through inductor's own function for it: a CPU never records one), once each."""
    mark = cudagraphs.watch()
    assert cudagraphs.watch() == mark  # one collector a process
    reason = "skipping cudagraphs due to mutated inputs (1 instances). Found from :\n  File x.py, line 1"
    log_cudagraph_skip_and_bump_counter(reason)
    assert cudagraphs.since(mark) == [reason]

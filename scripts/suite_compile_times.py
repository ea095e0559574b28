"""A pytest plugin that says where the suite's time goes: each test's wall time and torch.compile time,
and each graph inductor compiles (a hash of its code, its seconds, the test that compiled it), one JSON
file per xdist worker. Used for docs/benchmarks/cpu-2026-11-27-avx2-suite.md:

    PYTHONPATH=scripts SUITE_TIMES_OUT=/tmp/times python -m pytest -n 2 --dist worksteal -p suite_compile_times

A test's compile time is torch's own count (``fused.compile_seconds``: dynamo, AOTAutograd and
inductor); a graph's is the time inside mptrain's inductor backend (AOTAutograd and inductor, not
dynamo's tracing). ``torch._dynamo.reset()`` zeroes torch's count, so a test that calls it shows a
negative compile time, which the summary leaves out.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

_tests: list[tuple[str, float, float]] = []
_graphs: list[tuple[str, str, float]] = []
_current = [""]


def pytest_configure(config: pytest.Config) -> None:
    from mptrain.numerics import compiled_calls

    real = compiled_calls._Inductor.__call__

    def timed(self: Any, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = real(self, gm, example_inputs, **kwargs)
        _graphs.append((_current[0], hashlib.md5(gm.code.encode()).hexdigest()[:12], time.perf_counter() - start))
        return out

    compiled_calls._Inductor.__call__ = timed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    from mptrain.numerics import fused

    _current[0] = item.nodeid
    start, compiled = time.perf_counter(), fused.compile_seconds()
    yield
    _tests.append((item.nodeid, time.perf_counter() - start, fused.compile_seconds() - compiled))


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = Path(os.environ.get("SUITE_TIMES_OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (out / f"suite-times-{worker}.json").write_text(json.dumps({"tests": _tests, "graphs": _graphs}))

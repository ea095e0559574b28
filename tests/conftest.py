"""Shared helpers: compose the real configs (as the CLI does) and run jobs in-process."""

from __future__ import annotations

import os

# The emulated formats run their eager reference in the suite: compiling the fused kernels costs
# minutes on a cold cache. tests/test_fused.py and tests/test_fused_gemms.py turn them on and hold
# them bit-identical to it, unit by unit, layer by layer and through the engine.
os.environ.setdefault("MPTRAIN_FUSED", "0")

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mptrain.cli import compose
from mptrain.config import register_configs, validate
from mptrain.numerics import rounding_rng

register_configs()

# Under pytest-xdist (README's test command runs two workers), the workers share the CPUs: each
# takes its share of torch's threads (OpenMP threads spinning on an oversubscribed core slow
# everyone), as do the processes the tests start, and each compiles in its own process rather than
# starting a pool of compile workers.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    import torch
    import torch._inductor.config

    _share = max(1, (os.cpu_count() or 1) // _workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    torch.set_num_threads(_share)
    torch._inductor.config.compile_threads = 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist's worksteal (README's command; another --dist mode only sees a new order), each
    worker starts on a contiguous share of the collection and the others steal from its tail. The
    fused quantizers' tests compile graphs that only the process which traced them can call again
    (dynamo's work is per process, and inductor's disk cache serves another worker only once a graph
    is written), so a family of kernels split across two workers is compiled twice: 38 of 70 graph
    codes were, in a cold two-worker run (docs/benchmarks/cpu-2026-11-27-avx2-suite.md). Likewise a
    module fixture that launches torchrun or a multirun is built once per worker that runs one of its
    tests: tests/test_fsdp2.py's two launches were built on both workers of a cold run on torch 2.11,
    a setup of 76 s more.
    Each family (``@pytest.mark.kernels``, ``@pytest.mark.shared``) goes to the head of a share
    (the largest ones to shares of their own), where stealing, which takes the tail, leaves it; the
    other tests keep their order. Reordering only: no test depends on another's order. (Workers
    collect, and see their count in the environment: xdist resets their -n and --dist options.)"""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    families: dict[str, list[pytest.Item]] = {}
    rest: list[pytest.Item] = []
    for item in items:
        mark = item.get_closest_marker("kernels") or item.get_closest_marker("shared")
        (families.setdefault(f"{mark.name}:{mark.args[0]}", []) if mark else rest).append(item)
    if not families:  # a run of other tests only
        return
    # The scheduler's first split: worker k gets len(pending) // (workers - k) of what is left.
    starts, left = [0], len(items)
    for k in range(workers - 1):
        left -= left // (workers - k)
        starts.append(len(items) - left)
    ordered: list[pytest.Item] = []
    for k, family in enumerate(sorted(families.values(), key=len, reverse=True)):
        start = starts[min(k, workers - 1)]
        take = max(0, start - len(ordered))
        ordered += rest[:take] + family
        del rest[:take]
    items[:] = ordered + rest


# Tiny but real: the torchvision architectures at 1/8 width, small images, few steps.
TINY = [
    "data.batch_size=4",
    "data.train_samples=16",
    "data.val_samples=8",
    "data.num_classes=10",
    "data.num_workers=0",
    "trainer.log_every=2",
]
TINY_MODEL = {
    "alexnet": ["model.width_divisor=8", "data.image_size=64"],
    "vgg16": ["model.width_divisor=8", "data.image_size=32"],
    "resnet50": ["model.width_divisor=8", "data.image_size=32"],
    "googlenet": ["model.width_divisor=8", "data.image_size=32"],
    "inception_v3": ["model.width_divisor=16", "data.image_size=299", "data.batch_size=2", "data.train_samples=4",
                     "data.val_samples=2"],
}


def on_cpu(overrides: list[str] | tuple[str, ...]) -> list[str]:
    """The suite asserts CPU behaviour (what mixed resolves to, image sizes, no device memory), so
    runs are pinned to the CPU unless a test names a device itself (tests/test_cuda.py does)."""
    if any(a.startswith("trainer.device=") for a in overrides):
        return list(overrides)
    return [*overrides, "trainer.device=cpu"]


def run_job(run_dir: Path, *overrides: str) -> dict[str, Any]:
    """Compose + validate + train in this process (on the CPU unless told); returns summary.json."""
    from mptrain.run import train

    cfg = compose(on_cpu(overrides))
    validate(cfg)
    train(cfg, run_dir)
    return json.loads((run_dir / "summary.json").read_text())


def tiny(model: str = "resnet50", *extra: str) -> list[str]:
    return [f"model={model}", *TINY, *TINY_MODEL[model], *extra]


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """``python -m mptrain ARGS`` (pinned to the CPU unless told, like run_job)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    if "--help" not in args:
        args = tuple(on_cpu(args))
    return subprocess.run(
        [sys.executable, "-m", "mptrain", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


@pytest.fixture(autouse=True)
def _rounding_on_the_global_rng() -> Iterator[None]:
    """Every test leaves stochastic rounding on the global RNG: an engine that is built but never run
    to its end (tests/test_syncs.py steps one directly) keeps its run's stream seeded, and a later
    test's draws then depended on which tests ran before it (test_fp8's loss-scale invariance failed
    after test_syncs)."""
    yield
    rounding_rng.seed_rounding(None)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"

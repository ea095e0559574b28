"""Reading the benchmark notes and their data files, for the tests that hold one against the other
(tests/test_format_benchmarks.py, tests/test_format_change_runs.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Issue 24's CPU targets: (model, mode) -> the largest step time against FP32 it allows.
FORMAT_TARGETS = {
    ("mlp 4x1024 b128", "mxfp8"): 1.5, ("mlp 4x1024 b1024", "mxfp8"): 1.25,
    ("mlp 4x1024 b128", "nvfp4"): 2.0, ("mlp 4x1024 b1024", "nvfp4"): 1.5,
    ("mlp 4x1024 b128", "fp8 hybrid"): 1.6, ("mlp 4x1024 b1024", "fp8 hybrid"): 1.3,
    **{("resnet50/8", m): 2.0 for m in ("fp8 hybrid", "fp8 hybrid tensor", "fp8 hybrid rowwise", "mxfp8", "mxfp6",
                                         "mxfp4", "nvfp4")},
}  # fmt: skip


def assert_in_notes(phrases: list[str], notes: str = "docs/benchmarks/README.md") -> None:
    """Every phrase is in the notes, their whitespace folded (Markdown reflows lines freely)."""
    text = " ".join((ROOT / notes).read_text().split())
    missing = [p for p in phrases if p not in text]
    assert not missing, missing


def benchmark(name: str) -> dict[str, Any]:
    """docs/benchmarks/NAME.json."""
    return json.loads((ROOT / f"docs/benchmarks/{name}.json").read_text())


def keyed_rows(name: str) -> dict[tuple[str, str], dict[str, Any]]:
    """A formats benchmark's rows by (model, mode)."""
    return {(r["model"], r["mode"]): r for r in benchmark(name)["rows"]}


# the AVX512-BF16 EPYC's run of every cell at 2ea7724, and its ResNet-50/8 repeat (the baseline of later runs)
AVX512_RUNS = ("cpu-2026-11-28-avx512-formats-2ea7724", "cpu-2026-11-28-avx512-resnet-2ea7724")

"""Row-wise calls on narrow layouts and 2D tile calls, through their kept paths or their entry points'
full path, side by side in one process, on a CPU.

From a call's second time on, a quantizer entry point may skip its planning and dispatch and call
the generated code through a kept path (``compiled_calls._Fast``): first only where the kernel read
x in place. The row-wise quantizer on a narrow layout (a 2x2 activation, a 3x3 filter's taps along
its input channels: ``fused._transposed``) and the 2D tile quantizer (NVFP4's weights:
``fused._tiled``) copy or pad x first, and took the full path on every call; now they keep theirs.
This replays one ResNet-50/8 step's such calls (recorded at the entry point, after three warm-up
steps): the row-wise FP8 recipe's narrow row-wise calls, and NVFP4's tile calls, two ways:

- ``full``: every call through the entry point's full path (``fused._fast_for`` finds nothing), its
  kernel still called directly (``compiled_calls._Direct``), as before;
- ``kept``: the library's path.

Both return the same values bit for bit (checked on every call, stochastic rounding from streams
alike). Reported per kind of call: the minimum over interleaved rounds of the CPU time of all that
kind's calls of one step, and its share of the step's median time in the same process.

    python scripts/kept_paths_bench.py --out docs/benchmarks --name cpu-2026-11-28-avx2-kept-paths
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_formats  # the script beside this one (its directory leads sys.path)
import torch

from mptrain.bench.common import cpu_header, cpu_script_stamp, load_averages, write_report
from mptrain.numerics import fused, rounding_rng

Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _copy(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call's arguments for replaying it: tensors cloned, a rounding stream a fresh one."""
    return bench_formats._copy(a), {n: bench_formats._copy(v) for n, v in k.items()}


def _narrow_rowwise(x: torch.Tensor, fmt: Any, dim: int, **_: Any) -> bool:
    v = fused.view3(x, dim)
    return v is not None and v[2] is not None and fused._narrow_inner(v[0])


def _tiles(*_: Any, block_2d: bool = False, **__: Any) -> bool:
    return block_2d


# (mode, the entry point, which of its calls)
KINDS = {
    "fp8 hybrid rowwise: row-wise, narrow": ("fp8 hybrid rowwise", "axiswise_round", _narrow_rowwise),
    "nvfp4: 2D tiles": ("nvfp4", "quantize_blocks", _tiles),
}


def record(mode: str, entry: str, pick: Callable[..., bool]) -> tuple[list[Call], Any, torch.Tensor, torch.Tensor]:
    """One ResNet-50/8 step's calls of ``entry`` that ``pick`` selects (after three warm-up steps)."""
    rounding_rng.seed_rounding(0)
    _, batch, shape, classes = bench_formats.MODELS["resnet50/8"]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g)
    cell = bench_formats.build("resnet50/8", mode)
    assert not isinstance(cell, str)
    for _ in range(3):
        bench_formats.step(cell, x, y)
    calls: list[Call] = []
    real = getattr(fused, entry)

    def rec(*a: Any, **k: Any) -> Any:
        if pick(*a, **k):
            calls.append((real, *_copy(a, k)))
        return real(*a, **k)

    setattr(fused, entry, rec)
    try:
        bench_formats.step(cell, x, y)
    finally:
        setattr(fused, entry, real)
    return calls, cell, x, y


def _run(calls: list[Call], full: bool) -> list[Any]:
    real = fused._fast_for
    if full:
        fused._fast_for = lambda key: None  # type: ignore[assignment]
    try:
        return [fn(*b, **m) for fn, a, k in calls for b, m in [_copy(a, k)]]
    finally:
        fused._fast_for = real  # type: ignore[assignment]


def _bits(out: Any) -> list[torch.Tensor]:
    outs = out if isinstance(out, tuple) else (out,)
    return [t.contiguous().view(torch.int32) for t in outs if t is not None]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default="cpu-kept-paths")
    args = ap.parse_args(argv)
    info = cpu_script_stamp("kept_paths_bench.py", argv)
    rows = []
    for kind, (mode, entry, pick) in KINDS.items():
        calls, cell, x, y = record(mode, entry, pick)
        full, kept = _run(calls, True), _run(calls, False)
        for a, b in zip(full, kept, strict=True):
            assert all(torch.equal(u, v) for u, v in zip(_bits(a), _bits(b), strict=True)), kind
        # Each call with its arguments copied beforehand (a copy costs as much as a small call).
        replays = [[(fn, *_copy(a, k)) for fn, a, k in calls] for _ in range(2 * args.rounds)]
        times: dict[str, list[float]] = {"full": [], "kept": []}
        steps: list[float] = []
        real = fused._fast_for
        for r in range(args.rounds):
            for i, way in enumerate(times):
                fused._fast_for = (lambda key: None) if way == "full" else real  # type: ignore[assignment]
                t0 = time.process_time()
                for fn, a, k in replays[2 * r + i]:
                    fn(*a, **k)
                times[way].append(time.process_time() - t0)
            fused._fast_for = real  # type: ignore[assignment]
            t0 = time.process_time()
            bench_formats.step(cell, x, y)
            steps.append(time.process_time() - t0)
        ms = {way: round(1e3 * min(t), 3) for way, t in times.items()}
        step_ms = round(1e3 * statistics.median(steps), 2)
        rows.append({"kind": kind, "calls": len(calls), "elements": sum(c[1][0].numel() for c in calls), "ms_cpu": ms,
                     "saved_ms": round(ms["full"] - ms["kept"], 3), "kept_vs_full": round(ms["kept"] / ms["full"], 3),
                     "step_ms_cpu": step_ms})  # fmt: skip
        print(rows[-1], flush=True)
    result = {"info": info | {"load_average_end": load_averages()}, "rounds": args.rounds, "rows": rows}
    write_report(args.out, args.name, result, markdown(result))
    print(markdown(result))


def markdown(r: dict[str, Any]) -> str:
    lines = [
        *cpu_header(r["info"], "Kept paths for narrow row-wise calls and 2D tile calls: one ResNet-50/8 step's "
                    "calls, side by side",
                    f"- method: see the script's docstring; minimum over {r['rounds']} interleaved rounds of "
                    "the CPU time of one step's calls of each kind; both ways bit-identical on every call; "
                    "step: the median CPU time of one training step of that mode, a step after each round"),
        "| calls | number | elements | full path ms | kept path ms | kept / full | saved ms | step ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(f"| {row['kind']} | {row['calls']} | {row['elements']:,} | {row['ms_cpu']['full']:.2f} | "
                     f"{row['ms_cpu']['kept']:.2f} | {row['kept_vs_full']:.2f}x | {row['saved_ms']:.2f} | "
                     f"{row['step_ms_cpu']:.1f} |")
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    main()

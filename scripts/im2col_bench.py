"""wgrad's im2col columns on a CPU, the ways of ``mptrain.numerics.im2col`` against the ways before them, side by side.

Records the columns call of every quantized convolution in one ResNet-50/8 step (mode ``--mode``,
after three warm-up steps), then replays each call two ways, interleaved round by round:

- ``before``: ``wgrad_columns(..., fast=False)``: one strided copy of (padded) x, or aten's unfold
  and a permute copy where output rows are narrower than 8 pixels (the code before f08b759);
- ``now``: the library's ways: a cached gather for narrow rows, on a CPU.

Both return the same columns bit for bit (checked on every call here). Reported per way the library
takes: the minimum over the rounds of the CPU time of one step's calls of that way, and the total.

    python scripts/im2col_bench.py --out docs/benchmarks --name cpu-2026-11-29-avx512-im2col
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import bench_formats  # the script beside this one (its directory leads sys.path)
import torch

from mptrain.bench.common import cpu_header, cpu_script_stamp, load_averages, write_report
from mptrain.memory import keep_freed_host_memory
from mptrain.numerics import im2col, qgemm, rounding_rng

Call = tuple[torch.Tensor, tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]


def record(mode: str) -> list[Call]:
    """One ResNet-50/8 step's wgrad columns calls in ``mode`` (after three warm-up steps)."""
    rounding_rng.seed_rounding(0)
    _, batch, shape, classes = bench_formats.MODELS["resnet50/8"]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g)
    cell = bench_formats.build("resnet50/8", mode)
    assert not isinstance(cell, str), cell
    for _ in range(3):
        bench_formats.step(cell, x, y)
    calls: list[Call] = []
    real = qgemm.wgrad_columns

    def rec(x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append((x.detach().clone(), *args))
        return real(x, *args)

    qgemm.wgrad_columns = rec  # type: ignore[assignment]
    try:
        bench_formats.step(cell, x, y)
    finally:
        qgemm.wgrad_columns = real
    return calls


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="nvfp4", help="a bench_formats mode (every emulated mode takes the same calls)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default="cpu-im2col")
    args = ap.parse_args(argv)
    info = cpu_script_stamp("im2col_bench.py", argv) | {"host_memory": keep_freed_host_memory(), "mode": args.mode}
    calls = record(args.mode)
    groups: dict[str, list[Call]] = {}
    columns: dict[str, int] = {}
    for c in calls:
        way = im2col.column_way(*c)
        groups.setdefault(way, []).append(c)
        before, now = im2col.wgrad_columns(*c, fast=False), im2col.wgrad_columns(*c)
        assert torch.equal(before, now), c[0].shape
        columns[way] = columns.get(way, 0) + now.numel()
    times: dict[tuple[str, bool], list[float]] = {(way, fast): [] for way in groups for fast in (False, True)}
    for r in range(args.rounds):
        for way, group in groups.items():
            for fast in (r % 2 == 0, r % 2 == 1):  # each way first in every other round (warm caches)
                t0 = time.process_time()
                for c in group:
                    im2col.wgrad_columns(*c, fast=fast)
                times[way, fast].append(time.process_time() - t0)
    rows = []
    for way, group in groups.items():
        ms = {"before": 1e3 * min(times[way, False]), "now": 1e3 * min(times[way, True])}
        rows.append({"way": way, "calls": len(group), "elements": sum(c[0].numel() for c in group),
                     "columns": columns[way],
                     "ms_cpu": {k: round(v, 3) for k, v in ms.items()},
                     "now_vs_before": round(ms["now"] / ms["before"], 3)})  # fmt: skip
    total = {k: round(sum(r["ms_cpu"][k] for r in rows), 3) for k in ("before", "now")}
    result = {"info": info | {"load_average_end": load_averages()}, "rounds": args.rounds, "rows": rows,
              "total_ms_cpu": total, "total_now_vs_before": round(total["now"] / total["before"], 3)}  # fmt: skip
    write_report(args.out, args.name, result, markdown(result))
    print(markdown(result))


def markdown(r: dict[str, Any]) -> str:
    lines = [
        *cpu_header(r["info"], "wgrad's im2col columns on a CPU: one ResNet-50/8 step's calls, the ways before "
                    "and now, side by side",
                    f"- method: see the script's docstring; mode {r['info']['mode']}; minimum over {r['rounds']} "
                    "interleaved rounds of the CPU time of one step's calls of each way; both ways bit-identical "
                    "on every call"),
        "| way now | calls | input elements | column elements | before ms | now ms | now / before |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(f"| {row['way']} | {row['calls']} | {row['elements']:,} | {row['columns']:,} | "
                     f"{row['ms_cpu']['before']:.2f} | {row['ms_cpu']['now']:.2f} | {row['now_vs_before']:.2f}x |")
    t = r["total_ms_cpu"]
    lines.append(f"| all | {sum(row['calls'] for row in r['rows'])} | | | {t['before']:.2f} | {t['now']:.2f} | "
                 f"{r['total_now_vs_before']:.2f}x |")
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    main()

"""Page faults and step time with glibc's defaults against ``memory.keep_freed_host_memory``.

The setting is process-wide and cannot be taken back, so each measurement is a process of its own:
for every round, every model and mode runs twice, glibc defaults then kept, in alternating child
processes. A child builds the cell as ``bench_formats`` does (one thread), warms it up (compiles),
then times ``--steps`` steps on the process CPU clock and counts the minor page faults they took
(``getrusage``). Medians over rounds.

    python scripts/host_memory_bench.py --out docs/benchmarks --name cpu-2026-11-26-host-memory
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mptrain.bench.common import cpu_header, cpu_script_stamp, load_averages, write_report
from mptrain.memory import keep_freed_host_memory

HERE = Path(__file__).resolve().parent


def child(model: str, mode: str, keep: bool, steps: int, warmup: int) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    import bench_formats as bf

    from mptrain.numerics import rounding_rng

    torch.set_num_threads(1)
    rounding_rng.seed_rounding(0)
    host = keep_freed_host_memory() if keep else "glibc defaults"
    _, batch, shape, classes = bf.MODELS[model]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g)
    cell = bf.build(model, mode)
    assert not isinstance(cell, str), cell
    for _ in range(warmup):
        bf.step(cell, x, y)
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        t0 = time.process_time()
        bf.step(cell, x, y)
        times.append(time.process_time() - t0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return {"host_memory": host, "step_ms": 1e3 * statistics.median(times), "faults_per_step": faults / steps}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50/8")
    ap.add_argument("--modes", default="fp32,mxfp8,nvfp4,fp8 hybrid")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default="cpu-host-memory")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "KEEP"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        mode, keep = args.child
        print(json.dumps(child(args.model, mode, keep == "1", args.steps, args.warmup)))
        return
    info = cpu_script_stamp("host_memory_bench.py", argv)  # each mode's steps run in a child of their own
    modes = args.modes.split(",")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {m: {"defaults": [], "kept": []} for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            for setting in ("defaults", "kept"):
                cmd = [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps), "--warmup",
                       str(args.warmup), "--child", mode, "1" if setting == "kept" else "0"]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ).stdout
                got = json.loads(out.strip().splitlines()[-1])
                assert setting == "defaults" or got["host_memory"] == "kept", got
                runs[mode][setting].append(got)
                print(f"round {r} {mode} {setting}: {got['step_ms']:.1f} ms, {got['faults_per_step']:.0f} faults/step",
                      flush=True)
    rows = []
    for mode in modes:
        row: dict[str, Any] = {"mode": mode}
        for setting, got in runs[mode].items():
            row[f"step_ms_{setting}"] = round(statistics.median(g["step_ms"] for g in got), 2)
            row[f"faults_per_step_{setting}"] = round(statistics.median(g["faults_per_step"] for g in got), 1)
        row["kept_vs_defaults"] = round(row["step_ms_kept"] / row["step_ms_defaults"], 3)
        rows.append(row)
    fp32 = next((r for r in rows if r["mode"] == "fp32"), None)
    if fp32:
        for row in rows:
            row["vs_fp32_defaults"] = round(row["step_ms_defaults"] / fp32["step_ms_defaults"], 3)
            row["vs_fp32_kept"] = round(row["step_ms_kept"] / fp32["step_ms_kept"], 3)
    result = {"info": info | {"load_average_end": load_averages()}, "model": args.model,
              "rounds": args.rounds, "steps": args.steps, "rows": rows, "runs": runs}
    write_report(args.out, args.name, result, markdown(result))
    print(markdown(result))


def markdown(r: dict[str, Any]) -> str:
    info = r["info"]
    lines = [
        *cpu_header(info, f"Host memory kept between steps: {r['model']}, glibc defaults against kept",
                    f"- method: see the script's docstring; {r['rounds']} rounds of alternating processes, "
                    f"{r['steps']} timed steps each, medians"),
        "| mode | step ms, defaults | step ms, kept | kept / defaults | faults per step, defaults | "
        "faults per step, kept | vs fp32, defaults | vs fp32, kept |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['mode']} | {row['step_ms_defaults']:.1f} | {row['step_ms_kept']:.1f} | "
            f"{row['kept_vs_defaults']:.2f} | {row['faults_per_step_defaults']:.0f} | "
            f"{row['faults_per_step_kept']:.0f} | {row.get('vs_fp32_defaults', math.nan):.2f}x | "
            f"{row.get('vs_fp32_kept', math.nan):.2f}x |")
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    main()

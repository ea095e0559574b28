"""Run one ``bench_formats`` cell's training step in a loop, for a sampling profiler to look at.

The benchmark says how much slower an emulated step is; this says where the time goes, without
instrumenting anything: run it under ``perf`` (or py-spy), which sample the process from outside.
It builds the cell exactly as ``scripts/bench_formats.py`` does, warms up (the compiles), prints
``ready``, then steps for ``--seconds`` on one thread and prints the mean step time.

    perf record -D 15000 -o mxfp8.data python scripts/profile_step.py resnet50/8 mxfp8 --seconds 20
    perf report -i mxfp8.data --no-children --sort dso

(``-D``: start sampling after the warm-up; docs/benchmarks/cpu-2026-11-26-resnet50-8-perf.txt.)
"""

from __future__ import annotations

import argparse
import time

import bench_formats as bf  # the script beside this one (its directory leads sys.path)
import torch

from mptrain.numerics import rounding_rng


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(bf.MODELS))
    ap.add_argument("mode", help="a bench_formats mode: " + ", ".join(bf.MPTRAIN))
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rounding_rng.seed_rounding(0)  # stochastic rounding draws from the run's stream, as in bench_formats
    _, batch, shape, classes = bf.MODELS[args.model]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g)
    cell = bf.build(args.model, args.mode)
    if isinstance(cell, str):
        raise SystemExit(f"{args.model} / {args.mode}: {cell}")
    for _ in range(args.warmup):
        bf.step(cell, x, y)
    print("ready", flush=True)
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < args.seconds:
        bf.step(cell, x, y)
        steps += 1
    print(f"{args.model} {args.mode}: {steps} steps, {(time.perf_counter() - start) / steps * 1e3:.1f} ms a step")


if __name__ == "__main__":
    main()

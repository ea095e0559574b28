#!/usr/bin/env python
"""Cheap pilots before the study (issue 18): a recipe's FP32 seed spread, and each run kind's cost.

    python scripts/study_pilot.py spread alexnet 0 1 2 3 4   # the study's own fp32 runs (stamped, cached)
    python scripts/study_pilot.py timing                     # 60 steps of each kind: seconds per step

``spread`` runs the very specs of the parity part into ``runs/study/pilot`` (the study's
``runs/study/full`` is not touched) and prints each seed's metric, then mean and std. ``timing``
runs each kind of run for 60 steps (41 for the LM) and prints seconds per step from the median
throughput, plus the run's start-up and evaluation time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from study_parts import RECIPES, spec  # noqa: E402
from study_runs import read_json, run_one  # noqa: E402

PILOT = ROOT / "runs" / "study" / "pilot"
KINDS = [
    *(("alexnet", c) for c in ("fp32", "amp_fp16", "fp16_master", "amp_bf16", "fp8", "fp16_adaptive")),
    *(("resnet50", c) for c in ("fp32", "amp_fp16", "fp16_master", "amp_bf16")),
    *(("lstm_lm", c) for c in ("fp32", "amp_fp16", "amp_bf16")),
    ("lstm_lm_4ep", "fp16_master"),
]


def spread(model: str, seeds: list[int]) -> None:
    metric = RECIPES[model].metric
    vals = []
    for seed in seeds:
        s = spec("parity", model, "fp32", seed, quick=False)
        run_one(s, PILOT)
        summary = read_json(PILOT / s.name / "summary.json") or {}
        v = (summary.get("metrics") or {}).get(metric)
        vals.append(v)
        print(f"{s.name}: {metric} {v}", flush=True)
    ok = [v for v in vals if v is not None]
    if len(ok) > 1:
        print(f"{model} fp32 {metric}: {statistics.fmean(ok):.2f} ± {statistics.stdev(ok):.2f} over {len(ok)} seeds")


def timing() -> None:
    out = PILOT / "timing"
    out.mkdir(parents=True, exist_ok=True)
    for model, cell in KINDS:
        s = spec("timing", model, cell, 0, quick=False)
        steps = 41 if model.startswith("lstm") else 60
        drop = ("trainer.max_steps", "trainer.eval_every", "trainer.log_every")
        ov = [o for o in s.overrides if not o.startswith(drop)]
        ov += [f"trainer.max_steps={steps}", f"trainer.eval_every={steps}", "trainer.log_every=10"]
        d = out / f"{model}-{cell}"
        t0 = time.time()
        with open(f"{d}.log", "w") as log:
            subprocess.call([sys.executable, "-m", "mptrain", *ov, f"hydra.run.dir={d}"], cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"),
                            stdout=log, stderr=subprocess.STDOUT)
        wall = time.time() - t0
        summary = read_json(d / "summary.json") or {}
        per_step = summary.get("batch_size", 0) * (35 if model.startswith("lstm") else 1)  # LM: tokens
        step_s = per_step / summary["throughput"] if summary.get("throughput") else None
        overhead = None if step_s is None else wall - steps * step_s
        print(json.dumps({"model": model, "cell": cell, "status": summary.get("status"), "wall_s": round(wall, 1),
                          "step_s": step_s and round(step_s, 4), "overhead_s": overhead and round(overhead, 1)}),
              flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("spread")
    sp.add_argument("model", choices=list(RECIPES))
    sp.add_argument("seeds", type=int, nargs="+")
    sub.add_parser("timing")
    args = ap.parse_args()
    if args.cmd == "spread":
        spread(args.model, args.seeds)
    else:
        timing()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What an emulated run's start costs in compiling: one job run as fresh processes, first with an empty
inductor cache (cold: every kernel built) and then ``--warm`` times on the cache that left (warm: the
kernels loaded, as a user's second run finds them). Each run's wall time from launch to exit and the
compile time its ``summary.json`` reports (torch.compile's own count, kept out of throughput).

The job is the tiny transformer LM in NVFP4 with its whole recipe, four steps (the engine test's),
unless overrides are given. ``mptrain`` is whichever the child processes import: a worktree of
another commit on ``PYTHONPATH`` measures that commit (its ``git describe`` is recorded).

    python scripts/compile_start.py --out docs/benchmarks --name cpu-2026-11-29-avx512-compile-start
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from mptrain.bench.common import write_report

JOB = ["model=transformer_lm_tiny", "data.vocab_size=50", "data.train_tokens=4000", "data.val_tokens=800",
       "data.batch_size=4", "data.bptt=16", "data.max_val_batches=4", "precision=mx", "precision.format=nvfp4",
       "trainer.max_steps=4", "trainer.log_every=1", "trainer.precision_plan=false"]  # fmt: skip


def run_once(cache: Path, overrides: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="mptrain-start-") as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "MPTRAIN_RUNS": tmp}
        env.pop("MPTRAIN_FUSED", None)  # the fused quantizers, as a user runs them
        start = time.perf_counter()
        # cwd: not a source tree, whose mptrain ``-m`` would import before PYTHONPATH's
        proc = subprocess.run([sys.executable, "-m", "mptrain", *overrides, f"hydra.run.dir={tmp}/run"],
                              capture_output=True, text=True, env=env, cwd=tmp)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"the job failed:\n{proc.stderr[-2000:]}")
        s = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    if s.get("quantizers") != "fused":
        raise SystemExit(f"the job ran {s.get('quantizers')!r}, not the fused quantizers")
    return {"wall_s": round(wall, 2), "compile_time_s": round(float(s["compile_time_s"]), 2)}


def mptrain_commit() -> str:
    """The commit of the mptrain the children import (a worktree on PYTHONPATH, or this tree), "-dirty"
    where the package differs from it (changes elsewhere in the tree, as to the tests, are not what ran)."""
    where = subprocess.run([sys.executable, "-c", "import mptrain, os; print(os.path.dirname(mptrain.__file__))"],
                           capture_output=True, text=True, env=os.environ, cwd=tempfile.gettempdir()).stdout.strip()
    git = ["git", "-C", where]
    commit = subprocess.run([*git, "describe", "--always"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--porcelain", "--", "."], capture_output=True, text=True).stdout.strip()
    return (commit or "unknown") + ("-dirty" if changed else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warm", type=int, default=3, help="warm runs after the cold one")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--name", default=None)
    p.add_argument("overrides", nargs="*", help="the job's overrides (default: the NVFP4 transformer LM above)")
    a = p.parse_args()
    overrides = a.overrides or JOB
    with tempfile.TemporaryDirectory(prefix="mptrain-inductor-") as cache:
        runs = [{"cache": "cold", **run_once(Path(cache), overrides)}]
        runs += [{"cache": "warm", **run_once(Path(cache), overrides)} for _ in range(a.warm)]
    result = {
        "meta": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                 "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "versions": {"torch": torch.__version__, "python": platform.python_version()},
                 "mptrain": mptrain_commit(),
                 "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "command": " ".join(["python scripts/compile_start.py", *sys.argv[1:]]),
                 "job": "mptrain " + " ".join(overrides)},
        "runs": runs,
    }
    rows = ["| run | cache | wall s | compile s |", "|---|---|---|---|"]
    rows += [f"| {i} | {r['cache']} | {r['wall_s']:.1f} | {r['compile_time_s']:.1f} |" for i, r in enumerate(runs)]
    m = result["meta"]
    md = "\n".join([f"# An emulated run's start, cold and warm ({m['date']})", "",
                    f"`{m['job']}` as fresh processes on {m['cpu']} ({m['cores']} cores, torch CPU capability "
                    f"{m['torch_cpu_capability']}), torch {m['versions']['torch']}, mptrain {m['mptrain']}.", "",
                    *rows, "", f"Command: `{m['command']}`", ""])
    print(md)
    if a.out:
        write_report(a.out, a.name or f"cpu-{datetime.now(timezone.utc):%Y-%m-%d}-compile-start", result, md)


if __name__ == "__main__":
    main()

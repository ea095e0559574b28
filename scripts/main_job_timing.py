"""Time README's main job, ``mptrain model=resnet50 precision=mixed``, end to end on this CPU.

Two paths, each run ``--repeats`` times as a fresh process (wall time from launch to exit):

- ``native``: the machine as it is (bf16 autocast where the CPU has AVX512-BF16/AMX, else fp32);
- ``avx2``: ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``, so oneDNN and ATen use AVX2
  kernels only and mptrain sees no native bf16: what a user on an AVX2-only CPU gets.

On a CPU without native bf16 both paths are the same one. Writes JSON and markdown, stamped with
the CPU, versions, date and command:

    python scripts/main_job_timing.py --out docs/benchmarks
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

PATHS = {"native": {}, "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}


def run_once(extra_env: dict[str, str], args: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="mptrain-mainjob-") as tmp:
        env = {**os.environ, **extra_env, "MPTRAIN_RUNS": tmp}
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "mptrain", "model=resnet50", "precision=mixed", *args,
                               f"hydra.run.dir={tmp}/run"], capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"main job failed:\n{proc.stderr[-2000:]}")
        s = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    return {"wall_s": round(wall, 2), "train_wall_s": round(s["wall_time_s"], 2),
            "precision_resolved": s["precision_resolved"], "device_capability": s["device_capability"],
            "image_size": s["image_size"], "steps": s["steps"], "final_loss": s["final_loss"],
            "val_top1": s["metrics"].get("top1"), "throughput": s["throughput"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--name", default=None)
    p.add_argument("overrides", nargs="*", help="extra mptrain overrides")
    a = p.parse_args()
    runs = {path: [run_once(env, a.overrides) for _ in range(a.repeats)] for path, env in PATHS.items()}
    result = {
        "meta": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                 "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "versions": {"torch": torch.__version__, "python": platform.python_version()},
                 "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "command": " ".join(["python scripts/main_job_timing.py", *sys.argv[1:]]),
                 "job": "mptrain model=resnet50 precision=mixed " + " ".join(a.overrides)},
        "runs": runs,
    }
    rows = ["| path | resolved | native bf16 | image | wall s (each run) | val top-1 | final loss | samples/s |",
            "|---|---|---|---|---|---|---|---|"]
    for path, rs in runs.items():
        r = rs[0]
        walls = ", ".join(f"{x['wall_s']:.1f}" for x in rs)
        top1 = ", ".join(f"{x['val_top1']:.1f}" for x in rs)
        rows.append(f"| {path} | {r['precision_resolved']} | {r['device_capability']['native_bf16']} | "
                    f"{r['image_size']} px | {walls} | {top1} | {r['final_loss']:.3f} | {r['throughput']:.0f} |")
    md = "\n".join([f"# Main job timing ({result['meta']['date']})", "",
                    f"`{result['meta']['job']}` on {result['meta']['cpu']} ({result['meta']['cores']} cores, torch "
                    f"CPU capability {result['meta']['torch_cpu_capability']}), torch {torch.__version__}.", "",
                    *rows, "", f"Command: `{result['meta']['command']}`", ""])
    print(md)
    if a.out:
        stem = a.name or f"cpu-{datetime.now(timezone.utc):%Y-%m-%d}-main-job"
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        (a.out / f"{stem}.md").write_text(md)


if __name__ == "__main__":
    main()

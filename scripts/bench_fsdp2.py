"""DDP against FSDP2 on ``transformer_lm``: each rank's parameter, gradient and optimizer-state bytes
(summary.json's ``parallel.state_bytes``) and the step time, side by side in one run of this script.

Each layout is one ``torchrun --nproc_per_node=N -m mptrain`` job (gloo on CPU, NCCL on CUDA), run in
turn with the same config; the figures are read from the jobs' summary.json. Step time = global
tokens per step / median throughput over the logging windows after the first (warm-up) one.
Writes JSON and markdown, stamped with the device, versions, date, command and load:

    python scripts/bench_fsdp2.py --out docs/benchmarks            # 2 CPU ranks
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from mptrain.bench.common import stamp

LAYOUTS = ("ddp", "fsdp2")


def run(layout: str, args: argparse.Namespace, where: Path) -> dict:
    run_dir = where / layout
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
           "-m", "mptrain", "model=transformer_lm", f"parallel={layout}", f"precision={args.precision}",
           f"data.batch_size={args.batch_size}", f"data.bptt={args.bptt}", f"trainer.max_steps={args.steps}",
           f"trainer.log_every={args.log_every}", f"trainer.device={args.device}", "trainer.precision_plan=false",
           "data.val_tokens=2000", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{layout} failed:\n{proc.stderr[-3000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    tokens = args.batch_size * args.bptt * args.ranks
    return {"layout": layout, "command": shlex.join(cmd[2:]), "state_bytes": s["parallel"]["state_bytes"],
            "mixed_precision": s["parallel"].get("mixed_precision"), "units": s["parallel"].get("units"),
            "throughput_tokens_per_s": s["throughput"], "step_time_s": tokens / s["throughput"],
            "final_loss": s["final_loss"], "parameters": s["task"]["parameters"], "wall_time_s": s["wall_time_s"]}


def markdown(result: dict) -> str:
    info = result["stamp"]
    lines = [f"# DDP vs FSDP2: {info['device_name']}", "",
             f"- device: {info['device']} ({info['device_name']}), {result['ranks']} ranks, "
             f"{result['threads']} thread(s) per rank",
             f"- versions: torch {info['versions']['torch']}, mptrain {info['versions']['mptrain']}",
             f"- date: {info['date']}; load average (1/5/15 min) at start "
             f"{' / '.join(map(str, info['load_average_start']))}, at end {' / '.join(map(str, result['load_end']))}",
             f"- command: `{info['command']}`",
             f"- model: transformer_lm ({result['runs'][0]['parameters']:,} parameters), "
             f"precision={result['precision']}, AdamW, batch {result['batch_size']} x {result['bptt']} tokens "
             f"per rank, {result['steps']} steps",
             "- method: one torchrun job per layout, same config; bytes from summary.json's parallel.state_bytes "
             "(after the last step); step time = global tokens per step / median throughput of the logging "
             "windows after the first", "",
             "| layout | rank | params MiB | grads MiB | optimizer MiB | total MiB | vs DDP | step s | final loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    ddp_total = {r["rank"]: r["total_bytes"] for r in result["runs"][0]["state_bytes"]}
    for r in result["runs"]:
        for b in r["state_bytes"]:
            mib = [b[k] / 2**20 for k in ("param_bytes", "grad_bytes", "optim_bytes", "total_bytes")]
            lines.append(f"| {r['layout']} | {b['rank']} | " + " | ".join(f"{v:.2f}" for v in mib)
                         + f" | {b['total_bytes'] / ddp_total[b['rank']]:.3f} | {r['step_time_s']:.3f} "
                         f"| {r['final_loss']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--bptt", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--log-every", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--name", default=None)
    args = p.parse_args()
    info = stamp(torch.device(args.device), sys.argv[1:], args.threads)
    info["command"] = shlex.join(["python", "scripts/bench_fsdp2.py", *sys.argv[1:]])
    with tempfile.TemporaryDirectory(prefix="mptrain-fsdp2-bench-") as tmp:
        runs = [run(layout, args, Path(tmp)) for layout in LAYOUTS]
    result = {"stamp": info, "ranks": args.ranks, "threads": args.threads, "precision": args.precision,
              "batch_size": args.batch_size, "bptt": args.bptt, "steps": args.steps, "runs": runs,
              "load_end": [round(v, 2) for v in os.getloadavg()]}
    text = markdown(result)
    print(text)
    if args.out is not None:
        name = args.name or f"{args.device}-{info['date'][:10]}-fsdp2"
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / f"{name}.md").write_text(text)


if __name__ == "__main__":
    main()

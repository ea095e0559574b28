"""The adaptive loss-scaling rule's cost, before and after its statistics were fused, side by side.

Before, ``layer_scale`` took an FP32 copy of every activation gradient, then ``std_mean`` and
``aminmax`` over the copy; now it reads the gradient twice in its own dtype (an FP32-accumulated
2-norm and ``aminmax``), with the same result (tests/test_adaptive_scaling.py checks it against
the version kept here as ``layer_scale_before``). Two measurements, alternated so that load drifts
hit both alike, on the process's CPU time (other jobs share this machine):

- ``rule``: ``layer_scale`` alone on ResNet-50-like activation gradients, FP16, bf16 and FP32;
- ``step``: the engine's whole training step (ResNet-50, fp32 compute, loss_scale=adaptive) with
  either rule, and with loss_scale=none for the adaptive policy's total overhead.

    python scripts/bench_adaptive.py --out docs/benchmarks --name cpu-2026-11-25-adaptive-rule
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mptrain.numerics import adaptive_scaling
from mptrain.numerics.adaptive_rule import _erfinv_term, layer_scale


def layer_scale_before(gy: Tensor, weight: Tensor, prev_scale: Tensor | float, fan_in: int, *,
                       u_min: float = 2.0**-24, u_max: float = 65504.0, n_uf: float = 1e-3, layer_cap: float = 16.0,
                       accum_cap: float = 1024.0, power_of_two: bool = True) -> Tensor:
    """``layer_scale`` as it was: an FP32 copy of gy, std_mean and aminmax over it."""
    g, w = gy.detach().float(), weight.detach().float()
    sg, mg = torch.std_mean(g, correction=0)
    sw, mw = torch.std_mean(w, correction=0)
    sigma = torch.sqrt((sg * sg + mg * mg) * (sw * sw + mw * mw)) * math.sqrt(0.5 * fan_in)
    one = torch.ones_like(sigma)
    s = torch.where(sigma > 0, u_min / (_erfinv_term(n_uf) * sigma), one).clamp(min=1.0)
    gmin, gmax = torch.aminmax(g)
    wmin, wmax = torch.aminmax(w)
    o_max = torch.stack([gmax * wmax, gmin * wmin, gmax * wmin, gmin * wmax]).abs().max()
    s = torch.minimum(s, (u_max / fan_in) / o_max)
    s = torch.minimum(s, accum_cap / torch.as_tensor(prev_scale, dtype=s.dtype, device=s.device))
    s = s.clamp(max=layer_cap)
    s = torch.where(torch.isfinite(s) & (s > 0), s, one)
    return torch.exp2(torch.floor(torch.log2(s))) if power_of_two else s


RULES = {"before": layer_scale_before, "now": layer_scale}
# (batch, channels, h, w) of ResNet-50 stage outputs at 224 px, and the 3x3 conv weight that reads them.
SHAPES = [((16, 256, 56, 56), (64, 256, 1, 1)), ((16, 512, 28, 28), (128, 512, 1, 1)),
          ((16, 2048, 7, 7), (512, 2048, 1, 1))]


def _cpu_ms(fn: Any, reps: int) -> float:
    start = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - start) / reps * 1e3


def bench_rule(rounds: int, reps: int) -> list[dict[str, Any]]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for gshape, wshape in SHAPES:
        g32 = torch.randn(gshape, generator=gen) * 1e-4
        w32 = torch.randn(wshape, generator=gen) * 0.05
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            g, w = g32.to(dtype), w32.to(dtype)
            fan_in = wshape[0]
            same = layer_scale(g, w, 1.0, fan_in).item() == layer_scale_before(g, w, 1.0, fan_in).item()
            times: dict[str, list[float]] = {k: [] for k in RULES}
            for _ in range(rounds):  # alternated
                for name, rule in RULES.items():
                    times[name].append(_cpu_ms(functools.partial(rule, g, w, 1.0, fan_in), reps))
            before, now = statistics.median(times["before"]), statistics.median(times["now"])
            rows.append({"grad_shape": list(gshape), "dtype": str(dtype).removeprefix("torch."),
                         "before_ms": round(before, 3), "now_ms": round(now, 3), "speedup": round(before / now, 2),
                         "same_scale": same, "before_windows_ms": times["before"], "now_windows_ms": times["now"]})
            print(f"rule {gshape} {dtype}: before {before:.2f} ms, now {now:.2f} ms ({before / now:.1f}x)", flush=True)
    return rows


def _engine(overrides: list[str], run_dir: Path) -> Any:
    from mptrain.cli import compose
    from mptrain.config import register_configs, validate
    from mptrain.engine import Engine

    register_configs()
    cfg = compose([*overrides, "trainer.device=cpu"])
    validate(cfg)
    return Engine(cfg, run_dir)


def bench_step(overrides: list[str], windows: int, steps: int, warmup: int) -> dict[str, Any]:
    from mptrain.bench.runners import EngineRunner

    variants = {"none": ["loss_scale=none"], "adaptive_before": ["loss_scale=adaptive"],
                "adaptive_now": ["loss_scale=adaptive"]}
    with tempfile.TemporaryDirectory(prefix="mptrain-bench-adaptive-") as tmp:
        runners, batches = {}, {}
        for name, extra in variants.items():
            engine = _engine([*overrides, *extra], Path(tmp) / name)
            runners[name] = EngineRunner(engine)
            runners[name].train()
            batches[name] = [next(engine.task.train_batches(0))]
        times: dict[str, list[float]] = {k: [] for k in variants}
        original = adaptive_scaling.layer_scale

        def run(name: str, n: int) -> float:
            adaptive_scaling.layer_scale = layer_scale_before if name == "adaptive_before" else original
            try:
                start = time.process_time()
                for _ in range(n):
                    runners[name].step(batches[name])
                return (time.process_time() - start) / n * 1e3
            finally:
                adaptive_scaling.layer_scale = original

        for name in variants:
            run(name, warmup)
        for _ in range(windows):
            for name in variants:
                times[name].append(run(name, steps))
                runners[name].drop_rows()
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"step {k}: {v:.1f} ms", flush=True)
    return {"overrides": overrides, "windows": windows, "steps_per_window": steps, "warmup_steps": warmup,
            "step_ms": {k: round(v, 2) for k, v in med.items()}, "windows_ms": times,
            "adaptive_overhead_before": round(med["adaptive_before"] / med["none"], 3),
            "adaptive_overhead_now": round(med["adaptive_now"] / med["none"], 3),
            "step_speedup": round(med["adaptive_before"] / med["adaptive_now"], 3)}


def markdown(result: dict[str, Any]) -> str:
    m = result["meta"]
    lines = [f"# Adaptive loss scaling: the rule's statistics, before and after fusing ({m['date']})", "",
             f"CPU: {m['cpu']} ({m['cores']} cores, torch capability {m['cpu_capability']}), "
             f"{m['threads']} thread, load average {m['load_before']} before and {m['load_after']} after; "
             f"torch {m['torch']}, Python {m['python']}; process CPU time.", "",
             f"Command: `{m['command']}`", "",
             "## `layer_scale` on one activation gradient (median ms per call over alternated rounds)", "",
             "| gradient | dtype | before (FP32 copy, std_mean, aminmax) | now (2-norm, aminmax) | speedup "
             "| same scale |",
             "|---|---|---|---|---|---|"]
    for r in result["rule"]:
        lines.append(f"| {'x'.join(map(str, r['grad_shape']))} | {r['dtype']} | {r['before_ms']:.2f} | "
                     f"{r['now_ms']:.2f} | {r['speedup']:.1f}x | {'yes' if r['same_scale'] else 'NO'} |")
    s = result["step"]
    lines += ["", f"## The engine's training step ({' '.join(s['overrides'])})", "",
              f"Median of {s['windows']} alternated windows of {s['steps_per_window']} steps, after "
              f"{s['warmup_steps']} warm-up steps each.", "",
              "| loss_scale | ms per step | vs none |", "|---|---|---|"]
    for k, label in (("none", "none"), ("adaptive_before", "adaptive, rule before"),
                     ("adaptive_now", "adaptive, rule now")):
        lines.append(f"| {label} | {s['step_ms'][k]:.1f} | {s['step_ms'][k] / s['step_ms']['none']:.3f} |")
    lines += ["", f"The whole step with the fused rule: {s['step_speedup']:.3f}x as fast as with the old one.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--windows", type=int, default=7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--step-overrides", default="model=resnet50 model.width_divisor=4 data.image_size=64 "
                   "data.batch_size=16 precision=fp32 optim.impl=foreach")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--name", default="adaptive-rule")
    a = p.parse_args()
    torch.set_num_threads(1)
    load_before = round(os.getloadavg()[0], 2)
    rule = bench_rule(a.rounds, a.reps)
    step = bench_step(shlex.split(a.step_overrides), a.windows, a.steps, a.warmup)
    result = {"meta": {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "cpu": _cpu_name(),
                       "cores": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                       "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "python": platform.python_version(), "load_before": load_before,
                       "load_after": round(os.getloadavg()[0], 2), "clock": "process CPU time",
                       "command": shlex.join(["python", "scripts/bench_adaptive.py", *sys.argv[1:]])},
              "rule": rule, "step": step}
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"{a.name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (a.out / f"{a.name}.md").write_text(markdown(result))
    print(markdown(result))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()

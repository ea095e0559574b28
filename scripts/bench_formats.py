"""CPU cost of emulating the formats, side by side in one process: FP32 against emulated FP8
(hybrid: E4M3 forward, E5M2 backward; per-tensor and row-wise scaling) and emulated MX / NVFP4.

One training step = forward, cross-entropy, backward, SGD step and the precision's after_step, with
each mode built through ``mptrain.numerics.precision.build_precision`` and ``prepare_model`` from the
configs' defaults (the recipe defaults of each format: NVFP4 with stochastic rounding, Hadamard,
16x16 weight tiles and its last 15% of GEMM layers high). Modes run in interleaved rounds
(fp32, fp8..., mx..., fp32, ...) so that a shared machine's drift hits all of them alike; the
median step time is reported, on the process CPU clock (1 thread) and the wall clock.

    python scripts/bench_formats.py --out docs/benchmarks --name cpu-2026-11-24-formats
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from mptrain.bench.common import stamp
from mptrain.config import ClassifierModelConfig, FP8PrecisionConfig, MXPrecisionConfig, PrecisionConfig
from mptrain.hardware import device_capability
from mptrain.models import create_model
from mptrain.numerics.precision import build_precision

MODES: dict[str, Any] = {
    "fp32": PrecisionConfig(name="fp32"),
    "fp8 hybrid tensor": FP8PrecisionConfig(name="fp8", format="hybrid", scaling="tensor"),
    "fp8 hybrid rowwise": FP8PrecisionConfig(name="fp8", format="hybrid", scaling="rowwise"),
    "mxfp8": MXPrecisionConfig(name="mx", format="mxfp8"),
    "mxfp6": MXPrecisionConfig(name="mx", format="mxfp6"),
    "mxfp4": MXPrecisionConfig(name="mx", format="mxfp4"),
    "nvfp4": MXPrecisionConfig(name="mx", format="nvfp4"),
}


def mlp() -> nn.Module:
    """Linear-heavy: 3x32x32 -> 1024 -> 1024 -> 1024 -> 100, every reduction dim a multiple of 32."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(3072, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 100),
    )  # fmt: skip


def resnet50_8() -> nn.Module:
    """torchvision's ResNet-50 at 1/8 width (the tests' tiny model), 100 classes."""
    return create_model(OmegaConf.structured(ClassifierModelConfig(name="resnet50", width_divisor=8)), 100)


MODELS = {"mlp": (mlp, 128), "resnet50/8": (resnet50_8, 32)}


def build(model_name: str, mode: str) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    make, _ = MODELS[model_name]
    precision = build_precision(OmegaConf.structured(MODES[mode]), torch.device("cpu"))
    model = precision.prepare_model(make())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, opt, precision


def step(model: nn.Module, opt: torch.optim.Optimizer, precision: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    precision.after_step()
    return loss.item()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,resnet50/8")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default="cpu-formats")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models, modes = args.models.split(","), args.modes.split(",")
    info = stamp(torch.device("cpu"), sys.argv[1:] if argv is None else argv, args.threads)
    info["command"] = "python scripts/bench_formats.py " + " ".join(sys.argv[1:] if argv is None else argv)
    info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    cap = device_capability(torch.device("cpu"))
    info["native_bf16"] = cap.native_bf16
    info["capability_detail"] = cap.detail

    rows = []
    for model_name in models:
        _, batch = MODELS[model_name]
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 100, (batch,), generator=g)
        runs = {m: build(model_name, m) for m in modes}
        quantized = {}
        for m, (model, opt, precision) in runs.items():
            state = precision.mx_state or precision.fp8_state
            quantized[m] = None if state is None else sum(d.format != "high" for d in state.decisions)
            for _ in range(args.warmup):
                step(model, opt, precision, x, y)
        cpu: dict[str, list[float]] = {m: [] for m in modes}
        wall: dict[str, list[float]] = {m: [] for m in modes}
        losses: dict[str, float] = {}
        for _ in range(args.rounds):
            for m in modes:
                for _ in range(args.steps):
                    c0, w0 = time.process_time(), time.perf_counter()
                    losses[m] = step(*runs[m], x, y)
                    cpu[m].append(time.process_time() - c0)
                    wall[m].append(time.perf_counter() - w0)
        base_cpu, base_wall = statistics.median(cpu["fp32"]), statistics.median(wall["fp32"])
        for m in modes:
            c, w = statistics.median(cpu[m]), statistics.median(wall[m])
            rows.append({
                "model": model_name, "batch": batch, "mode": m, "quantized_layers": quantized[m],
                "step_ms_cpu": round(1e3 * c, 2), "step_ms_wall": round(1e3 * w, 2),
                "vs_fp32_cpu": round(c / base_cpu, 2), "vs_fp32_wall": round(w / base_wall, 2),
                "spread_cpu": round((max(cpu[m]) - min(cpu[m])) / c, 3), "last_loss": round(losses[m], 4),
            })  # fmt: skip
            print(f"{model_name:11s} {m:20s} {1e3 * c:8.1f} ms cpu  x{c / base_cpu:5.2f}  {1e3 * w:8.1f} ms wall")
    info["load_average_end"] = [round(v, 2) for v in __import__("os").getloadavg()]
    info["method"] = (
        "per mode: a fresh model from seed 0 through build_precision/prepare_model (config defaults), SGD momentum "
        f"0.9; {args.warmup} warm-up steps, then {args.rounds} interleaved rounds of {args.steps} steps; median "
        "step time on the process CPU clock and the wall clock; spread = (max-min)/median of the CPU step times"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"info": info, "rows": rows}, indent=2) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(info, rows))
    print(f"wrote {args.out / args.name}.json and .md")


def markdown(info: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    v = info["versions"]
    load = " / ".join(map(str, info["load_average_start"])), " / ".join(map(str, info["load_average_end"]))
    lines = [
        "# Emulated formats on CPU: step time against FP32",
        "",
        f"- device: {info['device_name']}, torch CPU capability `{info['cpu_capability']}`, native bf16 "
        f"(AVX512-BF16/AMX): {'yes' if info['native_bf16'] else 'no'} ({info['capability_detail']})",
        f"- versions: torch {v.get('torch')}, Python {v.get('python')}",
        f"- date: {info['date']}; torch threads {info['torch_threads']} of {info['cpu_count']} CPUs; load average "
        f"at start {load[0]}, at end {load[1]}",
        f"- command: `{info['command']}`",
        f"- method: {info['method']}",
        "- modes: fp8 = `precision=fp8 precision.format=hybrid` with `scaling=tensor` or `rowwise` (FP16 master "
        "rounding and stochastic rounding: the config defaults); mx formats = `precision=mx precision.format=...` with "
        "the format's recipe defaults. Everything is emulated in FP32: the ratio is the emulation's cost, not a "
        "speed-up any hardware would show.",
        "",
        "| model | batch | mode | quantized GEMM layers | step ms (CPU) | vs fp32 | step ms (wall) | vs fp32 (wall) "
        "| spread | loss after run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        q = "-" if r["quantized_layers"] is None else r["quantized_layers"]
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['mode']} | {q} | {r['step_ms_cpu']:.1f} | {r['vs_fp32_cpu']:.2f}x | "
            f"{r['step_ms_wall']:.1f} | {r['vs_fp32_wall']:.2f}x | {100 * r['spread_cpu']:.0f}% | {r['last_loss']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""CPU cost of emulating the formats, side by side in one process, against FP32 and against torchao.

One training step = forward, cross-entropy, backward, SGD step and the precision's after_step. The
mptrain modes are built through ``build_precision`` / ``prepare_model`` from the configs' defaults
(the recipe of each format: NVFP4 with stochastic rounding, the Hadamard transform, 16x16 weight
tiles and its last 15% of GEMM layers high; FP8 hybrid with FP16 master weights and stochastic
rounding), with the run's rounding stream seeded as the engine seeds it. torchao's emulated
equivalents (float8 ``emulate=True``, tensorwise and rowwise; MXFP8 with ``KernelPreference.EMULATED``)
run on the same model and batch, where they apply (nn.Linear). ``--reference`` adds mptrain's eager
reference quantizers (``mptrain.numerics.fused.reference``) for the issue's three modes.

Modes run in interleaved rounds (every mode once, then again) so that a shared machine's drift hits
all of them alike; the median step time is reported on the process CPU clock (one thread) and the
wall clock, and beside the ratio of medians, the median of each round's own ratio to FP32 (paired).
For the fused modes, the gap to FP32 is split into the quantizers (one step's quantizer calls
recorded, then replayed alone: ``quantizer_ms``) and the rest of the step.

    python scripts/bench_formats.py --out docs/benchmarks --name cpu-2026-11-25-fused-formats
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from mptrain.bench.common import stamp
from mptrain.config import ClassifierModelConfig, FP8PrecisionConfig, MXPrecisionConfig, PrecisionConfig
from mptrain.hardware import device_capability
from mptrain.memory import keep_freed_host_memory, preloaded_allocator
from mptrain.models import create_model
from mptrain.numerics import compiled_calls, fused, rounding_rng
from mptrain.numerics.precision import build_precision

MPTRAIN: dict[str, Any] = {
    "fp32": PrecisionConfig(name="fp32"),
    "fp8 hybrid": FP8PrecisionConfig(name="fp8", format="hybrid"),  # FP16 masters, SR: the defaults
    "fp8 hybrid tensor": FP8PrecisionConfig(name="fp8", format="hybrid", scaling="tensor"),
    "fp8 hybrid rowwise": FP8PrecisionConfig(name="fp8", format="hybrid", scaling="rowwise"),
    "mxfp8": MXPrecisionConfig(name="mx", format="mxfp8"),
    "mxfp6": MXPrecisionConfig(name="mx", format="mxfp6"),
    "mxfp4": MXPrecisionConfig(name="mx", format="mxfp4"),
    "nvfp4": MXPrecisionConfig(name="mx", format="nvfp4"),
}
# Not in the default set (--modes names them): what a CPU with native bf16 (AVX512-BF16, AMX) can
# do instead of FP32. "amp bf16" is precision=mixed there; the others multiply the quantized values
# in bf16 (precision.emulated_compute=bf16), which holds them exactly, so only the GEMM's kernel and
# its order of adds change (down to mx.bf16_exact_min_scale_exponent's block scale).
EXTRA: dict[str, Any] = {
    "amp bf16": PrecisionConfig(name="amp_bf16"),
    "mxfp8 bf16": MXPrecisionConfig(name="mx", format="mxfp8", emulated_compute="bf16"),
    "nvfp4 bf16": MXPrecisionConfig(name="mx", format="nvfp4", emulated_compute="bf16"),
    # ...and the layers NVFP4's recipe keeps high computed under a bf16 autocast, not in FP32
    "nvfp4 bf16 amp": MXPrecisionConfig(name="mx", format="nvfp4", emulated_compute="bf16", autocast="bf16"),
}
REFERENCE = ("fp8 hybrid", "mxfp8", "nvfp4")  # --reference: these again on the eager reference
# --modes "<mode> compiled": the model compiled whole as trainer.compile compiles it (the emulated
# layers traced into its graph, the quantizers' rounding options), the optimizer step eager as in a run.
COMPILED = " compiled"
TORCHAO = ("torchao float8 tensorwise", "torchao float8 rowwise", "torchao mxfp8")
# Which torchao mode each mptrain mode is held against (the "emulated equivalent").
EQUIVALENT = {"fp8 hybrid": TORCHAO[:2], "fp8 hybrid tensor": TORCHAO[:1], "fp8 hybrid rowwise": TORCHAO[1:2],
              "mxfp8": TORCHAO[2:]}
# The quantizer entry points of mptrain.numerics.fused (eager reference inside ``fused.reference``):
# every quantization an emulated step makes goes through one of them.
QUANTIZERS = ("quantize_blocks", "axiswise_round", "quantize_scaled", "round_to_element", "round_params_",
              "write_back_")


def mlp() -> nn.Module:
    """The issue's MLP: 4 x Linear(1024, 1024), ReLU between, on 1024 features (1024 classes)."""
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))  # fmt: skip


def resnet50_8() -> nn.Module:
    """torchvision's ResNet-50 at 1/8 width (the tests' tiny model), 100 classes, 32 px."""
    return create_model(OmegaConf.structured(ClassifierModelConfig(name="resnet50", width_divisor=8)), 100)


# name -> (model, batch, input shape, classes)
MODELS: dict[str, tuple[Callable[[], nn.Module], int, tuple[int, ...], int]] = {
    "mlp 4x1024 b128": (mlp, 128, (1024,), 1024),
    "mlp 4x1024 b1024": (mlp, 1024, (1024,), 1024),
    "resnet50/8": (resnet50_8, 32, (3, 32, 32), 100),
    # The same net at batch 2: its gap to FP32 is mostly work per call, not per element (Python,
    # dispatch, allocation, each kernel's fixed cost), against which batch 32's gap can be read.
    "resnet50/8 b2": (resnet50_8, 2, (3, 32, 32), 100),
}


@dataclasses.dataclass
class Mode:
    model: nn.Module
    opt: torch.optim.Optimizer
    after_step: Callable[[], None]
    context: Callable[[], Any]  # fused.reference for the eager-reference rows
    quantized: int | None


def build(model_name: str, mode: str) -> Mode | str:
    """A fresh model from seed 0 in ``mode``; a string says why the mode does not apply."""
    torch.manual_seed(0)
    make = MODELS[model_name][0]
    model = make()
    base = mode.removesuffix(" (eager reference)")
    context = fused.reference if base != mode else contextlib.nullcontext
    compiled = base.endswith(COMPILED)
    base = base.removesuffix(COMPILED)
    if base in MPTRAIN or base in EXTRA:
        precision = build_precision(OmegaConf.structured({**MPTRAIN, **EXTRA}[base]), torch.device("cpu"))
        if compiled and precision.fp8 is not None:
            return "trainer.compile refuses emulated FP8: its layers are graph breaks"
        model = precision.prepare_model(model, compiled=compiled)
        if compiled:
            # torch.compile(model), not model.compile(): dynamo skips the frames of torch's own modules
            # at the top (the MLP is an nn.Sequential), and would compile each layer on its own. Static
            # shapes: every mode's model runs Sequential.forward's code, and past its second compile
            # dynamo would make the formats' float constants symbolic (inductor 2.11 then failed).
            compiled_calls.pin_cpu_vector_isa()
            args = compiled_calls.model_compile_args("default", precision.emulated)
            model = torch.compile(model, dynamic=False, **args)  # type: ignore[assignment]
        if not mode.endswith(" (eager reference)"):  # the run's autocast region, where the mode has one
            context = precision.autocast
        state = precision.mx_state or precision.fp8_state
        quantized = None if state is None else sum(d.format != "high" for d in state.decisions)
        after = precision.after_step
    elif compiled:
        return "torchao's modes run eager here"
    else:
        if not isinstance(model[0] if isinstance(model, nn.Sequential) else None, nn.Linear):
            return "torchao converts nn.Linear only: not comparable on a convolutional net"
        try:
            model = torchao_convert(model, base)
        except Exception as exc:  # record why, keep benchmarking the rest
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        quantized = 4
        after = lambda: None  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return Mode(model, opt, after, context, quantized)


def torchao_convert(model: nn.Module, mode: str) -> nn.Module:
    if mode.startswith("torchao float8"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = mode.rsplit(" ", 1)[1]
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
        return convert_to_float8_training(model, config=config)
    from torchao.prototype.moe_training.config import KernelPreference, MXFP8TrainingOpConfig
    from torchao.quantization import quantize_

    # FP32 output: the same FP32 masters and FP32 products as mptrain's emulated_compute=fp32
    quantize_(model, MXFP8TrainingOpConfig(kernel_preference=KernelPreference.EMULATED, out_dtype=torch.float32))
    return model


def step(m: Mode, x: torch.Tensor, y: torch.Tensor) -> float:
    with m.context():
        m.opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(m.model(x), y)
        loss.backward()
        m.opt.step()
        m.after_step()
    return loss.item()


def graph_counts() -> dict[str, int]:
    """Graphs compiled so far for each fused kernel variant. A variant's dims are dynamic, so a second
    graph of one variant means dynamo compiled it again (a guard failed)."""
    return {k: len(backend.graphs) for k, (_, backend) in compiled_calls._kernels.items()}


def _copy(v: Any) -> Any:
    """A call's argument for replaying it: tensors cloned (in-place quantizers write into the clone),
    a rounding stream replaced by a fresh one (the run's own stream stays where it was)."""
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, list | tuple):
        return type(v)(_copy(u) for u in v)
    if isinstance(v, rounding_rng.RoundingStream):
        return rounding_rng.RoundingStream(0, v.device)
    return v


def quantizer_ms(m: Mode, x: torch.Tensor, y: torch.Tensor, repeats: int = 5) -> tuple[float, int]:
    """(CPU ms per step in the quantizers, calls per step): one step's quantizer calls are recorded
    (their arguments copied), then replayed ``repeats`` times on their own, with the same kernels.
    Timed this way rather than under torch.profiler, which slowed the compiled kernels of some modes
    several-fold in this script and so misplaced the gap."""
    calls: list[tuple[Callable[..., Any], Any, dict[str, Any]]] = []
    originals = {name: getattr(fused, name) for name in QUANTIZERS}

    def recorder(fn: Callable[..., Any]) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            calls.append((fn, _copy(args), {k: _copy(v) for k, v in kwargs.items()}))
            return fn(*args, **kwargs)

        return record

    for name, fn in originals.items():
        setattr(fused, name, recorder(fn))
    try:
        step(m, x, y)
    finally:
        for name, fn in originals.items():
            setattr(fused, name, fn)
    with m.context(), torch.no_grad():
        for fn, args, kwargs in calls:  # once untimed: any first-call cost stays out
            fn(*args, **kwargs)
        t0 = time.process_time()
        for _ in range(repeats):
            for fn, args, kwargs in calls:
                fn(*args, **kwargs)
        return (time.process_time() - t0) * 1e3 / repeats, len(calls)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--modes", default=",".join([*MPTRAIN, *TORCHAO]))
    ap.add_argument("--reference", action="store_true", help="also the eager reference of " + ", ".join(REFERENCE))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode per round")
    ap.add_argument("--warmup", type=int, default=3, help="steps per mode before timing (compiles the kernels)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--host-memory", choices=("keep", "defaults"), default="keep",
                    help="keep: freed host memory kept, as a run has it (trainer.keep_host_memory); defaults: glibc's")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default="cpu-formats")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(args.threads)
    rounding_rng.seed_rounding(0)  # stochastic rounding draws from the run's stream, as in a run
    info = stamp(torch.device("cpu"), argv, args.threads)
    info["command"] = "python scripts/bench_formats.py " + " ".join(argv)
    info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    cap = device_capability(torch.device("cpu"))
    info["native_bf16"], info["capability_detail"] = cap.native_bf16, cap.detail
    info["quantizers"] = fused.status("cpu")
    # a preloaded allocator serves in glibc's place whatever --host-memory says: named then
    keep = args.host_memory == "keep" or preloaded_allocator()
    info["host_memory"] = keep_freed_host_memory() if keep else "glibc defaults"

    rows, skipped = [], []
    for model_name in args.models.split(","):
        _, batch, shape, classes = MODELS[model_name]
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g)
        modes = args.modes.split(",") + ([f"{m} (eager reference)" for m in REFERENCE] if args.reference else [])
        runs: dict[str, Mode] = {}
        compile_s: dict[str, float] = {}
        graphs: dict[str, tuple[int, list[str]]] = {}
        for mode in modes:
            built = build(model_name, mode)
            if isinstance(built, str):
                skipped.append({"model": model_name, "mode": mode, "why": built})
                print(f"{model_name:17s} {mode:34s} skipped: {built}")
                continue
            c0, g0 = fused.compile_seconds(), graph_counts()
            for _ in range(args.warmup):
                step(built, x, y)
            runs[mode], compile_s[mode], g1 = built, fused.compile_seconds() - c0, graph_counts()
            graphs[mode] = (sum(g1.values()) - sum(g0.values()),
                            sorted(k for k, n in g1.items() if n > max(g0.get(k, 0), 1)))  # fmt: skip
        cpu: dict[str, list[float]] = {m: [] for m in runs}
        wall: dict[str, list[float]] = {m: [] for m in runs}
        losses: dict[str, float] = {}
        for _ in range(args.rounds):
            for m in runs:
                for _ in range(args.steps):
                    c0, w0 = time.process_time(), time.perf_counter()
                    losses[m] = step(runs[m], x, y)
                    cpu[m].append(time.process_time() - c0)
                    wall[m].append(time.perf_counter() - w0)
        base_cpu, base_wall = statistics.median(cpu["fp32"]), statistics.median(wall["fp32"])
        for m in runs:
            c, w = statistics.median(cpu[m]), statistics.median(wall[m])
            paired = statistics.median(_round_ratios(cpu[m], cpu["fp32"], args.steps))
            gap = 1e3 * (c - base_cpu)
            parts: dict[str, Any] = {"gap_ms": round(gap, 2), "quantizers_ms": None, "quantizer_calls": None,
                                     "other_ms": None}
            # The split is for the fused modes: replayed alone, the eager chains' many intermediates
            # meet colder caches than inside the step, and their replay overstated them. A model compiled
            # whole has its quantizers inside its graph, with no calls to record.
            if not m.endswith((" (eager reference)", COMPILED)):
                q_ms, q_calls = quantizer_ms(runs[m], x, y)
                parts.update(quantizers_ms=round(q_ms, 2), quantizer_calls=q_calls, other_ms=round(gap - q_ms, 2) + 0.0)
            rows.append({
                "model": model_name, "batch": batch, "mode": m, "quantized_layers": runs[m].quantized,
                "step_ms_cpu": round(1e3 * c, 2), "step_ms_wall": round(1e3 * w, 2),
                "vs_fp32_cpu": round(c / base_cpu, 3), "vs_fp32_cpu_paired": round(paired, 3),
                "vs_fp32_wall": round(w / base_wall, 3),
                "spread_cpu": round((max(cpu[m]) - min(cpu[m])) / c, 3), "last_loss": round(losses[m], 4),
                "compile_s": round(compile_s[m], 2), "graphs": graphs[m][0], "compiled_again": graphs[m][1],
                "gap": parts,
            })  # fmt: skip
            split = "" if parts["quantizers_ms"] is None else (
                f" = quantizers {parts['quantizers_ms']:.1f} ({parts['quantizer_calls']} calls) + other "
                f"{parts['other_ms']:.1f}")
            print(f"{model_name:17s} {m:34s} {1e3 * c:8.1f} ms cpu  x{c / base_cpu:5.2f}  {1e3 * w:8.1f} ms wall  "
                  f"gap {gap:.1f}{split}")
        for m in list(runs):
            for other in EQUIVALENT.get(m, ()):
                if other in runs:
                    mine = next(r for r in rows if r["model"] == model_name and r["mode"] == m)
                    theirs = next(r for r in rows if r["model"] == model_name and r["mode"] == other)
                    mine.setdefault("vs_torchao_cpu", {})[other] = round(mine["step_ms_cpu"] / theirs["step_ms_cpu"], 3)
    info["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    info["method"] = (
        "per mode: a fresh model from seed 0 (mptrain: build_precision/prepare_model with the config defaults; "
        f"torchao: its conversion), SGD momentum 0.9; {args.warmup} warm-up steps (they compile the fused kernels: "
        f"compile_s), then {args.rounds} interleaved rounds of {args.steps} steps; median step time on the process "
        "CPU clock and the wall clock; paired = the median over rounds of the round's median step time over FP32's "
        "in the same round; spread = (max-min)/median of the CPU step times; for the fused modes, the gap "
        "to fp32 (CPU ms) split into the quantizers (one step's quantizer calls recorded, then replayed alone 5 "
        "times: kernels and their Python dispatch) and the rest of it (the GEMM layers' autograd functions, copies "
        "and casts, conv wgrad's im2col, padding, master-weight bookkeeping)"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"info": info, "rows": rows, "skipped": skipped}
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(result))
    print(f"wrote {args.out / args.name}.json and .md")


def _round_ratios(mode: list[float], fp32: list[float], steps: int) -> list[float]:
    """Per round: the median of the mode's step times over the median of FP32's in the same round.
    A shared machine's slow spells last longer than a round but come and go within a run; a ratio
    taken inside each round cancels them, where a ratio of the run's two medians does not."""
    return [statistics.median(mode[i:i + steps]) / statistics.median(fp32[i:i + steps])
            for i in range(0, len(fp32), steps)]


def markdown(result: dict[str, Any]) -> str:
    info, rows = result["info"], result["rows"]
    v = info["versions"]
    load = " / ".join(map(str, info["load_average_start"])), " / ".join(map(str, info["load_average_end"]))
    lines = [
        "# Emulated formats on CPU: step time against FP32 and torchao, fused quantizers",
        "",
        f"- device: {info['device_name']}, torch CPU capability `{info['cpu_capability']}`, native bf16 "
        f"(AVX512-BF16/AMX): {'yes' if info['native_bf16'] else 'no'} ({info['capability_detail']})",
        f"- versions: torch {v.get('torch')}, Python {v.get('python')}; quantizers: {info['quantizers']}",
        f"- date: {info['date']}; torch threads {info['torch_threads']} of {info['cpu_count']} CPUs; load average "
        f"at start {load[0]}, at end {load[1]}",
        f"- command: `{info['command']}`",
        f"- method: {info['method']}",
        "- modes: `fp8 hybrid` = `precision=fp8 precision.format=hybrid` with its defaults (loss-scaling recipe, "
        "FP16 master weights, stochastic rounding), `tensor` / `rowwise` its per-tensor and row-wise scaled "
        "recipes; mx formats = `precision=mx precision.format=...` with the format's recipe defaults; torchao "
        "float8 with `emulate=True`, torchao MXFP8 with `KernelPreference.EMULATED` and FP32 output. Everything "
        "is emulated in FP32: the ratio is the emulation's cost, not a speed-up any hardware would show."
        + ("" if not any(r["mode"] in EXTRA for r in rows) else
           " Beside them, on a CPU with native bf16: `amp bf16` = `precision=amp_bf16` (what `precision=mixed` "
           "resolves to there); `mxfp8 bf16` and `nvfp4 bf16` = `precision.emulated_compute=bf16` (the quantized "
           "values multiplied in bf16, which holds them exactly); `nvfp4 bf16 amp` adds `precision.autocast=bf16` "
           "(the layers NVFP4 keeps high, and everything but the GEMMs, under a bf16 autocast)."),
        "",
        "| model | batch | mode | quantized GEMM layers | step ms (CPU) | vs fp32 | vs fp32 (paired) "
        "| vs torchao (CPU) | step ms (wall) | vs fp32 (wall) | spread | gap to fp32 ms | quantizers ms (calls) "
        "| other ms | compile s | graphs compiled (again) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        q = "-" if r["quantized_layers"] is None else r["quantized_layers"]
        vs = "; ".join(f"{v:.2f}x {k.removeprefix('torchao ')}" for k, v in r.get("vs_torchao_cpu", {}).items()) or "-"
        p = r["gap"]
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['mode']} | {q} | {r['step_ms_cpu']:.1f} | {r['vs_fp32_cpu']:.2f}x | "
            f"{r['vs_fp32_cpu_paired']:.2f}x | {vs} | {r['step_ms_wall']:.1f} | {r['vs_fp32_wall']:.2f}x | "
            f"{100 * r['spread_cpu']:.0f}% | "
            f"{p['gap_ms']:.1f} | "
            + ("- | - | " if p["quantizers_ms"] is None else
               f"{p['quantizers_ms']:.1f} ({p['quantizer_calls']}) | {p['other_ms']:.1f} | ")
            + f"{r['compile_s']:.1f} | {r.get('graphs', '-')} ({len(r.get('compiled_again', []))}) |"
        )
    if result["skipped"]:
        lines += ["", "Not run:", ""] + [f"- {s['model']}, {s['mode']}: {s['why']}" for s in result["skipped"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

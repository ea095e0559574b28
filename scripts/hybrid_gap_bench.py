"""Where FP8 hybrid's step time goes on the issue's MLP at batch 128, on a CPU: each kind of quantizer
call timed inside real training steps, and the same calls replayed alone, in one process, one thread.

FP8 hybrid (E4M3 forward, E5M2 backward, FP16 master weights, stochastic rounding: the config's
defaults) rounds every weight-sized tensor three times a step: the weight to E4M3 for the forward,
its gradient to E5M2 (stochastic), and the updated master back onto FP16 (stochastic). bench_formats
splits the gap to FP32 by replaying one step's quantizer calls back to back on copies of their
arguments; this says how far those replays are from what the calls cost inside a step:

- ``in step``: every call into the fused quantizers timed (``time.perf_counter`` around it) in the
  timed steps, summed by kind (function, operand shape, rounding);
- ``replayed``: one step's calls recorded (arguments copied), each replayed 5 times back to back
  (``bench_formats.quantizer_ms``' way);

beside FP32's and the mode's step times (interleaved rounds, process CPU clock) and one thread's copy
bandwidth (16 MiB, after a pass over a 64 MiB buffer). Freed host memory is kept, as a run keeps it.

A third model runs the mode as it was before ``Fp8State.after_step`` wrote each weight's next E4M3
forward operand in the pass that rounds its FP16 master (``fp8._kept_weights``): its forward rounds
the weight itself. It steps in the same rounds, and two steps of each way from the same state and
rounding stream say whether the two ways' weights came out bit-identical. Stochastic rounding draws
from the run's stream, as in bench_formats.

    python scripts/hybrid_gap_bench.py --out docs/benchmarks --name cpu-2026-12-03-amx-hybrid-gap
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_formats  # the script beside this one (its directory leads sys.path)
import torch

from mptrain.bench.common import cpu_header, cpu_script_stamp, load_averages, write_report
from mptrain.numerics import fp8, fused, rounding_rng

MODEL, MODE = "mlp 4x1024 b128", "fp8 hybrid"
ROUNDED = f"{MODE}, forward rounds its weight"  # the mode without fp8._kept_weights
# what a wrapped call reports: (name, function, args, kwargs, seconds)
Record = Callable[[str, Callable[..., Any], tuple[Any, ...], dict[str, Any], float], None]


def _kind(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    first = args[0]
    shape = "x".join(map(str, first.shape)) if isinstance(first, torch.Tensor) else f"{len(first)} tensors"
    return f"{name}|{shape}|{'stochastic' if kwargs.get('stochastic') else 'to nearest'}"


def _wrapped(record: Record) -> dict[str, Any]:
    """Every fused quantizer wrapped to report (name, function, args, kwargs, seconds); the originals."""
    originals = {name: getattr(fused, name) for name in bench_formats.QUANTIZERS}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            record(name, fn, args, kwargs, time.perf_counter() - t0)
            return out

        return timed

    for name, fn in originals.items():
        setattr(fused, name, wrap(name, fn))
    return originals


def _restore(originals: dict[str, Any]) -> None:
    for name, fn in originals.items():
        setattr(fused, name, fn)


def bandwidth_gb_s(evict: torch.Tensor) -> float:
    """One thread's read+write bandwidth: a 16 MiB copy right after a pass over ``evict`` (median of 5)."""
    src = torch.randn(4 << 20)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        evict.add_(1.0)
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def _step(name: str, cell: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    real = fp8._kept_weight
    if name == ROUNDED:
        fp8._kept_weight = lambda w, spec: None
    try:
        bench_formats.step(cell, x, y)
    finally:
        fp8._kept_weight = real


def _same_weights(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Two steps each way from the same seed-0 model and rounding stream: bit-identical weights? The
    kept weight is written by the first step's after_step and read by the second step's forward."""
    weights = []
    for name in (MODE, ROUNDED):
        cell = bench_formats.build(MODEL, MODE)
        rounding_rng.seed_rounding(0)
        for _ in range(2):
            _step(name, cell, x, y)
        weights.append([p.detach().clone() for p in cell.model.parameters()])  # type: ignore[union-attr]
    return all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default="cpu-hybrid-gap")
    args = ap.parse_args(argv)
    info = cpu_script_stamp("hybrid_gap_bench.py", argv)
    rounding_rng.seed_rounding(0)  # stochastic rounding draws from the run's stream, as in bench_formats
    info["host_memory"] = bench_formats.keep_freed_host_memory()
    _, batch, shape, classes = bench_formats.MODELS[MODEL]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g)
    cells = {name: bench_formats.build(MODEL, "fp32" if name == "fp32" else MODE) for name in ("fp32", MODE, ROUNDED)}
    for name, cell in cells.items():
        assert not isinstance(cell, str), cell
        for _ in range(5):  # compiles the kernels, warms the allocator
            _step(name, cell, x, y)
    same = _same_weights(x, y)

    # in step: the rounds interleave FP32's step with the mode's, whose calls are timed
    in_step: dict[str, float] = collections.defaultdict(float)
    steps: dict[str, list[float]] = {name: [] for name in cells}

    def add(name: str, fn: Any, a: tuple[Any, ...], kw: dict[str, Any], dt: float) -> None:
        in_step[_kind(name, a, kw)] += dt

    for _ in range(args.rounds):
        for name, cell in cells.items():
            originals = _wrapped(add) if name == MODE else {}
            t0 = time.process_time()
            _step(name, cell, x, y)
            steps[name].append(time.process_time() - t0)
            _restore(originals)

    # one step's calls, recorded with copies of their arguments, then replayed
    calls: list[tuple[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []
    originals = _wrapped(lambda name, fn, a, kw, dt: calls.append(
        (_kind(name, a, kw), fn, bench_formats._copy(a), {k: bench_formats._copy(v) for k, v in kw.items()})))
    bench_formats.step(cells[MODE], x, y)  # type: ignore[arg-type]
    _restore(originals)
    warm: dict[str, float] = collections.defaultdict(float)
    with torch.no_grad():
        for kind, fn, a, kw in calls:
            fn(*a, **kw)  # any first-call cost stays out
            t0 = time.perf_counter()
            for _ in range(5):
                fn(*a, **kw)
            warm[kind] += (time.perf_counter() - t0) / 5
    ms = {name: round(1e3 * statistics.median(t), 2) for name, t in steps.items()}
    kinds = sorted(warm, key=lambda k: -in_step[k])
    result = {
        "info": info | {"load_average_end": load_averages()},
        "model": MODEL, "mode": MODE, "rounds": args.rounds,
        "step_ms_cpu": ms, "vs_fp32_cpu": round(ms[MODE] / ms["fp32"], 3),
        "rounded_vs_fp32_cpu": round(ms[ROUNDED] / ms["fp32"], 3), "kept_vs_rounded": round(ms[MODE] / ms[ROUNDED], 3),
        "same_weights": same,
        "gap_ms": round(ms[MODE] - ms["fp32"], 2), "calls_per_step": len(calls),
        "quantizers_ms": {
            kind: {"calls": sum(c[0] == kind for c in calls), "in_step": round(1e3 * in_step[kind] / args.rounds, 2),
                   "replayed": round(1e3 * warm[kind], 2)}
            for kind in kinds
        },
        "totals_ms": {"in_step": round(1e3 * sum(in_step.values()) / args.rounds, 2),
                      "replayed": round(1e3 * sum(warm.values()), 2)},
        "bandwidth_gb_s": round(bandwidth_gb_s(torch.zeros(16 << 20)), 1),
    }  # fmt: skip
    write_report(args.out, args.name, result, markdown(result))
    print(markdown(result))


def markdown(r: dict[str, Any]) -> str:
    ms = r["step_ms_cpu"]
    lines = [
        *cpu_header(r["info"], f"{r['mode']} on the {r['model']}: its quantizer calls in the step and replayed",
                    f"- method: see the script's docstring; {r['rounds']} interleaved rounds"),
        f"- step (median, CPU): fp32 {ms['fp32']:.1f} ms, {r['mode']} {ms[r['mode']]:.1f} ms "
        f"({r['vs_fp32_cpu']:.2f}×, gap {r['gap_ms']:.1f} ms); {r['calls_per_step']} quantizer calls a step",
        *([f"- {ROUNDED}: {ms[ROUNDED]:.1f} ms ({r['rounded_vs_fp32_cpu']:.2f}× FP32); {r['mode']} took "
           f"{r['kept_vs_rounded']:.3f}× as long; weights after two steps bit-identical both ways: "
           f"{'yes' if r['same_weights'] else 'NO'}"] if ROUNDED in ms else []),
        f"- one thread's copy bandwidth: {r['bandwidth_gb_s']:.1f} GB/s (read + write)",
        "",
        "| function | operand | rounding | calls a step | in step ms | replayed ms | in step / replayed |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, q in r["quantizers_ms"].items():
        name, shape, rounding = kind.split("|")
        lines.append(f"| `{name}` | {shape} | {rounding} | {q['calls']} | {q['in_step']:.2f} | "
                     f"{q['replayed']:.2f} | {q['in_step'] / q['replayed']:.2f} |")
    t = r["totals_ms"]
    lines.append(f"| all | | | {r['calls_per_step']} | {t['in_step']:.2f} | {t['replayed']:.2f} | "
                 f"{t['in_step'] / t['replayed']:.2f} |")
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    main()

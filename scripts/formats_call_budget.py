"""How much time an emulated step leaves its quantizer calls, against what one call costs at least.

A bound for ``bench_formats``' "ResNet-50/8 <= 2x FP32" target. In one process, one thread,
interleaved rounds, it times four training steps of the same model:

- ``fp32``;
- the emulated mode (``mxfp8`` by default);
- that mode with its quantizers replaced by the identity ("layers alone"): the same converted layers,
  autograd functions, convolutions, im2col and copies, and no call into a quantizer;
- that mode with every quantizer call through torch.compile's entry (``compiled_calls.through_dynamo``: no
  direct calls), what the direct calls buy.

2x FP32 minus "layers alone" is what the quantizer calls may take for the step to meet 2x; divided by
the calls a step makes, it is a budget per call. Against it, the least one call costs: the block
kernel on one block of 32 elements, through ``compiled_calls._call`` (the path every call takes: a direct call
of the compiled function from a shape's second call on, ``compiled_calls._Direct``) and through torch.compile's
own entry (dynamo's guards, then the same function). If the floor is above the budget, no kernel
speed-up meets the target while each operand is a call of its own.

    python scripts/formats_call_budget.py --out docs/benchmarks --name cpu-2026-11-26-call-budget
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bench_formats as bf  # the script beside this one (its directory leads sys.path)
import torch

from mptrain.bench.common import cpu_header, cpu_script_stamp, load_averages, write_report
from mptrain.memory import keep_freed_host_memory
from mptrain.numerics import compiled_calls, fused, fused_kernels, mx, rounding_rng


@contextlib.contextmanager
def counted() -> Iterator[list[int]]:
    """Count the calls into ``fused.quantize_blocks`` (every block-format operand of a step)."""
    real, n = fused.quantize_blocks, [0]

    def count(*args: Any, **kwargs: Any) -> Any:
        n[0] += 1
        return real(*args, **kwargs)

    fused.quantize_blocks = count
    try:
        yield n
    finally:
        fused.quantize_blocks = real


@contextlib.contextmanager
def identity() -> Iterator[None]:
    """Quantizers off: every operand passes through as it is (no tensor scale)."""
    real = fused.quantize_blocks
    fused.quantize_blocks = lambda x, *args, **kwargs: (x, None)
    try:
        yield
    finally:
        fused.quantize_blocks = real


def per_call_us(fn: Callable[[], Any], n: int = 2000) -> float:
    for _ in range(200):
        fn()
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n * 1e6


def floor_us() -> dict[str, float]:
    """One block of 32 elements through the MXFP8 block kernel: compiled_calls._call, and the compiled function."""
    fmt = mx.BLOCK_FORMATS["mxfp8"]
    x3 = torch.randn(1, 32, 1)
    pf, pi = fused_kernels._elem(fmt.element, x3.device)
    options = fused._plan_blocks(x3, 1, "mx32", False, True, False).options
    args = (pf, pi, "mx32", False, None, None, None)  # as a step calls it: no rotation
    compiled_calls._call("blocks", options, x3, *args)  # compiles, and marks the dims dynamic as a step's calls do
    kernel = compiled_calls._entries["blocks", options, x3.shape, x3.dtype, x3.device].kernel
    return {"fused_call_us": round(per_call_us(lambda: compiled_calls._call("blocks", options, x3, *args)), 2),
            "compiled_fn_us": round(per_call_us(lambda: kernel(x3, *args)), 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50/8", choices=sorted(bf.MODELS))
    ap.add_argument("--mode", default="mxfp8", choices=("mxfp8", "mxfp6", "mxfp4", "nvfp4"))
    ap.add_argument("--target", type=float, default=2.0, help="the step-time target, x FP32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default="cpu-call-budget")
    args = ap.parse_args(argv)
    info = cpu_script_stamp("formats_call_budget.py", argv)
    rounding_rng.seed_rounding(0)
    info["host_memory"] = keep_freed_host_memory()  # as a run has it (trainer.keep_host_memory)

    _, batch, shape, classes = bf.MODELS[args.model]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g)
    cells: dict[str, tuple[bf.Mode, Callable[[], Any]]] = {}
    plain = contextlib.nullcontext
    for name, mode, context in (("fp32", "fp32", plain), (args.mode, args.mode, plain),
                                (f"{args.mode}, quantizers off", args.mode, identity),
                                (f"{args.mode}, through dynamo", args.mode, compiled_calls.through_dynamo)):
        built = bf.build(args.model, mode)
        assert not isinstance(built, str), built
        cells[name] = (built, context)
        with context():
            for _ in range(3):  # warm-up: compiles the kernels
                bf.step(built, x, y)
    with counted() as calls:
        bf.step(cells[args.mode][0], x, y)
    times: dict[str, list[float]] = {name: [] for name in cells}
    for _ in range(args.rounds):
        for name, (cell, context) in cells.items():
            with context():
                for _ in range(args.steps):
                    t0 = time.process_time()
                    bf.step(cell, x, y)
                    times[name].append(time.process_time() - t0)
    ms = {name: round(1e3 * statistics.median(t), 2) for name, t in times.items()}
    fp32, alone = ms["fp32"], ms[f"{args.mode}, quantizers off"]
    budget_ms = args.target * fp32 - alone
    result = {
        "info": info | {"load_average_end": load_averages()},
        "model": args.model, "mode": args.mode, "target_vs_fp32": args.target,
        "step_ms_cpu": ms,
        "spread_cpu": {n: round((max(t) - min(t)) / statistics.median(t), 3) for n, t in times.items()},
        "quantizer_calls": calls[0], "quantizers_in_step_ms": round(ms[args.mode] - alone, 2),
        "budget_ms": round(budget_ms, 2), "budget_per_call_us": round(1e3 * budget_ms / calls[0], 2),
        "floor": floor_us(),
    }  # fmt: skip
    write_report(args.out, args.name, result, markdown(result))
    print(markdown(result))


def markdown(r: dict[str, Any]) -> str:
    info, ms, fl = r["info"], r["step_ms_cpu"], r["floor"]
    off = f"{r['mode']}, quantizers off"
    return "\n".join([
        *cpu_header(info, f"Quantizer calls against their budget: {r['model']}, {r['mode']}, target "
                    f"{r['target_vs_fp32']}x FP32",
                    "- method: see the script's docstring; median step time on the process CPU clock over interleaved "
                    "rounds"),
        "| step | ms (CPU) | vs fp32 | spread |",
        "|---|---|---|---|",
        *[f"| {n} | {v:.1f} | {v / ms['fp32']:.2f}x | {r['spread_cpu'][n]:.0%} |" for n, v in ms.items()],
        "",
        f"- quantizer calls per step: {r['quantizer_calls']}; they take {r['quantizers_in_step_ms']:.1f} ms of the "
        f"step "
        f"({1e3 * r['quantizers_in_step_ms'] / r['quantizer_calls']:.0f} us a call)",
        f"- budget for them at {r['target_vs_fp32']}x FP32: {r['target_vs_fp32']} x {ms['fp32']:.1f} - "
        f"{ms[off]:.1f} = {r['budget_ms']:.1f} ms, {r['budget_per_call_us']:.1f} us a call",
        f"- one block of 32 through the block kernel: {fl['fused_call_us']:.1f} us via compiled_calls._call (a "
        f"direct call from the second on), {fl['compiled_fn_us']:.1f} us through torch.compile's entry",
        "",
    ])


if __name__ == "__main__":
    main()

"""ResNet-50/8's emulated steps with their 1x1 convolutions as GEMMs or as convolutions, side by side
in one process, on a CPU.

On a CPU the quantized layers run a 1x1 convolution with stride 1 and no padding as the matmul it is
(``qgemm._pointwise``): oneDNN's convolution costs tens of microseconds a call beyond its arithmetic
on these small layers, about twice that inside an emulated step. This times every mode's training step
both ways, in interleaved rounds:

- ``conv``: every quantized convolution through aten's convolution (``_pointwise`` finds nothing),
  as before;
- ``gemm``: the library's path;

and FP32's step beside them (which no quantized layer touches). Per-tensor FP8 (``fp8 hybrid``,
``fp8 hybrid tensor``) convolves its rounded operands through nn.Conv2d's own path, not qgemm's:
its two ways run the same code, a control for the noise. Each way has its own model, built
from the same seed; before the rounds, one step of each from the same state and rounding streams
says whether the two ways' weights came out bit-identical.

    python scripts/pointwise_bench.py --out docs/benchmarks --name cpu-2026-11-30-amx-pointwise
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import bench_formats  # the script beside this one (its directory leads sys.path)
import torch

from mptrain.bench.common import cpu_header, cpu_script_stamp, load_averages, write_report
from mptrain.numerics import qgemm, rounding_rng

MODEL = "resnet50/8"
MODES = ("fp8 hybrid", "fp8 hybrid tensor", "fp8 hybrid rowwise", "mxfp8", "mxfp6", "mxfp4", "nvfp4")
_pointwise = qgemm._pointwise


def _way(gemm: bool) -> None:
    qgemm._pointwise = _pointwise if gemm else (lambda *a, **k: None)  # type: ignore[assignment]


def _cell(mode: str) -> Any:
    cell = bench_formats.build(MODEL, mode)
    assert not isinstance(cell, str), cell
    return cell


def _same_first_step(mode: str, x: torch.Tensor, y: torch.Tensor) -> bool:
    """One step of each way from one seed and fresh rounding streams: the same weights, bit for bit?"""
    weights = []
    for gemm in (False, True):
        _way(gemm)
        rounding_rng.seed_rounding(0)
        cell = _cell(mode)
        bench_formats.step(cell, x, y)
        weights.append([p.detach().clone() for p in cell.model.parameters()])
    _way(True)
    return all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default="cpu-pointwise")
    args = ap.parse_args(argv)
    info = cpu_script_stamp("pointwise_bench.py", argv)
    _, batch, shape, classes = bench_formats.MODELS[MODEL]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g)
    bench_formats.keep_freed_host_memory()
    rows = []
    for mode in args.modes.split(","):
        same = _same_first_step(mode, x, y)
        cells = {"fp32": _cell("fp32"), "conv": _cell(mode), "gemm": _cell(mode)}
        for way, cell in cells.items():
            _way(way != "conv")
            for _ in range(3):  # compiles, allocator warm-up
                bench_formats.step(cell, x, y)
        times: dict[str, list[float]] = {way: [] for way in cells}
        for r in range(args.rounds):
            for way in (list(cells) if r % 2 else list(cells)[::-1]):
                _way(way != "conv")
                t0 = time.process_time()
                bench_formats.step(cells[way], x, y)
                times[way].append(time.process_time() - t0)
        _way(True)
        ms = {way: round(1e3 * statistics.median(t), 2) for way, t in times.items()}
        rows.append({"mode": mode, "step_ms_cpu": ms, "gemm_vs_conv": round(ms["gemm"] / ms["conv"], 3),
                     "vs_fp32_cpu": {w: round(ms[w] / ms["fp32"], 2) for w in ("conv", "gemm")},
                     "same_weights_after_one_step": same})  # fmt: skip
        print(rows[-1], flush=True)
    result = {"info": info | {"load_average_end": load_averages()}, "model": MODEL, "rounds": args.rounds,
              "rows": rows}
    write_report(args.out, args.name, result, markdown(result))
    print(markdown(result))


def markdown(r: dict[str, Any]) -> str:
    lines = [
        *cpu_header(r["info"], f"{r['model']}'s 1x1 convolutions as GEMMs or as convolutions, side by side",
                    f"- method: see the script's docstring; median CPU time of a training step over {r['rounds']} "
                    "interleaved rounds (FP32, the convolutions, the GEMMs), batch 32"),
        "| mode | fp32 ms | conv ms | gemm ms | gemm / conv | conv vs fp32 | gemm vs fp32 | same weights |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        ms, vs = row["step_ms_cpu"], row["vs_fp32_cpu"]
        lines.append(f"| {row['mode']} | {ms['fp32']:.1f} | {ms['conv']:.1f} | {ms['gemm']:.1f} | "
                     f"{row['gemm_vs_conv']:.3f} | {vs['conv']:.2f}× | {vs['gemm']:.2f}× | "
                     f"{'yes' if row['same_weights_after_one_step'] else 'no'} |")
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    main()

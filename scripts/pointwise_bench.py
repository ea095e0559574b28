"""ResNet-50/8's emulated steps with and without one of qgemm's CPU paths, side by side in one
process, on a CPU. ``--change`` picks the path:

- ``pointwise`` (the default): a 1x1 convolution with stride 1 and no padding run as the matmul it is
  (``qgemm._pointwise``): oneDNN's convolution costs tens of microseconds a call beyond its
  arithmetic on these small layers, about twice that inside an emulated step. The two ways are
  ``conv`` (every quantized convolution through aten's, as before) and ``gemm`` (the library's);
- ``row_windows``: wgrad's x operand quantized as x's row windows, each once, where the im2col
  columns repeat them (``qgemm._quantized_rows``: ResNet's stem under NVFP4). The ways are
  ``columns`` (the columns quantized, as before) and ``rows`` (the library's);
- ``kept_weight``: FP8's forward weight taken from the FP16 master's rounding, which writes it in the
  same pass (``fp8._kept_weight``), or rounded by the forward (``rounded``, as before; ``kept``, the
  library's). Only ``scaling=loss`` keeps it: ``fp8 hybrid tensor`` is the control. The kept weight
  is written by one step and read by the next, so the weights are compared after two steps.

Each mode's training step runs both ways in interleaved rounds, and FP32's step beside them (which
no quantized layer touches). Per-tensor FP8 (``fp8 hybrid``, ``fp8 hybrid tensor``) convolves its
rounded operands through nn.Conv2d's own path, not qgemm's: its two ways run the same code, a
control for the noise (as MX formats are for ``row_windows`` on these 16-pixel rows). Each way has
its own model, built from the same seed; before the rounds, one step of each from the same state
and rounding streams says whether the two ways' weights came out bit-identical.

    python scripts/pointwise_bench.py --out docs/benchmarks --name cpu-2026-11-30-amx-pointwise
    python scripts/pointwise_bench.py --change row_windows --modes mxfp8,nvfp4 --name cpu-...-row-windows
    python scripts/pointwise_bench.py --change kept_weight --modes "fp8 hybrid,fp8 hybrid tensor" --name ...
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
from mptrain.numerics import fp8, qgemm, rounding_rng

MODEL = "resnet50/8"
MODES = ("fp8 hybrid", "fp8 hybrid tensor", "fp8 hybrid rowwise", "mxfp8", "mxfp6", "mxfp4", "nvfp4")
# --change: (the way without the path, the way with it, the module and function of the path (None
# from it: not here), what the report's title says, steps before the weights are compared)
CHANGES = {
    "pointwise": ("conv", "gemm", qgemm, "_pointwise", "1x1 convolutions as GEMMs or as convolutions", 1),
    "row_windows": ("columns", "rows", qgemm, "_quantized_rows",
                    "wgrad's x operand quantized as row windows or as im2col columns", 1),
    "kept_weight": ("rounded", "kept", fp8, "_kept_weight",
                    "FP8 forward weights kept from the master's rounding or rounded by the forward", 2),
}  # fmt: skip
SAME = {1: "same_weights_after_one_step", 2: "same_weights_after_two_steps"}  # the rows' key, by steps
_library = {name: getattr(module, fn) for name, (_, _, module, fn, _, _) in CHANGES.items()}
_change = "pointwise"


def _way(on: bool) -> None:
    _, _, module, fn, _, _ = CHANGES[_change]
    setattr(module, fn, _library[_change] if on else (lambda *a, **k: None))


def _cell(mode: str) -> Any:
    cell = bench_formats.build(MODEL, mode)
    assert not isinstance(cell, str), cell
    return cell


def _same_weights(mode: str, x: torch.Tensor, y: torch.Tensor, steps: int) -> bool:
    """``steps`` steps of each way from one seed and fresh rounding streams: the same weights, bit for bit?"""
    weights = []
    for on in (False, True):
        _way(on)
        rounding_rng.seed_rounding(0)
        cell = _cell(mode)
        for _ in range(steps):
            bench_formats.step(cell, x, y)
        weights.append([p.detach().clone() for p in cell.model.parameters()])
    _way(True)
    return all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--change", choices=sorted(CHANGES), default="pointwise")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default="cpu-pointwise")
    args = ap.parse_args(argv)
    global _change
    _change = args.change
    off, on, _, _, _, steps = CHANGES[_change]
    info = cpu_script_stamp("pointwise_bench.py", argv)
    _, batch, shape, classes = bench_formats.MODELS[MODEL]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g)
    bench_formats.keep_freed_host_memory()
    rows = []
    for mode in args.modes.split(","):
        same = _same_weights(mode, x, y, steps)
        cells = {"fp32": _cell("fp32"), off: _cell(mode), on: _cell(mode)}
        for way, cell in cells.items():
            _way(way != off)
            for _ in range(3):  # compiles, allocator warm-up
                bench_formats.step(cell, x, y)
        times: dict[str, list[float]] = {way: [] for way in cells}
        for r in range(args.rounds):
            for way in (list(cells) if r % 2 else list(cells)[::-1]):
                _way(way != off)
                t0 = time.process_time()
                bench_formats.step(cells[way], x, y)
                times[way].append(time.process_time() - t0)
        _way(True)
        ms = {way: round(1e3 * statistics.median(t), 2) for way, t in times.items()}
        rows.append({"mode": mode, "step_ms_cpu": ms, f"{on}_vs_{off}": round(ms[on] / ms[off], 3),
                     "vs_fp32_cpu": {w: round(ms[w] / ms["fp32"], 2) for w in (off, on)},
                     SAME[steps]: same})  # fmt: skip
        print(rows[-1], flush=True)
    result = {"info": info | {"load_average_end": load_averages()}, "model": MODEL, "rounds": args.rounds,
              "change": _change, "rows": rows}
    write_report(args.out, args.name, result, markdown(result))
    print(markdown(result))


def markdown(r: dict[str, Any]) -> str:
    off, on, _, _, title, _ = CHANGES[r.get("change", "pointwise")]  # runs before --change: pointwise
    lines = [
        *cpu_header(r["info"], f"{r['model']}'s {title}, side by side",
                    f"- method: see the script's docstring; median CPU time of a training step over {r['rounds']} "
                    f"interleaved rounds (FP32, {off}, {on}), batch 32"),
        f"| mode | fp32 ms | {off} ms | {on} ms | {on} / {off} | {off} vs fp32 | {on} vs fp32 | same weights |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        ms, vs = row["step_ms_cpu"], row["vs_fp32_cpu"]
        lines.append(f"| {row['mode']} | {ms['fp32']:.1f} | {ms[off]:.1f} | {ms[on]:.1f} | "
                     f"{row[f'{on}_vs_{off}']:.3f} | {vs[off]:.2f}× | {vs[on]:.2f}× | "
                     f"{'yes' if any(row.get(k) for k in SAME.values()) else 'no'} |")
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    main()

"""NVFP4's B = 1 blocks viewed per row or as one run of blocks, side by side in one process, on a CPU.

``fused_kernels._k_blocks`` works out NVFP4's per-block scales (kept: ``kept_scales_bench.py``) in a
loop of their own, which inductor vectorises along its inner dim. For blocks along the contiguous
dim (B = 1) viewed per row, (A, N / 16, 16, 1), that dim is a row's N / 16 blocks: in a row under
16 blocks (every ResNet-50/8 activation, 256 channels or fewer) each block's scale ran in the loop's
scalar remainder. From 75af21a on, a CPU views them as one run, (A * N / 16, 1, 16, 1), and from
b4dd031 on, all but the stochastic and rotated ones (wgrad's gradients), which this measured slower
so. This replays one NVFP4 ResNet-50/8 step's B = 1 block-kernel calls (``kept_scales_bench.record``)
two ways, each through ``compiled_calls._call`` as a kernel of its own:

- ``rows``: the body with ``flat=False`` (as before 75af21a);
- ``flat``: the library's kernel (so its stochastic rotated calls run per row both ways: the
  method's noise).

Both return the same values bit for bit (checked on every call here). Reported per kind of call (to
nearest or stochastic, rotated or not): the minimum over interleaved rounds of the CPU time of all
that kind's calls of one step. Freed host memory is kept, as a run keeps it (``trainer.keep_host_memory``).

    python scripts/flat_blocks_bench.py --out docs/benchmarks --name cpu-2026-11-29-avx512-flat-blocks
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import kept_scales_bench  # the script beside this one (its directory leads sys.path)
import torch

from mptrain.bench.common import cpu_header, cpu_script_stamp, load_averages, write_report
from mptrain.memory import keep_freed_host_memory
from mptrain.numerics import compiled_calls, fused_kernels


def _rows(x3: torch.Tensor, pf: torch.Tensor, pi: torch.Tensor, kind: str, short: bool, keys: torch.Tensor | None,
          counter: torch.Tensor | None, rot: torch.Tensor | None = None) -> tuple[Any, ...]:
    # The body's own parameter names: a direct call (compiled_calls._Direct) maps the graph's inputs
    # by them, and without one every call would pay dynamo's ~25 us and make the comparison unfair.
    return fused_kernels._k_blocks(x3, pf, pi, kind, short, keys, counter, rot, flat=False)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default="cpu-flat-blocks")
    args = ap.parse_args(argv)
    info = cpu_script_stamp("flat_blocks_bench.py", argv)
    info["host_memory"] = keep_freed_host_memory()
    compiled_calls._BODIES["blocks_rows"] = _rows
    compiled_calls._PURE = compiled_calls._PURE | {"blocks_rows"}
    rows = kept_scales_bench.side_by_side(kept_scales_bench.record(), {"rows": "blocks_rows", "flat": "blocks"},
                                          args.rounds)
    for row in rows:
        row["flat_vs_rows"] = round(row["ms_cpu"]["flat"] / row["ms_cpu"]["rows"], 3)
    result = {"info": info | {"load_average_end": load_averages()}, "rounds": args.rounds, "rows": rows}
    write_report(args.out, args.name, result, markdown(result))
    print(markdown(result))


def markdown(r: dict[str, Any]) -> str:
    lines = [
        *cpu_header(r["info"], "NVFP4's B = 1 blocks per row or as one run: one ResNet-50/8 step's B = 1 block "
                    "calls, side by side",
                    f"- method: see the script's docstring; minimum over {r['rounds']} interleaved rounds of "
                    "the CPU time of one step's calls of each kind; both ways bit-identical on every call; "
                    f"host memory: {r['info']['host_memory']}"),
        "| calls | number | elements | rows ms | flat ms | flat / rows |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(f"| {row['kind']} | {row['calls']} | {row['elements']:,} | {row['ms_cpu']['rows']:.2f} | "
                     f"{row['ms_cpu']['flat']:.2f} | {row['flat_vs_rows']:.2f}x |")
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    main()

"""Stochastic rounding's arithmetic in the fused kernels two ways, side by side in one process, on a CPU.

``fused_kernels._round`` rounds stochastically by the reference's rule: a scaled onto the integers of
its binade, its floor, and 1 more where the uniform u is below the fraction. Before 9818627 it did so
as the reference writes it, building 2**-e and 2**e from the exponent bits; from then on it reaches
the same values from the nearest grid point (the add and subtract that rounding to nearest uses), a
step down where that overshot, and ``u * ulp < a - down``. This replays one NVFP4 ResNet-50/8 step's
B = 1 block-kernel calls (``kept_scales_bench.record``) two ways, each through ``compiled_calls._call``
as a kernel of its own:

- ``scaled``: the block kernel's body with ``_round`` as before 9818627 (the body's code, its
  module's globals but that one);
- ``grid``: the library's kernel.

Both return the same values bit for bit (checked on every call here). Calls rounded to nearest run
the same code both ways: their rows are the method's noise. Reported per kind of call: the minimum
over interleaved rounds of the CPU time of all that kind's calls of one step. Freed host memory is
kept, as a run keeps it.

    python scripts/sr_round_bench.py --out docs/benchmarks --name cpu-2026-11-29-avx512-sr-round
"""

from __future__ import annotations

import argparse
import types
from pathlib import Path
from typing import Any

import kept_scales_bench  # the script beside this one (its directory leads sys.path)
import torch

from mptrain.bench.common import cpu_script_stamp
from mptrain.memory import keep_freed_host_memory
from mptrain.numerics import compiled_calls, fused_kernels


def _scaled_round(xf: torch.Tensor, pf: Any, pi: Any, u: torch.Tensor | None) -> torch.Tensor:
    """``fused_kernels._round`` as it was before 9818627 (its stochastic branch as the reference writes it)."""
    if u is None:
        return fused_kernels._round(xf, pf, pi, None)
    a = xf.abs().clamp(max=pf[0])
    e = torch.clamp(fused_kernels._exponent(a), pi[0], pi[1])
    scaled = a * ((127 - e) << 23).view(torch.float32) * pf[1]
    down = torch.floor(scaled)
    r = down + (u < scaled - down).float()
    return fused_kernels._with_sign(r * pf[2] * ((e + 127) << 23).view(torch.float32), xf)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default="cpu-sr-round")
    args = ap.parse_args(argv)
    info = cpu_script_stamp("sr_round_bench.py", argv)
    info["host_memory"] = keep_freed_host_memory()
    body = fused_kernels._k_blocks
    # The same code and parameter names (a direct call maps the graph's inputs by them), reading
    # the old _round from its globals.
    compiled_calls._BODIES["blocks_scaled"] = types.FunctionType(
        body.__code__, {**body.__globals__, "_round": _scaled_round}, body.__name__, body.__defaults__)
    compiled_calls._PURE = compiled_calls._PURE | {"blocks_scaled"}
    kept_scales_bench.report(args, info, {"scaled": "blocks_scaled", "grid": "blocks"},
                             "Stochastic rounding's arithmetic, scaled or from the grid: one NVFP4 ResNet-50/8 "
                             "step's B = 1 block calls, side by side", f"; host memory: {info['host_memory']}")


if __name__ == "__main__":
    main()

"""Stochastic rounding's element kernels before and after fc8413e, side by side in one process, on a CPU.

FP8 hybrid's step rounds its weight gradients onto E5M2 and writes its FP16 master weights back, both
with stochastic rounding: on the MLP of issue 24 at batch 128, 8 of its 12 passes over 1M-element
tensors. Two changes cut down the element kernel's instructions (ccbc70a, fc8413e):

- ``compiled_calls.vector_iota``: the element index that the rounding stream hashes is written as a
  broadcast of the base plus a constant, not ATen's ``Vectorized::arange`` built from 16 scalars;
- ``fused_kernels._round``'s stochastic path: one power of two each way where there were two, a
  rounding up as a select of ``down + 1`` rather than a mask added as 0/1, and ``_overflow``'s sign
  from the sign bit rather than Sleef's ``copysign``.

This runs each kind of call two ways, each through ``compiled_calls._call`` as a kernel of its own:

- ``before``: the bodies as they were before fc8413e (``_round_before``, ``_overflow_before`` here),
  compiled with inductor's own index vectors (``vector_iota`` undone while they compile);
- ``after``: the library's kernels.

Both give the same values bit for bit (checked on every kind here). Reported per kind: the minimum
over interleaved rounds of the CPU time of one call, on the same 1M-element tensor each time (its
data warm in the caches, as the kernels' own cost; inside a training step each call meets colder
data). Freed host memory is kept, as a run keeps it (``trainer.keep_host_memory``).

    python scripts/sr_kernel_bench.py --out docs/benchmarks --name cpu-2026-11-30-amx-sr-kernels
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch._inductor.codegen.cpp import CppVecKernel

from mptrain.bench.common import cpu_header, cpu_script_stamp, load_averages, write_report
from mptrain.memory import keep_freed_host_memory
from mptrain.numerics import compiled_calls, fused, rounding_rng
from mptrain.numerics import formats as nf
from mptrain.numerics import fused_kernels as fk

_INDUCTOR_ARANGE = CppVecKernel.arange  # before any kernel compiles, so before vector_iota


def _pow2(k: Tensor) -> Tensor:
    """2**k for an integer k in [-126, 127], from the exponent bits (the library's before fc8413e)."""
    return ((k + 127) << 23).view(torch.float32)


def _round_before(xf: Tensor, pf: Any, pi: Any, u: Tensor) -> Tensor:
    """``fused_kernels._round``'s stochastic path as it was before fc8413e. Its 2**mbits and
    2**-mbits were format constants then; here they come from the constants' exponent fields
    (``pi[4]``, ``pi[5]``): one scalar each a loop step, not a vector op."""
    a = xf.abs().clamp(max=pf[0])
    e = torch.clamp(fk._exponent(a), pi[0], pi[1])
    scaled = a * _pow2(-e) * (pi[4] << 23).view(torch.float32)
    down = torch.floor(scaled)
    r = down + (u < scaled - down).float()
    return fk._with_sign(r * (pi[5] << 23).view(torch.float32) * _pow2(e), xf)


def _overflow_before(xf: Tensor, q: Tensor, pf: Tensor) -> Tensor:
    """``fused_kernels._overflow`` (stochastic) as it was before fc8413e."""
    return torch.where(xf.abs() > pf[0], torch.copysign(pf[2].expand_as(xf), xf), q)


# Under the library bodies' own parameter names: a direct call (compiled_calls._Direct) maps the
# graph's inputs by them, and without one every call would pay dynamo's ~25 us.
def _k_round_before(x: Tensor, pf: Tensor, pi: Tensor, saturate: bool, keys: Tensor | None,
                    counter: Tensor | None) -> Tensor:
    xf = x.float()
    q = _round_before(xf, pf, pi, fk._uniform(xf.shape[0], xf.device, keys, counter))  # type: ignore[arg-type]
    return q if saturate else _overflow_before(xf, q, pf)


def _k_round__before(x: Tensor, pf: Tensor, pi: Tensor, keys: Tensor | None, counter: Tensor | None) -> None:
    x.copy_(_round_before(x.float(), pf, pi, fk._uniform(x.shape[0], x.device, keys, counter)).to(x.dtype))  # type: ignore[arg-type]


@contextlib.contextmanager
def _inductor_index_vectors() -> Iterator[None]:
    """Inductor's own ``arange`` codegen while ``before``'s kernels compile."""
    compiled_calls.vector_iota()  # applied once a process: undone here, then put back
    ours = CppVecKernel.arange
    CppVecKernel.arange = _INDUCTOR_ARANGE
    try:
        yield
    finally:
        CppVecKernel.arange = ours


# kind -> (format, in place, saturate, shape)
KINDS: dict[str, tuple[nf.ElementFormat, bool, bool, tuple[int, ...]]] = {
    "E5M2, stochastic, saturate=False (a weight gradient)": (nf.E5M2, False, False, (1024 * 1024,)),
    "E5M2, stochastic, saturate=False (an activation gradient)": (nf.E5M2, False, False, (128 * 1024,)),
    "FP16, stochastic, in place (a master weight)": (nf.FP16, True, True, (1024 * 1024,)),
}


def _runner(name: str, fmt: nf.ElementFormat, in_place: bool, saturate: bool, x: Tensor,
            keys: Tensor, counter: Tensor) -> Callable[[], Any]:
    pf, pi = fk._elem(fmt, x.device)
    if in_place:
        return lambda: compiled_calls._call(name, fused._opts(True), x, pf, pi, keys, counter)
    return lambda: compiled_calls._call(name, fused._opts(saturate, True), x, pf, pi, saturate, keys, counter)


def side_by_side(rounds: int) -> list[dict[str, Any]]:
    """Each kind two ways: checked bit for bit, then timed in ``rounds`` interleaved rounds."""
    rows = []
    keys = rounding_rng.RoundingStream(0, torch.device("cpu")).keys
    counter = torch.tensor(7, dtype=torch.int32)
    for kind, (fmt, in_place, saturate, shape) in KINDS.items():
        # gradients' and weights' sizes, with one NaN, an Inf and a value past the format's max
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * (0.02 if in_place else 1e-3)
        x[:3] = torch.tensor([float("nan"), float("inf"), fmt.max_normal * 2])
        ways = {"before": "round__before" if in_place else "round_before", "after": "round_" if in_place else "round"}
        data = {way: x.clone() for way in ways}
        run = {way: _runner(name, fmt, in_place, saturate, data[way], keys, counter) for way, name in ways.items()}
        got = {}
        for way, call in run.items():  # compiles each way (before: with inductor's index vectors)
            with _inductor_index_vectors() if way == "before" else contextlib.nullcontext():
                out = call()
            got[way] = data[way] if in_place else out
        same = torch.equal(got["before"].view(torch.int32), got["after"].view(torch.int32))
        nan = torch.equal(got["before"].isnan(), got["after"].isnan())
        assert nan and (same or torch.equal(got["before"].nan_to_num(), got["after"].nan_to_num())), kind
        times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(rounds):
            for way, call in run.items():
                t0 = time.process_time()
                for _ in range(10):
                    call()
                times[way].append((time.process_time() - t0) / 10)
        rows.append({"kind": kind, "elements": x.numel(),
                     "ms_cpu": {way: round(1e3 * min(t), 3) for way, t in times.items()}})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default="cpu-sr-kernels")
    args = ap.parse_args(argv)
    info = cpu_script_stamp("sr_kernel_bench.py", argv)
    info["host_memory"] = keep_freed_host_memory()
    compiled_calls._BODIES["round_before"] = _k_round_before
    compiled_calls._BODIES["round__before"] = _k_round__before
    compiled_calls._PURE = compiled_calls._PURE | {"round_before"}
    rows = side_by_side(args.rounds)
    for row in rows:
        row["after_vs_before"] = round(row["ms_cpu"]["after"] / row["ms_cpu"]["before"], 3)
    result = {"info": info | {"load_average_end": load_averages()}, "rounds": args.rounds, "rows": rows}
    lines = [
        *cpu_header(result["info"], "Stochastic rounding's element kernels before and after fc8413e, side by side",
                    f"- method: see the script's docstring; minimum over {args.rounds} interleaved rounds of "
                    "the CPU time of one call (the mean of 10); both ways bit-identical on every kind; host "
                    f"memory: {info['host_memory']}"),
        "| call | elements | before ms | after ms | after / before |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['kind']} | {row['elements']:,} | {row['ms_cpu']['before']:.3f} | "
                     f"{row['ms_cpu']['after']:.3f} | {row['after_vs_before']:.2f}x |")
    text = "\n".join([*lines, ""])
    write_report(args.out, args.name, result, text)
    print(text)


if __name__ == "__main__":
    main()

"""NVFP4's per-block scales kept or inlined in the block kernel, side by side in one process, on a CPU.

``fused_kernels._k_blocks`` returns its per-block scales as extra outputs (``_kept``) that callers
drop: stored once, the rounding loop loads them; dropped, inductor inlines their arithmetic into
every vector of the element loop. Blocks along the contiguous dim (B = 1) keep NVFP4's scales on a
CPU from a333812 on, and return their blocks' shape from 0220b68 on. This replays one NVFP4
ResNet-50/8 step's B = 1 block-kernel calls (recorded through the library's call path) two ways,
each through ``compiled_calls._call`` as a kernel of its own:

- ``inlined``: the same body with the kept outputs dropped (inductor inlines the scales, as before
  a333812);
- ``kept``: the library's kernel.

Both return the same values bit for bit (checked on every call here). Reported per kind of call (to
nearest or stochastic, rotated or not): the minimum over interleaved rounds of the CPU time of all
that kind's calls of one step.

    python scripts/kept_scales_bench.py --out docs/benchmarks --name cpu-2026-11-28-avx2-kept-scales
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_formats  # the script beside this one (its directory leads sys.path)
import torch

from mptrain.bench.common import cpu_header, cpu_script_stamp, load_averages, write_report
from mptrain.memory import keep_freed_host_memory
from mptrain.numerics import compiled_calls, fused, fused_kernels, rounding_rng

Call = tuple[str, torch.Tensor, tuple[Any, ...]]


def _inlined(x3: torch.Tensor, pf: torch.Tensor, pi: torch.Tensor, kind: str, short: bool, keys: torch.Tensor | None,
             counter: torch.Tensor | None, rot: torch.Tensor | None = None) -> tuple[Any, ...]:
    # The body's own parameter names: a direct call (compiled_calls._Direct) maps the graph's inputs
    # by them, and without one every call would pay dynamo's ~25 us and make the comparison unfair.
    return fused_kernels._k_blocks(x3, pf, pi, kind, short, keys, counter, rot)[:2]


def record(every_b: bool = False) -> list[Call]:
    """One NVFP4 ResNet-50/8 step's block-kernel calls with B == 1, or ``every_b``, all of them (after
    three warm-up steps)."""
    rounding_rng.seed_rounding(0)
    _, batch, shape, classes = bench_formats.MODELS["resnet50/8"]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g)
    cell = bench_formats.build("resnet50/8", "nvfp4")
    assert not isinstance(cell, str)
    for _ in range(3):
        bench_formats.step(cell, x, y)
    calls: list[Call] = []
    real = compiled_calls._call

    def rec(name: str, options: str, x3: torch.Tensor, *args: Any) -> Any:
        if name == "blocks" and x3.dim() == 3 and (every_b or x3.shape[2] == 1):
            calls.append((options, x3.detach().clone(),
                          tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)))
        return real(name, options, x3, *args)

    fused._call = rec  # type: ignore[assignment]
    try:
        with compiled_calls.through_dynamo():  # every call through _call (no kept paths)
            bench_formats.step(cell, x, y)
    finally:
        fused._call = real  # type: ignore[assignment]
    return calls


def side_by_side(calls: list[Call], ways: dict[str, str], rounds: int) -> list[dict[str, Any]]:
    """Each kind of call (to nearest or stochastic, rotated or not) run each of ``ways`` (way -> the
    kernel body's name in ``compiled_calls._BODIES``): checked bit for bit (in x3's shape) and as
    direct calls, then timed in ``rounds`` interleaved rounds. Rows: kind, calls, elements and the
    minimum CPU ms of one step's calls of that kind per way."""
    kinds: dict[str, list[Call]] = {}
    for c in calls:  # args: pf, pi, kind, short, keys, counter, rot
        kind = ("sr" if c[2][4] is not None else "rn") + (" rotated" if c[2][6] is not None else "")
        kinds.setdefault(kind + ("" if c[1].shape[2] == 1 else ", B > 1"), []).append(c)
    direct: dict[str, int] = {}
    rows = []
    for kind, group in kinds.items():
        for options, x3, a in group:  # compiles each way, and checks them bit for bit
            got = [compiled_calls._call(name, options, x3, *a)[0].reshape(x3.shape) for name in ways.values()]
            assert all(torch.equal(got[0].view(torch.int32), g.view(torch.int32)) for g in got[1:]), kind
        for options, x3, a in group:  # each way's calls go direct (the library's path), not through dynamo
            for name in ways.values():
                sig = compiled_calls._signature(name, options, x3.detach(), a)
                direct[name] = direct.get(name, 0) + (compiled_calls._directs.get(sig) is not None)
        times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(rounds):
            for way, name in ways.items():
                t0 = time.process_time()
                for options, x3, a in group:
                    compiled_calls._call(name, options, x3, *a)
                times[way].append(time.process_time() - t0)
        rows.append({"kind": kind, "calls": len(group), "elements": sum(c[1].numel() for c in group),
                     "ms_cpu": {way: round(1e3 * min(t), 3) for way, t in times.items()}})  # fmt: skip
    assert all(direct[name] == len(calls) for name in ways.values()), direct
    return rows


def main(argv: list[str] | None = None) -> None:
    compare(argv, "kept_scales_bench.py", __doc__, "cpu-kept-scales", ("inlined", _inlined), "kept",
            "NVFP4's per-block scales kept or inlined: one ResNet-50/8 step's B = 1 block calls, side by side",
            keep_memory=False)


def blocks_with(**fixed: Any) -> Callable[..., tuple[Any, ...]]:
    """The library's block-kernel body with some of its options ``fixed`` (``flat=False``, ...), under
    the body's own parameter names: a direct call (compiled_calls._Direct) maps the graph's inputs by
    them, and without one every call would pay dynamo's ~25 us and make the comparison unfair."""

    def body(x3: torch.Tensor, pf: torch.Tensor, pi: torch.Tensor, kind: str, short: bool,
             keys: torch.Tensor | None, counter: torch.Tensor | None, rot: torch.Tensor | None = None) -> Any:
        return fused_kernels._k_blocks(x3, pf, pi, kind, short, keys, counter, rot, **fixed)

    return body


def compare(argv: list[str] | None, script: str, doc: str | None, default_name: str,
            before: tuple[str, Callable[..., tuple[Any, ...]]], after: str, title: str, every_b: bool = False,
            keep_memory: bool = True) -> None:
    """A side-by-side script's main: ``before`` (its way's name, and a block-kernel body with the
    library body's parameter names) against the library's kernel (way ``after``) on one recorded
    step's calls; ``keep_memory``: freed host memory kept, as a run keeps it."""
    ap = argparse.ArgumentParser(description=(doc or script).splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default=default_name)
    args = ap.parse_args(argv)
    info = cpu_script_stamp(script, argv)
    method = ""
    if keep_memory:
        info["host_memory"] = keep_freed_host_memory()
        method = f"; host memory: {info['host_memory']}"
    way, body = before
    compiled_calls._BODIES[f"blocks_{way}"] = body
    compiled_calls._PURE = compiled_calls._PURE | {f"blocks_{way}"}
    report(args, info, {way: f"blocks_{way}", after: "blocks"}, title, method, every_b)


def report(args: argparse.Namespace, info: dict[str, Any], ways: dict[str, str], title: str, method: str = "",
           every_b: bool = False) -> None:
    """``side_by_side`` on one recorded step's calls (``record(every_b)``), the two ``ways`` (before,
    after), written as ``args.name``.json and .md under ``args.out`` with ``title``, and printed."""
    before, after = ways
    rows = side_by_side(record(every_b), ways, args.rounds)
    for row in rows:
        row[f"{after}_vs_{before}"] = round(row["ms_cpu"][after] / row["ms_cpu"][before], 3)
    result = {"info": info | {"load_average_end": load_averages()}, "rounds": args.rounds, "rows": rows}
    lines = [
        *cpu_header(result["info"], title,
                    f"- method: see the script's docstring; minimum over {args.rounds} interleaved rounds of "
                    f"the CPU time of one step's calls of each kind; both ways bit-identical on every call{method}"),
        f"| calls | number | elements | {before} ms | {after} ms | {after} / {before} |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['kind']} | {row['calls']} | {row['elements']:,} | {row['ms_cpu'][before]:.2f} | "
                     f"{row['ms_cpu'][after]:.2f} | {row[f'{after}_vs_{before}']:.2f}x |")
    text = "\n".join([*lines, ""])
    write_report(args.out, args.name, result, text)
    print(text)


if __name__ == "__main__":
    main()

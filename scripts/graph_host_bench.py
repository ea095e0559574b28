"""Host time of an emulated step whose Linear layers run as compiled graphs (the CUDA path), on a CPU.

On a GPU, transformer_lm's emulated steps are paced by their host (docs/benchmarks/README.md, the
sixth GPU run), and no GPU is needed to count that host work: with tiny shapes (a 4-layer transformer
of d_model 64, 2 x 16 tokens) a CPU step's kernels take little, and the step is mostly Python,
dispatch and inductor's generated wrappers. ``fused.graphs("cpu")`` turns the Linear graphs on here.

In one process, one thread, interleaved rounds, it times the same model's step two ways:

- ``named``: every ``compiled_calls.call_graph`` call names its variant and key before finding its
  direct call (the path before ``_graph_fast``);
- ``fast``: from a layout's third call on, the direct call is found by the arguments themselves.

It reports the median CPU time of a step and the Python function calls a step makes (cProfile's
count: the same on every machine), and checks that both ways compute the same losses.

    python scripts/graph_host_bench.py --out docs/benchmarks --name cpu-2026-11-28-avx2-graph-host
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from mptrain.bench.common import cpu_header, cpu_script_stamp, load_averages, write_report
from mptrain.config import MXPrecisionConfig
from mptrain.models.transformer import TransformerLanguageModel
from mptrain.numerics import compiled_calls, fused, rounding_rng
from mptrain.numerics.precision import build_precision

VOCAB, D_MODEL, LAYERS, HEADS, TOKENS, ROWS = 256, 64, 4, 4, 16, 2


class _Off(dict):
    """A ``_graph_fast`` that never finds or keeps anything: every call takes the named path."""

    def get(self, *args: Any) -> None:
        return None

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


@contextlib.contextmanager
def named() -> Iterator[None]:
    real = compiled_calls._graph_fast
    compiled_calls._graph_fast = _Off()
    try:
        yield
    finally:
        compiled_calls._graph_fast = real


def build(fmt: str, compute: str) -> Callable[[], float]:
    """A fresh model from seed 0 in ``precision=mx`` with ``fmt``; returns its training step."""
    torch.manual_seed(0)
    cfg = OmegaConf.structured(MXPrecisionConfig(name="mx", format=fmt, emulated_compute=compute))
    precision = build_precision(cfg, torch.device("cpu"))
    model = precision.prepare_model(TransformerLanguageModel(VOCAB, D_MODEL, LAYERS, HEADS, TOKENS))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, VOCAB, (ROWS, TOKENS), generator=g), torch.randint(0, VOCAB, (ROWS, TOKENS), generator=g)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
        loss.backward()
        opt.step()
        precision.after_step()
        return loss.item()

    return step


def graph_calls(step: Callable[[], float]) -> int:
    """``call_graph`` calls in one step (two a Linear layer: forward and backward)."""
    real, n = compiled_calls.call_graph, [0]

    def count(*args: Any) -> Any:
        n[0] += 1
        return real(*args)

    compiled_calls.call_graph = count
    try:
        step()
    finally:
        compiled_calls.call_graph = real
    return n[0]


def python_calls(step: Callable[[], float], n: int = 5) -> float:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    return pstats.Stats(prof).total_calls / n  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="mxfp8,nvfp4")
    ap.add_argument("--compute", default="fp32", choices=("fp32", "bf16"),
                    help="precision.emulated_compute (bf16 GEMMs are emulated on an AVX2-only CPU)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default="cpu-graph-host")
    args = ap.parse_args(argv)
    info = cpu_script_stamp("graph_host_bench.py", argv)
    rounding_rng.seed_rounding(0)
    ways: dict[str, Callable[[], Any]] = {"named": named, "fast": contextlib.nullcontext}
    rows = []
    with fused.graphs("cpu"):
        for fmt in args.formats.split(","):
            steps = {way: build(fmt, args.compute) for way in ways}
            losses: dict[str, list[float]] = {}
            for way, context in ways.items():
                with context():
                    losses[way] = [steps[way]() for _ in range(4)]  # compiles, then direct calls
            times: dict[str, list[float]] = {way: [] for way in ways}
            for _ in range(args.rounds):
                for way, context in ways.items():
                    with context():
                        t0 = time.process_time()
                        for _ in range(args.steps):
                            losses[way].append(steps[way]())
                        times[way].append((time.process_time() - t0) / args.steps)
            calls = {}
            for way, context in ways.items():
                with context():
                    calls[way] = python_calls(steps[way])
            graphs = graph_calls(steps["fast"])
            ms = {way: round(1e3 * statistics.median(t), 3) for way, t in times.items()}
            rows.append({
                "format": fmt, "step_ms_cpu": ms,
                "spread_cpu": {w: round((max(t) - min(t)) / statistics.median(t), 3) for w, t in times.items()},
                "python_calls_per_step": calls, "same_losses": losses["named"] == losses["fast"],
                "graph_calls_per_step": graphs,
            })  # fmt: skip
    result = {"info": info | {"load_average_end": load_averages()},
              "model": {"vocab": VOCAB, "d_model": D_MODEL, "layers": LAYERS, "heads": HEADS, "tokens": TOKENS,
                        "rows": ROWS},
              "compute": args.compute, "rounds": args.rounds, "steps": args.steps, "rows": rows}  # fmt: skip
    write_report(args.out, args.name, result, markdown(result))
    print(markdown(result))


def markdown(r: dict[str, Any]) -> str:
    info, m = r["info"], r["model"]
    lines = [
        *cpu_header(info, "Host time of an emulated step with the Linear graphs on (the CUDA path), on a CPU",
                    f"- model: transformer LM, {m['layers']} layers, d_model {m['d_model']}, vocab {m['vocab']}, "
                    f"{m['rows']} x {m['tokens']} tokens; precision=mx, emulated_compute={r['compute']}; AdamW "
                    "(for-loop)",
                    f"- method: see the script's docstring; {r['rounds']} interleaved rounds of {r['steps']} steps "
                    "each way, median CPU time of a step; Python calls a step from cProfile over 5 steps"),
        "| format | way | step ms (CPU) | spread | Python calls a step | graph calls a step | same losses |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        for way, ms in row["step_ms_cpu"].items():
            lines.append(f"| {row['format']} | {way} | {ms:.2f} | {row['spread_cpu'][way]:.0%} | "
                         f"{row['python_calls_per_step'][way]:,.0f} | {row['graph_calls_per_step']} | "
                         f"{'yes' if row['same_losses'] else 'no'} |")
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    main()

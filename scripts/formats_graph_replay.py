"""Replay gpu_check's formats cells on a CPU with the Linear GEMM graphs forced on, and print which
graphs each cell compiled and which it gave up for per-quantizer kernels.

The H200's second run measured mxfp8 with bf16 products slower than with FP32 products, and did not
record whether any graph had been given up (docs/benchmarks/README.md). This asks the question the
run could not, on the same cells at a CPU's size (transformer_lm_tiny):

    python scripts/formats_graph_replay.py
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path

from mptrain.bench.cli import main as bench
from mptrain.numerics import compiled_calls, fused

CELLS = "amp_bf16,mxfp8,mxfp8_bf16,nvfp4,nvfp4_bf16"


def main() -> None:
    out = Path(tempfile.mkdtemp())
    logging.getLogger("mptrain.numerics.fused").addHandler(logging.StreamHandler(sys.stdout))  # a give-up's line
    with fused.graphs("cpu"), fused.forced():
        bench(["--no-process-warmup", "--out", str(out), "--name", "replay", "--models", "transformer_lm_tiny",
               "--batch-sizes", "4", "--steps", "4", "--window", "2", "--warmup", "2", "--precisions", CELLS,
               "--device", "cpu"])
    print(f"graphs compiled: {len(compiled_calls._graphs)}; given up: {sorted(compiled_calls._given_up) or 'none'}")
    for c in json.loads((out / "replay.json").read_text())["cells"]:
        print(f"{c['precision']:<12} {1e3 * c['step_time_s']:6.1f} ms  {c.get('fused_graphs')}")


if __name__ == "__main__":
    main()

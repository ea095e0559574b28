"""NVFP4's B = 1 blocks viewed per row or as one run of blocks, side by side in one process, on a CPU.

``fused_kernels._k_blocks`` works out NVFP4's per-block scales (kept: ``kept_scales_bench.py``) in a
loop of their own, which inductor vectorises along its inner dim. For blocks along the contiguous
dim (B = 1) viewed per row, (A, N / 16, 16, 1), that dim is a row's N / 16 blocks: in a row under
16 blocks (every ResNet-50/8 activation, 256 channels or fewer) each block's scale ran in the loop's
scalar remainder. From 75af21a on, a CPU views them as one run, (A * N / 16, 1, 16, 1); from
b4dd031 to 1cd9006, all but the stochastic and rotated ones (wgrad's gradients), which this measured
slower so, until the integer amax tree (flat only: ``amax_bits_bench.py``) made them faster flat as
well. This replays one NVFP4 ResNet-50/8 step's B = 1 block-kernel calls (``kept_scales_bench.record``)
two ways, each through ``compiled_calls._call`` as a kernel of its own:

- ``rows``: the body with ``flat=False`` (per row, as before 75af21a, so without the tree);
- ``flat``: the library's kernel (at b4dd031 to 1cd9006 its stochastic rotated calls ran per row both
  ways: the method's noise).

Both return the same values bit for bit (checked on every call here). Reported per kind of call (to
nearest or stochastic, rotated or not): the minimum over interleaved rounds of the CPU time of all
that kind's calls of one step. Freed host memory is kept, as a run keeps it (``trainer.keep_host_memory``).

    python scripts/flat_blocks_bench.py --out docs/benchmarks --name cpu-2026-11-29-avx512-flat-blocks
"""

from __future__ import annotations

import kept_scales_bench  # the script beside this one (its directory leads sys.path)


def main(argv: list[str] | None = None) -> None:
    before = ("rows", kept_scales_bench.blocks_with(flat=False))
    kept_scales_bench.compare(argv, "flat_blocks_bench.py", __doc__, "cpu-flat-blocks", before, "flat",
                              "NVFP4's B = 1 blocks per row or as one run: one ResNet-50/8 step's B = 1 block "
                              "calls, side by side")


if __name__ == "__main__":
    main()

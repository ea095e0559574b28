"""NVFP4's amaxes as floats or from the elements' bits, side by side in one process, on a CPU.

From 05be55f on, ``fused_kernels._k_blocks`` takes NVFP4's amaxes on a CPU as integer maxima of the
elements' bits less the sign: the per-block amax of blocks along the contiguous dim (B = 1) as a
tree of maxima (``_tree_amax``), and the tensor amax of the finite elements as an integer amax
(``_tensor_scale``). A float amax checks for NaN in every step of its reduction, and for B = 1
blocks, inductor reduces each block's vector across its lanes. This replays one NVFP4 ResNet-50/8
step's block-kernel calls, every B (``kept_scales_bench.record``), two ways, each through
``compiled_calls._call`` as a kernel of its own:

- ``floats``: the body with ``bits=False`` (as before 05be55f);
- ``bits``: the library's kernel.

Both return the same values bit for bit (checked on every call here). Reported per kind of call (to
nearest or stochastic, rotated or not, B = 1 or more): the minimum over interleaved rounds of the
CPU time of all that kind's calls of one step. Freed host memory is kept, as a run keeps it
(``trainer.keep_host_memory``).

    python scripts/amax_bits_bench.py --out docs/benchmarks --name cpu-2026-11-29-avx512-amax-bits
"""

from __future__ import annotations

import kept_scales_bench  # the script beside this one (its directory leads sys.path)


def main(argv: list[str] | None = None) -> None:
    before = ("floats", kept_scales_bench.blocks_with(bits=False))
    kept_scales_bench.compare(argv, "amax_bits_bench.py", __doc__, "cpu-amax-bits", before, "bits",
                              "NVFP4's amaxes as floats or from the bits: one ResNet-50/8 step's block calls, "
                              "side by side", every_b=True)


if __name__ == "__main__":
    main()

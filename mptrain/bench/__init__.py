"""``mptrain-bench``: speed and memory of the engine, against a bare PyTorch loop, cell by cell.

    mptrain-bench --models resnet50,alexnet --precisions fp32,amp_bf16 --batch-sizes 32,64 \\
        --steps 20 --warmup 5 --image-size 64 --width-divisor 4 --out docs/benchmarks
    mptrain-bench --models resnet50 --precisions fp32,tf32,amp_fp16,amp_bf16,fp16_master \\
        --batch-sizes 256 --overrides trainer.channels_last=true --fast-paths --out docs/benchmarks
    mptrain-bench data --workers 0,1,2 --out docs/benchmarks   # the input pipeline alone: bench/data.py

A cell is one (model, precision, batch size, variant). A variant is the base config (the grid plus
``--overrides``) or the base with one fast path toggled (``--fast-paths``: channels_last, compile,
fused / foreach optimizer, cudnn.benchmark) or with the numerics telemetry on. For each cell, in one
process and on the same synthetic batches:

- the **engine**: a real ``Engine`` built from the composed Hydra config (in a temporary run
  directory, logger closed: no TensorBoard, console or checkpoint work), timed through
  ``Engine._train_step`` exactly as ``Engine.fit`` calls it;
- the **bare loop**: plain ``torch.autocast`` + ``torch.amp.GradScaler`` (enabled for FP16 only),
  written here, on a model built by ``mptrain.models.create_model`` and loaded with the engine's
  initial weights, with the same memory layout, optimizer (same param groups, lr, impl), schedule
  (the same function over plain Python values), gradient clipping and accumulation. fp16_master
  gets the textbook FP16-weights + FP32-masters loop; bf16_pure and fp8 have no bare loop.

Timing: warm-up steps (whose losses are the like-for-like check), then ``--steps`` timed steps per
runner in windows of ``--window`` steps, engine and bare windows interleaved so that drift and
other processes hit both alike. Both runners start every group of steps from the same RNG state
on the same batches, so they stay on one trajectory and do the same work. A window is bracketed by
CUDA events after a synchronize on CUDA; on CPU by ``perf_counter`` (``--clock wall``) or by the
process's CPU time (``--clock cpu``: for a machine shared with other jobs). The step time is the
median window's; ``overhead`` = engine / bare step time.

Peak memory (CUDA only) is each runner's resident memory plus the peak of one extra steady-state
step over it (``reset_peak_memory_stats`` / ``max_memory_allocated``) plus one step's batches, so
the two runners living side by side do not count against each other. MFU: FLOPs of one training
step counted by ``torch.utils.flop_counter.FlopCounterMode`` (matmuls and convolutions, forward
and backward) over the datasheet dense peak of the cell's compute dtype (``PEAK_TFLOPS``) or
``--peak-tflops``; null on CPU unless that is given. ``--profile N`` writes torch.profiler and
cProfile tables of N steps of each runner, and the ops the engine calls that the bare loop does not.

The package, module by module:

- ``harness.py``: cells and variants, timing windows, ``run_cell``, FLOP counting, peak memory,
  profiling, the ratios between cells;
- ``runners.py``: the two runners, the engine's step (``EngineRunner``) and the bare loop
  (``BareRunner``, ``build_bare``);
- ``tables.py``: the report's tables, for the console (rich) and as markdown;
- ``cli.py``: the parser, the grid (``plan``), ``run`` and ``main``;
- ``data.py``: ``mptrain-bench data``, the input pipeline alone;
- ``common.py``: what both harnesses stamp their results with.
"""

from mptrain.bench.cli import (
    PRECISION_ALIASES,
    base_overrides,
    build_parser,
    main,
    parse_list,
    plan,
    run,
    write_result,
)
from mptrain.bench.harness import (
    FAST_PATHS,
    METHOD,
    PEAK_TFLOPS,
    TELEMETRY_EVERY_STEP,
    TELEMETRY_KEY,
    TELEMETRY_ON,
    Cell,
    Options,
    Timing,
    Variant,
    add_ratios,
    compute_dtype,
    count_flops,
    count_syncs,
    peak_tflops,
    profile_cell,
    run_cell,
    step_peak,
    time_window,
    variants_for,
    warm,
)
from mptrain.bench.runners import BareRunner, EngineRunner, Runner, build_bare
from mptrain.bench.tables import markdown, print_tables

__all__ = [
    "FAST_PATHS", "METHOD", "PEAK_TFLOPS", "PRECISION_ALIASES", "TELEMETRY_EVERY_STEP", "TELEMETRY_KEY",
    "TELEMETRY_ON", "BareRunner", "Cell", "EngineRunner", "Options", "Runner", "Timing", "Variant",
    "add_ratios", "base_overrides", "build_bare", "build_parser", "compute_dtype", "count_flops",
    "count_syncs", "main", "markdown", "parse_list", "peak_tflops", "plan", "print_tables", "profile_cell",
    "run", "run_cell", "step_peak", "time_window", "variants_for", "warm", "write_result",
]

"""``mptrain-bench``'s command line: the parser, the grid of cells (``plan``), the run over it (``run``,
which writes ``<stem>.json`` and ``.md`` after every cell) and ``main``. ``mptrain-bench data ...``
is handed to ``mptrain.bench.data``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from mptrain.bench.common import device_name, stamp
from mptrain.bench.common import slug as _slug
from mptrain.bench.harness import (
    FAST_PATHS,
    METHOD,
    TELEMETRY_KEY,
    TELEMETRY_ON,
    Cell,
    Options,
    _release,
    add_ratios,
    frozen_heap,
    run_cell,
    variants_for,
)
from mptrain.bench.tables import _mib, _ms, _num, _x, markdown, print_tables
from mptrain.errors import MptrainError

# ------------------------------------------------------------------------------------ grid


def parse_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


# The modes that also come compiled whole (PRECISION_ALIASES' *_compiled, *_cudagraphs): the baselines,
# MXFP8 and NVFP4, whose layers trainer.compile traces into the model's graph.
_MXFP8 = ["precision=mx", "precision.format=mxfp8"]
_NVFP4 = ["precision=mx", "precision.format=nvfp4"]
_COMPILABLE = {"fp32": ["precision=fp32"], "amp_bf16": ["precision=amp_bf16"], "mxfp8": _MXFP8,
               "mxfp8_bf16": [*_MXFP8, "precision.emulated_compute=bf16"], "nvfp4": _NVFP4,
               "nvfp4_bf16": [*_NVFP4, "precision.emulated_compute=bf16"]}

# Precision names the harness accepts beyond the config group's: a mode with a non-default option,
# so one grid can hold both FP8 backends.
PRECISION_ALIASES = {
    "fp8_torchao": ["precision=fp8", "precision.backend=torchao", "precision.recipe=tensorwise"],
    "fp8_torchao_rowwise": ["precision=fp8", "precision.backend=torchao", "precision.recipe=rowwise"],
    # The emulated block formats by name, so one grid can hold them beside amp_bf16 (their "vs bf16").
    **{fmt: ["precision=mx", f"precision.format={fmt}"] for fmt in ("mxfp8", "mxfp6", "mxfp4", "nvfp4")},
    # ...and with their products in bf16 (tensor cores, FP32 accumulation) rather than FP32: on the
    # H200 the FP32 GEMMs, not the quantizers, set the emulation's pace (docs/benchmarks).
    **{f"{fmt}_bf16": ["precision=mx", f"precision.format={fmt}", "precision.emulated_compute=bf16"]
       for fmt in ("mxfp8", "mxfp6", "mxfp4", "nvfp4")},
    # ...and with the rest of the model in a bf16 autocast too (the layers kept high, attention), as
    # amp_bf16 runs it: on the H200 of 2026-11-28 NVFP4's kept layers alone took 4.4 ms of FP32 GEMMs.
    **{f"{fmt}_bf16_amp": ["precision=mx", f"precision.format={fmt}", "precision.emulated_compute=bf16",
                           "precision.autocast=bf16"] for fmt in ("mxfp8", "mxfp6", "mxfp4", "nvfp4")},
    # ...and with inductor's combo kernels in their CUDA graphs (precision.graph_combo_kernels): fewer
    # launches a Linear, where the launches paced the H200's step
    **{f"{fmt}_bf16_combo": ["precision=mx", f"precision.format={fmt}", "precision.emulated_compute=bf16",
                             "precision.graph_combo_kernels=true"] for fmt in ("mxfp8", "nvfp4")},
    # ...and with each layer's CUDA graphs compiled for its shapes (precision.graph_static_shapes): no
    # division by a run-time size in their kernels
    **{f"{fmt}_bf16_static": ["precision=mx", f"precision.format={fmt}", "precision.emulated_compute=bf16",
                              "precision.graph_static_shapes=true"] for fmt in ("mxfp8", "nvfp4")},
    # ...and compiled whole, the emulated layers traced into the model's graph (trainer.compile; NVFP4
    # with its recipe's stochastic rounding), beside amp_bf16 compiled the same way; "cudagraphs": with
    # compile_mode=reduce-overhead, which replays each step's kernels as CUDA graphs on a GPU
    **{f"{name}_compiled": [*_COMPILABLE[name], "trainer.compile=true"] for name in _COMPILABLE},
    **{f"{name}_cudagraphs": [*_COMPILABLE[name], "trainer.compile=true",
                              "trainer.compile_mode=reduce-overhead"] for name in _COMPILABLE},
}


# --models entries ROUTE:NAME bring a model (README, "Bring your own model"): the key NAME sets.
ROUTE_KEYS = {"torchvision": "arch", "timm": "arch", "hf_causal_lm": "model_type", "custom": "_target_"}
# hf_causal_lm cells: a small decoder (a config type's defaults are its full size: 7B for llama),
# unless an --override sets model.config.
HF_BENCH_CONFIG = "model.config={hidden_size:256,intermediate_size:1024,num_hidden_layers:4,num_attention_heads:4}"


def model_overrides(entry: str, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """A --models entry as overrides: a model config's name (resnet50), or ROUTE:NAME
    (torchvision:resnet18, timm:convnext_atto, hf_causal_lm:llama, custom:torchvision.models.resnet18)."""
    route, sep, name = entry.partition(":")
    if not sep:
        return [f"model={entry}"]
    if route not in ROUTE_KEYS or not name:
        raise MptrainError(f"--models {entry}: a route entry is ROUTE:NAME with ROUTE one of {', '.join(ROUTE_KEYS)}")
    out = [f"model={route}", f"model.{ROUTE_KEYS[route]}={name}"]
    if route == "hf_causal_lm" and not any(o.startswith("model.config=") for o in overrides):
        out.append(HF_BENCH_CONFIG)
    return out


def base_overrides(model: str, precision: str, batch: int, args: argparse.Namespace) -> list[str]:
    chosen = PRECISION_ALIASES.get(precision, [f"precision={precision}"])
    out = [*model_overrides(model, args.overrides), *chosen, f"data.batch_size={batch}"]
    if args.device != "auto":
        out.append(f"trainer.device={args.device}")
    return out


def plan(args: argparse.Namespace) -> tuple[list[tuple[Cell, DictConfig]], list[dict[str, str]], bool]:
    """Compose and validate every cell's config before any is run.

    Returns (cells, skipped models with the reason, whether the telemetry key exists).
    """
    from mptrain.cli import choices, compose
    from mptrain.config import register_configs, validate

    register_configs()
    # The model configs; the routes need a NAME (ROUTE:NAME), so 'all' is the configs that name their model.
    registered = [m for m in choices("model") if m not in ROUTE_KEYS]
    models = registered if args.models == "all" else parse_list(args.models)
    skipped: list[dict[str, str]] = []
    cells: list[tuple[Cell, DictConfig]] = []
    telemetry_exists = False
    paths = [] if args.fast_paths is None else (
        list(FAST_PATHS) if args.fast_paths == "all" else parse_list(args.fast_paths))
    for p in paths:
        if p not in FAST_PATHS:
            raise MptrainError(f"--fast-paths {p}: unknown; choose from {', '.join(FAST_PATHS)}")
    total = args.warmup + args.steps + 8 + args.profile * 2  # every step either runner takes
    for model in models:
        if ":" not in model and model not in registered:
            skipped.append({"model": model, "reason": "no such model config (configs/model)"})
            continue
        try:
            probe = compose([*model_overrides(model, args.overrides), *args.overrides])
            validate(probe)  # an unknown arch or a missing extra: skipped with its one line
        except MptrainError as exc:
            skipped.append({"model": model, "reason": str(exc)})
            continue
        telemetry_exists = telemetry_exists or TELEMETRY_KEY in probe
        task = probe.model.get("task", "classification")
        for precision in parse_list(args.precisions):
            for batch in [int(b) for b in parse_list(args.batch_sizes)]:
                extra = base_overrides(model, precision, batch, args)
                if task == "classification":
                    if args.image_size:
                        extra.append(f"data.image_size={args.image_size}")
                    if args.width_divisor and "width_divisor" in probe.model:  # the zoo routes narrow
                        extra.append(f"model.width_divisor={args.width_divisor}")
                    accum = int(probe.trainer.grad_accum)
                    extra.append(f"data.train_samples={max(1280, batch * accum * args.pool)}")
                extra += [f"trainer.max_steps={total}", *args.overrides]
                cfg = compose(extra)
                validate(cfg)
                for v in variants_for(cfg, paths, args.compile_mode, args.telemetry):
                    overrides = extra + v.overrides
                    vcfg = cfg if not v.overrides else compose(overrides)
                    validate(vcfg)
                    if v.name == "telemetry":
                        v.setting = f"telemetry on, every {vcfg.telemetry.every} steps (mean)"
                    cells.append((Cell(model, precision, batch, v, overrides), vcfg))
    return cells, skipped, telemetry_exists


# ------------------------------------------------------------------------------------ entry


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mptrain-bench",
        description="Throughput, step time, peak memory and MFU of mptrain's engine against a bare "
                    "PyTorch loop, over a grid of models x precisions x batch sizes (synthetic data).")
    p.add_argument("--models", default="resnet50",
                   help="comma list of model configs or ROUTE:NAME entries (torchvision:resnet18, timm:convnext_atto, "
                        "hf_causal_lm:llama, custom:pkg.module.fn), or 'all' (default resnet50)")
    p.add_argument("--precisions", default=None,
                   help="comma list (default: fp32,amp_bf16 on CPU; fp32,tf32,amp_fp16,amp_bf16,fp16_master on CUDA)")
    p.add_argument("--batch-sizes", default=None, help="comma list (default: 32 on CPU, 256 on CUDA)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per runner (default 20)")
    p.add_argument("--window", type=int, default=5, help="steps per timed window (default 5)")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps per runner (default 5, >= 1)")
    p.add_argument("--pool", type=int, default=4, help="distinct synthetic batches cycled through (default 4)")
    p.add_argument("--image-size", type=int, default=None, help="data.image_size (default: the model's for the device)")
    p.add_argument("--width-divisor", type=int, default=None, help="model.width_divisor (CNNs)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="CPU timing: wall (perf_counter) or cpu (process CPU time: for a machine shared "
                        "with other jobs; with --threads 1 it is the step's own work). CUDA always uses events")
    p.add_argument("--overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="extra mptrain overrides applied to every cell, e.g. trainer.channels_last=true")
    p.add_argument("--fast-paths", nargs="?", const="all", default=None, metavar="LIST",
                   help=f"also measure each fast path toggled ({', '.join(FAST_PATHS)}; default all)")
    p.add_argument("--compile-mode", default="default", choices=("default", "reduce-overhead", "max-autotune"),
                   help="trainer.compile_mode for the compile fast path")
    p.add_argument("--telemetry", action="store_true",
                   help=f"also measure with {' '.join(TELEMETRY_ON)} (when the config has '{TELEMETRY_KEY}')")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: table; CPU: none)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="profile STEPS steps of each runner per cell (torch.profiler + cProfile) into --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-process-warmup", action="store_true",
                   help="skip the throwaway run of the first cell before the measured ones")
    p.add_argument("--out", type=Path, default=None, help="write <device>-<date>.json and .md here")
    p.add_argument("--name", default=None, help="file stem for --out (default <device>-<date>)")
    return p


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Measure the grid; returns the result dict (also written under ``args.out``)."""
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with warnings.catch_warnings(), frozen_heap():
            # A skipped first FP16 step makes torch warn that the scheduler stepped first; filtered
            # once for the whole run, so the bare loop pays for no warnings context per step.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            return _run(args, argv)
    finally:
        torch.set_num_threads(threads)  # callers in the same process (tests) keep their setting


def _run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    if args.precisions is None:
        args.precisions = "fp32,tf32,amp_fp16,amp_bf16,fp16_master" if cuda else "fp32,amp_bf16"
    if args.batch_sizes is None:
        args.batch_sizes = "256" if cuda else "32"
    for name in ("steps", "window", "warmup", "pool"):
        if getattr(args, name) < 1:
            raise MptrainError(f"--{name}={getattr(args, name)}: must be >= 1")
    if args.window > args.steps:
        args.window = args.steps
    cells, skipped, telemetry_exists = plan(args)
    meta = stamp(device, argv, torch.get_num_threads())
    meta["method"] = METHOD
    meta["options"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    if args.telemetry:
        meta["telemetry"] = ("measured on/off: variants 'telemetry' (its default every) and 'telemetry_every_step' "
                             "(every=1: the cost of one captured step), by mean step time" if telemetry_exists else
                             f"not measured: the config has no '{TELEMETRY_KEY}' key yet "
                             f"(hook: mptrain.bench.TELEMETRY_KEY / TELEMETRY_ON)")
    if cuda and args.clock == "cpu":
        raise MptrainError("--clock cpu: CUDA work is timed with device events; use --clock wall")
    meta["clock"] = "cuda events" if cuda else {"wall": "wall (perf_counter)", "cpu": "process CPU time"}[args.clock]
    opts = Options(steps=args.steps, window=args.window, warmup=args.warmup, pool=args.pool, seed=args.seed,
                   peak_tflops=args.peak_tflops, profile=args.profile, out=args.out, clock=args.clock)
    records: list[dict[str, Any]] = []
    flops_cache: dict[str, int | None] = {}
    result: dict[str, Any] = {"meta": meta, "cells": records, "skipped": skipped}
    stem = args.name or "-".join([_slug("cpu" if device.type == "cpu" else device_name(device).replace("NVIDIA", "")),
                                  meta["date"][:10]])
    if cells and not args.no_process_warmup:
        # A throwaway run of the first cell: the first cell a process measures on CPU showed a
        # transient (one runner 40% slower for dozens of steps, then the other: allocator and page
        # placement settling) that later cells never showed.
        print(f"[0/{len(cells)}] process warm-up (discarded): {cells[0][0].key}", file=sys.stderr, flush=True)
        warm_opts = Options(steps=2 * opts.window, window=opts.window, warmup=opts.warmup, pool=opts.pool,
                            seed=opts.seed, clock=opts.clock)
        with contextlib.suppress(MptrainError, RuntimeError, torch.cuda.OutOfMemoryError):
            run_cell(cells[0][0], cells[0][1], warm_opts, {})
    for i, (cell, cfg) in enumerate(cells, 1):
        print(f"[{i}/{len(cells)}] {cell.key}", file=sys.stderr, flush=True)
        try:
            rec = run_cell(cell, cfg, opts, flops_cache)
        except (MptrainError, RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            rec = {"model": cell.model, "precision": cell.precision, "batch_size": cell.batch_size,
                   "variant": cell.variant.name, "overrides": cell.overrides,
                   "error": f"{type(exc).__name__}: {first[:300]}"}
            _release(device)
        records.append(rec)
        print(f"    {_one_line(rec)}", file=sys.stderr, flush=True)
        add_ratios(records)
        meta["complete"] = i == len(cells)
        if hasattr(os, "getloadavg"):
            meta["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
        if args.out is not None:  # after every cell: a run cut short (a time limit) keeps what it measured
            result["files"] = write_result(result, args.out, stem)
    if not cells:
        meta["complete"] = True
        if args.out is not None:
            result["files"] = write_result(result, args.out, stem)
    return result


def _one_line(rec: dict[str, Any]) -> str:
    if "error" in rec:
        return rec["error"]
    return (f"engine {_ms(rec['step_time_s'])} ms, bare {_ms(rec['bare_step_time_s'])} ms, "
            f"engine/bare {_x(rec['overhead'], 3)}, {_num(rec['throughput'])} {rec['unit']}/s"
            + (f", peak {_mib(rec['peak_memory_bytes'])} MiB" if rec["peak_memory_bytes"] is not None else ""))


def write_result(result: dict[str, Any], out: Path, stem: str) -> list[str]:
    """Write ``<stem>.json`` and ``<stem>.md`` (atomically: a reader never sees half a file)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    texts = [json.dumps({k: v for k, v in result.items() if k != "files"}, indent=2, default=str) + "\n",
             markdown(result)]
    for path, text in zip(paths, texts, strict=True):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return [str(p) for p in paths]


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``mptrain-bench``. Exit status 2 on bad input, with one line on stderr."""
    args_list = sys.argv[1:] if argv is None else list(argv)
    if args_list[:1] == ["data"]:  # the input pipeline alone: its own module
        from mptrain.bench import data

        return data.main(args_list[1:])
    args = build_parser().parse_args(args_list)
    try:
        result = run(args, args_list)
    except MptrainError as exc:
        print(f"mptrain-bench: error: {exc}", file=sys.stderr)
        return 2
    print_tables(result)
    for path in result.get("files", []):
        print(f"wrote {path}", file=sys.stderr)
    return 0



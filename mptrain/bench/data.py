"""``mptrain-bench data``: the image_folder input pipeline alone (no model), on real JPEG files.

    mptrain-bench data --workers 0,1,2 --decodes pil,cpu --out docs/benchmarks
    mptrain-bench data --device cuda --workers 4,8,15 --decodes pil,cpu,gpu --batch-size 256 \\
        --images 4096 --channels-last --out docs/benchmarks
    mptrain-bench data --device cuda --workers 15 --decodes cpu,gpu --batch-size 256 --images 32768 \\
        --splits "" --channels-last --train resnet50 --train-overrides precision=mixed

``--train MODEL`` then trains MODEL through the real engine (``mptrain.run.train``), once on
synthetic data and once on the JPEG tree per decode path, same config otherwise, and reports the
engine's median throughput, the median data-wait fraction, and each run's throughput over the
synthetic run's: the input pipeline's share of a real run, side by side in one harness run.

A JPEG ImageFolder is written on the fly into a temporary directory (ImageNet-like: about 500x375,
quality 90, smooth content plus sensor-like noise, so a file is about 100 KB as in ImageNet's
train set). For each transform (``train``: RandomResizedCrop + flip; ``val``: resize + center crop)
and each worker count, one loader per ``data.decode`` is built through ``build_image_data`` exactly
as a run builds it, and each is timed over whole passes until it yields float, normalised batches on
the device. The decode paths are timed in interleaved rounds (ABC, CBA, ...) so that load from other
processes hits them alike; ``vs_<first decode>`` is the median of the per-round ratios.

Clocks: wall time (``img/s``), and the CPU time of the main process plus its DataLoader workers
(``img/cpu-s``, from /proc), which on a machine shared with other jobs is the per-core cost of the
whole pipeline without time spent descheduled. ``img/s per worker`` divides by ``max(workers, 1)``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from mptrain.errors import MptrainError

DECODES = ("pil", "cpu", "gpu")
SPLITS = ("train", "val")

METHOD = ("per (split, workers) cell: one loader per decode path built by build_image_data (as a run does), "
          "one untimed warm-up pass each (starts the persistent workers), then --rounds rounds; in a round "
          "each loader makes --passes full passes (train: whole epochs; val: the whole val split), in "
          "alternating order. img/s = images / wall time until the last float batch is on the device "
          "(CUDA: synchronised); img/cpu-s = images / CPU time of the main process and its workers (/proc: "
          "user + system; robust to a shared machine, and per core what img/s per worker is per worker); "
          "vs_<first> = median over rounds of img/s ratio, measured side by side")


# ------------------------------------------------------------------------------------ images


def make_jpeg_tree(root: Path, *, classes: int, train_images: int, val_images: int, seed: int = 0,
                   size: tuple[int, int] = (500, 375), quality: int = 90, processes: int = 1) -> Path:
    """An ImageNet-layout tree of JPEGs: ``root/{train,val}/class_<k>/<i>.jpg``.

    Content: a low-frequency random field upsampled bicubically plus Gaussian noise, which gives
    JPEG files of ImageNet's size and decode cost (flat colours would compress to a few KB and
    decode unrealistically fast). Sizes vary by up to 20% and one image in five is portrait.
    """
    jobs = []
    for split, n in (("train", train_images), ("val", val_images)):
        for k in range(classes):
            (root / split / f"class_{k:03d}").mkdir(parents=True, exist_ok=True)
        # Each image has its own seed: the tree is the same whatever the number of processes.
        jobs += [(root / split / f"class_{i % classes:03d}" / f"{i:05d}.jpg", (seed, split == "val", i), i % 5 == 4)
                 for i in range(n)]
    if processes > 1 and len(jobs) > 64:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(processes) as pool:
            list(pool.map(_write_jpeg, jobs, [size] * len(jobs), [quality] * len(jobs), chunksize=32))
    else:
        for job in jobs:
            _write_jpeg(job, size, quality)
    return root


def _write_jpeg(job: tuple[Path, tuple[int, ...], bool], size: tuple[int, int], quality: int) -> None:
    from PIL import Image

    path, key, portrait = job
    rng = np.random.default_rng(key)
    w0, h0 = size
    w, h = int(w0 * rng.uniform(0.8, 1.0)), int(h0 * rng.uniform(0.8, 1.0))
    if portrait:
        w, h = h, w
    coarse = rng.integers(0, 256, (max(h // 12, 2), max(w // 12, 2), 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32)
    pixels = np.clip(field + rng.normal(0.0, 22.0, field.shape), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path, quality=quality)


def tree_stats(root: Path) -> dict[str, Any]:
    files = sorted(root.rglob("*.jpg"))
    sizes = [f.stat().st_size for f in files]
    return {"files": len(files), "mean_bytes": int(statistics.mean(sizes)) if sizes else 0}


# ------------------------------------------------------------------------------------ timing


def data_config(root: Path, decode: str, workers: int, batch_size: int) -> DictConfig:
    from mptrain.config import DataConfig

    kw: dict[str, Any] = {"name": "image_folder", "root": str(root), "batch_size": batch_size,
                          "num_workers": workers}
    if "decode" in {f.name for f in fields(DataConfig)}:
        kw["decode"] = decode
    elif decode != "pil":  # a tree from before data.decode existed: only today's PIL loader
        raise MptrainError(f"--decodes {decode}: this mptrain has no data.decode (only pil)")
    return OmegaConf.structured(DataConfig(**kw))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_pass(data: Any, split: str, epoch: int, device: torch.device) -> int:
    """Images through one pass, each batch materialised as a float tensor on the device."""
    n = 0
    last = None
    for images, _ in data.train_batches(epoch) if split == "train" else data.val_batches():
        n += images.shape[0]
        last = images
    if last is not None:
        assert last.dtype == torch.float32
    _sync(device)
    return n


def worker_pids(data: Any, split: str) -> list[int]:
    """PIDs of the split's persistent DataLoader workers (private attributes: a benchmark may peek)."""
    loader = getattr(data, "_train_loader" if split == "train" else "_val_loader", None)
    iterator = getattr(loader, "_iterator", None)
    return [w.pid for w in getattr(iterator, "_workers", [])]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of this process (all threads) and of ``pids`` (Linux /proc; else 0)."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
    return total


def time_passes(data: Any, split: str, passes: int, epoch0: int, device: torch.device) -> tuple[int, float, float]:
    """(images, wall seconds, CPU seconds of this process and its workers) over ``passes`` passes."""
    n = 0
    pids = worker_pids(data, split)
    w0, c0 = time.perf_counter(), cpu_seconds(pids)
    for p in range(passes):
        n += one_pass(data, split, epoch0 + p, device)
    return n, time.perf_counter() - w0, cpu_seconds(pids) - c0


def measure_cell(root: Path, split: str, workers: int, decodes: list[str], args: argparse.Namespace,
                 device: torch.device) -> dict[str, Any]:
    from mptrain.data import build_image_data

    loaders = {}
    for d in decodes:
        cfg = data_config(root, d, workers, args.batch_size)
        loaders[d] = build_image_data(cfg, image_size=args.image_size, device=device, seed=args.seed,
                                      channels_last=args.channels_last)
        one_pass(loaders[d], split, 0, device)  # warm-up: worker start, allocator, page cache
    rates: dict[str, list[float]] = {d: [] for d in decodes}
    cpu_rates: dict[str, list[float]] = {d: [] for d in decodes}
    for r in range(args.rounds):
        order = decodes if r % 2 == 0 else decodes[::-1]
        for d in order:
            n, wall, cpu = time_passes(loaders[d], split, args.passes, 1 + r * args.passes, device)
            rates[d].append(n / wall)
            cpu_rates[d].append(n / cpu if cpu > 0 else float("nan"))
    base = decodes[0]
    out: dict[str, Any] = {"split": split, "workers": workers, "decodes": {}}
    for d in decodes:
        rec = {
            "img_s": statistics.median(rates[d]),
            "img_s_rounds": [round(v, 1) for v in rates[d]],
            "img_s_per_worker": statistics.median(rates[d]) / max(workers, 1),
            "img_cpu_s": statistics.median(cpu_rates[d]),
            "spread": (max(rates[d]) - min(rates[d])) / statistics.median(rates[d]),
            f"vs_{base}": statistics.median(a / b for a, b in zip(rates[d], rates[base], strict=True)),
        }
        rec[f"cpu_vs_{base}"] = statistics.median(a / b for a, b in zip(cpu_rates[d], cpu_rates[base], strict=True))
        out["decodes"][d] = rec
    del loaders
    gc.collect()  # shut the persistent workers down before the next cell starts its own
    return out


# ------------------------------------------------------------------------------------ training


def train_runs(root: Path, decodes: list[str], args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """The engine on synthetic data, then on the tree per decode path: same model, batch, precision."""
    from mptrain.cli import compose
    from mptrain.config import register_configs, validate
    from mptrain.run import train

    register_configs()
    common = [f"model={args.train}", f"data.batch_size={args.batch_size}", f"data.image_size={args.image_size}",
              f"trainer.device={device.type}", f"trainer.max_steps={args.train_steps}",
              f"trainer.log_every={args.train_log_every}", "data.max_val_batches=1", "trainer.checkpoint_every=null",
              f"trainer.channels_last={str(args.channels_last).lower()}", *args.train_overrides]
    classes = sum(1 for p in (root / "train").iterdir() if p.is_dir())
    workers = _int_list(args.workers, "--workers")[-1]
    plans = [("synthetic", ["data=synthetic", f"data.num_classes={classes}",
                            f"data.train_samples={max(args.images, args.batch_size)}"])]
    plans += [(f"image_folder/{d}", ["data=image_folder", f"data.root={root}", f"data.decode={d}",
                                     f"data.num_workers={workers}"]) for d in decodes]
    records = []
    for name, data in plans:
        print(f"train {args.train} on {name}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="mptrain-bench-data-run-") as run_dir:
            cfg = compose([*data, *common])
            validate(cfg)
            s = train(cfg, Path(run_dir))
        records.append({"data": name, "throughput": s["throughput"], "data_wait_fraction": s["data_wait_fraction"],
                        "data_wait_s": s["data_wait_s"], "precision": s["precision_resolved"],
                        "steps": s["steps"], "overrides": [*data, *common]})
        print(f"    {s['throughput']:,.1f} img/s, data wait {s['data_wait_fraction']:.0%}", file=sys.stderr, flush=True)
    base = records[0]["throughput"]
    for r in records:
        r["vs_synthetic"] = r["throughput"] / base if base else None
    return records


# ------------------------------------------------------------------------------------ output


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    base = meta["options"]["decodes"].split(",")[0]
    lines = [
        f"# mptrain-bench data: {meta['device_name']} ({meta.get('cpu_capability', '-')})",
        "",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items() if v)}",
        f"- tree: {meta['tree']['files']} JPEGs, mean {meta['tree']['mean_bytes'] / 1e3:.0f} KB; "
        f"image size {meta['options']['image_size']}, batch {meta['options']['batch_size']}",
        f"- cpus: {meta['cpu_count']}, load average {meta.get('load_average_start')} -> "
        f"{meta.get('load_average_end')} (shared machine: read the ratios, not the absolute figures)",
        f"- method: {meta['method']}",
    ]
    if result["cells"]:
        lines += ["", f"| split | workers | decode | img/s | img/s per worker | vs {base} (wall) | img/cpu-s "
                      f"| vs {base} (cpu) | spread |", "|---|---|---|---|---|---|---|---|---|"]
    for cell in result["cells"]:
        for d, rec in cell["decodes"].items():
            lines.append(f"| {cell['split']} | {cell['workers']} | {d} | {rec['img_s']:,.0f} | "
                         f"{rec['img_s_per_worker']:,.0f} | {rec[f'vs_{base}']:.2f}x | {rec['img_cpu_s']:,.0f} | "
                         f"{rec[f'cpu_vs_{base}']:.2f}x | {rec['spread']:.0%} |")
    if result.get("train"):
        title = f"Training {meta['options']['train']} through the engine (median throughput over logging windows):"
        lines += ["", title, "", "| data | img/s | vs synthetic | data wait (fraction of step time) |",
                  "|---|---|---|---|"]
        lines += [f"| {r['data']} | {r['throughput']:,.1f} | {r['vs_synthetic']:.3f} | {r['data_wait_fraction']:.1%} |"
                  for r in result["train"]]
    return "\n".join(lines) + "\n"


def write_result(result: dict[str, Any], out: Path, stem: str) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    body = json.dumps({k: v for k, v in result.items() if k != "files"}, indent=2, default=str) + "\n"
    for path, text in zip(paths, [body, markdown(result)], strict=True):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return [str(p) for p in paths]


# ------------------------------------------------------------------------------------ entry


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise MptrainError(f"{flag} {text}: must be a comma list of integers") from None
    if not values or min(values) < 0:
        raise MptrainError(f"{flag} {text}: must be a comma list of integers >= 0")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mptrain-bench data",
        description="Images per second of the image_folder loader alone (no model) against the number of "
                    "workers and data.decode, on a JPEG ImageFolder written on the fly.")
    p.add_argument("--workers", default="0,1,2", help="comma list of data.num_workers (default 0,1,2)")
    p.add_argument("--decodes", default=None,
                   help=f"comma list of data.decode from {', '.join(DECODES)}; the first is the baseline of the "
                        "ratios (default: pil,cpu; pil,cpu,gpu on CUDA)")
    p.add_argument("--splits", default="train,val",
                   help="train (RandomResizedCrop + flip), val (resize + crop); empty: no loader cells")
    p.add_argument("--images", type=int, default=256, help="training images in the tree (default 256)")
    p.add_argument("--val-images", type=int, default=None, help="val images (default: same as --images)")
    p.add_argument("--classes", type=int, default=4, help="class folders (default 4)")
    p.add_argument("--batch-size", type=int, default=32, help="data.batch_size (default 32)")
    p.add_argument("--image-size", type=int, default=224, help="crop size (default 224)")
    p.add_argument("--passes", type=int, default=1, help="passes per loader per round (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the main process (default 1, as in a DataLoader worker)")
    p.add_argument("--channels-last", action="store_true", help="channels_last batches (as trainer.channels_last)")
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1,
                   help="processes writing the JPEG tree (default: all cores)")
    p.add_argument("--train", default=None, metavar="MODEL",
                   help="also train MODEL through the engine on synthetic data and on the tree (each decode path, "
                        "the last --workers value)")
    p.add_argument("--train-steps", type=int, default=100, help="steps per --train run (default 100)")
    p.add_argument("--train-log-every", type=int, default=10, help="steps per throughput window (default 10)")
    p.add_argument("--train-overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="mptrain overrides for the --train runs, e.g. precision=mixed")
    p.add_argument("--root", type=Path, default=None, help="use this ImageFolder instead of generating one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write <stem>.json and .md here")
    p.add_argument("--name", default=None, help="file stem (default data-<device>-<date>)")
    return p


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    from mptrain.bench.common import device_name, stamp
    from mptrain.bench.common import slug as _slug

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        raise MptrainError("--device cuda: no CUDA device is available")
    device = torch.device("cuda" if cuda else "cpu")
    decodes = [d.strip() for d in (args.decodes or ("pil,cpu,gpu" if cuda else "pil,cpu")).split(",") if d.strip()]
    args.decodes = ",".join(decodes)
    for d in decodes:
        if d not in DECODES:
            raise MptrainError(f"--decodes {d}: unknown decode path (allowed: {', '.join(DECODES)})")
    if "gpu" in decodes and not cuda:
        raise MptrainError("--decodes gpu: needs a CUDA device (nvjpeg); use pil,cpu on CPU")
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    for s in splits:
        if s not in SPLITS:
            raise MptrainError(f"--splits {s}: unknown split (allowed: {', '.join(SPLITS)})")
    workers = _int_list(args.workers, "--workers")
    for name in ("images", "classes", "batch_size", "passes", "rounds", "threads"):
        if getattr(args, name) < 1:
            raise MptrainError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.images < args.batch_size:
        raise MptrainError(f"--images={args.images}: fewer than one batch of --batch-size={args.batch_size}")

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    tmp = None
    try:
        root = args.root
        if root is None:
            tmp = tempfile.TemporaryDirectory(prefix="mptrain-bench-data-")
            root = make_jpeg_tree(Path(tmp.name), classes=args.classes, train_images=args.images,
                                  val_images=args.val_images or args.images, seed=args.seed,
                                  processes=args.processes)
        meta = stamp(device, argv, torch.get_num_threads())
        meta["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        meta["method"] = METHOD
        meta["tree"] = {**tree_stats(root), "generated": args.root is None}
        meta["options"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        cells: list[dict[str, Any]] = []
        result = {"meta": meta, "cells": cells}
        stem = args.name or "-".join(["data", _slug("cpu" if not cuda else device_name(device).replace("NVIDIA", "")),
                                      meta["date"][:10]])
        for split in splits:
            for w in workers:
                print(f"{split} workers={w}: {', '.join(decodes)}", file=sys.stderr, flush=True)
                cell = measure_cell(root, split, w, decodes, args, device)
                cells.append(cell)
                print("    " + ", ".join(f"{d} {r['img_s']:,.0f} img/s ({r[f'vs_{decodes[0]}']:.2f}x)"
                                         for d, r in cell["decodes"].items()), file=sys.stderr, flush=True)
                if hasattr(os, "getloadavg"):
                    meta["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
                if args.out is not None:  # after every cell: a run cut short keeps what it measured
                    result["files"] = write_result(result, args.out, stem)
        if args.train:
            result["train"] = train_runs(root, decodes, args, device)
            if args.out is not None:
                result["files"] = write_result(result, args.out, stem)
        return result
    finally:
        torch.set_num_threads(threads)
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.cleanup()


def main(argv: list[str]) -> int:
    """``mptrain-bench data ...``. Exit status 2 on bad input, with one line on stderr."""
    args = build_parser().parse_args(argv)
    try:
        result = run(args, ["data", *argv])
    except MptrainError as exc:
        print(f"mptrain-bench data: error: {exc}", file=sys.stderr)
        return 2
    print(markdown(result))
    for path in result.get("files", []):
        print(f"wrote {path}", file=sys.stderr)
    return 0

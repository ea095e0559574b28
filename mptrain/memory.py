"""Peak device memory per phase of a run (training's working set, and evaluation's apart), and how
the host's allocator keeps memory between steps."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path
from typing import Any

import torch

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_host_memory() -> str:
    """Ask glibc's malloc to keep freed memory for the next step rather than hand it back to the OS:
    "kept", or "glibc defaults (why)" where it cannot (another C library, another OS), or "LIBRARY
    (preloaded)" where another allocator serves the process (LD_PRELOAD) and glibc's is left alone.

    Why: a training step frees and allocates the same tensors again every step. By default glibc
    returns an allocation over its mmap threshold to the OS when it is freed, and trims the heap's
    top once more than its trim threshold lies free there, so the next step faults that memory in
    again: a page fault, and a page zeroed by the kernel, for every 4 KiB it writes
    (``scripts/host_memory_bench.py`` counts them per step, docs/benchmarks). PyTorch's CPU tuning advice is
    jemalloc or tcmalloc through LD_PRELOAD, which keep freed memory likewise; these two settings do
    it in-process, with no library to install. Process-wide and for the rest of the process: RSS
    stays at the run's peak, as a GPU's caching allocator keeps its own.
    """
    if not sys.platform.startswith("linux"):
        return f"glibc defaults (not on {sys.platform})"
    preloaded = preloaded_allocator()
    if preloaded:  # it keeps freed memory itself; glibc's settings would govern nothing
        return f"{preloaded} (preloaded)"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as exc:
        return f"glibc defaults (no mallopt: {exc})"
    # Up to 1 GiB from the heap (older glibc caps the threshold at 32 MiB), and never trim it.
    mapped = mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 or mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
    if not (mapped and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1):
        return "glibc defaults (mallopt refused the settings)"
    return "kept"


def host_memory(keep: bool) -> str:
    """What serves the run's host allocations, for summary.json's ``host_memory``: with ``keep``,
    ``keep_freed_host_memory()``'s answer; without, glibc's defaults, or the preloaded allocator,
    which serves in glibc's place either way."""
    if keep or preloaded_allocator():  # a preloaded allocator: named, glibc's settings left alone
        return keep_freed_host_memory()
    return "glibc defaults (trainer.keep_host_memory=false)"


def preloaded_allocator() -> str | None:
    """The allocator put in front of glibc's (``LD_PRELOAD=libtcmalloc_minimal.so.4``, jemalloc), or
    None: the process's ``malloc`` is then another library's than libc's own."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    process_malloc = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value  # the first in lookup order
    if process_malloc == ctypes.cast(libc.malloc, ctypes.c_void_p).value:
        return None
    names = [Path(p).name for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split()]
    return next((n for n in names if "malloc" in n), names[0] if names else "another malloc")


class PeakMemory:
    """Peak device memory per phase: the training working set, and evaluation's apart.

    torch keeps one peak counter per device, so it is read and reset at every phase change: an
    evaluation (another batch shape, which also autotunes cuDNN again) or a checkpoint (state
    copied to the host) must not count as training. ``stats``: ``torch.cuda`` on a GPU, None
    elsewhere (no device memory to measure); any object with those two calls stands in for it.
    """

    def __init__(self, device: torch.device, stats: Any = None) -> None:
        self.device = device
        self.stats = stats if stats is not None else (torch.cuda if device.type == "cuda" else None)
        self.train_bytes = 0
        self.eval_bytes: int | None = None

    def reset(self) -> None:
        if self.stats is not None:
            self.stats.reset_peak_memory_stats(self.device)

    def _read(self) -> int:
        return int(self.stats.max_memory_allocated(self.device))

    def end_train(self) -> None:
        """Before an evaluation or a checkpoint: bank training's peak so far."""
        if self.stats is not None:
            self.train_bytes = max(self.train_bytes, self._read())
            self.reset()

    def end_eval(self) -> None:
        if self.stats is not None:
            self.eval_bytes = max(self.eval_bytes or 0, self._read())
            self.reset()

    def train_peak(self) -> int | None:
        """Training's peak (``peak_memory_bytes``); None without device memory statistics."""
        return None if self.stats is None else max(self.train_bytes, self._read())

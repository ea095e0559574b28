"""Peak device memory per phase of a run: training's working set, and evaluation's apart."""

from __future__ import annotations

from typing import Any

import torch


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

"""Tasks: what a model family needs from the one engine loop.

A task supplies its modules, batches, losses, evaluation and samples. The engine owns everything
else: precision, loss scaling, stepping, logging, checkpoints and summary.json. A task with several
losses (a GAN) lists several objectives; each gets its own optimizer and its own loss scaler.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from mptrain.errors import MptrainError
from mptrain.numerics.precision import Precision


@dataclass(frozen=True)
class Objective:
    """One loss, minimised by updating ``module`` (a key of ``Task.modules``)."""

    name: str
    module: str


class Task(ABC):
    """Base class. Subclasses set ``modules``, ``objectives``, ``unit`` and ``primary_metric``."""

    modules: dict[str, nn.Module]
    objectives: list[Objective]
    unit: str = "samples"  # what throughput counts: samples | tokens
    primary_metric: str = "loss"  # key of evaluate()'s result that summarises the run

    @abstractmethod
    def steps_per_epoch(self) -> int: ...

    @abstractmethod
    def train_batches(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """This epoch's batches from index ``start`` on; deterministic, for exact resume."""

    @abstractmethod
    def loss(self, objective: Objective, batch: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """The objective's loss on one (micro-)batch, and extra detached metrics to log.

        Runs inside the precision's autocast context.
        """

    @abstractmethod
    def batch_size(self, batch: Any) -> int:
        """How many ``unit``s a batch holds (for throughput)."""

    @abstractmethod
    def evaluate(self, precision: Precision) -> dict[str, float]: ...

    def describe(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Task state beyond the modules (e.g. a GAN's fixed noise)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional
        pass

    def log_media(self, writer: Any, step: int) -> None:  # noqa: B027 - optional
        """Images or text for TensorBoard on logging steps (e.g. a GAN's sample grid)."""

    def finish(self, run_dir: Any) -> None:  # noqa: B027 - optional
        """Write end-of-run artifacts into the run directory."""


def build_task(cfg: DictConfig, device: torch.device, precision: Precision, image_size: int | None) -> Task:
    """Pick the task for ``model.task``."""
    kind = cfg.model.get("task", "classification")
    if kind == "classification":
        from mptrain.tasks.classification import ClassificationTask

        return ClassificationTask(cfg, device, precision, image_size)
    if kind == "language_model":
        from mptrain.tasks.language_model import LanguageModelTask

        return LanguageModelTask(cfg, device, precision)
    if kind == "gan":
        from mptrain.tasks.gan import GANTask

        return GANTask(cfg, device, precision, image_size)
    raise MptrainError(f"model.task={kind!r}: unknown task (classification, language_model, gan)")

"""What every image dataset offers the engine, and the epoch order they share.

The order of an epoch is a pure function of ``(seed, epoch, rank, world_size)``: a resumed run
recomputes it and starts at the batch it stopped at, without touching the skipped samples.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from mptrain.errors import MptrainError

Batch = tuple[Tensor, Tensor]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """A well-spread 63-bit seed from several integers.

    Seeding with e.g. ``seed + epoch`` would make (seed=0, epoch=1) and (seed=1, epoch=0) share a
    stream; hashing the tuple keeps every combination independent.
    """
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h >> 1  # torch.manual_seed takes any 64-bit value, but stay clear of sign issues


class EpochOrder:
    """DistributedSampler(shuffle=True, drop_last=True) semantics plus batching with drop_last.

    Every rank draws the same permutation of ``range(n)`` from ``(seed, epoch)``, cuts it to a
    multiple of ``world_size`` and takes every ``world_size``-th index from ``rank``: the shards
    are disjoint and equally long, so all ranks run the same number of steps. Within a shard the
    remainder that does not fill a batch is dropped.
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.n = n
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.per_rank = n // world_size
        self.steps = self.per_rank // batch_size

    def indices(self, epoch: int) -> Tensor:
        """This rank's ``per_rank`` sample indices for ``epoch`` (int64, CPU), in order."""
        g = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
        perm = torch.randperm(self.n, generator=g)
        return perm[: self.per_rank * self.world_size][self.rank :: self.world_size]

    def batches(self, epoch: int, start: int = 0) -> Iterator[Tensor]:
        """Index tensors of the epoch's batches ``start, start+1, ...``."""
        check_start(start, self.steps)
        order = self.indices(epoch)
        b = self.batch_size
        for i in range(start, self.steps):
            yield order[i * b : (i + 1) * b]


def check_start(start: int, steps: int) -> None:
    # A bad start is an engine bug, not user input: ValueError rather than MptrainError.
    if not 0 <= start <= steps:
        raise ValueError(f"start={start}: must be in [0, {steps}] (batches in one epoch)")


def check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")


def check_steps(batch_size: int, per_rank: int, what: str, world_size: int) -> None:
    """Refuse a batch size that would leave an epoch with no batch at all."""
    if batch_size > per_rank:
        where = f" per rank ({world_size} ranks)" if world_size > 1 else ""
        raise MptrainError(
            f"data.batch_size={batch_size}: larger than the {per_rank} {what}{where}, "
            f"so an epoch would have 0 batches (use data.batch_size <= {per_rank})"
        )


def val_shard(n: int, batch_size: int, rank: int, world_size: int, max_batches: int | None) -> list[Tensor]:
    """Index batches of this rank's validation shard: in order, last batch may be short.

    Ranks take every ``world_size``-th sample, so the shards are disjoint and cover the whole
    split (they differ in length by at most one sample): sum metrics across ranks.
    """
    mine = torch.arange(rank, n, world_size)
    out = list(mine.split(batch_size))
    return out if max_batches is None else out[:max_batches]


class ImageData(ABC):
    """Image classification batches for the engine.

    ``train_batches`` and ``val_batches`` yield ``(images, labels)``: float32 ``[B, 3, H, W]``
    (``torch.channels_last`` when asked) and int64 ``[B]``, both on the target device.
    """

    name: str
    num_classes: int
    image_size: int
    train_size: int  # samples in the whole training split (all ranks)
    val_size: int

    @abstractmethod
    def steps_per_epoch(self) -> int:
        """Training batches in one epoch on this rank (incomplete batches dropped)."""

    @abstractmethod
    def train_batches(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """The epoch's batches from index ``start`` on; the order depends only on (seed, epoch, rank)."""

    @abstractmethod
    def val_batches(self) -> Iterator[Batch]:
        """This rank's validation batches: deterministic, never augmented, at most data.max_val_batches."""

    def describe(self) -> dict[str, Any]:
        """A small JSON-able summary for logs and summary.json."""
        return {
            "name": self.name,
            "train_size": self.train_size,
            "val_size": self.val_size,
            "num_classes": self.num_classes,
            "image_size": self.image_size,
            "steps_per_epoch": self.steps_per_epoch(),
        }

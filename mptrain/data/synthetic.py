"""Learnable random images generated on the device: the default data and the benchmark data."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from mptrain.data.base import Batch, ImageData, check_start, check_steps, mix_seed

_TRAIN, _VAL, _PROTOTYPES = 0, 1, 2  # stream tags mixed into the seeds
PATTERN_SIZE = 4  # side of each class's low-resolution pattern
NOISE_STD = 1.0  # per-pixel noise; the upsampled pattern has std < 1, so single pixels are noisy


class SyntheticData(ImageData):
    """Each class is a fixed random ``[3, 4, 4]`` pattern (drawn from the seed), bilinearly
    upsampled to ``image_size``, plus Gaussian noise; labels are uniform.

    Nothing touches the host: a device generator is reseeded per batch from
    ``(seed, split, epoch, batch index, rank)``, so any batch can be made on its own (exact resume,
    nothing to skip) and ranks see distinct samples. ``data.train_samples`` is the epoch size over
    all ranks, like a dataset's length under DistributedSampler.

    Reads ``data.``: batch_size, val_batch_size, num_classes (default 1000), train_samples,
    val_samples, max_val_batches, pattern_scale (default 1.0: less makes the task harder, while
    the pixels keep unit noise, so the input scale stays what an untuned network expects) and
    task_seed (null: the run's seed). A fixed ``task_seed`` keeps the class patterns and the
    validation images the same for every run seed, so seeds vary only the training draws (the
    study's CNN proxy, issue 18).
    """

    name = "synthetic"

    def __init__(
        self,
        *,
        batch_size: int,
        val_batch_size: int,
        num_classes: int,
        train_samples: int,
        val_samples: int,
        max_val_batches: int | None,
        image_size: int,
        device: torch.device,
        seed: int,
        channels_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        pattern_scale: float = 1.0,
        task_seed: int | None = None,
    ) -> None:
        self.pattern_scale = pattern_scale
        self.task_seed = seed if task_seed is None else task_seed
        self.num_classes = num_classes
        self.image_size = image_size
        self.train_size = train_samples
        self.val_size = val_samples
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size
        self.max_val_batches = max_val_batches
        self.device = device
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        per_rank = train_samples // world_size
        check_steps(batch_size, per_rank, "data.train_samples", world_size)
        self._steps = per_rank // batch_size
        # Validation: this rank's share of val_samples (shares differ by at most one sample).
        self._val_per_rank = len(range(rank, val_samples, world_size))
        self._gen = torch.Generator(device=device)
        self._gen.manual_seed(mix_seed(self.task_seed, _PROTOTYPES))
        self.prototypes = torch.randn(
            (num_classes, 3, PATTERN_SIZE, PATTERN_SIZE), generator=self._gen, device=device
        )

    def steps_per_epoch(self) -> int:
        return self._steps

    def _make(self, split: int, epoch: int, index: int, n: int) -> Batch:
        g = self._gen
        seed = self.task_seed if split == _VAL else self.seed  # validation belongs to the task
        g.manual_seed(mix_seed(seed, split, epoch, index, self.rank))
        labels = torch.randint(0, self.num_classes, (n,), generator=g, device=self.device)
        size = (self.image_size, self.image_size)
        pattern = F.interpolate(self.prototypes[labels], size=size, mode="bilinear", align_corners=False)
        if self.pattern_scale != 1.0:
            pattern = pattern * self.pattern_scale
        # Draw the noise straight into the requested layout: no conversion copy afterwards.
        images = torch.empty((n, 3, *size), device=self.device, memory_format=self.memory_format)
        images.normal_(0.0, NOISE_STD, generator=g).add_(pattern)
        return images, labels

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        check_start(start, self._steps)
        return (self._make(_TRAIN, epoch, i, self.batch_size) for i in range(start, self._steps))

    def val_batches(self) -> Iterator[Batch]:
        sizes = [len(r) for r in _chunks(self._val_per_rank, self.val_batch_size)]
        if self.max_val_batches is not None:
            sizes = sizes[: self.max_val_batches]
        return (self._make(_VAL, 0, i, n) for i, n in enumerate(sizes))


def _chunks(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]

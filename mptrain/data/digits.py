"""scikit-learn's bundled 8x8 handwritten digits: small real data that needs no download."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from mptrain.data.base import Batch, EpochOrder, ImageData, check_steps, val_shard
from mptrain.errors import MptrainError

# The train/val split uses its own fixed seed, not trainer.seed: runs with different seeds are then
# evaluated on the same held-out images and their accuracies compare.
SPLIT_SEED = 0


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(images [1797, 8, 8] float64 in 0..16, targets [1797] int)`` from scikit-learn."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise MptrainError("data=digits needs scikit-learn: pip install 'mptrain[digits]'") from None
    d = load_digits()
    return np.asarray(d.images), np.asarray(d.target)


def stratified_split(
    targets: np.ndarray, val_fraction: float, seed: int = SPLIT_SEED
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted ``(train, val)`` indices holding out ``round(val_fraction * n_c)`` of each class c."""
    rng = np.random.RandomState(seed)
    train: list[np.ndarray] = []
    val: list[np.ndarray] = []
    for c in np.unique(targets):
        idx = np.flatnonzero(targets == c)
        rng.shuffle(idx)
        # Keep at least one image of each class on both sides.
        k = min(max(round(val_fraction * len(idx)), 1), len(idx) - 1)
        val.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


class DigitsData(ImageData):
    """The whole dataset lives on the device as normalised ``[N, 1, 8, 8]`` tensors (a few hundred
    KB); each batch is indexed out, bilinearly resized to ``image_size`` and replicated to 3
    channels. Resizing per batch keeps memory small at any image size, and because bilinear
    weights sum to one, normalising before resizing equals normalising after.

    Pixels are scaled to [0, 1], then standardised with the training split's mean and std. No
    random augmentation. ``train_indices`` / ``val_indices`` are the positions in
    ``sklearn.datasets.load_digits()``.

    Reads ``data.``: batch_size, val_batch_size, val_fraction, num_classes (must be null or 10),
    max_val_batches.
    """

    name = "digits"

    def __init__(
        self,
        *,
        batch_size: int,
        val_batch_size: int,
        val_fraction: float,
        num_classes: int | None,
        max_val_batches: int | None,
        image_size: int,
        device: torch.device,
        seed: int,
        channels_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        images, targets = load_digits_arrays()
        self.num_classes = int(targets.max()) + 1
        if num_classes is not None and num_classes != self.num_classes:
            raise MptrainError(
                f"data.num_classes={num_classes}: data=digits has {self.num_classes} classes "
                "(leave data.num_classes null)"
            )
        self.image_size = image_size
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.train_indices, self.val_indices = stratified_split(targets, val_fraction)
        self.train_size = len(self.train_indices)
        self.val_size = len(self.val_indices)

        x = torch.from_numpy(images).float().div_(16.0).unsqueeze(1)  # [N, 1, 8, 8] in [0, 1]
        y = torch.from_numpy(targets).long()
        train_x = x[self.train_indices]
        self.mean, self.std = float(train_x.mean()), float(train_x.std())
        self._train_x = ((train_x - self.mean) / self.std).to(device)
        self._train_y = y[self.train_indices].to(device)
        self._val_x = ((x[self.val_indices] - self.mean) / self.std).to(device)
        self._val_y = y[self.val_indices].to(device)

        self._order = EpochOrder(self.train_size, batch_size, seed, rank, world_size)
        check_steps(batch_size, self._order.per_rank, "digits training images", world_size)
        shard = val_shard(self.val_size, val_batch_size, rank, world_size, max_val_batches)
        self._val = [idx.to(device) for idx in shard]

    def steps_per_epoch(self) -> int:
        return self._order.steps

    def _batch(self, x: Tensor, y: Tensor, idx: Tensor) -> Batch:
        size = (self.image_size, self.image_size)
        img = F.interpolate(x[idx], size=size, mode="bilinear", align_corners=False)
        img = img.expand(-1, 3, -1, -1).contiguous(memory_format=self.memory_format)
        return img, y[idx]

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        batches = list(self._order.batches(epoch, start))  # validates start now, not at first next()
        if not batches:
            return iter(())
        # One host-to-device copy of the whole epoch's order instead of one per batch.
        order = torch.cat(batches).to(self.device)
        return (self._batch(self._train_x, self._train_y, idx) for idx in order.split(self._order.batch_size))

    def val_batches(self) -> Iterator[Batch]:
        return (self._batch(self._val_x, self._val_y, idx) for idx in self._val)

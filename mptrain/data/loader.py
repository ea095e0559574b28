"""Map-style datasets behind a DataLoader, finished on the device: the loader that the file datasets
(image_folder, cifar10) and the user's own (data=custom) share.

One ``DataLoader`` per split serves every epoch (persistent workers); its batch sampler yields this
rank's batches of ``(epoch, index)`` keys from ``EpochOrder``, and each sample's random transform is
seeded from ``(seed, epoch, index)``: a resumed run, or one with another ``data.num_workers``, sees
the very same batches, crops and flips. ``DeviceFeeder`` does the copy and the float finish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from mptrain.data.base import Batch, EpochOrder, ImageData, check_start, check_steps, val_shard
from mptrain.data.feed import DeviceFeeder, JpegDecoder, collate_raw, collate_uint8, seeded_rng


class SeededItems(Dataset[Any]):
    """Looks up ``(epoch, index)`` keys, with the sample's transform seeded from ``(seed, epoch, index)``
    (see ``feed.seeded``): a resumed run, or one with another ``data.num_workers``, sees the very
    same crops and flips."""

    def __init__(self, base: Dataset[Any], seed: int) -> None:
        self.base = base
        self.seed = seed

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        with seeded_rng(self.seed, epoch, index):
            return self.base[index]


class IndexedItems(Dataset[Any]):
    """``(data, label, index)`` for ``data.decode=gpu``: the index seeds the augmentation on the device."""

    def __init__(self, base: Dataset[Any]) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, int, int]:
        index = key[1] if isinstance(key, tuple) else key
        data, label = self.base[index]
        return data, label, index


class EpochBatchSampler:
    """The DataLoader's batch sampler: yields this rank's batches of ``(epoch, index)`` keys.

    One sampler (and one DataLoader) serves every epoch, so persistent workers survive between
    epochs; ``set`` picks the epoch and the first batch before each ``iter(loader)``.
    """

    def __init__(self, order: EpochOrder) -> None:
        self.order = order
        self.epoch = 0
        self.start = 0

    def set(self, epoch: int, start: int) -> None:
        check_start(start, self.order.steps)
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, start = self.epoch, self.start  # snapshot now: the generator body runs later
        # Only the index lists of skipped batches are computed; their images are never loaded.
        return ([(epoch, i) for i in idx.tolist()] for idx in self.order.batches(epoch, start))

    def __len__(self) -> int:
        return self.order.steps - self.start


class LoaderData(ImageData):
    """Map-style datasets of ``(image tensor, label)`` behind DataLoaders, finished on the device by
    a ``DeviceFeeder``: ``mean``/``std`` given means the datasets yield uint8 images, normalised on
    the device; ``decoders`` (train, val) means they yield file bytes, decoded on the device.

    ``check(batch, split)``, when given, sees every host batch before the feed (data=custom's
    contract checks: one line for a bad label, in the main process).

    Reads ``data.``: batch_size, val_batch_size, num_workers, pin_memory (CUDA only),
    prefetch_factor (only with workers), max_val_batches.
    """

    def __init__(
        self,
        *,
        name: str,
        train_set: Dataset[Any],
        val_set: Dataset[Any],
        num_classes: int,
        cfg: Any,
        image_size: int,
        device: torch.device,
        seed: int,
        channels_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        info: dict[str, Any] | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        decoders: dict[str, JpegDecoder] | None = None,
        check: Callable[[Any, str], None] | None = None,
    ) -> None:
        self.name = name
        self.num_classes = num_classes
        self.image_size = image_size
        self.train_size = len(train_set)  # type: ignore[arg-type]
        self.val_size = len(val_set)  # type: ignore[arg-type]
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.info = info or {}
        self._check = check
        batch_size = int(cfg.batch_size)
        val_batch_size = int(cfg.val_batch_size or batch_size)

        order = EpochOrder(self.train_size, batch_size, seed, rank, world_size)
        check_steps(batch_size, order.per_rank, f"{name} training images", world_size)
        self._order = order
        self._sampler = EpochBatchSampler(order)

        # Pinned host batches make the copies truly asynchronous; pinning is pointless on CPU, and
        # so it is for file bytes (decode=gpu), which nvjpeg reads from pageable memory itself.
        non_blocking = device.type == "cuda" and bool(cfg.pin_memory)
        self._feed = DeviceFeeder(device, memory_format=self.memory_format, non_blocking=non_blocking,
                                  mean=mean, std=std, decoders=decoders)
        workers = int(cfg.num_workers)
        # A private generator: each iter(loader) draws the workers' base seed from it, not from the
        # global RNG (which would shift the model's dropout and init draws with the data settings).
        kw: dict[str, Any] = {
            "num_workers": workers,
            "pin_memory": non_blocking and not decoders,
            "generator": torch.Generator().manual_seed(seed),
        }
        if decoders:
            kw["collate_fn"] = collate_raw
        elif mean is not None:
            kw["collate_fn"] = collate_uint8
        if workers > 0:
            # Workers survive between epochs (and evaluations) instead of being re-forked each time.
            kw.update(persistent_workers=True, prefetch_factor=int(cfg.prefetch_factor))
        # decode=gpu: workers only read bytes; the seeded augmentation runs where the decode does.
        train_items = IndexedItems(train_set) if decoders else SeededItems(train_set, seed)
        self._train_loader = DataLoader(train_items, batch_sampler=self._sampler, **kw)
        val_index = [
            idx.tolist()
            for idx in val_shard(self.val_size, val_batch_size, rank, world_size, cfg.max_val_batches)
        ]
        self._val_loader = DataLoader(IndexedItems(val_set) if decoders else val_set, batch_sampler=val_index, **kw)

    def steps_per_epoch(self) -> int:
        return self._order.steps

    def _host(self, loader: DataLoader[Any], split: str) -> Iterator[Any]:
        if self._check is None:
            return iter(loader)
        return (self._check(batch, split) or batch for batch in loader)

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        self._sampler.set(epoch, start)
        return self._feed(self._host(self._train_loader, "train"), "train", epoch)

    def val_batches(self) -> Iterator[Batch]:
        return self._feed(self._host(self._val_loader, "val"), "val")

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), **self.info}

"""``data=custom data._target_=pkg.module.callable``: the user's own datasets.

    mptrain model=custom model._target_=mynets.cnn data=custom data._target_=mydata.make \\
        data.num_classes=10 'data.kwargs={root:/data/x}'

The callable gets ``data.kwargs`` as keyword arguments and returns a pair ``(train, val)`` of
map-style datasets (``__getitem__`` and ``__len__``, as ``torch.utils.data.Dataset``). mptrain's own
keys stay mptrain's: batch sizes, workers, pinning, ``max_val_batches``, the epoch order (sharded
over ranks, resumable) and the device feed are those of the built-in file datasets
(:class:`mptrain.data.loader.LoaderData`), and so is the data-wait telemetry. A random transform in
``__getitem__`` is seeded per sample from ``(seed, epoch, index)``: a resumed run sees the same one.

- classification (``model.task``'s default): items ``(float image [3, H, W], int label)``, with
  ``data.num_classes`` given; each batch's labels are checked on the host (one line for a label out
  of range), and a dataset's ``.targets`` (torchvision's convention) before the first step.
- language model: items are int64 token tensors of ``data.bptt + 1`` tokens, each an independent
  sequence (inputs ``[:-1]``, targets ``[1:]``), with ``data.vocab_size`` given; tokens are checked
  against it on the host.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from mptrain.data.base import EpochOrder, check_rank, check_steps, val_shard
from mptrain.data.feed import DeviceFeeder
from mptrain.data.loader import EpochBatchSampler, LoaderData, SeededItems
from mptrain.errors import MptrainError, check
from mptrain.targets import call_target, import_target

KEY = "data._target_"


def check_custom_data(cfg: DictConfig) -> None:
    """Before any work (from ``mptrain.config.validate``): the callable imports, and the key the
    task needs is given."""
    d = cfg.data
    import_target(str(d._target_), KEY)
    if cfg.model.get("task", "classification") == "language_model":
        check(d.vocab_size is not None, "data=custom with a language model needs data.vocab_size (tokens are 0..V-1)")
    else:
        check(d.num_classes is not None, "data=custom needs data.num_classes (labels are 0..num_classes-1)")


def load_datasets(cfg: DictConfig) -> tuple[Dataset[Any], Dataset[Any]]:
    """``data._target_(**data.kwargs)``, checked to be a (train, val) pair of non-empty map-style datasets."""
    target = str(cfg._target_)
    out = call_target(import_target(target, KEY), target, KEY, cfg.get("kwargs"), {})
    check(isinstance(out, tuple | list) and len(out) == 2,
          f"{KEY}={target}: returned a {type(out).__name__}; it must return a pair (train, val) of datasets")
    for split, ds in zip(("train", "val"), out, strict=True):
        check(hasattr(ds, "__getitem__") and hasattr(ds, "__len__"),
              f"{KEY}={target}: the {split} set is a {type(ds).__name__}, not a map-style dataset "
              "(__getitem__ and __len__)")
        check(len(ds) > 0, f"{KEY}={target}: the {split} set is empty")
    return out[0], out[1]


def _describe(item: Any) -> str:
    parts = item if isinstance(item, tuple | list) else (item,)
    return "(" + ", ".join(f"{t.dtype} tensor {list(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
                           for t in parts) + ")"


# --------------------------------------------------------------------------------------------
# classification


class LabelCheck:
    """Each host batch's labels in 0..num_classes-1 (a cheap check of B integers on the host: a label
    out of range would otherwise be a device-side assert in the loss, or silently wrong on CPU)."""

    def __init__(self, target: str, num_classes: int) -> None:
        self.target, self.num_classes = target, num_classes

    def __call__(self, batch: Any, split: str) -> None:
        images, labels = batch
        if not (isinstance(images, Tensor) and images.is_floating_point() and images.dim() == 4):
            raise MptrainError(f"{KEY}={self.target}: a {split} batch of images is {_describe(images)}; items must "
                               "be (float image [3, H, W], int label)")
        if labels.dtype.is_floating_point or labels.dim() != 1:
            raise MptrainError(f"{KEY}={self.target}: {split} labels are {_describe(labels)}; items must be "
                               "(float image [3, H, W], int label)")
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= self.num_classes:
            bad = low if low < 0 else high
            raise MptrainError(f"data.num_classes={self.num_classes}: a {split} label is {bad}, outside "
                               f"0..{self.num_classes - 1} ({KEY}={self.target})")


def build_custom_image_data(cfg: DictConfig, *, device: torch.device, seed: int, channels_last: bool = False,
                            rank: int = 0, world_size: int = 1) -> LoaderData:
    """The user's (train, val) classification datasets behind mptrain's loader. Reads ``data.``:
    _target_, kwargs, num_classes, and the DataLoader keys (see LoaderData)."""
    check_rank(rank, world_size)
    target = str(cfg._target_)
    check(cfg.num_classes is not None, "data=custom needs data.num_classes (labels are 0..num_classes-1)")
    num_classes = int(cfg.num_classes)
    train, val = load_datasets(cfg)
    first = train[0]
    ok = isinstance(first, tuple | list) and len(first) == 2 and isinstance(first[0], Tensor) \
        and first[0].is_floating_point() and first[0].dim() == 3
    check(ok, f"{KEY}={target}: a train item is {_describe(first)}; items must be (float image [3, H, W], int label)")
    labels = LabelCheck(target, num_classes)
    for split, ds in (("train", train), ("val", val)):
        targets = getattr(ds, "targets", None)  # torchvision's datasets list every label: check them all now
        if isinstance(targets, Sequence | Tensor) and len(targets):
            labels((first[0][None], torch.as_tensor(targets).flatten()), split)
    return LoaderData(name="custom", train_set=train, val_set=val, num_classes=num_classes, cfg=cfg,
                      image_size=int(first[0].shape[-1]), device=torch.device(device), seed=seed,
                      channels_last=channels_last, rank=rank, world_size=world_size, info={"target": target},
                      check=labels)


# --------------------------------------------------------------------------------------------
# language models


def collate_tokens(samples: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Sequences of T + 1 tokens -> (inputs [B, T], targets [B, T]), the next-token pairs."""
    rows = torch.stack([torch.as_tensor(s) for s in samples])
    return rows[:, :-1], rows[:, 1:]


class CustomTextData:
    """Independent token sequences behind a DataLoader (the same epoch order, sampler and device feed
    as the image datasets), for a stateless language model. The interface of ``TextData``."""

    vocab = None  # ids only: no strings to write into vocab.json

    def __init__(self, cfg: DictConfig, *, device: torch.device, seed: int, rank: int = 0, world_size: int = 1):
        check_rank(rank, world_size)
        self.target = target = str(cfg._target_)
        check(cfg.vocab_size is not None, "data=custom with a language model needs data.vocab_size (tokens are 0..V-1)")
        self.name = "custom"
        self.vocab_size = int(cfg.vocab_size)
        self.bptt = int(cfg.bptt)
        self.batch_size = int(cfg.batch_size)
        self.info = {"target": target}
        train, val = load_datasets(cfg)
        first = train[0]
        ok = isinstance(first, Tensor) and first.dim() == 1 and not first.is_floating_point() \
            and first.numel() == self.bptt + 1
        check(ok, f"{KEY}={target}: a train item is {_describe(first)}; items must be int64 token tensors of "
                  f"data.bptt + 1 = {self.bptt + 1} tokens (inputs [:-1], targets [1:])")
        self.train_size, self.val_size = len(train) * self.bptt, len(val) * self.bptt  # tokens scored
        order = EpochOrder(len(train), self.batch_size, seed, rank, world_size)
        check_steps(self.batch_size, order.per_rank, "training sequences", world_size)
        self._steps = order.steps
        self._sampler = EpochBatchSampler(order)
        non_blocking = device.type == "cuda" and bool(cfg.pin_memory)
        self._feed = DeviceFeeder(device, memory_format=torch.contiguous_format, non_blocking=non_blocking)
        kw: dict[str, Any] = {"num_workers": int(cfg.num_workers), "pin_memory": non_blocking,
                              "collate_fn": collate_tokens, "generator": torch.Generator().manual_seed(seed)}
        if kw["num_workers"] > 0:
            kw.update(persistent_workers=True, prefetch_factor=int(cfg.prefetch_factor))
        self._train = DataLoader(SeededItems(train, seed), batch_sampler=self._sampler, **kw)
        val_batch = int(cfg.val_batch_size or self.batch_size)
        index = [i.tolist() for i in val_shard(len(val), val_batch, rank, world_size, cfg.max_val_batches)]
        self._val = DataLoader(val, batch_sampler=index, **kw)

    def _checked(self, loader: DataLoader[Any], split: str) -> Iterator[tuple[Tensor, Tensor]]:
        for inputs, targets in loader:
            low = min(int(inputs.min()), int(targets.min()))
            high = max(int(inputs.max()), int(targets.max()))
            if low < 0 or high >= self.vocab_size:
                raise MptrainError(f"data.vocab_size={self.vocab_size}: a {split} token is {low if low < 0 else high}, "
                                   f"outside 0..{self.vocab_size - 1} ({KEY}={self.target})")
            yield inputs, targets

    def steps_per_epoch(self) -> int:
        return self._steps

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
        self._sampler.set(epoch, start)
        return self._feed(self._checked(self._train, "train"), "train", epoch)

    def val_batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self._feed(self._checked(self._val, "val"), "val")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "vocab_size": self.vocab_size, "train_tokens": self.train_size,
                "val_tokens": self.val_size, "bptt": self.bptt, "steps_per_epoch": self._steps, **self.info}

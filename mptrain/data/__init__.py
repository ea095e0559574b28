"""Image data for classification: ``build_image_data(cfg.data, ...)`` returns an ``ImageData``.

Datasets (``data.name``): ``synthetic`` (made on the device), ``digits`` (scikit-learn's 8x8
digits, held on the device), ``image_folder`` (ImageNet layout) and ``cifar10`` (the python
batches), the last two through torchvision and a DataLoader, and ``custom`` (the user's own
datasets, :mod:`mptrain.data.custom`, through the same DataLoader and device feed).

Every split is deterministic: an epoch's order depends only on (seed, epoch, rank), augmentation
only on (seed, epoch, sample), so ``train_batches(epoch, start)`` resumes a run exactly. With
``world_size > 1`` pass the same ``seed`` on every rank: the ranks shard one common permutation.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from mptrain.data.base import Batch, ImageData, check_rank
from mptrain.errors import MptrainError

__all__ = ["DATASETS", "Batch", "ImageData", "build_image_data"]

DATASETS = ("synthetic", "image_folder", "cifar10", "digits")


def build_image_data(
    cfg: DictConfig,
    *,
    image_size: int | None,
    device: torch.device,
    seed: int,
    channels_last: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> ImageData:
    """The ``data`` group's dataset, yielding batches on ``device``.

    ``image_size`` is the engine's resolved size (``data.image_size`` is ignored here; data=custom
takes its items' size and ignores it). Reads
    ``data.name`` and ``data.batch_size`` / ``data.val_batch_size`` (null: batch_size) plus each
    dataset's keys, listed in its class docstring.
    """
    check_rank(rank, world_size)
    if cfg.name == "custom":  # the user's datasets: their items have their own size
        from mptrain.data.custom import build_custom_image_data

        return build_custom_image_data(cfg, device=device, seed=seed, channels_last=channels_last, rank=rank,
                                       world_size=world_size)
    if image_size is None or image_size < 8:
        raise MptrainError(f"image_size={image_size}: must be >= 8 px")
    device = torch.device(device)
    name = cfg.name
    batch_size = int(cfg.batch_size)
    val_batch_size = int(cfg.val_batch_size or batch_size)
    common = {
        "image_size": image_size,
        "device": device,
        "seed": seed,
        "channels_last": channels_last,
        "rank": rank,
        "world_size": world_size,
    }
    if name == "synthetic":
        from mptrain.data.synthetic import SyntheticData

        return SyntheticData(
            batch_size=batch_size,
            val_batch_size=val_batch_size,
            num_classes=int(cfg.num_classes or 1000),
            train_samples=int(cfg.train_samples),
            val_samples=int(cfg.val_samples),
            max_val_batches=cfg.max_val_batches,
            pattern_scale=float(cfg.get("pattern_scale", 1.0)),
            task_seed=cfg.get("task_seed"),
            **common,
        )
    if name == "digits":
        from mptrain.data.digits import DigitsData

        return DigitsData(
            batch_size=batch_size,
            val_batch_size=val_batch_size,
            val_fraction=float(cfg.val_fraction),
            num_classes=cfg.num_classes,
            max_val_batches=cfg.max_val_batches,
            **common,
        )
    if name in ("image_folder", "cifar10"):
        if cfg.root is None:
            raise MptrainError(f"data={name} needs data.root=PATH (the dataset directory)")
        # torchvision is imported only for the datasets that read files.
        from mptrain.data import vision

        build = vision.build_image_folder if name == "image_folder" else vision.build_cifar10
        return build(cfg, **common)
    raise MptrainError(f"data.name={name!r}: unknown dataset (allowed: {', '.join(DATASETS)})")


# Language-model token streams (data=synthetic_text | text_corpus | python_docs).
from mptrain.data.text import TEXT_DATASETS, TextData, build_text_data  # noqa: E402

__all__ += ["TEXT_DATASETS", "TextData", "build_text_data"]

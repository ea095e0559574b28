"""Image files through torchvision datasets and a DataLoader: ImageNet-layout folders and CIFAR-10."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from PIL import Image
from torch import Tensor
from torchvision import datasets
from torchvision import transforms as T
from torchvision.io import ImageReadMode, decode_image, read_file
from torchvision.transforms import v2
from torchvision.transforms.v2.functional import pil_to_tensor

from mptrain.data.feed import JpegDecoder, is_jpeg
from mptrain.data.loader import LoaderData
from mptrain.errors import MptrainError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Per-channel statistics of the 50,000 CIFAR-10 training images (the often-copied 0.2023, 0.1994,
# 0.2010 are not the std).
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CENTER_CROP_FRACTION = 0.875  # the standard ImageNet evaluation: resize to size/0.875, crop size

# --------------------------------------------------------------------------------------------
# image_folder


def _names(items: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" (and {len(items) - limit} more)" if len(items) > limit else "")


def _class_folders(split_dir: Path, root: str, split: str) -> list[str]:
    if not split_dir.is_dir():
        raise MptrainError(
            f"data.root={root}: no {split}/ folder (expected ImageNet layout root/{split}/<class>/*.jpg)"
        )
    classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
    if not classes:
        raise MptrainError(
            f"data.root={root}: {split}/ has no class folders (expected root/{split}/<class>/*.jpg)"
        )
    return classes


def _check_no_empty_class(ds: datasets.ImageFolder, root: str, split: str) -> None:
    counts = torch.bincount(torch.tensor(ds.targets, dtype=torch.long), minlength=len(ds.classes))
    empty = [f"{split}/{ds.classes[i]}" for i in torch.nonzero(counts == 0).flatten().tolist()]
    if empty:
        exts = ", ".join(datasets.folder.IMG_EXTENSIONS)
        raise MptrainError(f"data.root={root}: no images in class folder {_names(empty)} (allowed: {exts})")


DECODES = ("cpu", "gpu", "pil")


def image_folder_transforms(image_size: int, augment: bool) -> tuple[T.Compose, T.Compose]:
    """``data.decode=pil``, the legacy path: ``(train, val)`` on PIL images, finished as float on the
    host. RandomResizedCrop + flip, or resize + center crop."""
    finish = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    center = [T.Resize(int(image_size / CENTER_CROP_FRACTION)), T.CenterCrop(image_size)]
    train = [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()] if augment else center
    return T.Compose(train + finish), T.Compose(center + finish)


class PackedRandomResizedCrop(v2.RandomResizedCrop):
    """``v2.RandomResizedCrop``, same parameters and random draws, with the crop of a CPU uint8
    image packed channels_last before the resize.

    torch's uint8 antialiased resize has an AVX2 path for packed channels_last images; the crop is
    a strided view into the decoded image and misses it (measured on this project's AVX2 CPU, one
    300x260 crop to 224: 0.31 ms as a view, 0.21 ms packed, copy included). The decoded image
    itself is packed (HWC memory), so the val path's resize already takes the fast path. The
    output stays channels_last, and so does the batch (``collate_uint8``).
    """

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        if not (isinstance(inpt, Tensor) and inpt.dtype == torch.uint8 and inpt.device.type == "cpu"):
            return super().transform(inpt, params)
        crop = v2.functional.crop(inpt, params["top"], params["left"], params["height"], params["width"])
        packed = crop[None].contiguous(memory_format=torch.channels_last)[0]
        return v2.functional.resize(packed, list(self.size), interpolation=self.interpolation,
                                    antialias=self.antialias)


def image_folder_transforms_v2(image_size: int, augment: bool) -> tuple[v2.Compose, v2.Compose]:
    """``data.decode=cpu|gpu``: the same ops as ``image_folder_transforms`` on uint8 CHW tensors,
    without the float finish (that happens on the device). The v2 ops draw their random parameters
    in the same order from the same generator as the PIL ones: same seed, same crop and flip."""
    center = [v2.Resize(int(image_size / CENTER_CROP_FRACTION), antialias=True), v2.CenterCrop(image_size)]
    train = [PackedRandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()] if augment else center
    return v2.Compose(train), v2.Compose(center)


def read_image_uint8(path: str) -> Tensor:
    """RGB uint8 ``[3, H, W]`` through torchvision.io (libjpeg-turbo, libpng); PIL only for the
    formats ImageFolder accepts that torchvision.io cannot decode (BMP, TIFF, PPM...)."""
    try:
        return decode_image(read_file(path), mode=ImageReadMode.RGB)
    except RuntimeError:
        with Image.open(path) as im:
            return pil_to_tensor(im.convert("RGB"))


def read_jpeg_bytes(path: str) -> Tensor:
    """``data.decode=gpu``: a JPEG's bytes as 1-D uint8 for nvjpeg; other formats decoded here."""
    # clone: read_file's tensor is file-mapped, and a DataLoader worker cannot move such a storage
    # to shared memory (the pickling fails in the queue's feeder thread, and the batch is lost).
    data = read_file(path).clone()
    return data if is_jpeg(data) else read_image_uint8(path)


def _check_decode_device(decode: str, device: torch.device) -> None:
    # torchvision decodes a list of JPEGs on CPU too; only nvjpeg makes decode=gpu worth it.
    if decode == "gpu" and device.type != "cuda":
        raise MptrainError(f"data.decode=gpu: decodes with nvjpeg on CUDA, but the device is {device.type} "
                           "(use data.decode=cpu)")


def build_image_folder(cfg: Any, **kw: Any) -> LoaderData:
    """ImageNet layout ``root/{train,val}/<class>/*``; both splits must have the same classes.

    Reads ``data.``: root, augment, num_classes (null, or must match the class folders), and the
    DataLoader keys (see LoaderData).
    """
    root = Path(str(cfg.root)).expanduser()
    train_classes = _class_folders(root / "train", cfg.root, "train")
    val_classes = _class_folders(root / "val", cfg.root, "val")
    if train_classes != val_classes:
        only_train = [c for c in train_classes if c not in set(val_classes)]
        only_val = [c for c in val_classes if c not in set(train_classes)]
        raise MptrainError(
            f"data.root={cfg.root}: train/ and val/ class folders differ "
            f"(only in train: {_names(only_train) or '-'}; only in val: {_names(only_val) or '-'})"
        )
    _check_num_classes(cfg, len(train_classes), "image_folder")
    decode = str(cfg.get("decode", "cpu"))
    if decode not in DECODES:
        raise MptrainError(f"data.decode={decode}: unknown decode path (allowed: {', '.join(DECODES)})")
    device = kw["device"]
    _check_decode_device(decode, device)
    augment = bool(cfg.augment)
    extra: dict[str, Any] = {}
    if decode == "pil":
        train_tf, val_tf = image_folder_transforms(kw["image_size"], augment)
        sets = {"transform": train_tf}, {"transform": val_tf}
    else:
        train_tf, val_tf = image_folder_transforms_v2(kw["image_size"], augment)
        extra = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD}
        if decode == "cpu":
            sets = ({"transform": train_tf, "loader": read_image_uint8},
                    {"transform": val_tf, "loader": read_image_uint8})
        else:
            sets = {"loader": read_jpeg_bytes}, {"loader": read_jpeg_bytes}
            extra["decoders"] = {"train": JpegDecoder(train_tf, device, kw["seed"], augment),
                                 "val": JpegDecoder(val_tf, device, kw["seed"], False)}
    # allow_empty: an empty class folder gets our one-line error below instead of torchvision's.
    train_set = datasets.ImageFolder(str(root / "train"), allow_empty=True, **sets[0])
    val_set = datasets.ImageFolder(str(root / "val"), allow_empty=True, **sets[1])
    _check_no_empty_class(train_set, cfg.root, "train")
    _check_no_empty_class(val_set, cfg.root, "val")
    return LoaderData(
        name="image_folder",
        train_set=train_set,
        val_set=val_set,
        num_classes=len(train_classes),
        cfg=cfg,
        info={"root": str(root), "decode": decode},
        **extra,
        **kw,
    )


def _check_num_classes(cfg: Any, found: int, name: str) -> None:
    if cfg.num_classes is not None and cfg.num_classes != found:
        raise MptrainError(
            f"data.num_classes={cfg.num_classes}: data={name} at {cfg.root} has {found} classes "
            "(leave data.num_classes null)"
        )


# --------------------------------------------------------------------------------------------
# cifar10

CIFAR_BATCHES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


class LocalCIFAR10(datasets.CIFAR10):
    """torchvision's CIFAR10 with the md5 check replaced by an existence check.

    torchvision compares each file with the md5 sum of the official download, so any other valid
    copy in the same format (re-exported, subsetted, or written by the tests) is refused as
    "corrupted". mptrain never downloads, and a malformed file still fails while unpickling.
    """

    # _load_meta calls check_integrity(path, md5); with md5=None that is only "the file exists".
    meta: ClassVar[dict[str, str | None]] = {**datasets.CIFAR10.meta, "md5": None}

    def _check_integrity(self) -> bool:
        folder = Path(self.root, self.base_folder)
        return all((folder / name).is_file() for name, _ in self.train_list + self.test_list)


def cifar_transforms(image_size: int, augment: bool) -> tuple[T.Compose, T.Compose]:
    """``(train, val)``: pad-4 random crop + flip when augmenting, resize when not 32 px, normalise."""
    resize = [T.Resize(image_size)] if image_size != 32 else []
    finish = [T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)]
    aug = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()] if augment else []
    return T.Compose(aug + resize + finish), T.Compose(resize + finish)


def build_cifar10(cfg: Any, **kw: Any) -> LoaderData:
    """CIFAR-10 in its original python format under ``root/cifar-10-batches-py``; test_batch is val.

    Reads ``data.``: root, augment, num_classes (null or 10), and the DataLoader keys (see LoaderData).
    """
    root = Path(str(cfg.root)).expanduser()
    folder = root / LocalCIFAR10.base_folder
    missing = [n for n in [*CIFAR_BATCHES, "batches.meta"] if not (folder / n).is_file()]
    if not folder.is_dir() or all(n in missing for n in CIFAR_BATCHES):
        raise MptrainError(
            f"data.root={cfg.root}: no CIFAR-10 batches found "
            "(expected cifar-10-batches-py/ with data_batch_1..5 and test_batch)"
        )
    if missing:
        raise MptrainError(
            f"data.root={cfg.root}: cifar-10-batches-py/ lacks {', '.join(missing)} "
            "(expected data_batch_1..5, test_batch and batches.meta)"
        )
    train_tf, val_tf = cifar_transforms(kw["image_size"], bool(cfg.augment))
    try:
        train_set = LocalCIFAR10(str(root), train=True, transform=train_tf, download=False)
        val_set = LocalCIFAR10(str(root), train=False, transform=val_tf, download=False)
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, UnicodeDecodeError) as e:
        detail = " ".join(f"{type(e).__name__}: {e}".split())  # keep the message on one line
        raise MptrainError(f"data.root={cfg.root}: cannot read the CIFAR-10 batches ({detail})") from e
    num_classes = len(train_set.classes)
    labels = train_set.targets + val_set.targets
    if labels and not 0 <= min(labels) <= max(labels) < num_classes:
        raise MptrainError(
            f"data.root={cfg.root}: CIFAR-10 labels span {min(labels)}..{max(labels)} but batches.meta "
            f"names {num_classes} classes"
        )
    _check_num_classes(cfg, num_classes, "cifar10")
    return LoaderData(
        name="cifar10",
        train_set=train_set,
        val_set=val_set,
        num_classes=num_classes,
        cfg=cfg,
        info={"root": str(root)},
        **kw,
    )

"""mptrain.data on real formats written on the fly (PNG/JPEG folders, CIFAR-10 pickles) and the real
scikit-learn digits: shapes, values, determinism, exact resume, DDP sharding and the error messages."""

from __future__ import annotations

import json
import pickle
import re
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from mptrain.config import DataConfig
from mptrain.data import ImageData, build_image_data
from mptrain.data.base import EpochOrder
from mptrain.data.vision import CIFAR_MEAN, CIFAR_STD, IMAGENET_MEAN, IMAGENET_STD
from mptrain.errors import MptrainError

CPU = torch.device("cpu")
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def data_cfg(name: str, **kw: Any) -> DictConfig:
    kw.setdefault("num_workers", 0)
    return OmegaConf.structured(DataConfig(name=name, **kw))


def build(cfg: DictConfig, image_size: int = 16, seed: int = 0, **kw: Any) -> ImageData:
    return build_image_data(cfg, image_size=image_size, device=CPU, seed=seed, **kw)


def assert_same(a: Batches, b: Batches) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb)
        assert torch.equal(ya, yb)


def check_batches(batches: Batches, n: int, size: int, num_classes: int) -> None:
    for x, y in batches:
        assert x.shape == (n, 3, size, size) and x.dtype == torch.float32 and x.device == CPU
        assert y.shape == (n,) and y.dtype == torch.int64 and y.device == CPU
        assert int(y.min()) >= 0 and int(y.max()) < num_classes


def unnormalize(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """Normalised images back to 0..255 bytes (as float)."""
    return (x * torch.tensor(std)[:, None, None] + torch.tensor(mean)[:, None, None]) * 255


def test_epoch_order_shards_like_distributed_sampler() -> None:
    n, bs = 23, 3
    full = EpochOrder(n, bs, seed=5).indices(0)
    shards = [EpochOrder(n, bs, seed=5, rank=r, world_size=2) for r in range(2)]
    assert all(s.per_rank == 11 and s.steps == 3 for s in shards)  # remainder dropped, equal steps
    a, b = (s.indices(0) for s in shards)
    # Rank r takes every second index of the common permutation (one sample dropped): disjoint.
    assert torch.equal(torch.stack([a, b], 1).flatten(), full[:22])
    assert not set(a.tolist()) & set(b.tolist())
    assert not torch.equal(full, EpochOrder(n, bs, seed=5).indices(1))
    assert not torch.equal(full, EpochOrder(n, bs, seed=6).indices(0))


# --------------------------------------------------------------------------------------------
# synthetic


def synth(**kw: Any) -> DictConfig:
    base: dict[str, Any] = {"num_classes": 10, "train_samples": 100, "val_samples": 30, "batch_size": 16}
    return data_cfg("synthetic", **{**base, **kw})


def test_synthetic_shapes_steps_and_describe() -> None:
    data = build(synth(val_batch_size=8), image_size=24)
    assert data.steps_per_epoch() == 6  # 100 // 16, remainder dropped
    train = list(data.train_batches(0))
    assert len(train) == 6
    check_batches(train, 16, 24, 10)
    val = list(data.val_batches())
    assert [len(y) for _, y in val] == [8, 8, 8, 6]
    check_batches(val[:3], 8, 24, 10)
    assert len(list(build(synth(max_val_batches=1)).val_batches())) == 1
    info = json.loads(json.dumps(data.describe()))
    assert info["name"] == "synthetic" and info["num_classes"] == 10 and info["image_size"] == 24
    assert info["train_size"] == 100 and info["val_size"] == 30
    assert build(data_cfg("synthetic")).num_classes == 1000  # the default


def test_synthetic_deterministic_and_resumes_exactly() -> None:
    a, b = build(synth()), build(synth())
    e0 = list(a.train_batches(0))
    assert_same(e0, list(b.train_batches(0)))
    assert_same(e0[4:], list(b.train_batches(0, start=4)))
    assert list(b.train_batches(0, start=6)) == []
    assert not torch.equal(e0[0][0], next(a.train_batches(1))[0])
    assert not torch.equal(e0[0][0], next(build(synth(), seed=1).train_batches(0))[0])
    assert_same(list(a.val_batches()), list(b.val_batches()))
    with pytest.raises(ValueError, match="start=7"):
        a.train_batches(0, start=7)


def test_synthetic_ranks_get_distinct_samples() -> None:
    r0, r1 = (build(synth(), rank=r, world_size=2) for r in range(2))
    assert r0.steps_per_epoch() == r1.steps_per_epoch() == 3  # (100 // 2) // 16
    x0 = torch.cat([x for x, _ in r0.train_batches(0)]).flatten(1)
    x1 = torch.cat([x for x, _ in r1.train_batches(0)]).flatten(1)
    assert torch.cdist(x0, x1).min() > 0  # no image shared between ranks


def test_synthetic_channels_last() -> None:
    x, _ = next(build(synth(), channels_last=True).train_batches(0))
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def test_synthetic_is_learnable() -> None:
    """Nearest class-mean classification, fitted on train and scored on val, beats chance by far."""
    data = build(synth(train_samples=640, val_samples=200, batch_size=64))
    xs, ys = zip(*data.train_batches(0), strict=True)
    x, y = torch.cat(xs).flatten(1), torch.cat(ys)
    means = torch.stack([x[y == c].mean(0) for c in range(10)])
    vx, vy = zip(*data.val_batches(), strict=True)
    pred = torch.cdist(torch.cat(vx).flatten(1), means).argmin(1)
    assert (pred == torch.cat(vy)).float().mean() > 0.9  # chance: 0.1


def test_batch_larger_than_epoch_is_refused() -> None:
    with pytest.raises(MptrainError, match=r"data.batch_size=128: larger than the 100 .* 0 batches"):
        build(synth(batch_size=128))
    with pytest.raises(MptrainError, match=r"data.batch_size=64: larger than the 50 .*per rank \(2 ranks\)"):
        build(synth(batch_size=64), rank=0, world_size=2)


def test_unknown_dataset_and_missing_root() -> None:
    with pytest.raises(MptrainError, match=r"data.name='imagenet': unknown dataset \(allowed: synthetic,"):
        build(data_cfg("imagenet"))
    with pytest.raises(MptrainError, match=r"data=cifar10 needs data\.root=PATH"):
        build(data_cfg("cifar10"))


# --------------------------------------------------------------------------------------------
# digits (scikit-learn's bundled data)


@pytest.fixture(scope="module")
def sk_digits() -> Any:
    datasets = pytest.importorskip("sklearn.datasets")
    return datasets.load_digits()


def test_digits_split_values_and_shapes(sk_digits: Any) -> None:
    data = build(data_cfg("digits", batch_size=32), image_size=8)
    tr, va = data.train_indices, data.val_indices
    assert data.num_classes == 10 and data.train_size + data.val_size == 1797
    assert not set(tr) & set(va) and abs(data.val_size - 0.2 * 1797) < 10
    assert set(sk_digits.target[va]) == set(range(10))  # stratified: every class held out
    assert data.steps_per_epoch() == data.train_size // 32
    check_batches(list(data.train_batches(0)), 32, 8, 10)
    # Val comes in sklearn's order; at 8 px the pixels are the originals, scaled and standardised.
    x, y = next(data.val_batches())
    raw = torch.from_numpy(sk_digits.images[va[:32]]).float() / 16
    assert torch.allclose(x[:, 0] * data.std + data.mean, raw, atol=1e-5)
    assert torch.equal(x[:, 0], x[:, 2])  # replicated grey channels
    assert torch.equal(y, torch.from_numpy(sk_digits.target[va[:32]]).long())
    x64, _ = next(build(data_cfg("digits"), image_size=64).val_batches())
    assert x64.shape[-2:] == (64, 64)


def test_digits_deterministic_resume_and_channels_last(sk_digits: Any) -> None:
    cfg = data_cfg("digits", batch_size=100, max_val_batches=2)
    a, b = build(cfg, seed=3), build(cfg, seed=3, channels_last=True)
    e0 = list(a.train_batches(0))
    assert_same(e0[5:], list(b.train_batches(0, start=5)))
    assert next(b.train_batches(0))[0].is_contiguous(memory_format=torch.channels_last)
    assert not torch.equal(e0[0][1], next(a.train_batches(1))[1])
    assert len(list(a.val_batches())) == 2
    # The split does not depend on trainer.seed: every seed is scored on the same images.
    assert np.array_equal(a.val_indices, build(cfg, seed=4).val_indices)
    r0, r1 = (build(cfg, rank=r, world_size=2) for r in range(2))
    assert r0.steps_per_epoch() == r1.steps_per_epoch() == (a.train_size // 2) // 100


def test_digits_without_sklearn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # makes the import fail
    expected = "data=digits needs scikit-learn: pip install 'mptrain[digits]'"
    with pytest.raises(MptrainError, match=re.escape(expected)):
        build(data_cfg("digits"))


# --------------------------------------------------------------------------------------------
# cifar10, written in the original format: Python 2 pickles, whose str keys are byte strings


class _Py2Str(bytes):
    """Pickled as a Python 2 ``str`` (BINSTRING), as in the official files: it loads as ``str`` with
    encoding="latin1" (torchvision) and as ``bytes`` with encoding="bytes" (the website's recipe)."""


class _Py2Pickler(pickle._Pickler):  # the pure-Python pickler lets us add an opcode writer
    dispatch = pickle._Pickler.dispatch.copy()

    def save_py2str(self, obj: bytes) -> None:
        n = len(obj)
        head = pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n)
        self.write(head + bytes(obj))

    dispatch[_Py2Str] = save_py2str


def _dump_py2(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        _Py2Pickler(f, protocol=2).dump(obj)


def write_cifar(root: Path, per_batch: int = 8, n_test: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Random images; byte 0 (red, top-left pixel) of image i is i, so each image identifies itself."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    out = []
    files = [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", n_test)]
    for k, (name, n) in enumerate(files):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        first = k * per_batch if name != "test_batch" else 0
        data[:, 0] = np.arange(first, first + n)
        labels = [(first + i) % 10 for i in range(n)]
        entry = {
            _Py2Str(b"batch_label"): _Py2Str(name.encode()),
            _Py2Str(b"labels"): labels,
            _Py2Str(b"data"): data,
            _Py2Str(b"filenames"): [_Py2Str(b"img_%d.png" % i) for i in range(n)],
        }
        _dump_py2(entry, folder / name)
        out.append(data)
    names = [_Py2Str(c) for c in b"airplane automobile bird cat deer dog frog horse ship truck".split()]
    meta = {_Py2Str(b"num_cases_per_batch"): per_batch, _Py2Str(b"label_names"): names}
    _dump_py2({**meta, _Py2Str(b"num_vis"): 3072}, folder / "batches.meta")
    with open(folder / "data_batch_1", "rb") as f:  # the layout every CIFAR loader expects
        assert set(pickle.load(f, encoding="bytes")) == {b"batch_label", b"labels", b"data", b"filenames"}
    return np.concatenate(out[:5]), out[5]


def sample_ids(batches: Batches) -> list[int]:
    """Recover each image's index from its red top-left byte (unaugmented, 32 px)."""
    x = torch.cat([x for x, _ in batches])
    return unnormalize(x, CIFAR_MEAN, CIFAR_STD)[:, 0, 0, 0].round().long().tolist()


@pytest.fixture
def cifar(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    return (tmp_path, *write_cifar(tmp_path))


def test_cifar_pixels_round_trip(cifar: tuple[Path, np.ndarray, np.ndarray]) -> None:
    root, train, test = cifar
    data = build(data_cfg("cifar10", root=str(root), batch_size=4, augment=False), image_size=32)
    assert (data.num_classes, data.train_size, data.val_size, data.steps_per_epoch()) == (10, 40, 10, 10)
    val = list(data.val_batches())
    assert [len(y) for _, y in val] == [4, 4, 2]
    x = torch.cat([x for x, _ in val])
    written = torch.from_numpy(test).reshape(10, 3, 32, 32).float()
    assert torch.allclose(unnormalize(x, CIFAR_MEAN, CIFAR_STD), written, atol=1e-3)
    assert torch.cat([y for _, y in val]).tolist() == [i % 10 for i in range(10)]
    batches = list(data.train_batches(0))
    check_batches(batches, 4, 32, 10)
    ids = sample_ids(batches)
    assert sorted(ids) == list(range(40))  # the whole training split, each image once
    assert torch.cat([y for _, y in batches]).tolist() == [i % 10 for i in ids]  # labels follow images
    x0 = torch.from_numpy(train[ids[0]]).reshape(3, 32, 32).float()
    assert torch.allclose(unnormalize(batches[0][0][0], CIFAR_MEAN, CIFAR_STD), x0, atol=1e-3)
    assert json.loads(json.dumps(data.describe()))["root"] == str(root)


def test_cifar_order_resume_and_ddp_sharding(cifar: tuple[Path, np.ndarray, np.ndarray]) -> None:
    root = cifar[0]
    cfg = data_cfg("cifar10", root=str(root), batch_size=5, augment=False)
    full = build(cfg, image_size=32, seed=7)
    order = sample_ids(list(full.train_batches(2)))
    assert order == sample_ids(list(build(cfg, image_size=32, seed=7).train_batches(2)))
    assert order != sample_ids(list(full.train_batches(3)))
    assert sample_ids(list(full.train_batches(2, start=3))) == order[15:]
    r0, r1 = (build(cfg, image_size=32, seed=7, rank=r, world_size=2) for r in range(2))
    assert r0.steps_per_epoch() == r1.steps_per_epoch() == 4
    ids0, ids1 = sample_ids(list(r0.train_batches(2))), sample_ids(list(r1.train_batches(2)))
    assert not set(ids0) & set(ids1)
    assert [i for pair in zip(ids0, ids1, strict=True) for i in pair] == order  # together: the order
    v0, v1 = sample_ids(list(r0.val_batches())), sample_ids(list(r1.val_batches()))
    assert sorted(v0 + v1) == list(range(10))  # val shards cover the split once


def test_cifar_augmentation_is_deterministic(cifar: tuple[Path, np.ndarray, np.ndarray]) -> None:
    root = cifar[0]
    cfg = data_cfg("cifar10", root=str(root), batch_size=8, augment=True)
    plain = build(data_cfg("cifar10", root=str(root), batch_size=8, augment=False), image_size=32)
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    data = build(cfg, image_size=32)
    e0 = list(data.train_batches(0))
    assert torch.equal(torch.rand(3), expected_draw)  # the training process's RNG is left alone
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(e0, plain.train_batches(0), strict=True))
    # Same crops and flips with worker processes, on resume, and across epochs only by design.
    workers = build(data_cfg("cifar10", root=str(root), batch_size=8, num_workers=2), image_size=32)
    assert_same(e0, list(workers.train_batches(0)))
    assert_same(e0[2:], list(workers.train_batches(0, start=2)))  # persistent workers, new start
    assert_same(list(data.val_batches()), list(workers.val_batches()))
    assert not torch.equal(e0[0][0], next(data.train_batches(1))[0])


def test_cifar_resize_and_channels_last(cifar: tuple[Path, np.ndarray, np.ndarray]) -> None:
    data = build(data_cfg("cifar10", root=str(cifar[0]), batch_size=8), image_size=48, channels_last=True)
    x, _ = next(data.train_batches(0))
    assert x.shape == (8, 3, 48, 48) and x.is_contiguous(memory_format=torch.channels_last)
    xv, _ = next(data.val_batches())
    assert xv.shape == (8, 3, 48, 48) and xv.is_contiguous(memory_format=torch.channels_last)


def test_cifar_errors(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not cifar")
    expected = (
        f"data.root={tmp_path}: no CIFAR-10 batches found "
        "(expected cifar-10-batches-py/ with data_batch_1..5 and test_batch)"
    )
    with pytest.raises(MptrainError, match=f"^{re.escape(expected)}$"):
        build(data_cfg("cifar10", root=str(tmp_path)))
    write_cifar(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(MptrainError, match="cifar-10-batches-py/ lacks test_batch"):
        build(data_cfg("cifar10", root=str(tmp_path)))
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(b"garbage")
    with pytest.raises(MptrainError, match="cannot read the CIFAR-10 batches"):
        build(data_cfg("cifar10", root=str(tmp_path)))


def test_cifar_num_classes_must_match(cifar: tuple[Path, np.ndarray, np.ndarray]) -> None:
    with pytest.raises(MptrainError, match=r"data.num_classes=100: data=cifar10 .* has 10 classes"):
        build(data_cfg("cifar10", root=str(cifar[0]), num_classes=100))


# --------------------------------------------------------------------------------------------
# image_folder


COLORS = {"cat": (200, 30, 30), "dog": (30, 200, 30), "owl": (30, 30, 200)}


def write_folder(root: Path, classes: dict[str, tuple[int, int, int]] = COLORS, n: int = 3) -> None:
    """Solid-colour images per class, PNG and JPEG, of different sizes and aspect ratios."""
    for split in ("train", "val"):
        for name, color in classes.items():
            d = root / split / name
            d.mkdir(parents=True)
            for i in range(n):
                ext = "png" if i % 2 == 0 else "jpg"
                Image.new("RGB", (40 + 6 * i, 30), color).save(d / f"{i}.{ext}")


def test_image_folder_values_and_shapes(tmp_path: Path) -> None:
    write_folder(tmp_path)
    (tmp_path / "train" / "cat" / "README.txt").write_text("not an image: ignored")
    data = build(data_cfg("image_folder", root=str(tmp_path), batch_size=2, augment=False), image_size=16)
    assert (data.num_classes, data.train_size, data.val_size, data.steps_per_epoch()) == (3, 9, 9, 4)
    train = list(data.train_batches(0))
    check_batches(train, 2, 16, 3)
    colors = torch.tensor(list(COLORS.values()), dtype=torch.float32)  # sorted names = label order
    for x, y in [*train, *data.val_batches()]:
        rgb = unnormalize(x, IMAGENET_MEAN, IMAGENET_STD).mean((2, 3))
        assert torch.allclose(rgb, colors[y], atol=2.0)  # JPEG may shift a solid colour by a level
    val_labels = torch.cat([y for _, y in data.val_batches()]).tolist()
    assert val_labels == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_image_folder_augmented_is_deterministic(tmp_path: Path) -> None:
    write_folder(tmp_path, n=4)
    cfg = data_cfg("image_folder", root=str(tmp_path), batch_size=3, max_val_batches=2)
    a, b = build(cfg, image_size=24, seed=1), build(cfg, image_size=24, seed=1, channels_last=True)
    e0 = list(a.train_batches(0))
    check_batches(e0, 3, 24, 3)
    assert_same(e0[1:], [(x.contiguous(), y) for x, y in b.train_batches(0, start=1)])
    assert next(b.train_batches(0))[0].is_contiguous(memory_format=torch.channels_last)
    assert [len(y) for _, y in a.val_batches()] == [3, 3]


def test_image_folder_errors(tmp_path: Path) -> None:
    root = str(tmp_path)
    (tmp_path / "stuff").mkdir()
    expected = f"data.root={root}: no train/ folder (expected ImageNet layout root/train/<class>/*.jpg)"
    with pytest.raises(MptrainError, match=f"^{re.escape(expected)}$"):
        build(data_cfg("image_folder", root=root))
    (tmp_path / "train").mkdir()
    with pytest.raises(MptrainError, match=r"train/ has no class folders"):
        build(data_cfg("image_folder", root=root))
    write_folder(tmp_path / "x")
    tmp_path.joinpath("train").rmdir()
    tmp_path.joinpath("x", "train").rename(tmp_path / "train")
    with pytest.raises(MptrainError, match=r"no val/ folder"):
        build(data_cfg("image_folder", root=root))
    tmp_path.joinpath("x", "val").rename(tmp_path / "val")
    (tmp_path / "val" / "owl").rename(tmp_path / "val" / "bat")
    with pytest.raises(MptrainError, match=r"class folders differ \(only in train: owl; only in val: bat\)"):
        build(data_cfg("image_folder", root=root))
    (tmp_path / "val" / "bat").rename(tmp_path / "val" / "owl")
    for f in (tmp_path / "val" / "dog").iterdir():
        f.unlink()
    with pytest.raises(MptrainError, match=r"no images in class folder val/dog \(allowed: .jpg"):
        build(data_cfg("image_folder", root=root))
    with pytest.raises(MptrainError, match=r"data.num_classes=5: data=image_folder .* has 3 classes"):
        build(data_cfg("image_folder", root=root, num_classes=5))


def test_synthetic_task_seed_fixes_the_task_and_pattern_scale_weakens_it() -> None:
    """The study's CNN proxy (issue 18): one task and one validation set for every run seed."""
    import torch

    from mptrain.data.synthetic import SyntheticData

    def make(seed: int, **kw: Any) -> SyntheticData:
        return SyntheticData(batch_size=8, val_batch_size=8, num_classes=10, train_samples=16, val_samples=16,
                             max_val_batches=None, image_size=8, device=torch.device("cpu"), seed=seed, **kw)

    a, b = make(0, task_seed=7), make(1, task_seed=7)
    assert torch.equal(a.prototypes, b.prototypes)
    for (xa, ya), (xb, yb) in zip(a.val_batches(), b.val_batches(), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(next(a.train_batches(0))[0], next(b.train_batches(0))[0])  # the seed still draws
    # without task_seed the run seed picks the task, as before
    assert not torch.equal(make(0).prototypes, make(1).prototypes)
    # pattern_scale scales the class pattern; the noise stays
    weak, full = make(0, task_seed=7, pattern_scale=0.1), make(0, task_seed=7)
    (xw, yw), (xf, yf) = next(weak.val_batches()), next(full.val_batches())
    assert torch.equal(yw, yf)
    pattern = torch.nn.functional.interpolate(full.prototypes[yf], size=(8, 8), mode="bilinear", align_corners=False)
    assert torch.allclose(xf - xw, 0.9 * pattern, atol=1e-5)

"""The image_folder input pipeline (issue 13): decode paths, device-side finish, data-wait reporting.

Real JPEG trees are written on the fly (noisy content, so a crop in the wrong place or a missing
flip changes the pixels a lot). Speed is measured by ``mptrain-bench data``, never asserted here.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_job
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from mptrain.bench.data import make_jpeg_tree
from mptrain.config import DataConfig
from mptrain.data import ImageData, build_image_data
from mptrain.data.feed import DeviceFeeder, JpegDecoder, collate_raw, collate_uint8
from mptrain.data.loader import SeededItems
from mptrain.data.vision import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    image_folder_transforms_v2,
    read_image_uint8,
    read_jpeg_bytes,
)
from mptrain.errors import MptrainError

CPU = torch.device("cpu")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cfg(root: Path, **kw: Any) -> DictConfig:
    kw.setdefault("num_workers", 0)
    return OmegaConf.structured(DataConfig(name="image_folder", root=str(root), **kw))


def build(c: DictConfig, device: torch.device = CPU, size: int = 24, **kw: Any) -> ImageData:
    return build_image_data(c, image_size=size, device=device, seed=3, **kw)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 12 train / 6 val JPEGs of about 64x48 over 3 classes: tiny, but real libjpeg files.
    return make_jpeg_tree(tmp_path_factory.mktemp("jpeg"), classes=3, train_images=12, val_images=6,
                          size=(64, 48))


def batches(data: ImageData, split: str = "train", epoch: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(data.train_batches(epoch) if split == "train" else data.val_batches())


def test_decode_cpu_keeps_the_pil_augmentation(tree: Path) -> None:
    """Same seed, same crops and flips: the uint8 path matches the legacy PIL path to a level or two
    (both are libjpeg-turbo and antialiased bilinear), on noisy images where a different crop or a
    missing flip would differ by tens of levels."""
    old = build(cfg(tree, batch_size=4, decode="pil"))
    new = build(cfg(tree, batch_size=4, decode="cpu"))
    for split in ("train", "val"):
        for epoch in (0, 1):
            for (xo, yo), (xn, yn) in zip(batches(old, split, epoch), batches(new, split, epoch), strict=True):
                assert xn.dtype == torch.float32 and xn.shape == xo.shape and xn.shape[1:] == (3, 24, 24)
                assert torch.equal(yo, yn)
                levels = (xn - xo).abs() * torch.tensor(IMAGENET_STD)[:, None, None] * 255
                assert levels.mean() < 1.0 and levels.max() < 8, (split, epoch, levels.mean(), levels.max())
    # Different epochs crop differently: the comparison above is not trivially equal.
    e0, e1 = batches(new, "train", 0)[0][0], batches(new, "train", 1)[0][0]
    assert not torch.allclose(e0, e1)


def test_packed_crop_is_random_resized_crop(tree: Path) -> None:
    """The packed crop (a speed detail) draws the same parameters and gives the same bytes."""
    from torchvision.transforms import v2

    from mptrain.data.vision import PackedRandomResizedCrop

    img = read_image_uint8(str(next((tree / "train").rglob("*.jpg"))))
    plain, packed = v2.RandomResizedCrop(20, antialias=True), PackedRandomResizedCrop(20, antialias=True)
    for seed in range(8):
        torch.manual_seed(seed)
        a = plain(img)
        torch.manual_seed(seed)
        b = packed(img)
        assert torch.equal(a, b) and b.stride()[0] == 1  # HWC memory: channels innermost


def test_decode_cpu_order_resume_workers_and_shards(tree: Path) -> None:
    c = cfg(tree, batch_size=2)
    full = batches(build(c), "train", 1)
    resumed = list(build(c).train_batches(1, start=2))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full[2:], resumed, strict=True))
    with_worker = batches(build(cfg(tree, batch_size=2, num_workers=1)), "train", 1)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(full, with_worker, strict=True))
    # DDP: two ranks share one permutation, disjoint halves; images are the rank-0 ones exactly.
    r0 = build(c, rank=0, world_size=2)
    r1 = build(c, rank=1, world_size=2)
    assert r0.steps_per_epoch() == r1.steps_per_epoch() == 3
    x0 = torch.cat([x for x, _ in r0.train_batches(0)])
    x1 = torch.cat([x for x, _ in r1.train_batches(0)])
    assert not any(torch.equal(a, b) for a in x0 for b in x1)


def test_feeder_normalises_uint8_on_the_device_side() -> None:
    x = torch.randint(0, 256, (2, 3, 5, 4), dtype=torch.uint8)
    y = torch.tensor([1, 0])
    feed = DeviceFeeder(CPU, memory_format=torch.channels_last, non_blocking=False, mean=IMAGENET_MEAN,
                        std=IMAGENET_STD)
    (out, labels), = list(feed(iter([(x, y)])))
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, (x.float() / 255 - mean) / std)
    assert torch.equal(labels, y)
    # channels_last uint8, as collate_uint8 batches them, to an NCHW model input: same values.
    nchw = DeviceFeeder(CPU, memory_format=torch.contiguous_format, non_blocking=False, mean=IMAGENET_MEAN,
                        std=IMAGENET_STD)
    out_cl = next(nchw(iter([(x.contiguous(memory_format=torch.channels_last), y)])))[0]
    assert out_cl.is_contiguous()
    torch.testing.assert_close(out_cl, (x.float() / 255 - mean) / std)
    # Finished (float) batches, as decode=pil and CIFAR-10 make them, are only moved.
    plain = DeviceFeeder(CPU, memory_format=torch.contiguous_format, non_blocking=False)
    f = torch.randn(2, 3, 5, 4)
    assert next(plain(iter([(f, y)])))[0] is f


def test_bytes_path_decodes_like_the_workers(tree: Path, tmp_path: Path) -> None:
    """data.decode=gpu's logic on CPU: workers read bytes, the decoder decodes the batch and applies
    the same per-sample seeded transform: bit-identical to decode=cpu's worker output."""
    from torchvision import datasets

    png = tmp_path / "x.png"  # nvjpeg reads JPEG only: other formats are decoded in the worker
    Image.new("RGB", (30, 20), (10, 200, 30)).save(png)
    assert read_jpeg_bytes(str(png)).shape == (3, 20, 30)
    train_tf, _ = image_folder_transforms_v2(24, augment=True)
    ds = datasets.ImageFolder(str(tree / "train"), transform=train_tf, loader=read_image_uint8)
    seeded = SeededItems(ds, seed=3)
    keys = [(2, 5), (2, 0), (2, 7)]
    raw = collate_raw([(read_jpeg_bytes(ds.samples[i][0]), ds.samples[i][1], i) for _, i in keys]
                      + [(read_jpeg_bytes(str(png)), 0, 1)])
    assert raw.items[0].dim() == 1  # bytes, not pixels
    packed, labels = collate_uint8([seeded[k] for k in keys])
    assert packed.is_contiguous(memory_format=torch.channels_last)
    assert labels.tolist() == [ds.targets[i] for _, i in keys]
    out = JpegDecoder(train_tf, CPU, seed=3, augment=True)(raw, epoch=2)
    assert out.shape == (4, 3, 24, 24) and out.dtype == torch.uint8
    for j, key in enumerate(keys):
        assert torch.equal(out[j], seeded[key][0]) and torch.equal(packed[j], out[j])


def test_bytes_pipeline_end_to_end_on_cpu(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole decode=gpu pipeline (workers read bytes, RawBatch through the worker queue, batched
    decode and seeded augmentation where the batch lands), with the CPU standing in for CUDA: the
    batches are bit-identical to decode=cpu's. Only nvjpeg itself needs a GPU (CUDA test below)."""
    from mptrain.data import vision

    monkeypatch.setattr(vision, "_check_decode_device", lambda decode, device: None)
    ref = build(cfg(tree, batch_size=4))
    raw = build(cfg(tree, batch_size=4, decode="gpu", num_workers=1))
    for split in ("train", "val"):
        for (xr, yr), (xb, yb) in zip(batches(ref, split, 1), batches(raw, split, 1), strict=True):
            assert torch.equal(xr, xb) and torch.equal(yr, yb)
    resumed = list(raw.train_batches(1, start=1))
    assert torch.equal(resumed[0][0], batches(ref, "train", 1)[1][0])


def test_gpu_decode_drains_the_prefetch_stream_before_nvjpeg_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 17: nvjpeg writes on torchvision's own stream into blocks the allocator handed out by
    # the prefetch stream's order; the prefetch stream must be drained first. CUDA's calls are
    # recorded here, so the order is checked on any machine.
    import torchvision.io

    calls: list[str] = []

    class Stream:
        def synchronize(self) -> None:
            calls.append("synchronize")

    def decode_jpeg(items: list[torch.Tensor], mode: Any, device: Any) -> list[torch.Tensor]:
        calls.append("decode")
        return [torch.zeros(3, 4, 4, dtype=torch.uint8) for _ in items]

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torchvision.io, "decode_jpeg", decode_jpeg)
    jpeg = torch.tensor([0xFF, 0xD8, 0xFF, 0xE0], dtype=torch.uint8)
    raw = collate_raw([(jpeg, 0, 0), (jpeg, 1, 1)])
    out = JpegDecoder(lambda img: img, torch.device("cuda"), seed=0, augment=False)(raw, epoch=0)
    assert out.shape == (2, 3, 4, 4) and calls == ["synchronize", "decode"]


def test_decode_errors(tree: Path) -> None:
    with pytest.raises(MptrainError, match=r"^data.decode=gpu: decodes with nvjpeg on CUDA, but the device is cpu "
                                           r"\(use data.decode=cpu\)$"):
        build(cfg(tree, decode="gpu"))
    with pytest.raises(MptrainError, match=r"^data.decode=jpeg: unknown decode path \(allowed: cpu, gpu, pil\)$"):
        build(cfg(tree, decode="jpeg"))


def test_validate_refuses_bad_decode(tree: Path) -> None:
    from mptrain.cli import compose
    from mptrain.config import validate

    with pytest.raises(MptrainError, match=r"^data.decode='nvjpeg': must be one of cpu, gpu, pil$"):
        validate(compose(["data=image_folder", f"data.root={tree}", "data.decode=nvjpeg"]))
    with pytest.raises(MptrainError, match=r"^data.decode=gpu: only data=image_folder decodes image files"):
        validate(compose(["data=synthetic", "data.decode=gpu"]))


# ------------------------------------------------------------------------------------ data wait


# Data wait is measured by the engine around next(batches), whatever the task: the tiny LSTM LM
# steps in milliseconds, so a sleeping loader makes a clearly input-bound run in well under a second.
TINY_LM = ["model=lstm_lm_tiny", "data.vocab_size=50", "data.train_tokens=4000", "data.val_tokens=800",
           "data.batch_size=4", "data.bptt=8", "trainer.log_every=2", "trainer.max_steps=4", "trainer.device=cpu"]


@pytest.fixture
def one_thread() -> Any:
    """A tiny model on a shared 2-core CPU: OpenMP's spin-waits would make each step many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_data_wait_is_logged_and_an_input_bound_run_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    from mptrain.tasks.language_model import LanguageModelTask

    real = LanguageModelTask.train_batches

    def slow(self: Any, epoch: int, start: int = 0) -> Any:
        for b in real(self, epoch, start):
            time.sleep(0.05)  # a loader far slower than the model's step
            yield b

    monkeypatch.setattr(LanguageModelTask, "train_batches", slow)
    caplog.set_level(logging.INFO, logger="mptrain")
    run = tmp_path / "run"
    summary = run_job(run, *TINY_LM)
    assert summary["status"] == "completed"
    assert 0.05 <= summary["data_wait_s"] < 0.5 and summary["data_wait_fraction"] > 0.3
    warned = [r.getMessage() for r in caplog.records if "input-bound" in r.getMessage()]
    assert len(warned) == 1 and "waiting for data" in warned[0]  # once per run, not once per window
    assert any(re.search(r"data_wait \d+\.\d ms/step \(\d+%\)", r.getMessage()) for r in caplog.records)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run))
    ea.Reload()
    assert {"train/data_wait", "train/data_wait_fraction"} <= set(ea.Tags()["scalars"])
    assert [e.step for e in ea.Scalars("train/data_wait")] == [2, 4]
    assert all(e.value >= 0.05 for e in ea.Scalars("train/data_wait"))
    assert json.loads((run / "summary.json").read_text())["data_wait_fraction"] == summary["data_wait_fraction"]


@pytest.mark.usefixtures("one_thread")
def test_no_stall_line_when_the_data_keeps_up(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mptrain")
    summary = run_job(tmp_path / "run", *TINY_LM)
    assert summary["data_wait_s"] is not None and summary["data_wait_fraction"] < 0.1
    assert not [r for r in caplog.records if "input-bound" in r.getMessage()]


@pytest.mark.parametrize(("data", "device", "hint"), [
    ({"name": "image_folder", "decode": "pil", "num_workers": 8}, "cuda",
     "; try more data.num_workers (now 8), data.decode=cpu, data.decode=gpu"),
    ({"name": "image_folder", "decode": "cpu", "num_workers": 2}, "cpu", "; try more data.num_workers (now 2)"),
    ({"name": "synthetic_text", "decode": "cpu", "num_workers": 2}, "cpu", "; try a faster data source"),
])
def test_stall_line_says_what_to_try(data: dict[str, Any], device: str, hint: str,
                                     caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from mptrain.engine import Engine

    fake = SimpleNamespace(cfg=OmegaConf.create({"data": data, "trainer": {"warmup_windows": 1}}),
                           device=torch.device(device), step=40, data_wait_windows=[(0.02, 0.25)],
                           dist=SimpleNamespace(is_main=True))
    caplog.set_level(logging.INFO, logger="mptrain")
    assert not Engine._warn_data_wait(fake, 1)  # the warm-up window (worker start-up) never warns
    assert Engine._warn_data_wait(fake, 2)
    line = caplog.records[-1].getMessage()
    assert line.startswith("input-bound: steps spent 25% of their time waiting for data (20.0 ms/step) at step 40")
    assert line.endswith(hint)
    fake.data_wait_windows = [(0.001, 0.05)]
    assert not Engine._warn_data_wait(fake, 3)
    fake.data_wait_windows, fake.dist.is_main = [(0.02, 0.25)], False
    assert not Engine._warn_data_wait(fake, 3)  # other ranks stay quiet


# ------------------------------------------------------------------------------------ CUDA


@pytest.mark.cuda
@cuda
def test_cuda_prefetched_uint8_matches_cpu(tree: Path) -> None:
    dev = torch.device("cuda")
    for split in ("train", "val"):
        host = batches(build(cfg(tree, batch_size=4)), split)
        gpu = batches(build(cfg(tree, batch_size=4), device=dev, channels_last=True), split)
        for (xh, yh), (xg, yg) in zip(host, gpu, strict=True):
            assert xg.is_cuda and xg.is_contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(xg.cpu(), xh, atol=1e-5, rtol=0)
            assert torch.equal(yg.cpu(), yh)


@pytest.mark.cuda
@cuda
def test_cuda_decode_gpu_matches_decode_cpu(tree: Path) -> None:
    """nvjpeg + augmentation on the GPU: the same crops and flips as the CPU workers. Pixels differ by
    a few levels (nvjpeg's IDCT and chroma upsampling, the float resize on CUDA), far less than the
    same images under other crops (epoch 1) differ."""
    dev = torch.device("cuda")
    std = torch.tensor(IMAGENET_STD)[:, None, None] * 255
    for split in ("train", "val"):
        ref = batches(build(cfg(tree, batch_size=4, decode="cpu")), split)
        other = batches(build(cfg(tree, batch_size=4, decode="cpu")), split, epoch=1)
        gpu = batches(build(cfg(tree, batch_size=4, decode="gpu", num_workers=1), device=dev), split)
        assert len(ref) == len(gpu)
        for (xr, yr), (xg, yg), (xo, _) in zip(ref, gpu, other, strict=True):
            assert xg.is_cuda and xg.dtype == torch.float32 and xg.shape == xr.shape
            same = ((xg.cpu() - xr).abs() * std).mean()
            assert same < 8.0, (split, same)
            if split == "train":
                assert same < ((xo - xr).abs() * std).mean() / 3, split
            assert torch.equal(yg.cpu(), yr)


# ------------------------------------------------------------------------------------ mptrain-bench data


def test_bench_data_json_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mptrain.bench import main

    args = ["data", "--images", "8", "--classes", "2", "--workers", "0", "--rounds", "2", "--batch-size", "4",
            "--image-size", "32", "--device", "cpu", "--out", str(tmp_path), "--name", "r"]
    assert main(args) == 0  # --device cpu: with a GPU visible, auto would pick it and the contract differs
    result = json.loads((tmp_path / "r.json").read_text())
    meta = result["meta"]
    assert meta["command"].startswith("mptrain-bench data --images 8") and meta["device"] == "cpu"
    assert meta["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert meta["tree"] == {"files": 16, "mean_bytes": meta["tree"]["mean_bytes"], "generated": True}
    assert meta["tree"]["mean_bytes"] > 50_000  # ImageNet-like files, not flat colours
    assert [(c["split"], c["workers"], list(c["decodes"])) for c in result["cells"]] == [
        ("train", 0, ["pil", "cpu"]), ("val", 0, ["pil", "cpu"])]
    for cell in result["cells"]:
        pil, new = cell["decodes"]["pil"], cell["decodes"]["cpu"]
        assert pil["vs_pil"] == 1.0 and len(new["img_s_rounds"]) == 2
        assert new["img_s"] > 0 and new["img_cpu_s"] > 0 and new["vs_pil"] > 0
    assert "| train | 0 | cpu |" in (tmp_path / "r.md").read_text()
    assert main(["data", "--decodes", "gpu", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "mptrain-bench data: error: --decodes gpu: needs a CUDA device (nvjpeg); use pil,cpu on CPU")


def test_bench_data_trains_through_the_engine(tmp_path: Path) -> None:
    from mptrain.bench import main

    args = ["data", "--images", "4", "--classes", "2", "--splits", "", "--decodes", "cpu", "--workers", "0",
            "--batch-size", "2", "--image-size", "32", "--train", "resnet50", "--train-steps", "2",
            "--train-log-every", "1", "--train-overrides", "model.width_divisor=8", "--device", "cpu",
            "--out", str(tmp_path),
            "--name", "r"]
    assert main(args) == 0
    runs = json.loads((tmp_path / "r.json").read_text())["train"]
    assert [r["data"] for r in runs] == ["synthetic", "image_folder/cpu"]
    assert runs[0]["vs_synthetic"] == 1.0 and all(r["steps"] == 2 and r["throughput"] > 0 for r in runs)
    assert 0 <= runs[1]["data_wait_fraction"] <= 1
    assert "| image_folder/cpu |" in (tmp_path / "r.md").read_text()

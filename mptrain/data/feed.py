"""From host batches to the model's input on the device: the one place images are finished.

Workers of ``data.decode=cpu`` hand over uint8 ``[B, 3, H, W]`` batches (a quarter of the bytes of
float32), pinned by the DataLoader. ``DeviceFeeder`` copies them non-blocking, converts to float,
normalises and goes channels_last on the device; on CUDA it does this on a side stream one batch
ahead, so the copy and the conversion overlap the previous step (timm's ``PrefetchLoader``,
written here because torch's DataLoader stops at pinned host memory).

``data.decode=gpu``: workers only read the files' bytes; ``JpegDecoder`` decodes a batch with
nvjpeg (``torchvision.io.decode_jpeg(list, device="cuda")``) and applies the same seeded v2
transforms as the workers of ``decode=cpu`` would, on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from mptrain.data.base import Batch, mix_seed

AUGMENT_STREAM = 3  # tag mixed into per-sample augmentation seeds (shared by every decode path)
_JPEG_MAGIC = b"\xff\xd8"


@contextlib.contextmanager
def seeded_rng(seed: int, epoch: int, index: int) -> Iterator[None]:
    """Within the block, torch's CPU RNG is seeded from ``(seed, epoch, index)``.

    torchvision's random transforms draw their parameters from the global CPU generator, whose
    state in DataLoader workers depends on the worker count; seeding per sample makes an augmented
    image a function of (seed, epoch, index) alone, wherever it is computed (worker, main process,
    GPU). ``fork_rng`` restores the caller's CPU RNG afterwards; only the CPU generator is forked and
    reseeded (``torch.manual_seed`` would also reseed CUDA's generators in the training process).
    """
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(mix_seed(seed, AUGMENT_STREAM, epoch, index))
        yield


def is_jpeg(data: Tensor) -> bool:
    return data.dim() == 1 and data.numel() >= 2 and bytes(data[:2].tolist()) == _JPEG_MAGIC


class RawBatch:
    """A ``data.decode=gpu`` batch as the workers leave it: per-sample file bytes (1-D uint8) or,
    for files nvjpeg cannot read (PNG, ...), the image already decoded on the host (uint8 CHW)."""

    def __init__(self, items: list[Tensor], labels: Tensor, indices: Tensor) -> None:
        self.items, self.labels, self.indices = items, labels, indices

    def __len__(self) -> int:
        return len(self.items)


def collate_raw(samples: Sequence[tuple[Tensor, int, int]]) -> RawBatch:
    """Keeps the variable-length byte strings as a list (default_collate would try to stack them)."""
    return RawBatch([s[0] for s in samples], torch.tensor([s[1] for s in samples], dtype=torch.long),
                    torch.tensor([s[2] for s in samples], dtype=torch.long))


def collate_uint8(samples: Sequence[tuple[Tensor, int]]) -> tuple[Tensor, Tensor]:
    """uint8 images into one channels_last batch (HWC memory, as decoded and resized).

    default_collate would stack them into NCHW: a transposing copy that costs more on the host
    than the resize it follows. Channels_last goes to the device as is, where the model wants it
    (trainer.channels_last) or where the transpose is cheap.
    """
    c, h, w = samples[0][0].shape
    out = torch.empty((len(samples), c, h, w), dtype=torch.uint8, memory_format=torch.channels_last)
    if torch.utils.data.get_worker_info() is not None:
        out.share_memory_()  # filled in shared memory, as default_collate does: no copy on the way out
    for i, (img, _) in enumerate(samples):
        out[i].copy_(img)
    return out, torch.tensor([s[1] for s in samples], dtype=torch.long)


class JpegDecoder:
    """Decodes a ``RawBatch`` on ``device`` and applies ``transform`` per sample: uint8 ``[B, 3, S, S]``.

    With ``augment`` the transform is seeded per sample exactly as the ``decode=cpu`` workers seed
    it, so both paths pick the same crops and flips for the same (seed, epoch, index).
    """

    def __init__(self, transform: Callable[[Tensor], Tensor], device: torch.device, seed: int, augment: bool) -> None:
        self.transform, self.device, self.seed, self.augment = transform, device, seed, augment

    def __call__(self, raw: RawBatch, epoch: int) -> Tensor:
        jpeg = [i for i, t in enumerate(raw.items) if is_jpeg(t)]
        images: list[Tensor | None] = [None] * len(raw)
        if jpeg:
            # One batched call: on CUDA, nvjpeg decodes the whole batch (the host only parses headers).
            from torchvision.io import ImageReadMode, decode_jpeg

            if self.device.type == "cuda":
                # nvjpeg writes the outputs on torchvision's own decoder stream, but the caching
                # allocator hands them blocks by the current (prefetch) stream's order: a block
                # freed there may still be in use by kernels queued on it. Drain that stream first,
                # so no queued kernel can touch a block nvjpeg writes. Cheap: torchvision's batched
                # decode blocks the host until it is done anyway (cudaStreamSynchronize).
                torch.cuda.current_stream(self.device).synchronize()
            decoded = decode_jpeg([raw.items[i] for i in jpeg], mode=ImageReadMode.RGB, device=self.device)
            for i, img in zip(jpeg, decoded, strict=True):
                images[i] = img
        out = []
        for i, img in enumerate(images):
            img = raw.items[i].to(self.device, non_blocking=True) if img is None else img
            with seeded_rng(self.seed, epoch, int(raw.indices[i])) if self.augment else contextlib.nullcontext():
                out.append(self.transform(img))
        return torch.stack(out)


class DeviceFeeder:
    """Host batches in, ``(images, labels)`` on the device out: float32, normalised, in the memory
    format the model wants.

    ``mean``/``std`` given: images arrive as uint8 (0..255) and are normalised here; ``None``: they
    arrive finished (float, normalised on the host: CIFAR-10 and ``data.decode=pil``) and are only
    copied. ``decoder`` given: batches arrive as ``RawBatch`` and are decoded here first.
    """

    def __init__(self, device: torch.device, *, memory_format: torch.memory_format, non_blocking: bool,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 decoders: dict[str, JpegDecoder] | None = None) -> None:
        self.device = device
        self.memory_format = memory_format
        self.non_blocking = non_blocking
        self.decoders = decoders or {}
        self.scale: Tensor | None = None
        self.shift: Tensor | None = None
        if mean is not None and std is not None:
            std_t = torch.tensor(std, dtype=torch.float32)
            self.scale = (1.0 / (255.0 * std_t)).view(1, 3, 1, 1).to(device)
            self.shift = (-torch.tensor(mean, dtype=torch.float32) / std_t).view(1, 3, 1, 1).to(device)

    def finish(self, images: Tensor) -> Tensor:
        """Host or device batch -> the model's input on the device (enqueued on the current stream)."""
        x = images.to(self.device, non_blocking=self.non_blocking)
        mf = self.memory_format
        if self.scale is None or self.shift is None:
            return x.contiguous(memory_format=mf)
        # (x/255 - mean)/std = x * scale + shift, in place on the float copy.
        if x.device.type == "cuda":
            # Relayout first: it moves uint8, a quarter of the bytes; in-place ops keep the layout.
            return x.contiguous(memory_format=mf).float().mul_(self.scale).add_(self.shift)
        # CPU: the channel broadcast is ~6x slower on a channels_last tensor than on NCHW, and a
        # uint8 relayout slower than a float one (measured, one thread). Fastest: one copy_ that
        # converts (and transposes) into an NCHW float buffer, normalise there, relayout last.
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)
        return out.mul_(self.scale).add_(self.shift).contiguous(memory_format=mf)

    def _load(self, batch: Any, split: str, epoch: int) -> Batch:
        if isinstance(batch, RawBatch):
            labels = batch.labels.to(self.device, non_blocking=self.non_blocking)
            return self.finish(self.decoders[split](batch, epoch)), labels
        images, labels = batch
        return self.finish(images), labels.to(self.device, non_blocking=self.non_blocking)

    def __call__(self, it: Iterator[Any], split: str = "train", epoch: int = 0) -> Iterator[Batch]:
        if self.device.type != "cuda":
            for batch in it:
                yield self._load(batch, split, epoch)
            return
        yield from self._prefetch(it, split, epoch)

    def _prefetch(self, it: Iterator[Any], split: str, epoch: int) -> Iterator[Batch]:
        # The next batch's copy, decode and normalisation are enqueued on a side stream before the
        # current batch is handed out, so they overlap the current step on the device. The compute
        # stream waits on an event of that batch only (no host sync), and record_stream keeps the
        # caching allocator from reusing the tensors while the compute stream still reads them.
        stream = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        pending: tuple[Batch, torch.cuda.Event] | None = None
        for batch in it:
            with torch.cuda.stream(stream):
                loaded = self._load(batch, split, epoch)
                event = torch.cuda.Event()
                event.record(stream)
            if pending is not None:
                yield self._handover(*pending, main)
            pending = (loaded, event)
        if pending is not None:
            yield self._handover(*pending, main)

    @staticmethod
    def _handover(batch: Batch, event: torch.cuda.Event, main: torch.cuda.Stream) -> Batch:
        main.wait_event(event)
        for t in batch:
            t.record_stream(main)
        return batch

"""DCGAN training (Radford et al. 2015), the GAN of Micikevicius et al. 2017, in the one engine.

Two objectives, in this order each step, each with its own optimizer and loss scaler:

- ``discriminator``: BCE(D(x), real) + BCE(D(G(z)), fake), with G(z) detached;
- ``generator``: BCE(D(G(z)), real), the non-saturating loss, on the same z, through the
  discriminator as it is after its update.

The discriminator's step makes G(z) without a graph and the generator's step makes it again with
one. Reusing one graph across both steps (as PyTorch's DCGAN example does) would break whenever
the generator's weights change in place in between (emulated FP8 re-rounds every model's weights
after each optimizer step), and under DDP the generator's forward would run outside its own
step's ``no_sync``. The two forwards give the same images: same weights, same z, same batch
statistics.

The noise z of a batch is drawn from ``(trainer.seed, epoch, batch index, rank)``, so a resumed run
sees the same z. Real images are mapped to the generator's tanh range [-1, 1]; labels are ignored.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from mptrain import distributed
from mptrain.data import build_image_data
from mptrain.data.base import ImageData, mix_seed
from mptrain.errors import MptrainError
from mptrain.models import create_model
from mptrain.numerics.precision import Precision
from mptrain.tasks import Objective, Task

log = logging.getLogger("mptrain")

Batch = tuple[Tensor, Tensor]  # (real images in [-1, 1], z [B, nz, 1, 1])
_NOISE, _FIXED, _EVAL = 10, 11, 12  # stream tags mixed into the seeds
SAMPLES_PNG = "samples.png"


def _plain(module: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel wrapper."""
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


@contextlib.contextmanager
def frozen(module: nn.Module) -> Iterator[None]:
    """Parameters excluded from the graph built inside: the generator's loss needs gradients through
    the discriminator's activations, not into its weights (which its own objective owns)."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


@contextlib.contextmanager
def batch_statistics(*modules: nn.Module) -> Iterator[None]:
    """Train-mode batch norm (per-batch statistics, as in training) that leaves the running
    statistics untouched: samples and evaluation must not change the state that is checkpointed."""
    norms = [m for mod in modules for m in mod.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [[b.clone() for b in m.buffers(recurse=False)] for m in norms]
    modes = [m.training for m in modules]
    for m in modules:
        m.train()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes, strict=True):
            m.train(mode)
        with torch.no_grad():
            for m, bufs in zip(norms, saved, strict=True):
                for b, s in zip(m.buffers(recurse=False), bufs, strict=True):
                    b.copy_(s)


def to_tanh_range(data: ImageData) -> tuple[Tensor, Tensor] | None:
    """``(scale, shift)`` with ``x * scale + shift`` in [-1, 1] for the dataset's normalised images,
    or None for synthetic data (unbounded pattern + noise), which is squashed with tanh instead."""
    if data.name == "synthetic":
        return None
    if data.name == "digits":
        mean, std = torch.tensor([data.mean]), torch.tensor([data.std])  # type: ignore[attr-defined]
    else:
        from mptrain.data import vision

        stats = {"cifar10": (vision.CIFAR_MEAN, vision.CIFAR_STD), "image_folder": (vision.IMAGENET_MEAN,
                                                                                    vision.IMAGENET_STD)}
        if data.name not in stats:
            raise MptrainError(f"data={data.name}: the GAN does not know this dataset's pixel range")
        mean, std = (torch.tensor(v) for v in stats[data.name])
    # normalised x = (p - mean) / std with p in [0, 1]  ->  2p - 1 = 2 std x + 2 mean - 1
    return (2 * std).view(1, -1, 1, 1), (2 * mean - 1).view(1, -1, 1, 1)


class GANTask(Task):
    """Reads ``model.*`` (nz, ngf, ndf, image_size / cpu_image_size, sample_every, num_samples),
    ``data.*`` (any image dataset: synthetic, image_folder, cifar10, digits), ``trainer.seed``,
    ``trainer.channels_last``, ``trainer.max_steps`` / ``trainer.epochs`` / ``trainer.grad_accum``
    (to draw the last sample grid on the last step).

    Logged per step: ``train/loss_discriminator``, ``train/loss_generator``, D(x) as
    ``train/d_x_discriminator``, D(G(z)) before and after the discriminator's update as
    ``train/d_g_z_discriminator`` and ``train/d_g_z_generator``; throughput in images/s.
    A fixed-noise sample grid goes to TensorBoard (``samples/fixed_noise``) every
    ``model.sample_every`` steps and on the last one, and to ``samples.png`` in the run dir at the end.
    """

    unit = "images"
    primary_metric = "loss_g"  # no sample-quality metric without pretrained weights (FID, IS)

    def __init__(self, cfg: DictConfig, device: torch.device, precision: Precision, image_size: int | None):
        m = cfg.model
        assert image_size is not None, "the engine resolves the image size for image tasks"
        self.image_size = int(image_size)
        self.device = device
        self.precision = precision
        self.seed = int(cfg.trainer.seed)
        env = distributed.env()
        self.rank, self.is_main = env.rank, env.is_main
        self.data = build_image_data(
            cfg.data,
            image_size=self.image_size,
            device=device,
            seed=self.seed,
            channels_last=cfg.trainer.channels_last,
            rank=env.rank,
            world_size=env.world_size,
        )
        affine = to_tanh_range(self.data)
        self._affine = None if affine is None else (affine[0].to(device), affine[1].to(device))
        # The registry builds from the model group; the size it needs is the one resolved here.
        gan = create_model(OmegaConf.merge(m, {"image_size": self.image_size}), 0).to(device)
        if cfg.trainer.channels_last:
            gan = gan.to(memory_format=torch.channels_last)
        self.modules = {"discriminator": gan.discriminator, "generator": gan.generator}
        self.objectives = [Objective("discriminator", "discriminator"), Objective("generator", "generator")]
        self.num_params = {k: sum(p.numel() for p in v.parameters()) for k, v in self.modules.items()}
        self.nz = int(m.nz)
        self.sample_every = int(m.sample_every)
        t = cfg.trainer
        self.total_steps = t.max_steps or t.epochs * (self.data.steps_per_epoch() // t.grad_accum)
        self._gen = torch.Generator(device=device)
        self._gen.manual_seed(mix_seed(self.seed, _FIXED))
        self.fixed_noise = torch.randn((int(m.num_samples), self.nz, 1, 1), generator=self._gen, device=device)
        self._last_media: int | None = None

    # ------------------------------------------------------------------------------- batches

    def steps_per_epoch(self) -> int:
        return self.data.steps_per_epoch()

    def _real(self, images: Tensor) -> Tensor:
        if self._affine is None:
            return images.tanh()
        scale, shift = self._affine
        return images * scale + shift

    def _noise(self, n: int, *tag: int) -> Tensor:
        self._gen.manual_seed(mix_seed(self.seed, *tag, self.rank))
        return torch.randn((n, self.nz, 1, 1), generator=self._gen, device=self.device)

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        images = self.data.train_batches(epoch, start)
        return ((self._real(x), self._noise(x.shape[0], _NOISE, epoch, i))
                for i, (x, _labels) in enumerate(images, start))

    def batch_size(self, batch: Batch) -> int:
        return batch[0].shape[0]

    # ------------------------------------------------------------------------------- losses

    def loss(self, objective: Objective, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        real, z = batch
        cast = self.precision.input_cast
        D = self.modules["discriminator"]
        if objective.name == "discriminator":
            with torch.no_grad():
                fake = _plain(self.modules["generator"])(cast(z))
            d_real = D(cast(real)).float()
            d_fake = D(fake).float()
            loss = (F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
                    + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake)))
            return loss, {"d_x": d_real.detach().sigmoid().mean(), "d_g_z": d_fake.detach().sigmoid().mean()}
        fake = self.modules["generator"](cast(z))
        d_plain = _plain(D)  # no DDP hooks: only the generator's gradients are reduced in this step
        with frozen(d_plain):
            d_fake = d_plain(fake).float()
        loss = F.binary_cross_entropy_with_logits(d_fake, torch.ones_like(d_fake))
        return loss, {"d_g_z": d_fake.detach().sigmoid().mean()}

    # ------------------------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate(self, precision: Precision) -> dict[str, float]:
        """Both losses, D(x) and D(G(z)) on the validation images (fresh noise per batch, the same
        every evaluation), batch norm on batch statistics as in training; one host sync."""
        G, D = _plain(self.modules["generator"]), _plain(self.modules["discriminator"])
        sums = torch.zeros(5, device=self.device, dtype=torch.float64)
        with batch_statistics(G, D):
            for i, (images, _labels) in enumerate(self.data.val_batches()):
                z = self._noise(images.shape[0], _EVAL, i)
                with precision.autocast():
                    d_real = D(precision.input_cast(self._real(images))).float()
                    d_fake = D(G(precision.input_cast(z))).float()
                bce = F.binary_cross_entropy_with_logits
                sums += torch.stack([
                    bce(d_real, torch.ones_like(d_real), reduction="sum")
                    + bce(d_fake, torch.zeros_like(d_fake), reduction="sum"),
                    bce(d_fake, torch.ones_like(d_fake), reduction="sum"),
                    d_real.sigmoid().sum(), d_fake.sigmoid().sum(), d_real.new_tensor(float(d_real.numel())),
                ]).double()
        loss_d, loss_g, d_x, d_g_z, n = distributed.all_reduce(sums, "sum").tolist()
        n = max(n, 1.0)
        return {"loss_d": loss_d / n, "loss_g": loss_g / n, "d_x": d_x / n, "d_g_z": d_g_z / n}

    # ------------------------------------------------------------------------------- samples

    @torch.no_grad()
    def sample_grid(self) -> Tensor:
        """The fixed-noise samples as one ``[3, H, W]`` image grid in [0, 1] (FP32, on the CPU)."""
        from torchvision.utils import make_grid

        G = _plain(self.modules["generator"])
        with batch_statistics(G), self.precision.autocast():
            images = G(self.precision.input_cast(self.fixed_noise))
        images = (images.float().cpu() + 1) / 2
        return make_grid(images.clamp_(0, 1), nrow=max(1, math.isqrt(images.shape[0])), padding=2)

    def log_media(self, writer: Any, step: int) -> None:
        """On logging steps at least ``model.sample_every`` apart, and on the last step."""
        tb = getattr(writer, "writer", None)
        if tb is None:  # logging disabled (ranks other than 0)
            return
        due = self._last_media is None or step - self._last_media >= self.sample_every
        if not (due or step >= self.total_steps):
            return
        tb.add_image("samples/fixed_noise", self.sample_grid(), step)
        self._last_media = step

    def finish(self, run_dir: Any) -> None:
        """samples.png: the fixed-noise grid of the final generator."""
        if not self.is_main:
            return
        try:
            from torchvision.utils import save_image

            save_image(self.sample_grid(), Path(run_dir) / SAMPLES_PNG)
        except Exception as exc:  # never mask the run's own outcome from the engine's finally block
            log.warning("could not write %s: %s", SAMPLES_PNG, exc)

    # ------------------------------------------------------------------------------- state

    def describe(self) -> dict[str, Any]:
        return {"image_size": self.image_size, "nz": self.nz, "parameters": self.num_params,
                "data": self.data.describe()}

    def state_dict(self) -> dict[str, Any]:
        return {"fixed_noise": self.fixed_noise, "last_media_step": self._last_media}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        noise = state["fixed_noise"]
        if tuple(noise.shape) != tuple(self.fixed_noise.shape):
            raise MptrainError(
                f"trainer.resume: the checkpoint's fixed noise is {tuple(noise.shape)}, this run's "
                f"{tuple(self.fixed_noise.shape)} (model.num_samples, model.nz)"
            )
        self.fixed_noise = noise.to(self.device)
        self._last_media = state.get("last_media_step")

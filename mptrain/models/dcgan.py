"""DCGAN (Radford, Metz and Chintala 2015), the GAN of Micikevicius et al. 2017.

The generator projects z to a 4x4 map and doubles it with stride-2 transposed convolutions (batch
norm + ReLU) up to the image size, ending in tanh; the discriminator mirrors it with stride-2
convolutions (batch norm except on the first layer, LeakyReLU 0.2) down to 4x4 and one logit.
At 64 px this is exactly the paper's (and PyTorch's example's) 64-128-256-512 layout; at 32 px
(CIFAR-10, digits) one stage fewer on each side. Weights ~ N(0, 0.02), batch-norm scales ~
N(1, 0.02), as in the paper. Activations are not in place: layers that wrap their outputs in
custom autograd functions (emulated FP8, per-layer loss scaling) must not see them overwritten.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig
from torch import Tensor, nn

from mptrain.models import register_model


def _stages(image_size: int) -> int:
    """Doublings between the 4x4 map and the image (64 px: 4)."""
    n = int(math.log2(image_size)) - 2
    if n < 1 or 4 * 2**n != image_size:
        raise ValueError(f"image_size={image_size}: must be a power of two >= 8")
    return n


class Generator(nn.Module):
    """``z [B, nz, 1, 1] -> images [B, channels, size, size]`` in [-1, 1]."""

    def __init__(self, image_size: int, nz: int = 100, ngf: int = 64, channels: int = 3) -> None:
        super().__init__()
        n = _stages(image_size)
        width = ngf * 2 ** (n - 1)
        layers: list[nn.Module] = [
            nn.ConvTranspose2d(nz, width, 4, 1, 0, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        ]
        for _ in range(n - 1):
            layers += [nn.ConvTranspose2d(width, width // 2, 4, 2, 1, bias=False), nn.BatchNorm2d(width // 2),
                       nn.ReLU()]
            width //= 2
        layers += [nn.ConvTranspose2d(width, channels, 4, 2, 1, bias=False), nn.Tanh()]
        self.main = nn.Sequential(*layers)

    def forward(self, z: Tensor) -> Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    """``images [B, channels, size, size] -> logits [B]`` (the sigmoid is in the loss: autocast-safe)."""

    def __init__(self, image_size: int, ndf: int = 64, channels: int = 3) -> None:
        super().__init__()
        n = _stages(image_size)
        layers: list[nn.Module] = [nn.Conv2d(channels, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2)]
        width = ndf
        for _ in range(n - 1):
            layers += [nn.Conv2d(width, width * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(width * 2),
                       nn.LeakyReLU(0.2)]
            width *= 2
        layers += [nn.Conv2d(width, 1, 4, 1, 0, bias=False)]
        self.main = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.main(x).flatten()


class DCGAN(nn.Module):
    """Holds both networks (built together from one config); the GAN task trains them apart."""

    def __init__(self, image_size: int, nz: int = 100, ngf: int = 64, ndf: int = 64, channels: int = 3) -> None:
        super().__init__()
        self.generator = Generator(image_size, nz, ngf, channels)
        self.discriminator = Discriminator(image_size, ndf, channels)
        self.apply(init_weights)


def init_weights(m: nn.Module) -> None:
    """Radford et al.: every weight ~ N(0, 0.02); batch-norm scale ~ N(1, 0.02), shift 0."""
    if isinstance(m, nn.Conv2d | nn.ConvTranspose2d):
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


@register_model("dcgan", task="gan")
def dcgan(cfg: DictConfig, num_classes: int) -> nn.Module:
    """Reads ``model.``: image_size (the resolved size: the GAN task sets it), nz, ngf, ndf.
    ``num_classes`` is ignored (an unconditional GAN); images have 3 channels, as all data does."""
    return DCGAN(int(cfg.image_size), nz=int(cfg.nz), ngf=int(cfg.ngf), ndf=int(cfg.ndf))

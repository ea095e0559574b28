"""The five ImageNet CNNs of Micikevicius et al. 2017 (Mixed Precision Training), from torchvision.

All are random init (``weights=None``; nothing is downloaded). ``model.width_divisor`` > 1 builds
a tiny copy of the real architecture with every channel count divided (see :func:`narrow`), for
fast CPU tests and smoke runs; 1 builds exactly torchvision's model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any

import torch
import torchvision.models as tvm
from omegaconf import DictConfig
from torch import nn

from mptrain.errors import MptrainError, check
from mptrain.models import register_model

TASK = "classification"

# Layer types narrow() knows how to rebuild; a parametrised layer of any other type is refused.
_RESIZABLE = (nn.Conv2d, nn.Linear, nn.BatchNorm2d)


# --------------------------------------------------------------------------------------------
# narrowing


def classifier_heads(model: nn.Module) -> set[str]:
    """Names of the Linear layers that no sibling Linear follows (in registration order).

    That is each classifier's final layer in torchvision's CNNs (``fc``, ``classifier.6``,
    ``aux1.fc2``, ``AuxLogits.fc``), and the last Linear of a flat ``nn.Sequential``: the layers
    whose outputs are the class logits.
    """
    heads = set()
    for parent_name, parent in model.named_modules():
        linears = [name for name, m in parent.named_children() if isinstance(m, nn.Linear)]
        if linears:
            heads.add(f"{parent_name}.{linears[-1]}" if parent_name else linears[-1])
    return heads


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _like(m: nn.Module, device: torch.device | str | None) -> dict[str, Any]:
    """Factory kwargs putting a rebuilt layer where the old one was (or on ``device``)."""
    ref = next(iter(m.parameters(recurse=False)), None)
    if ref is None:
        ref = next(iter(m.buffers(recurse=False)))
    return {"device": ref.device if device is None else device, "dtype": ref.dtype}


def narrow(
    model: nn.Module,
    divisor: int,
    *,
    keep_out: Collection[str] | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Divide every channel count of ``model`` by ``divisor``, in place; returns ``model``.

    Each Conv2d / Linear / BatchNorm2d is replaced by a fresh layer of the same type and
    hyper-parameters with its widths divided, except the input width of the first Conv2d or
    Linear (the image channels) and the output width of the layers in ``keep_out`` (default:
    :func:`classifier_heads`, so every head still emits ``num_classes`` logits). Linear inputs that
    come from a flattened C x H x W map are divided too, which matches (C / divisor) x H x W.
    Everything else (module tree, forward, outputs) is untouched.

    The rebuilt layers are freshly initialised: He (kaiming, fan-out) for conv weights, as
    torchvision's ResNet and VGG do, since it adapts to the narrower fan; N(0, 0.01) for Linear
    weights as torchvision's VGG does; zero biases; BatchNorm at (1, 0). ``device``: where the
    rebuilt layers go (default: where the old ones were), so a model built on the meta device
    costs nothing until narrowed. ``divisor`` 1 returns the model unchanged.

    Raises MptrainError naming the allowed divisors when ``divisor`` does not divide every width.
    """
    check(
        isinstance(divisor, int) and divisor >= 1, f"model.width_divisor={divisor}: must be an integer >= 1"
    )
    if divisor == 1:
        return model
    heads = classifier_heads(model) if keep_out is None else set(keep_out)
    layers = [(name, m) for name, m in model.named_modules() if type(m) in _RESIZABLE]
    unsupported = [
        name
        for name, m in model.named_modules()
        if type(m) not in _RESIZABLE and any(True for _ in [*m.parameters(False), *m.buffers(False)])
    ]
    if unsupported:
        raise ValueError(f"narrow: cannot resize {', '.join(unsupported)} (only {_RESIZABLE})")
    stem = next((name for name, m in layers if isinstance(m, nn.Conv2d | nn.Linear)), None)

    # (in, out, groups) after narrowing, for every layer; collect the widths that get divided.
    divided: list[int] = []

    def div(width: int, keep: bool) -> int:
        if keep:
            return width
        divided.append(width)
        return width // divisor

    plan: dict[str, tuple[int, int, int]] = {}
    for name, m in layers:
        if isinstance(m, nn.Conv2d):
            groups = m.groups if m.groups == 1 or name == stem else div(m.groups, False)
            plan[name] = (div(m.in_channels, name == stem), div(m.out_channels, name in heads), groups)
        elif isinstance(m, nn.Linear):
            plan[name] = (div(m.in_features, name == stem), div(m.out_features, name in heads), 1)
        else:
            width = div(m.num_features, False)
            plan[name] = (width, width, 1)
    gcd = math.gcd(*divided)
    if gcd % divisor:
        allowed = ", ".join(map(str, _divisors(gcd)))
        raise MptrainError(
            f"model.width_divisor={divisor}: must divide every channel count of "
            f"{type(model).__name__}; allowed: {allowed}"
        )

    for name, m in layers:
        n_in, n_out, groups = plan[name]
        factory = _like(m, device)
        new: nn.Module
        if isinstance(m, nn.Conv2d):
            new = nn.Conv2d(
                n_in,
                n_out,
                m.kernel_size,
                stride=m.stride,
                padding=m.padding,  # type: ignore[arg-type]  # may be "same" / "valid"
                dilation=m.dilation,
                groups=groups,
                bias=m.bias is not None,
                padding_mode=m.padding_mode,
                **factory,
            )
            nn.init.kaiming_normal_(new.weight, mode="fan_out", nonlinearity="relu")
            if new.bias is not None:
                nn.init.zeros_(new.bias)
        elif isinstance(m, nn.Linear):
            new = nn.Linear(n_in, n_out, bias=m.bias is not None, **factory)
            nn.init.normal_(new.weight, 0.0, 0.01)
            if new.bias is not None:
                nn.init.zeros_(new.bias)
        else:
            assert isinstance(m, nn.BatchNorm2d)
            new = nn.BatchNorm2d(
                n_out,
                eps=m.eps,
                momentum=m.momentum,
                affine=m.affine,
                track_running_stats=m.track_running_stats,
                **factory,
            )
        new.train(m.training)
        parent, _, attr = name.rpartition(".")
        # setattr on an existing name keeps its place in _modules, so registration order holds.
        setattr(model.get_submodule(parent), attr, new)
    return model


# --------------------------------------------------------------------------------------------
# builders


def _build(factory: Callable[..., nn.Module], cfg: DictConfig, num_classes: int, **kwargs: Any) -> nn.Module:
    """Build ``factory(weights=None, num_classes=..., **kwargs)``, narrowed by ``cfg.width_divisor``."""
    check(num_classes >= 1, f"num_classes={num_classes}: must be >= 1")
    divisor = cfg.width_divisor
    check(
        isinstance(divisor, int) and divisor >= 1, f"model.width_divisor={divisor}: must be an integer >= 1"
    )
    if divisor == 1:
        return factory(weights=None, num_classes=num_classes, **kwargs)
    # The full-width model only serves as a blueprint: build it on the meta device (no memory, no
    # init: VGG-16 alone would take seconds) and create the narrowed layers on the real device.
    target = torch.get_default_device()
    with torch.device("meta"):
        model = factory(weights=None, num_classes=num_classes, **kwargs)
    narrow(model, divisor, device=target)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left and target.type != "meta":  # a tensor narrow() did not rebuild would stay a meta placeholder
        raise RuntimeError(f"narrow left {', '.join(left)} on the meta device")
    return model


def _no_aux(cfg: DictConfig) -> None:
    check(
        not cfg.aux_logits,
        f"model.aux_logits=true: {cfg.name} has no auxiliary classifiers (googlenet and inception_v3 do)",
    )


@register_model("alexnet", task=TASK)
def alexnet(cfg: DictConfig, num_classes: int) -> nn.Module:
    """AlexNet. Reads model.width_divisor, model.dropout, model.aux_logits (must be false)."""
    _no_aux(cfg)
    return _build(tvm.alexnet, cfg, num_classes, dropout=cfg.dropout)


@register_model("vgg16", task=TASK)
def vgg16(cfg: DictConfig, num_classes: int) -> nn.Module:
    """VGG-16 without batch norm (the paper's VGG-D). Reads model.width_divisor, model.dropout."""
    _no_aux(cfg)
    return _build(tvm.vgg16, cfg, num_classes, dropout=cfg.dropout)


@register_model("resnet50", task=TASK)
def resnet50(cfg: DictConfig, num_classes: int) -> nn.Module:
    """ResNet-50. Reads model.width_divisor; model.dropout is unused (ResNet has no dropout)."""
    _no_aux(cfg)
    return _build(tvm.resnet50, cfg, num_classes)


@register_model("googlenet", task=TASK)
def googlenet(cfg: DictConfig, num_classes: int) -> nn.Module:
    """GoogLeNet. Reads model.width_divisor, model.dropout (before fc), model.aux_logits.

    With aux_logits, train mode returns ``GoogLeNetOutputs(logits, aux_logits2, aux_logits1)``;
    eval mode always returns the logits tensor. The auxiliary heads keep torchvision's 0.7 dropout.
    """
    return _build(
        tvm.googlenet,
        cfg,
        num_classes,
        aux_logits=cfg.aux_logits,
        init_weights=True,  # torchvision's truncated-normal init (and no scipy warning)
        dropout=cfg.dropout,
    )


@register_model("inception_v3", task=TASK)
def inception_v3(cfg: DictConfig, num_classes: int) -> nn.Module:
    """Inception v3. Reads model.width_divisor, model.dropout (before fc), model.aux_logits.

    With aux_logits, train mode returns ``InceptionOutputs(logits, aux_logits)``; eval mode the
    logits tensor. The auxiliary head needs 299 px inputs (a 5x5 conv on a 5x5 map).
    """
    return _build(
        tvm.inception_v3,
        cfg,
        num_classes,
        aux_logits=cfg.aux_logits,
        init_weights=True,
        dropout=cfg.dropout,
    )

"""Image classifiers from the zoos: ``model=torchvision`` and ``model=timm`` (``model.arch=NAME``).

    mptrain model=torchvision model.arch=convnext_tiny precision=mx
    mptrain model=timm model.arch=resnet50d model.kwargs={drop_path_rate:0.1}

The five ImageNet CNNs of Micikevicius et al. 2017 (alexnet, vgg16, resnet50, googlenet,
inception_v3) are presets over the torchvision route: configs/model/<name>.yaml set the arch and
what the papers need (GoogLeNet's auxiliary heads, Inception's 299 px). One path for vision models.

Every model is random init (``weights=None``, ``pretrained=False``: nothing is downloaded) with the
data's class count. ``model.width_divisor`` > 1 builds a tiny copy of the real architecture with
every channel count divided (see :func:`narrow`), for fast CPU tests and smoke runs.

Image size: a null ``model.image_size`` is the architecture's canonical one (its weights' crop size
in torchvision, its pretrained config's input size in timm); a null ``model.cpu_image_size`` is
``model.image_size`` when set, else the smallest of a few sizes that a forward on the meta device
accepts (``accepts``: free, nothing allocated). A size the architecture rejects fails the first batch,
and ``explain_rejected_size`` turns that into one line with the sizes it does accept.
"""

from __future__ import annotations

import difflib
import functools
import math
from collections.abc import Callable, Collection
from typing import Any

import torch
import torchvision.models as tvm
from omegaconf import DictConfig, OmegaConf, open_dict
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
# the routes


def _build(factory: Callable[..., nn.Module], cfg: DictConfig, num_classes: int, **kwargs: Any) -> nn.Module:
    """Build ``factory(num_classes=..., **kwargs)``, narrowed by ``cfg.width_divisor``."""
    check(num_classes >= 1, f"num_classes={num_classes}: must be >= 1")
    divisor = cfg.get("width_divisor", 1)
    check(
        isinstance(divisor, int) and divisor >= 1, f"model.width_divisor={divisor}: must be an integer >= 1"
    )
    if divisor == 1:
        return factory(num_classes=num_classes, **kwargs)
    # The full-width model only serves as a blueprint: build it on the meta device (no memory, no
    # init: VGG-16 alone would take seconds) and create the narrowed layers on the real device.
    target = torch.get_default_device()
    with torch.device("meta"):
        model = factory(num_classes=num_classes, **kwargs)
    try:
        narrow(model, divisor, device=target)
    except ValueError as exc:  # a layer type narrow() cannot resize: the architecture's, not a bug
        raise MptrainError(f"model.width_divisor={divisor}: {cfg.arch} cannot be narrowed ({exc}); use 1") from exc
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left and target.type != "meta":  # a tensor narrow() did not rebuild would stay a meta placeholder
        raise RuntimeError(f"narrow left {', '.join(left)} on the meta device")
    return model


def _kwargs(cfg: DictConfig) -> dict[str, Any]:
    """``model.kwargs`` as a plain dict (a copy: the builders add their own defaults to it)."""
    node = cfg.get("kwargs")
    return dict(OmegaConf.to_container(node, resolve=True)) if node else {}  # type: ignore[arg-type]


def _refused(cfg: DictConfig, zoo: str, kwargs: dict[str, Any], exc: TypeError) -> MptrainError:
    """One line for constructor arguments the architecture does not take."""
    if "aux_logits" in str(exc):
        return MptrainError(f"model.aux_logits={str(cfg.aux_logits).lower()}: {cfg.arch} has no auxiliary "
                            "classifiers (googlenet and inception_v3 do)")
    if "'dropout'" in str(exc) and cfg.get("dropout") is not None:
        return MptrainError(f"model.dropout={cfg.dropout}: {zoo}'s {cfg.arch} takes no dropout argument "
                            "(leave model.dropout null)")
    return MptrainError(f"model.kwargs={kwargs}: {zoo}'s {cfg.arch} does not take them ({exc})")


def _close(name: str, names: list[str]) -> str:
    near = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
    return ", ".join(near) if near else ", ".join(names[:8]) + ", ..."


def torchvision_names() -> list[str]:
    """torchvision's classification architectures (``torchvision.models.list_models``)."""
    return tvm.list_models(module=tvm)


def check_torchvision(cfg: DictConfig) -> None:
    """Before any work: ``model.arch`` is one of torchvision's classifiers."""
    check(not OmegaConf.is_missing(cfg, "arch"),
          "model=torchvision needs model.arch=NAME (torchvision.models.list_models(), e.g. resnet18, vit_b_16)")
    names = torchvision_names()
    arch = str(cfg.arch)
    check(arch in names,
          f"model.arch={arch}: not a torchvision classification model; close matches: {_close(arch, names)}")


# The two with auxiliary heads; torchvision warns that they will change their default init, and the
# papers' runs used this one
_INIT_WEIGHTS = ("googlenet", "inception_v3")


@register_model("torchvision", task=TASK, check=check_torchvision)
def torchvision_model(cfg: DictConfig, num_classes: int) -> nn.Module:
    """``torchvision.models.get_model(model.arch, weights=None, num_classes=..., **model.kwargs)``.
    Reads model.arch, model.kwargs, model.width_divisor, and model.dropout and model.aux_logits when
    set (null: the architecture's default). With aux_logits, GoogLeNet's and Inception v3's train mode
    returns their auxiliary logits too; eval mode the logits tensor."""
    kwargs = _kwargs(cfg)
    if cfg.get("dropout") is not None:
        kwargs.setdefault("dropout", float(cfg.dropout))
    if cfg.get("aux_logits") is not None:
        kwargs.setdefault("aux_logits", bool(cfg.aux_logits))
    if cfg.arch in _INIT_WEIGHTS:
        # Null aux_logits: the heads only when their loss counts (torchvision's default is always on).
        kwargs.setdefault("aux_logits", float(cfg.get("aux_weight", 0.0)) > 0)
        kwargs.setdefault("init_weights", True)  # torchvision's truncated-normal init (and no scipy warning)
    try:
        return _build(functools.partial(tvm.get_model, str(cfg.arch), weights=None), cfg, num_classes, **kwargs)
    except TypeError as exc:
        raise _refused(cfg, "torchvision", kwargs, exc) from exc


def _timm() -> Any:
    try:
        import timm
    except ImportError as exc:
        raise MptrainError("model=timm needs the timm package: pip install 'mptrain[timm]'") from exc
    return timm


def check_timm(cfg: DictConfig) -> None:
    """Before any work: timm is installed and ``model.arch`` is one of its models."""
    timm = _timm()
    check(not OmegaConf.is_missing(cfg, "arch"),
          "model=timm needs model.arch=NAME (timm.list_models(), e.g. resnet50d, vit_small_patch16_224)")
    check(timm.is_model(str(cfg.arch)),
          f"model.arch={cfg.arch}: not a timm model; close matches: {_close(str(cfg.arch), timm.list_models())}")


@register_model("timm", task=TASK, check=check_timm)
def timm_model(cfg: DictConfig, num_classes: int) -> nn.Module:
    """``timm.create_model(model.arch, pretrained=False, num_classes=..., **model.kwargs)``. Reads
    model.arch, model.kwargs, model.width_divisor, and model.dropout when set (timm's drop_rate)."""
    timm = _timm()
    kwargs = _kwargs(cfg)
    if cfg.get("dropout") is not None:
        kwargs.setdefault("drop_rate", float(cfg.dropout))
    check(not cfg.get("aux_logits"), f"model.aux_logits=true: model=timm has no auxiliary classifiers ({cfg.arch})")
    try:
        return _build(functools.partial(timm.create_model, str(cfg.arch), pretrained=False), cfg, num_classes,
                      **kwargs)
    except TypeError as exc:
        raise _refused(cfg, "timm", kwargs, exc) from exc


# --------------------------------------------------------------------------------------------
# image sizes

# What the CPU default is chosen from, smallest first: the first one a meta forward accepts.
CANDIDATE_SIZES = (32, 64, 96, 128, 160, 192, 224, 256, 299, 320, 384, 448, 512)


def _meta_model(cfg: DictConfig) -> nn.Module:
    """The full-width architecture on the meta device (no memory), for shapes only."""
    from mptrain.models import build_architecture

    blueprint = cfg.copy()
    with open_dict(blueprint):
        blueprint.width_divisor = 1
    with torch.device("meta"):
        return build_architecture(blueprint, int(cfg.get("num_classes") or 10))


def accepts(model: nn.Module, size: int) -> bool | None:
    """Whether a train-mode forward of ``size`` x ``size`` images goes through (auxiliary heads
    included), on a model built on the meta device; None where the meta device cannot tell (an op
    without a meta kernel, a data-dependent branch)."""
    try:
        with torch.no_grad():
            model.train()(torch.empty(2, 3, size, size, device="meta"))
    except NotImplementedError:
        return None
    except Exception as exc:  # the architecture's own shape checks raise whatever they raise
        return None if "meta" in str(exc) else False
    return True


def canonical_size(cfg: DictConfig) -> int:
    """The architecture's own input size: model.kwargs' image_size / img_size, else its weights'
    crop size (torchvision) or pretrained config's input size (timm), else 224."""
    kwargs = cfg.get("kwargs") or {}
    for key in ("image_size", "img_size"):
        if isinstance(kwargs.get(key), int):
            return int(kwargs[key])
    route = cfg.get("route")
    if route == "torchvision":
        weights = tvm.get_model_weights(str(cfg.arch)).DEFAULT
        return int(getattr(weights.transforms, "keywords", {}).get("crop_size", 224))
    if route == "timm":
        size = _timm().get_pretrained_cfg_value(str(cfg.arch), "input_size")
        return int(size[-1]) if size else 224
    return 224


def image_size_for(cfg: DictConfig, device_type: str) -> int:
    """The input size for a run on ``device_type`` when data.image_size is null (see the module docstring)."""
    if device_type == "cuda":
        return int(cfg.image_size or canonical_size(cfg))
    if cfg.get("cpu_image_size") or cfg.get("image_size"):
        return int(cfg.get("cpu_image_size") or cfg.image_size)
    model = _meta_model(cfg)
    return next((s for s in CANDIDATE_SIZES if accepts(model, s)), canonical_size(cfg))


def explain_rejected_size(cfg: DictConfig, size: int, key: str, exc: Exception) -> MptrainError | None:
    """One line for a first batch that failed because the architecture rejects ``size`` px (it
    accepts other sizes on the meta device), or None when the size is not the cause."""
    try:
        model = _meta_model(cfg)
        if accepts(model, size) is not False:
            return None
        ok = [s for s in (*CANDIDATE_SIZES, canonical_size(cfg)) if accepts(model, s)]
    except Exception:  # the diagnosis must not hide the failure it explains
        return None
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    sizes = ", ".join(str(s) for s in sorted(set(ok))[:6]) or "none of " + ", ".join(map(str, CANDIDATE_SIZES))
    return MptrainError(f"{key}={size}: {cfg.name} rejects {size} px inputs ({first}); it accepts {sizes}")

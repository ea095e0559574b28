"""Model registry (timm-style): ``model.name`` -> a builder ``(cfg, num_classes) -> nn.Module``.

A module of this package registers its builders with ``@register_model(name, task=...)``; the
``task`` tag tells the runner (and the tests) which kind of model it is, e.g. ``classification``
for the ImageNet CNNs in :mod:`mptrain.models.vision`. Every builder takes the composed ``model``
config group and the number of classes (resolved by the caller from ``model.num_classes`` or the
data); builders for tasks without classes ignore the second argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig
from torch import nn

from mptrain.errors import MptrainError

ModelBuilder = Callable[[DictConfig, int], nn.Module]


@dataclass(frozen=True)
class ModelEntry:
    """One registered model: its ``model.name``, its task tag and its builder."""

    name: str
    task: str
    builder: ModelBuilder


_REGISTRY: dict[str, ModelEntry] = {}


def register_model(name: str, *, task: str = "classification") -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator: register ``builder(cfg, num_classes) -> nn.Module`` as ``model=name``."""

    def decorator(builder: ModelBuilder) -> ModelBuilder:
        # Two modules claiming one name is a bug in mptrain, not a user error.
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is registered twice")
        _REGISTRY[name] = ModelEntry(name=name, task=task, builder=builder)
        return builder

    return decorator


def list_models(task: str | None = None) -> list[str]:
    """Registered model names, sorted; only those tagged ``task`` when given."""
    return sorted(name for name, entry in _REGISTRY.items() if task is None or entry.task == task)


def get_model_entry(name: str) -> ModelEntry:
    """The registry entry for ``name``. Raises MptrainError naming the choices if unknown."""
    if name not in _REGISTRY:
        raise MptrainError(f"model={name!r}: unknown; choose one of {', '.join(list_models())}")
    return _REGISTRY[name]


def create_model(cfg: DictConfig, num_classes: int) -> nn.Module:
    """Build ``cfg.name`` (cfg is the composed ``model`` group) on the current default device.

    Reads ``model.name`` here; each builder documents the other keys it reads.
    """
    return get_model_entry(str(cfg.name)).builder(cfg, num_classes)


# Imported last so that the builders find register_model defined (vision imports this package).
import mptrain.models.dcgan as _dcgan  # noqa: E402, F401  (task="gan")
import mptrain.models.lstm as _lstm  # noqa: E402, F401  (task="language_model")
import mptrain.models.transformer as _transformer  # noqa: E402, F401  (task="language_model")
from mptrain.models import vision  # noqa: E402, F401

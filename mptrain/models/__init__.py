"""Model registry (timm-style): a builder ``(cfg, num_classes) -> nn.Module`` per key.

The key is ``model.route`` where the config has one (the routes that bring a model from elsewhere:
``torchvision``, ``timm``, ``hf_causal_lm``, ``custom``; the built-in CNNs are presets over
``torchvision``), else ``model.name`` (mptrain's own architectures: the LSTMs, the transformer,
DCGAN). A module of this package registers its builders with ``@register_model(key, task=...)``;
the ``task`` tag tells the runner (and the tests) which kind of model it is. Every builder takes the
composed ``model`` config group and the number of classes (resolved by the caller from
``model.num_classes`` or the data; the vocabulary size for a language model).

``create_model`` builds, checks that the builder returned an ``nn.Module``, and loads
``model.init_from`` (``mptrain.models.weights``) on every route.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig
from torch import nn

from mptrain.errors import MptrainError

ModelBuilder = Callable[[DictConfig, int], nn.Module]
ConfigCheck = Callable[[DictConfig], None]


@dataclass(frozen=True)
class ModelEntry:
    """One registered model: its key, its task tag, its builder, and the checks its config gets
    before any work (an unknown arch, a missing package: one line each)."""

    name: str
    task: str
    builder: ModelBuilder
    check: ConfigCheck | None = None


_REGISTRY: dict[str, ModelEntry] = {}


def register_model(name: str, *, task: str = "classification",
                   check: ConfigCheck | None = None) -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator: register ``builder(cfg, num_classes) -> nn.Module`` under ``name`` (a route or a
    model name); ``check(cfg)`` runs in ``check_config``, before any model is built."""

    def decorator(builder: ModelBuilder) -> ModelBuilder:
        # Two modules claiming one name is a bug in mptrain, not a user error.
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is registered twice")
        _REGISTRY[name] = ModelEntry(name=name, task=task, builder=builder, check=check)
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


def model_key(cfg: DictConfig) -> str:
    """The registry key of a ``model`` group: its route, else its name."""
    return str(cfg.get("route") or cfg.name)


def check_config(cfg: DictConfig) -> None:
    """The model's own checks (``register_model(check=...)``), run by ``mptrain.config.validate``."""
    entry = get_model_entry(model_key(cfg))
    if entry.check is not None:
        entry.check(cfg)


def build_architecture(cfg: DictConfig, num_classes: int) -> nn.Module:
    """The builder's model (random init) on the current default device; MptrainError if the
    builder (a user's callable, on ``model=custom``) returned something else."""
    model: Any = get_model_entry(model_key(cfg)).builder(cfg, num_classes)
    if not isinstance(model, nn.Module):
        raise MptrainError(f"model={cfg.name}: the builder returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def create_model(cfg: DictConfig, num_classes: int) -> nn.Module:
    """Build the model of ``cfg`` (the composed ``model`` group) on the current default device, with
    ``model.init_from``'s weights when set (strict unless ``model.init_strict=false``).

    Reads ``model.route`` / ``model.name`` and ``model.init_from`` here; each builder documents the
    other keys it reads.
    """
    model = build_architecture(cfg, num_classes)
    if cfg.get("init_from"):
        from mptrain.models.weights import load_init

        load_init(model, str(cfg.init_from), strict=bool(cfg.get("init_strict", True)))
    return model


# Imported last so that the builders find register_model defined (vision imports this package).
import mptrain.models.custom as _custom  # noqa: E402, F401  (model=custom)
import mptrain.models.dcgan as _dcgan  # noqa: E402, F401  (task="gan")
import mptrain.models.hf as _hf  # noqa: E402, F401  (model=hf_causal_lm)
import mptrain.models.lstm as _lstm  # noqa: E402, F401  (task="language_model")
import mptrain.models.transformer as _transformer  # noqa: E402, F401  (task="language_model")
from mptrain.models import vision  # noqa: E402, F401

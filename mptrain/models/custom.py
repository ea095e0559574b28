"""``model=custom model._target_=pkg.module.callable``: the user's own model, built by their callable.

    mptrain model=custom model._target_=mynets.small_cnn model.kwargs={width:64} precision=mx

The callable gets ``model.kwargs`` as keyword arguments (nested nodes with a ``_target_`` are
instantiated first, as Hydra's ``instantiate`` does), plus ``num_classes`` for a classifier
(``vocab_size`` for a language model) when its signature takes that argument and ``model.kwargs``
does not give it. It must return an ``nn.Module``. The contract (README, "Bring your own model"):

- ``model.task=classification`` (the default): (N, 3, H, W) float images -> (N, num_classes) logits,
  or a tuple whose first element is those logits and the rest auxiliary logits (weighted by
  ``model.aux_weight``);
- ``model.task=language_model``: (N, T) int64 tokens -> (N, T, V) logits (or an object with a
  ``.logits`` such tensor, as Hugging Face models return), V at least the data's vocabulary.

The callable is found as ``mptrain.targets`` finds every ``_target_`` (the current directory too).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf
from torch import nn

from mptrain.errors import MptrainError, check
from mptrain.models import register_model
from mptrain.targets import call_target, import_target

TASKS = ("classification", "language_model")


def check_custom(cfg: DictConfig) -> None:
    """Before any work: a task the contract covers, and a ``_target_`` that imports."""
    check(not OmegaConf.is_missing(cfg, "_target_"),
          "model=custom needs model._target_=package.module.callable (it returns your nn.Module)")
    check(cfg.task in TASKS, f"model.task={cfg.task!r}: model=custom takes one of {', '.join(TASKS)}")
    import_target(str(cfg._target_), "model._target_")


@register_model("custom", task="any", check=check_custom)
def custom_model(cfg: DictConfig, num_classes: int) -> nn.Module:
    """The user's callable. Reads model._target_, model.kwargs, model.task; ``num_classes`` is the
    vocabulary size for a language model."""
    target = str(cfg._target_)
    fn = import_target(target, "model._target_")
    extra = {"vocab_size" if cfg.task == "language_model" else "num_classes": num_classes}
    model = call_target(fn, target, "model._target_", cfg.get("kwargs"), extra)
    if not isinstance(model, nn.Module):
        raise MptrainError(f"model._target_={target}: returned a {type(model).__name__}, not a torch.nn.Module")
    return model

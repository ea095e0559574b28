"""Image classification: the ImageNet CNNs of Micikevicius et al. 2017, any torchvision or timm
classifier, and any model that maps (N, 3, H, W) images to (N, num_classes) logits (``model=custom``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor

from mptrain import distributed
from mptrain.data import build_image_data
from mptrain.errors import MptrainError
from mptrain.models import create_model
from mptrain.numerics.precision import Precision
from mptrain.tasks import Objective, Task

Batch = tuple[Tensor, Tensor]


class ClassificationTask(Task):
    """Cross-entropy on class labels; GoogLeNet and Inception v3 add their auxiliary losses.

    Reads ``model.*`` (name, num_classes, aux_weight), ``data.*`` and ``trainer.seed``,
    ``trainer.channels_last``.
    """

    primary_metric = "top1"

    def __init__(self, cfg: DictConfig, device: torch.device, precision: Precision, image_size: int | None):
        self.device = device
        self.model_cfg = cfg.model
        # The key that set this run's size, for the one line a rejected size gets.
        self.size_key = "data.image_size" if cfg.data.image_size else \
            ("model.image_size" if device.type == "cuda" else "model.cpu_image_size")
        self.precision = precision
        self.data = build_image_data(
            cfg.data,
            image_size=image_size,
            device=device,
            seed=cfg.trainer.seed,
            channels_last=cfg.trainer.channels_last,
            rank=distributed.env().rank,
            world_size=distributed.env().world_size,
        )
        self.image_size = self.data.image_size  # data=custom: its items' size
        num_classes = cfg.model.num_classes or self.data.num_classes
        self.num_classes = num_classes
        self._checked = False  # the first batch's forward is checked against the contract
        self.aux_weight = float(cfg.model.get("aux_weight", 0.0))
        model = create_model(cfg.model, num_classes).to(device)
        if cfg.trainer.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.modules = {"model": model}
        self.objectives = [Objective("model", "model")]

    def steps_per_epoch(self) -> int:
        return self.data.steps_per_epoch()

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        return self.data.train_batches(epoch, start)

    def batch_size(self, batch: Batch) -> int:
        return batch[0].shape[0]

    def loss(self, objective: Objective, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        images, labels = batch
        out = self._forward(images) if not self._checked else self.modules["model"](self.precision.input_cast(images))
        # Softmax and its sum are reductions: always FP32 (autocast does this too; fp16_master and
        # bf16_pure models emit half logits, so upcast explicitly).
        if isinstance(out, tuple):  # GoogLeNetOutputs / InceptionOutputs in train mode
            logits, *aux = (o for o in out if o is not None)
            main = F.cross_entropy(logits.float(), labels)
            loss = main + self.aux_weight * sum(F.cross_entropy(a.float(), labels) for a in aux)
            return loss, {"main_loss": main.detach()}
        return F.cross_entropy(out.float(), labels), {}

    @torch.no_grad()
    def evaluate(self, precision: Precision) -> dict[str, float]:
        """Top-1/top-5 accuracy (%) and loss on the validation split, one host sync at the end."""
        model = self.modules["model"]
        was_training = model.training
        model.eval()
        correct1 = torch.zeros((), device=self.device)
        correct5 = torch.zeros((), device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        seen = 0
        k = min(5, self.num_classes)
        for images, labels in self.data.val_batches():
            with precision.autocast():
                logits = model(precision.input_cast(images))
            logits = (logits[0] if isinstance(logits, tuple) else logits).float()
            loss_sum += F.cross_entropy(logits, labels, reduction="sum")
            topk = logits.topk(k, dim=1).indices
            hits = topk.eq(labels[:, None])
            correct1 += hits[:, 0].sum()
            correct5 += hits.any(dim=1).sum()
            seen += labels.shape[0]
        model.train(was_training)
        # Each rank scored its own shard of the validation set: sum the counts over ranks.
        totals = torch.stack([correct1, correct5, loss_sum, torch.tensor(float(seen), device=self.device)])
        c1, c5, ls, seen = distributed.all_reduce(totals, "sum").tolist()
        seen = max(seen, 1)
        return {"top1": 100.0 * c1 / seen, "top5": 100.0 * c5 / seen, "loss": ls / seen}

    def _forward(self, images: Tensor) -> Any:
        """The first batch's forward, checked: a size the architecture rejects, or logits that are not
        (N, num_classes), is one line (expected and got) instead of a traceback from deep in the model."""
        try:
            out = self.modules["model"](self.precision.input_cast(images))
        except (RuntimeError, ValueError, AssertionError, TypeError) as exc:
            explained = None
            if self.model_cfg.get("route") in ("torchvision", "timm"):
                from mptrain.models.vision import explain_rejected_size

                explained = explain_rejected_size(self.model_cfg, int(images.shape[-1]), self.size_key, exc)
            if explained is None:
                raise
            raise explained from exc
        logits = out[0] if isinstance(out, tuple) else out
        n = images.shape[0]
        if not (isinstance(logits, Tensor) and tuple(logits.shape) == (n, self.num_classes)):
            got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise MptrainError(f"model={self.model_cfg.name}: a classifier maps (N, 3, H, W) images to "
                               f"(N, num_classes) logits; for images {tuple(images.shape)} it returned {got}, "
                               f"expected ({n}, {self.num_classes})")
        self._checked = True
        return out

    def describe(self) -> dict[str, Any]:
        return {"num_classes": self.num_classes, "data": self.data.describe()}

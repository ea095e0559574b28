"""Image classification: the ImageNet CNNs of Micikevicius et al. 2017."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor

from mptrain import distributed
from mptrain.data import build_image_data
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
        assert image_size is not None
        self.device = device
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
        num_classes = cfg.model.num_classes or self.data.num_classes
        self.num_classes = num_classes
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
        out = self.modules["model"](self.precision.input_cast(images))
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
            logits = logits.float()
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

    def describe(self) -> dict[str, Any]:
        return {"num_classes": self.num_classes, "data": self.data.describe()}

"""Language modeling: the LSTMs of Micikevicius et al. 2017 (bigLSTM), a GPT-style transformer, and any
model that maps (N, T) tokens to (N, T, V) logits (Hugging Face causal LMs, ``model=custom``).

A model says whether it carries state between batches (a ``stateful`` attribute; absent: no). A stateful model (the
LSTM) trains with truncated BPTT: its hidden state is carried from one batch to the next (row r of
batch i + 1 continues row r of batch i, see :mod:`mptrain.data.text`) and detached, so gradients
flow through ``data.bptt`` steps only. It is reset at the start of every epoch and saved in the
checkpoint, so a resumed run continues with the very state the interrupted one had. A stateless
model (the transformer) is called as ``model(tokens) -> logits``: each row of ``data.bptt`` tokens
is one context, and there is nothing to carry. Gradient clipping by norm is the engine's
``trainer.grad_clip``, applied to unscaled gradients (the LM configs set it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor, nn

from mptrain import distributed
from mptrain.data.text import TextBatch, build_text_data
from mptrain.errors import MptrainError
from mptrain.models import create_model
from mptrain.numerics.precision import Precision
from mptrain.tasks import Objective, Task

log = logging.getLogger("mptrain")

Hidden = tuple[Tensor, Tensor]


def _detach(hidden: Hidden) -> Hidden:
    return (hidden[0].detach(), hidden[1].detach())


def logits_of(out: Any) -> Any:
    """A forward's logits: the tensor itself, or the ``.logits`` of a Hugging Face model's output."""
    return getattr(out, "logits", out)


def tied_head(model: nn.Module) -> bool:
    """Whether an output Linear shares its weight with an Embedding (a tied softmax), however the
    model ties it (mptrain's ``tie_weights``, transformers' ``tie_word_embeddings``). The LSTM reads
    its embedding through ``F.linear`` and has no head Linear, so its own ``tied`` flag counts too."""
    if getattr(model, "tied", False):
        return True
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return any(id(m.weight) in embeddings for m in model.modules() if isinstance(m, nn.Linear))


class LanguageModelTask(Task):
    """Cross-entropy of the next token; perplexity = exp(mean loss per token).

    Reads ``model.*`` (see :mod:`mptrain.models.lstm` and :mod:`mptrain.models.transformer`), ``data.*`` (see
    :func:`mptrain.data.text.build_text_data`) and ``trainer.seed``. Logs ``train/ppl`` beside the
    loss; ``evaluate`` returns ``loss`` and ``ppl`` on the validation stream. Throughput is in
    tokens (``batch_size`` x ``bptt`` per batch).
    """

    unit = "tokens"
    primary_metric = "ppl"

    def __init__(self, cfg: DictConfig, device: torch.device, precision: Precision) -> None:
        self.device = device
        self.precision = precision
        env = distributed.env()
        self.is_main = env.is_main
        self.data = build_text_data(
            cfg.data, device=device, seed=cfg.trainer.seed, rank=env.rank, world_size=env.world_size
        )
        self.vocab_size = self.data.vocab_size
        self.model_name = str(cfg.model.name)
        model = create_model(cfg.model, self.vocab_size).to(device)
        self.modules = {"model": model}
        self.objectives = [Objective("model", "model")]
        self.num_params = sum(p.numel() for p in model.parameters())
        self.tied = tied_head(model)
        # Read once from the bare module: the engine may wrap it later (DDP, compile, adaptive). Only
        # mptrain's LSTM says it is stateful; any other model is called as model(tokens).
        self.stateful = bool(getattr(model, "stateful", False))
        self._hidden: Hidden | None = None
        self._checked = False  # the first batch's output is checked against the contract

    def steps_per_epoch(self) -> int:
        return self.data.steps_per_epoch()

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[TextBatch]:
        # A new epoch starts the stream over: the carried state would belong to its end. A resumed
        # epoch (start > 0) keeps the state loaded from the checkpoint.
        if start == 0:
            self._hidden = None
        return self.data.train_batches(epoch, start)

    def batch_size(self, batch: TextBatch) -> int:
        return batch[0].numel()

    def loss(self, objective: Objective, batch: TextBatch) -> tuple[Tensor, dict[str, Tensor]]:
        inputs, targets = batch
        if self.stateful:
            logits, hidden = self.modules["model"](inputs, self._hidden)
            # Truncated BPTT: the next batch starts from this state, but no gradient flows back into it.
            self._hidden = _detach(hidden)
        else:
            logits = self._logits(self.modules["model"](inputs), inputs)
        # The softmax and its sum over the vocabulary are reductions: FP32 whatever the logits are.
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return loss, {"ppl": loss.detach().exp()}

    @torch.no_grad()
    def evaluate(self, precision: Precision) -> dict[str, float]:
        """Loss per token and perplexity over the whole validation stream (at most
        ``data.max_val_batches`` batches), a stateful model's state carried from batch to batch; one
        host sync."""
        model = self.modules["model"]
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        tokens = 0
        hidden: Hidden | None = None
        for inputs, targets in self.data.val_batches():
            with precision.autocast():
                if self.stateful:
                    logits, hidden = model(inputs, hidden)
                else:
                    logits = logits_of(model(inputs))
            loss_sum += F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
            tokens += targets.numel()
        model.train(was_training)
        # Each rank scored its own rows of the validation stream: sum over ranks.
        totals = torch.stack([loss_sum, torch.tensor(float(tokens), device=self.device, dtype=torch.float64)])
        total_loss, total_tokens = distributed.all_reduce(totals, "sum").tolist()
        loss = total_loss / max(total_tokens, 1)
        return {"loss": loss, "ppl": math.exp(loss) if loss < 700 else math.inf}

    def _logits(self, out: Any, inputs: Tensor) -> Tensor:
        """The logits of a forward's output; on the first batch, checked against the contract:
        (N, T) tokens -> (N, T, V) with V at least the vocabulary (one line naming both shapes)."""
        logits = logits_of(out)
        if not self._checked:
            n, t = inputs.shape
            ok = isinstance(logits, Tensor) and logits.dim() == 3 and tuple(logits.shape[:2]) == (n, t) \
                and logits.shape[2] >= self.vocab_size and logits.is_floating_point()
            got = f"{tuple(logits.shape)} {logits.dtype}" if isinstance(logits, Tensor) else type(logits).__name__
            if not ok:
                raise MptrainError(f"model={self.model_name}: a language model maps (N, T) tokens to (N, T, V) "
                                   f"logits; for tokens ({n}, {t}) it returned {got}, expected ({n}, {t}, "
                                   f">= {self.vocab_size})")
            self._checked = True
        return logits

    def describe(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "tied_softmax": self.tied, "parameters": self.num_params,
                "data": self.data.describe()}

    def state_dict(self) -> dict[str, Any]:
        vocab = self.data.vocab
        return {
            "hidden": None if self._hidden is None else list(self._hidden),
            "vocab_digest": None if vocab is None else vocab.digest(),
            "vocab_size": self.vocab_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vocab = self.data.vocab
        digest = None if vocab is None else vocab.digest()
        if state.get("vocab_digest") != digest or state.get("vocab_size") != self.vocab_size:
            raise MptrainError(
                f"trainer.resume: the checkpoint was trained on another vocabulary ({state.get('vocab_size')} "
                f"words) than this run's data ({self.vocab_size} words, data={self.data.name})"
            )
        hidden = state.get("hidden")
        if hidden is not None and hidden[0].shape[1] != self.data.batch_size:
            raise MptrainError(
                f"trainer.resume: the checkpoint carries an LSTM state for data.batch_size={hidden[0].shape[1]}, "
                f"this run has data.batch_size={self.data.batch_size}"
            )
        self._hidden = None if hidden is None else (hidden[0].to(self.device), hidden[1].to(self.device))

    def finish(self, run_dir: Any) -> None:
        """vocab.json (id -> word) in the run dir: what the model's output rows mean."""
        vocab = self.data.vocab
        if vocab is None or not self.is_main:
            return
        try:
            vocab.save(Path(run_dir) / "vocab.json", str(self.data.info.get("source", self.data.name)))
        except OSError as exc:  # never mask the run's own outcome from the engine's finally block
            log.warning("could not write vocab.json: %s", exc)

"""A word-level LSTM language model: the family of Zaremba et al.'s PTB models up to bigLSTM
(Jozefowicz et al. 2016; 2 x 8192 cells projected to 1024, the LSTM of Micikevicius et al. 2017).

embedding -> dropout -> nn.LSTM (``proj_size`` > 0: LSTMP) -> dropout -> softmax layer, whose
weight is the embedding matrix when ``model.tie_weights`` (Press and Wolf 2017; Inan et al. 2017).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor, nn
from torch.func import functional_call

from mptrain.hardware import lstm_path
from mptrain.models import register_model

log = logging.getLogger(__name__)

Hidden = tuple[Tensor, Tensor]  # (h, c), each [num_layers, batch, size]


class LSTMLanguageModel(nn.Module):
    """``forward(tokens [B, T], hidden | None) -> (logits [B, T, V], hidden)``.

    The tied softmax reads ``embedding.weight`` through ``F.linear`` instead of sharing a Parameter
    with an ``nn.Linear``: one parameter, one owner, so optimizer groups and weight-decay rules see
    it once.
    """

    stateful = True  # (h, c) is carried between batches: the LM task passes it back in

    def __init__(
        self,
        vocab_size: int,
        emb_size: int,
        hidden_size: int,
        num_layers: int,
        proj_size: int = 0,
        dropout: float = 0.0,
        tie_weights: bool = True,
        init_range: float = 0.1,
    ) -> None:
        super().__init__()
        out_size = proj_size or hidden_size
        if tie_weights and out_size != emb_size:
            raise ValueError(f"tie_weights needs emb_size == output size ({emb_size} != {out_size})")
        self.vocab_size = vocab_size
        self.tied = tie_weights
        self.embedding = nn.Embedding(vocab_size, emb_size)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(
            emb_size, hidden_size, num_layers, batch_first=True, proj_size=proj_size,
            dropout=dropout if num_layers > 1 else 0.0,  # between layers; torch warns on 1 layer
        )
        self.decoder = None if tie_weights else nn.Linear(out_size, vocab_size)
        self.decoder_bias = nn.Parameter(torch.zeros(vocab_size)) if tie_weights else None
        nn.init.uniform_(self.embedding.weight, -init_range, init_range)
        if self.decoder is not None:
            nn.init.uniform_(self.decoder.weight, -init_range, init_range)
            nn.init.zeros_(self.decoder.bias)

    def _lstm(self, x: Tensor, hidden: Hidden | None) -> tuple[Tensor, Hidden]:
        if x.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
            return self.lstm(x, hidden)
        dtype = torch.get_autocast_dtype("cpu")
        path = lstm_path("cpu", dtype)
        if path == "autocast":
            return self.lstm(x, hidden)
        # No oneDNN LSTM for this dtype on this CPU: cast by hand (ATen's LSTM, same rounding) or,
        # failing that, run in FP32. Gradients flow back through the casts to the FP32 parameters.
        _say_once(path, dtype)
        run_dtype = dtype if path == "cast" else torch.float32
        weights = {k: v.to(run_dtype) for k, v in self.lstm.named_parameters()}
        hx = None if hidden is None else (hidden[0].to(run_dtype), hidden[1].to(run_dtype))
        with torch.autocast("cpu", enabled=False):
            return functional_call(self.lstm, weights, (x.to(run_dtype), hx))

    def forward(self, tokens: Tensor, hidden: Hidden | None = None) -> tuple[Tensor, Hidden]:
        x = self.drop(self.embedding(tokens))
        out, hidden = self._lstm(x, hidden)
        out = self.drop(out)
        if self.decoder is not None:
            return self.decoder(out), hidden
        return F.linear(out, self.embedding.weight, self.decoder_bias), hidden


@functools.cache
def _say_once(path: str, dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    if path == "cast":
        log.info("LSTM: oneDNN has no %s LSTM on this CPU; running ATen's %s LSTM instead", name, name)
    else:
        log.warning("LSTM: this CPU has no %s LSTM kernel; the LSTM layers run in fp32 (as autocast does for "
                    "ops it cannot lower), the rest of the model in %s", name, name)


def lstm_lm(cfg: DictConfig, num_classes: int) -> nn.Module:
    """``num_classes`` is the vocabulary size. Reads ``model.``: emb_size, hidden_size, num_layers,
    proj_size, dropout, tie_weights, init_range."""
    return LSTMLanguageModel(
        vocab_size=num_classes,
        emb_size=int(cfg.emb_size),
        hidden_size=int(cfg.hidden_size),
        num_layers=int(cfg.num_layers),
        proj_size=int(cfg.proj_size),
        dropout=float(cfg.dropout),
        tie_weights=bool(cfg.tie_weights),
        init_range=float(cfg.init_range),
    )


# One architecture, several sizes (configs/model/lstm_lm*.yaml): each size is its own model name, so
# run names, summaries and the checkpoint's model check tell them apart.
SIZES = ("lstm_lm_tiny", "lstm_lm", "lstm_lm_medium", "lstm_lm_large")
for _name in SIZES:
    register_model(_name, task="language_model")(lstm_lm)

"""A GPT-style decoder-only transformer language model, written like nanoGPT (Karpathy; GPT-2 layout).

token + learned position embeddings -> dropout -> ``num_layers`` pre-LayerNorm blocks
(``x + attn(ln(x))``, ``x + mlp(ln(x))``) -> final LayerNorm -> ``lm_head``, whose weight is the
token embedding when ``model.tie_weights`` (Press and Wolf 2017). Attention is causal
``F.scaled_dot_product_attention(is_causal=True)`` (flash/efficient kernels where the device has
them); the MLP is 4x wide with GELU.

Precision notes: every GEMM is an ``nn.Linear`` (q/k/v, attention output, MLP in and out, the head),
so FP8 conversion (which swaps nn.Linear) reaches all of them and adaptive loss scaling sees each as
a scaling site. LayerNorm normalises in FP32 whatever its input dtype (``_LayerNorm``), so that with
FP16 weights (``precision=fp16_master``, where norm layers keep FP32 weights) the statistics keep
FP32's range. The model is stateless: each row of a batch is its own context of at most
``block_size`` tokens, nothing is carried between batches (``stateful = False``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor, nn

from mptrain.errors import MptrainError
from mptrain.models import register_model


class _LayerNorm(nn.LayerNorm):
    """nn.LayerNorm computed in FP32 and returned in the input's dtype.

    Under autocast this is what torch does anyway (layer_norm is an FP32 op); with FP16 or bf16
    *storage* (fp16_master keeps the norm's weights FP32 while activations are FP16) it avoids a
    mixed-dtype call and keeps the mean/variance reduction in FP32.
    """

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype:
            return super().forward(x)
        w, b = self.weight.float(), None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


class Embeddings(nn.Module):
    """Token + learned position embeddings, then dropout. Holds no Linear, so adaptive loss
    scaling's fx tracer keeps it as one leaf and the length check below is plain Python."""

    def __init__(self, vocab_size: int, d_model: int, block_size: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        if t > self.block_size:
            raise MptrainError(
                f"a sequence of {t} tokens is longer than model.block_size={self.block_size} (the transformer's "
                f"context length); use data.bptt <= {self.block_size} or a larger model.block_size"
            )
        pos = torch.arange(t, device=tokens.device)
        return self.drop(self.wte(tokens) + self.wpe(pos))


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.dropout = dropout
        self.c_attn = nn.Linear(d_model, 3 * d_model)  # q, k, v in one GEMM
        self.c_proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(
            self._heads(q), self._heads(k), self._heads(v),
            dropout_p=self.dropout if self.training else 0.0, is_causal=True,
        )
        return self.resid_drop(self.c_proj(y.transpose(1, 2).flatten(-2)))

    def _heads(self, t: Tensor) -> Tensor:
        # [B, T, d] -> [B, heads, T, head_dim]. unflatten rather than view(B, T, ...): no sizes are
        # read, so torch.fx (adaptive loss scaling) traces it as it is.
        return t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm: the residual stream itself is never normalised (GPT-2)."""

    def __init__(self, d_model: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = _LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, num_heads, dropout)
        self.ln_2 = _LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TransformerLanguageModel(nn.Module):
    """``forward(tokens [B, T]) -> logits [B, T, V]``, T <= ``block_size``; logit t sees tokens <= t.

    Tying follows nanoGPT: ``lm_head.weight`` *is* ``embed.wte.weight`` (one Parameter), so
    ``parameters()`` yields it once and FP8 conversion still finds the head as an nn.Linear.
    """

    stateful = False  # nothing carried between batches: the LM task calls model(tokens)

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        block_size: int,
        dropout: float = 0.0,
        tie_weights: bool = True,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.tied = tie_weights
        self.embed = Embeddings(vocab_size, d_model, block_size, dropout)
        self.blocks = nn.ModuleList(Block(d_model, num_heads, dropout) for _ in range(num_layers))
        self.ln_f = _LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)  # the last layer
        if tie_weights:
            self.lm_head.weight = self.embed.wte.weight
        # GPT-2 init: N(0, init_std) everywhere, biases zero, and the projections that write into the
        # residual stream scaled by 1/sqrt(2 * layers) so its variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.ndim == 2:
                std = init_std / math.sqrt(2 * num_layers) if name.endswith("c_proj.weight") else init_std
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def analytic_params(vocab_size: int, d_model: int, num_layers: int, block_size: int, tie_weights: bool) -> int:
    """Parameter count: embeddings, 12 d^2 + 13 d per block (4 Linear layers with biases and two
    LayerNorms), the final LayerNorm, and a bias-free head unless tied."""
    d = d_model
    head = 0 if tie_weights else vocab_size * d
    return vocab_size * d + block_size * d + num_layers * (12 * d * d + 13 * d) + 2 * d + head


def analytic_train_flops(vocab_size: int, d_model: int, num_layers: int, tokens_per_row: int, rows: int) -> int:
    """FLOPs of one training step (forward + backward = 3x forward) counting matmuls only, as
    ``torch.utils.flop_counter`` does: 6 N per token over the N = 12 L d^2 + d V weights that
    multiply (biases, norms and embedding lookups do not), plus attention's QK^T and AV, 12 L T d
    per token (kept whole: the causal mask's skipped half is still counted, as nanoGPT and the
    FLOP counter both do)."""
    d, layers, t = d_model, num_layers, tokens_per_row
    n_matmul = 12 * layers * d * d + d * vocab_size
    return rows * t * (6 * n_matmul + 12 * layers * t * d)


def transformer_lm(cfg: DictConfig, num_classes: int) -> nn.Module:
    """``num_classes`` is the vocabulary size. Reads ``model.``: d_model, num_layers, num_heads,
    block_size, dropout, tie_weights, init_std."""
    return TransformerLanguageModel(
        vocab_size=num_classes,
        d_model=int(cfg.d_model),
        num_layers=int(cfg.num_layers),
        num_heads=int(cfg.num_heads),
        block_size=int(cfg.block_size),
        dropout=float(cfg.dropout),
        tie_weights=bool(cfg.tie_weights),
        init_std=float(cfg.init_std),
    )


# One architecture, three sizes (configs/model/transformer_lm*.yaml), each its own model name.
SIZES = ("transformer_lm_tiny", "transformer_lm", "transformer_lm_large")
for _name in SIZES:
    register_model(_name, task="language_model")(transformer_lm)

"""``model=hf_causal_lm``: any causal language model that Hugging Face transformers knows, offline.

    mptrain model=hf_causal_lm model.model_type=llama \\
        'model.config={hidden_size:128,intermediate_size:256,num_hidden_layers:2,num_attention_heads:4}'

``AutoConfig.for_model(model_type, **model.config)`` makes the config and
``AutoModelForCausalLM.from_config`` the random-init model: no hub access, no download. The
vocabulary size is the data's unless ``model.config.vocab_size`` sets it (it may be larger, as a
padded embedding table, never smaller). The model is returned as transformers builds it, no
wrapper: the LM task calls ``model(tokens)`` and reads ``.logits``, the plan finds its Linear layers
by name (``model.layers.0.self_attn.q_proj``, ``lm_head``), tied heads included, and FSDP2's
default units are the classes the model lists in ``_no_split_modules`` (its decoder layers).
"""

from __future__ import annotations

import difflib
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from mptrain.errors import MptrainError, check
from mptrain.models import register_model

ATTENTION = ("eager", "sdpa", "flash_attention_2", "flex_attention")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise MptrainError("model=hf_causal_lm needs the transformers package: pip install 'mptrain[hf]'") from exc
    return transformers


def causal_lm_types() -> list[str]:
    """The model types that AutoModelForCausalLM can build."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def check_hf(cfg: DictConfig) -> None:
    """Before any work: transformers is installed and ``model.model_type`` is a causal LM it knows."""
    _transformers()
    check(not OmegaConf.is_missing(cfg, "model_type"),
          "model=hf_causal_lm needs model.model_type=TYPE (e.g. llama, gpt2, qwen2, mistral)")
    kind = str(cfg.model_type)
    types = causal_lm_types()
    if kind not in types:
        near = difflib.get_close_matches(kind, types, n=5, cutoff=0.5)
        raise MptrainError(f"model.model_type={kind}: not a causal LM that transformers knows; "
                           f"close matches: {', '.join(near) if near else ', '.join(types[:8]) + ', ...'}")
    check(str(cfg.attn_implementation) in ATTENTION,
          f"model.attn_implementation={cfg.attn_implementation}: must be one of {', '.join(ATTENTION)}")


def hf_config(cfg: DictConfig, vocab_size: int) -> Any:
    """The transformers config of ``cfg`` for data of ``vocab_size`` tokens."""
    transformers = _transformers()
    fields: dict[str, Any] = dict(OmegaConf.to_container(cfg.get("config") or {}, resolve=True))  # type: ignore[arg-type]
    fields.setdefault("use_cache", False)  # training: no key/value cache
    given = fields.get("vocab_size")
    if given is None:
        fields["vocab_size"] = vocab_size
    else:
        check(int(given) >= vocab_size,
              f"model.config.vocab_size={given}: smaller than the data's vocabulary ({vocab_size} tokens); "
              "leave it null to take the data's")
    try:
        config = transformers.AutoConfig.for_model(str(cfg.model_type), **fields)
    except (TypeError, ValueError) as exc:
        detail = " ".join(str(exc).split())[:300]
        raise MptrainError(f"model.config={fields}: transformers refuses it for {cfg.model_type} ({detail})") from exc
    # A default special token of a vocabulary the data does not have (GPT-2's eos 50256): none.
    # Training on mptrain's data never reads them; generation with the model would need them set.
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= config.vocab_size and key not in fields:
            setattr(config, key, None)
    return config


@register_model("hf_causal_lm", task="language_model", check=check_hf)
def hf_causal_lm(cfg: DictConfig, vocab_size: int) -> nn.Module:
    """``AutoModelForCausalLM.from_config(AutoConfig.for_model(model.model_type, **model.config))``.
    Reads model.model_type, model.config, model.attn_implementation."""
    transformers = _transformers()
    config = hf_config(cfg, vocab_size)
    try:
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=str(cfg.attn_implementation))
    except (ImportError, ValueError) as exc:  # an attention backend not installed, a config it cannot build
        detail = " ".join(str(exc).split())[:300]
        raise MptrainError(f"model=hf_causal_lm model.model_type={cfg.model_type}: transformers cannot build it "
                           f"({detail})") from exc

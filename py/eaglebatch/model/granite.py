"""Granite 3.x (`granite`): Llama with four multipliers, applied as transformers does, in the
activation dtype: embeddings * `embedding_multiplier`; each attention and MLP output *
`residual_multiplier` before it joins the residual stream; `attention_multiplier` as the
attention scale itself (softmax(q.k * it), in place of head_dim ** -0.5); logits divided by
`logits_scaling`. Each defaults to 1.0, as in transformers' GraniteConfig (so a config without
`attention_multiplier` scales attention by 1, not head_dim ** -0.5). `attention_bias` puts
biases on q/k/v and o. llama.cpp's `granite` files: Llama's (q/k rows permuted) with the
multipliers in the header."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.config_values import bool_value, positive_float
from eaglebatch.model.family import Family


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool_value(raw, "attention_bias")
    return {"attention_bias": bias, "o_proj_bias": bias,
            "embedding_multiplier": positive_float(raw, "embedding_multiplier", 1.0),
            "residual_multiplier": positive_float(raw, "residual_multiplier", 1.0),
            "attention_multiplier": positive_float(raw, "attention_multiplier", 1.0),
            "logits_divisor": positive_float(raw, "logits_scaling", 1.0)}  # fmt: skip


def _gguf_config(own: dict[str, Any], tensors) -> dict[str, Any]:
    """llama.cpp's `granite` header: the multipliers as `*_scale` keys, written only where
    config.json set them; an unwritten attention scale is llama.cpp's head_dim ** -0.5."""
    head_dim = own["embedding_length"] // own["attention.head_count"]
    return {"embedding_multiplier": own.get("embedding_scale", 1.0),
            "residual_multiplier": own.get("residual_scale", 1.0),
            "attention_multiplier": own.get("attention.scale", head_dim**-0.5),
            "logits_scaling": own.get("logit_scale", 1.0)}  # fmt: skip


GRANITE = Family("granite", "GraniteForCausalLM", _features, gguf_architectures=("granite",),
                 gguf_qk_permuted=True, gguf_config=_gguf_config)  # fmt: skip

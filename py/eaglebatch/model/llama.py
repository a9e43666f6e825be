"""Llama (`llama`): the reference decoder -- pre-norm RMSNorm, RoPE, grouped-query attention,
gated MLP; every ModelConfig default is Llama's. `attention_bias` puts biases on q/k/v and o."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.config_values import bool_value
from eaglebatch.model.family import Family


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool_value(raw, "attention_bias")
    return {"attention_bias": bias, "o_proj_bias": bias}


LLAMA = Family("llama", "LlamaForCausalLM", _features, gguf_architectures=("llama",),
               gguf_qk_permuted=True)  # fmt: skip

"""Qwen3 dense (`qwen3`): Llama with an RMSNorm over each query and key head before RoPE,
`attention_bias` on q/k/v and o, and a length-capping window when `use_sliding_window` is
set."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.config_values import bool_value
from eaglebatch.model.family import Family


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool_value(raw, "attention_bias")
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    return {"attention_bias": bias, "o_proj_bias": bias, "qk_norm": "head",
            "sliding_window": window}  # fmt: skip


QWEN3 = Family("qwen3", "Qwen3ForCausalLM", _features, gguf_architectures=("qwen3",))

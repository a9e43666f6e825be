"""Qwen2 (`qwen2`): Llama with biases on q/k/v (never on o), and a length-capping window when
`use_sliding_window` is set."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.family import Family


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    return {"attention_bias": True, "sliding_window": window}


QWEN2 = Family("qwen2", "Qwen2ForCausalLM", _features, gguf_architectures=("qwen2",))

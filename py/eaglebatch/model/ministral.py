"""Ministral (`ministral`, Ministral-8B of 2024): Mistral's layers with real windowed
attention per layer: `layer_types` says which layers are sliding, and those attend to the last
`sliding_window` positions (the default, without layer_types: every layer sliding when
sliding_window is set, else every layer full)."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.config_values import int_value
from eaglebatch.model.family import FULL, SLIDING, Family


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    layers = int_value(raw, "num_hidden_layers")
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if types is None:
        types = [SLIDING if window is not None else FULL] * layers
    if not isinstance(types, list) or len(types) != layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"model config: layer_types must list {layers} of {SLIDING!r} / {FULL!r}")
    if SLIDING not in types:
        return {}
    if window is None:
        raise ValueError(f"model config: layer_types has {SLIDING!r} layers but sliding_window "
                         "is null")  # fmt: skip
    return {"layer_types": tuple(types), "attention_window": int_value(raw, "sliding_window")}


MINISTRAL = Family("ministral", "MinistralForCausalLM", _features)

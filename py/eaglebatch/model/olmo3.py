"""OLMo 3 (`olmo3`): OLMo 2's layers (olmo2.py: post-norms, q/k norms over the whole
projection, cast-last RMSNorms) in two kinds (`layer_types`; by default every fourth layer is
full): sliding layers attend to the last `sliding_window` positions, full layers to every
position. Each kind has its RoPE (`rope_parameters` keyed by layer type): full layers take
`rope_theta` and its scaling, sliding layers their own base and no scaling. With the flat
layout (`rope_theta` + `rope_scaling`), transformers gives the scaling and `rope_theta` to the
full layers only and sliding layers the default base 500000; so does this file.
"""

from __future__ import annotations

from typing import Any

from eaglebatch.model.config_values import int_value
from eaglebatch.model.family import FULL, SLIDING, Family
from eaglebatch.model.olmo2 import olmo_features

DEFAULT_THETA = 500000.0  # OLMo 3's RoPE base where config.json states none


def _layer_types(raw: dict[str, Any]) -> tuple[str, ...]:
    layers = int_value(raw, "num_hidden_layers")
    types = raw.get("layer_types")
    if types is None:
        types = [FULL if (i + 1) % 4 == 0 else SLIDING for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"model config: layer_types must list {layers} of {SLIDING!r} / {FULL!r}")
    return tuple(types)


def _theta(params: Any, key: str, default: Any) -> float:
    """The `rope_theta` of `params` (`default`, else DEFAULT_THETA, when unstated); `key`
    names it in the error."""
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    theta = default if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float, type(None))):
        raise ValueError(f"model config: {key} must be a number, got {theta!r}")
    return DEFAULT_THETA if theta is None else float(theta)


def _rope(raw: dict[str, Any]) -> dict[str, float]:
    """rope_theta (full layers) and rope_local_theta (sliding layers); a scaling of sliding
    layers is refused (the decoder scales full layers only)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and (SLIDING in params or FULL in params):
        local = params.get(SLIDING) or {}
        kind = local.get("rope_type", local.get("type", "default"))
        if kind != "default":
            raise ValueError(f"model config: rope_parameters.{SLIDING}.rope_type = {kind!r} is "
                             "not supported (sliding layers take unscaled RoPE)")  # fmt: skip
        # a top-level rope_theta fills in the full layers' base only (as transformers reads it)
        return {"rope_theta": _theta(params.get(FULL), f"rope_parameters.{FULL}.rope_theta",
                                     raw.get("rope_theta")),
                "rope_local_theta": _theta(local, f"rope_parameters.{SLIDING}.rope_theta", None)}
    if params is not None:
        raise ValueError("model config: an olmo3 rope_parameters must be keyed by layer type "
                         f"({SLIDING!r}, {FULL!r})")  # fmt: skip
    return {"rope_theta": _theta(raw, "rope_theta", None), "rope_local_theta": DEFAULT_THETA}


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    types = _layer_types(raw)
    if SLIDING in types and "sliding_window" in raw and raw["sliding_window"] is None:
        raise ValueError("model config: sliding_window = None is not supported with "
                         "sliding_attention layers")  # fmt: skip
    return {**olmo_features(raw), **_rope(raw), "layer_types": types,
            "attention_window": int_value(raw, "sliding_window", 4096)}  # fmt: skip


OLMO3 = Family("olmo3", "Olmo3ForCausalLM", _features)

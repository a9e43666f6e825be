"""Ministral 3 text models (`ministral3`, and the text tower of a multimodal `mistral3`).

What differs from Mistral: queries are scaled per position after RoPE (`query_position_scale`,
read from rope_parameters' `llama_4_scaling_beta` and `original_max_position_embeddings`).
`sliding_window`, when set, windows every layer (a length cap: config.py's module doc);
transformers ignores `layer_types` for this model, and so do we. A `mistral3` whose text_config
is a plain `mistral` config (no scaling beta) reads the same way: Mistral's layers.
"""

from __future__ import annotations

from typing import Any

from eaglebatch.model.config_values import int_value
from eaglebatch.model.family import Family

_BETA = "llama_4_scaling_beta"


def _query_position_scale(raw: dict[str, Any]) -> tuple[float, int] | None:
    """(beta, original_max_position_embeddings) of rope_parameters (or rope_scaling); None
    without a beta or with beta 0 (the factor is then 1)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or params.get(_BETA) is None:
        return None
    beta = params[_BETA]
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1e300:
        raise ValueError(f"model config: rope_parameters.{_BETA} must be a number >= 0, "
                         f"got {beta!r}")  # fmt: skip
    if beta == 0:
        return None
    if params.get("original_max_position_embeddings") is None:
        raise ValueError(f"model config: rope_parameters.{_BETA} needs "
                         "rope_parameters.original_max_position_embeddings")  # fmt: skip
    return float(beta), int_value(params, "original_max_position_embeddings")


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    return {"sliding_window": raw.get("sliding_window"),
            "query_position_scale": _query_position_scale(raw)}  # fmt: skip


MINISTRAL3 = Family("ministral3", "Ministral3ForCausalLM", _features,
                    text_tower_of=("mistral3",))  # fmt: skip

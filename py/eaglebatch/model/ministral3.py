"""Ministral 3 text models (`ministral3`, and the text tower of a multimodal `mistral3`).

What differs from Mistral: queries are scaled per position after RoPE (`query_position_scale`,
read from rope_parameters' `llama_4_scaling_beta` and `original_max_position_embeddings`).
`sliding_window`, when set, windows every layer (a length cap: config.py's module doc);
transformers ignores `layer_types` for this model, and so do we. A `mistral3` whose text_config
is a plain `mistral` config (no scaling beta) reads the same way: Mistral's layers.

llama.cpp's `mistral3` GGUF files (its converter's Llama path: q/k rows permuted) state the
YaRN settings as `rope.scaling.*` (`yarn_log_multiplier` is mscale_all_dim; llama.cpp takes
mscale as 1 beside it), the scaling beta as `attention.temperature_scale` over
`rope.scaling.original_context_length` (llama.cpp's default: context_length), and no window.
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


# header key (prefix dropped) -> rope_parameters key, read as they are
_YARN = {"rope.scaling.factor": "factor", "rope.scaling.yarn_beta_fast": "beta_fast",
         "rope.scaling.yarn_beta_slow": "beta_slow",
         "rope.scaling.yarn_attn_factor": "attention_factor"}  # fmt: skip


def _gguf_rope(own: dict[str, Any]) -> dict[str, Any]:
    kind = own.get("rope.scaling.type", "none")
    if kind not in ("none", "yarn"):
        raise ValueError(f"GGUF mistral3.rope.scaling.type = {kind!r}: only YaRN is supported")
    if own.get("rope.scaling.yarn_ext_factor") is not None:
        raise ValueError("GGUF mistral3.rope.scaling.yarn_ext_factor is not supported")
    rope = {"rope_type": "default" if kind == "none" else "yarn",
            "rope_theta": own.get("rope.freq_base", 10000.0),
            "original_max_position_embeddings": own.get("rope.scaling.original_context_length",
                                                        own["context_length"])}  # fmt: skip
    if kind == "yarn":
        rope.update({key: own[k] for k, key in _YARN.items() if k in own})
        log_mul = own.get("rope.scaling.yarn_log_multiplier")
        if log_mul is not None:
            rope.update({"mscale": 1.0, "mscale_all_dim": log_mul})
    if own.get("attention.temperature_scale"):
        rope[_BETA] = own["attention.temperature_scale"]
    return rope


def _gguf_config(own: dict[str, Any], tensors) -> dict[str, Any]:
    if "rope_freqs.weight" in tensors:  # its rope_parameters come from the header alone
        raise ValueError("GGUF tensor rope_freqs.weight: RoPE frequency factors are not "
                         "supported for architecture 'mistral3'")  # fmt: skip
    if own.get("attention.sliding_window"):
        raise ValueError("GGUF mistral3.attention.sliding_window: llama.cpp windows no "
                         "mistral3 layer; a window is not supported")  # fmt: skip
    return {"rope_parameters": _gguf_rope(own), "sliding_window": None}


MINISTRAL3 = Family("ministral3", "Ministral3ForCausalLM", _features,
                    text_tower_of=("mistral3",), gguf_architectures=("mistral3",),
                    gguf_qk_permuted=True, gguf_config=_gguf_config)  # fmt: skip

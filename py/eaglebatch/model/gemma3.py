"""Gemma 3 text models (`gemma3_text`, and the text tower of a multimodal `gemma3`).

What differs from Llama: embeddings scaled by sqrt(hidden); (1 + weight) RMSNorms in float32;
per-head q/k norms; four norms per layer (before and after attention and the MLP); GeGLU with
tanh GELU; attention scale query_pre_attn_scalar ** -0.5; tied embeddings by default; optional
final logit soft-capping; and two kinds of layers (`layer_types`): sliding layers attend to the
last `sliding_window` positions with RoPE base `rope_local_base_freq` (or rope_parameters'
sliding_attention entry, unscaled), full layers to every position with `rope_theta` and its
scaling. llama.cpp stores its norm weights as 1 + w.
"""

from __future__ import annotations

from typing import Any

from eaglebatch.model.config_values import bool_value, int_value, positive_float, refuse
from eaglebatch.model.family import FULL, SLIDING, Family


def _layer_types(raw: dict[str, Any]) -> tuple[str, ...]:
    layers = int_value(raw, "num_hidden_layers")
    types = raw.get("layer_types")
    if types is None:  # older configs: every `sliding_window_pattern`-th layer is global
        pattern = int_value(raw, "sliding_window_pattern", 6)
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"model config: layer_types must list {layers} of {SLIDING!r} / {FULL!r}")
    return tuple(types)


def _local_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters")
    local = params.get(SLIDING) if isinstance(params, dict) else None
    if isinstance(local, dict) and local.get("rope_type", "default") != "default":
        raise ValueError("model config: RoPE scaling of sliding layers is not supported")
    theta = local.get("rope_theta") if isinstance(local, dict) else raw.get("rope_local_base_freq")
    return float(theta if theta is not None else 10000.0)


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    refuse(raw, "attn_logit_softcapping", "use_bidirectional_attention")
    bias = bool_value(raw, "attention_bias")
    cap = raw.get("final_logit_softcapping")
    return {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "norm_kind": "rms_plus_one",
        "norm_layout": "sandwich",
        "qk_norm": "head",
        "embedding_multiplier": int_value(raw, "hidden_size") ** 0.5,
        "query_pre_attn_scalar": positive_float(raw, "query_pre_attn_scalar", 256.0),
        "final_logit_softcapping": None if cap is None else positive_float(
            raw, "final_logit_softcapping", 1.0),
        "layer_types": _layer_types(raw),
        "attention_window": int_value(raw, "sliding_window", 4096),
        "rope_local_theta": _local_theta(raw),
    }


GEMMA3 = Family("gemma3_text", "Gemma3ForCausalLM", _features, tie_word_embeddings=True,
                text_tower_of=("gemma3",), gguf_architectures=("gemma3",),
                gguf_norm_offset=1.0)  # fmt: skip

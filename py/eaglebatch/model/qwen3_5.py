"""Qwen3.5 dense (`qwen3_5_text`, and the text tower of a multimodal `qwen3_5`): a hybrid of
Gated DeltaNet (linear-attention) layers and gated full attention, three linear layers for
every full one by default (`layer_types`, else every `full_attention_interval`-th layer full).

What differs from Llama: (1 + w) RMSNorms in float32 (input, post-attention, final, per-head
q/k); full attention with a sigmoid output gate (q_proj twice as wide), head_dim 256 by default
and partial rotary (`partial_rotary_factor`, default 0.25); the linear layers' shapes from the
`linear_*` keys (deltanet_shape.py). The rotary is multimodal (mrope sections over temporal,
height and width positions): for text every section holds the same position, which is plain
RoPE over the rotated dims, so `mrope_section` / `mrope_interleaved` change nothing here.
The checkpoints' `mtp.*` tensors are not the model's: they are the MTP drafter's
(`draft: mtp`, speculative/mtp.py).
"""

from __future__ import annotations

from typing import Any

from eaglebatch.model.config_values import bool_value, int_value
from eaglebatch.model.deltanet_shape import DeltaNetShape
from eaglebatch.model.family import FULL, LINEAR, Family
from eaglebatch.model.hybrid_gguf import hybrid_gguf_keys

PARTIAL_ROTARY = 0.25  # transformers' default for these configs


def hybrid_layer_types(raw: dict[str, Any]) -> tuple[str, ...]:
    """`layer_types`, else every `full_attention_interval`-th layer (default 4) full."""
    layers = int_value(raw, "num_hidden_layers")
    types = raw.get("layer_types")
    if types is None:
        every = int_value(raw, "full_attention_interval", 4)
        types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - {LINEAR, FULL}:
        raise ValueError(f"model config: layer_types must list {layers} of {LINEAR!r} / {FULL!r}")
    return tuple(types)


def with_partial_rotary(raw: dict[str, Any]) -> dict[str, Any]:
    """The config with `partial_rotary_factor` where transformers defaults it (0.25)."""
    params = raw.get("rope_parameters")
    if raw.get("partial_rotary_factor") is not None:
        return raw
    if isinstance(params, dict):
        if params.get("partial_rotary_factor") is not None:
            return raw
        return {**raw, "rope_parameters": {**params, "partial_rotary_factor": PARTIAL_ROTARY}}
    return {**raw, "partial_rotary_factor": PARTIAL_ROTARY}


def hybrid_features(raw: dict[str, Any]) -> dict[str, Any]:
    """The features every Qwen3.5 / Qwen3-Next text model shares (module doc)."""
    bias = bool_value(raw, "attention_bias")
    return {"attention_bias": bias, "o_proj_bias": bias, "norm_kind": "rms_plus_one",
            "qk_norm": "head", "attention_output_gate": True,
            "layer_types": hybrid_layer_types(raw),
            "deltanet": DeltaNetShape.from_raw(raw)}  # fmt: skip


QWEN3_5 = Family("qwen3_5_text", "Qwen3_5ForCausalLM", hybrid_features,
                 standardize=with_partial_rotary, text_tower_of=("qwen3_5",),
                 dropped=("mtp.",), **hybrid_gguf_keys("qwen35", experts=False))  # fmt: skip

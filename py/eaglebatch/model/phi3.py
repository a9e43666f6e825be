"""Phi-3 and Phi-4 (`phi3`): Llama without biases whose checkpoints fuse the attention input
projections (`self_attn.qkv_proj`: the q rows, then k, then v) and the MLP's two input
projections (`mlp.gate_up_proj`: the gate rows, then the up rows; the MLP computes
up * act(gate), Llama's), split into the decoder's parameters on the way in. `sliding_window`,
when set, windows every layer: a length cap (config.py's module doc). llama.cpp's `phi3` files
store the same fused tensors (`attn_qkv`, `ffn_up`), unpermuted.

Refused: a `partial_rotary_factor` other than 1 (Phi-4-mini rotates 3/4 of each head); the
longrope scaling of the 128k models is refused by the shared RoPE parser."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.family import Family, Fused


def _partial_rotary_factor(raw: dict[str, Any]) -> None:
    """Every head_dim value is rotated: a ValueError naming the key otherwise."""
    for where in ("rope_parameters", "rope_scaling", None):
        spec = raw.get(where) if where else raw
        if not isinstance(spec, dict) or spec.get("partial_rotary_factor") is None:
            continue
        value = spec["partial_rotary_factor"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != 1:
            key = f"{where}.partial_rotary_factor" if where else "partial_rotary_factor"
            raise ValueError(f"model config: {key} = {value!r} is not supported (only 1)")


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    _partial_rotary_factor(raw)
    return {"sliding_window": raw.get("sliding_window")}


def _qkv_rows(cfg) -> tuple[int, int, int]:
    kv = cfg.num_key_value_heads * cfg.head_dim
    return cfg.num_attention_heads * cfg.head_dim, kv, kv


PHI3 = Family(
    "phi3", "Phi3ForCausalLM", _features,
    fused=(
        Fused("self_attn.qkv_proj.weight",
              ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
              _qkv_rows),
        Fused("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
              lambda cfg: (cfg.intermediate_size, cfg.intermediate_size)),
    ),
    gguf_architectures=("phi3",),
)  # fmt: skip

"""Phi-3 and Phi-4 (`phi3`): Llama without biases whose checkpoints fuse the attention input
projections (`self_attn.qkv_proj`: the q rows, then k, then v) and the MLP's two input
projections (`mlp.gate_up_proj`: the gate rows, then the up rows; the MLP computes
up * act(gate), Llama's), split into the decoder's parameters on the way in. `sliding_window`,
when set, windows every layer: a length cap (config.py's module doc). llama.cpp's `phi3` files
store the same fused tensors (`attn_qkv`, `ffn_up`), unpermuted.

RoPE as Phi3Config normalises it (`_standardize`), then read by the shared parser
(rope_config.py): the kinds are "default" and "longrope", which early configs name "su" or
"yarn" (both mean longrope here, never YaRN); `original_max_position_embeddings` is the
top-level value, 4096 when absent (a value inside the RoPE settings is ignored); longrope's
factor lists must fit the rotary dim of both hidden_size / num_attention_heads (Phi3Config's
check) and head_dim (its RoPE). Partial rotary (`partial_rotary_factor`, Phi-4-mini: 0.75) is
the shared rotary_dim. Longrope serves sequences up to the original length with the short
factors, the max_model_len cap (rope_config.py's module doc).

Refused: any other RoPE kind (Phi3Config rejects them too)."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.family import Family, Fused
from eaglebatch.model.rope_config import rotary_dim_of

ROPE_KINDS = ("default", "longrope")
LONGROPE_NAMES = ("su", "yarn")  # what early Phi-3 configs call longrope
ORIGINAL_LEN = 4096  # Phi3Config's original_max_position_embeddings when config.json has none


def _standardize(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with its RoPE kind renamed and the original length set as Phi3Config does; a
    ValueError naming the key of a kind Phi3Config rejects."""
    out = dict(raw)
    where = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    spec = raw.get(where)
    if isinstance(spec, dict):
        key = "rope_type" if "rope_type" in spec else "type"
        kind = spec.get(key, "default")
        if kind in LONGROPE_NAMES:
            kind = "longrope"
            out[where] = spec = {**spec, "rope_type": kind}
        if kind not in ROPE_KINDS:
            raise ValueError(f"model config: {where}.{key} = {kind!r} is not supported for "
                             f"phi3 (only {', '.join(ROPE_KINDS)})")  # fmt: skip
        if kind == "longrope":
            _check_factor_lengths(out, spec, where)
    if out.get("original_max_position_embeddings") is None:
        out["original_max_position_embeddings"] = ORIGINAL_LEN
    return out


def _check_factor_lengths(raw: dict[str, Any], spec: dict[str, Any], where: str) -> None:
    """Phi3Config sizes the longrope factor lists by hidden_size / num_attention_heads, its
    RoPE by head_dim: a config where the two differ in rotary pairs runs in neither."""
    hidden, heads = raw.get("hidden_size"), raw.get("num_attention_heads")
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
        return  # the shared shape readers name the bad key
    if raw.get("head_dim") in (None, hidden // heads):
        return  # one rotary dim: the shared check_rotary_dim covers it
    pairs = rotary_dim_of(raw, hidden // heads) // 2
    for name in ("short_factor", "long_factor"):
        values = spec.get(name)
        if isinstance(values, list) and len(values) != pairs:
            raise ValueError(f"model config: {where}.{name} has {len(values)} entries, phi3 "
                             f"needs {pairs} (hidden_size / num_attention_heads rotary "
                             "dims / 2)")  # fmt: skip


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    return {"sliding_window": raw.get("sliding_window")}


def _qkv_rows(cfg) -> tuple[int, int, int]:
    kv = cfg.num_key_value_heads * cfg.head_dim
    return cfg.num_attention_heads * cfg.head_dim, kv, kv


PHI3 = Family(
    "phi3", "Phi3ForCausalLM", _features,
    standardize=_standardize,
    fused=(
        Fused("self_attn.qkv_proj.weight",
              ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
              _qkv_rows),
        Fused("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
              lambda cfg: (cfg.intermediate_size, cfg.intermediate_size)),
    ),
    gguf_architectures=("phi3",),
)  # fmt: skip

"""Gemma 4 dense text models (`gemma4_text`, and the text tower of a multimodal `gemma4`).

What a Gemma 4 decoder computes (transformers' Gemma4ForCausalLM), over residual stream x [T, H]:

- embeddings: table[ids] * sqrt(H) (the scale cast to the weights' dtype first); tied LM head
  by default; logits soft-capped (cap * tanh(logits / cap)) where final_logit_softcapping is set.
- every RMSNorm is x / sqrt(mean(x^2) + eps) * w, all in float32, cast back (w itself, not 1 + w
  as in Gemma 3): `rms_float32`.
- a layer: a = o(attention(input_layernorm(x))); h = x + post_attention_layernorm(a);
  h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))) with the GeGLU
  mlp down(gelu_tanh(gate(.)) * up(.)); then, with per-layer embeddings (PLE),
  h = h + post_per_layer_input_norm(per_layer_projection(gelu_tanh(per_layer_input_gate(h)) *
  e_i)); finally h * layer_scalar (a [1] tensor of the checkpoint).
- PLE: e [T, L, P] = (norm_P(per_layer_model_projection(embeds) / sqrt(H)) + table_ple[ids] *
  sqrt(P)) / sqrt(2), with embeds the scaled embeddings; layer i reads e[:, i].
- attention, with two kinds of layers (`layer_types`; the last layer is always full):
  sliding layers see the last `sliding_window` positions with `head_dim`, num_key_value_heads
  and default RoPE of rope_parameters.sliding_attention; full layers see every position with
  their own head dim and KV heads (`global_head_dim`, `num_global_key_value_heads` -- the
  latter only with attention_k_eq_v -- or, as transformers 5 writes them, `per_layer_config`)
  and rope_parameters.full_attention's RoPE, typically "proportional" (rotate-half over the
  whole head dim, of whose frequencies only the lowest partial_rotary_factor are non-zero).
  q = rope(q_norm(q_proj(x))) per head; k = rope(k_norm(k_proj(x))); v = v_norm(v_proj(x)),
  v_norm weightless; with attention_k_eq_v, full layers have no v_proj and v = v_norm of the
  k projection's output (before k_norm and RoPE). Attention scale 1 (the norms set it).
- KV sharing (num_kv_shared_layers = n): the last n layers have no k/v projections or norms;
  each attends (with its own q and window) to the K/V of the last earlier non-shared layer of
  its kind, writing none. use_double_wide_mlp doubles the MLP's inner size of those layers.

Mixture of experts (`enable_moe_block`, the 26B-A4B shape): every layer keeps its dense MLP
and adds `num_experts` GeGLU experts of `moe_intermediate_size` beside it (moe_beside_dense):
h = h + post_feedforward_layernorm(post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(h)))
+ post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h)))). The router scores
the residual h itself: proj(rms(h) * router.scale / sqrt(H)) (rms weightless), softmax in
float32, the top `top_k_experts`, renormalised, each weight times router.per_expert_scale of
its expert, applied in float32. Checkpoint tensors router.proj / router.scale /
router.per_expert_scale / experts.gate_up_proj [E, 2I, H] (gate rows first) /
experts.down_proj [E, H, I] load as moe.gate / moe.router_scale / moe.per_expert_scale /
moe.experts.{e}.* (the family's renames, expert_layout.py).

use_bidirectional_attention "vision" makes only image tokens attend both ways: text is causal.

Refused (a ValueError naming the key): use_bidirectional_attention "all",
attn_logit_softcapping, a vocab_size_per_layer_input other than vocab_size, a config without
rope_parameters, sliding-layer RoPE scaling, per_layer_config keys other than head_dim /
num_key_value_heads or giving layers of one kind different head dims.
"""

from __future__ import annotations

from typing import Any

from eaglebatch.model.config_values import bool_value, int_value, positive_float, refuse
from eaglebatch.model.family import FULL, SLIDING, Family
from eaglebatch.model.gemma4_gguf import gemma4_gguf_config

_LAYER_KEYS = ("head_dim", "num_key_value_heads")  # what per_layer_config may override


def _layer_types(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    """`layer_types` (default: every 6th layer full), the last layer full as transformers
    forces it."""
    types = raw.get("layer_types")
    if types is None:
        types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"model config: layer_types must list {layers} of {SLIDING!r} / {FULL!r}")
    return (*types[:-1], FULL)


def _overrides(raw: dict[str, Any], types: tuple[str, ...]) -> dict[int, dict[str, Any]]:
    """Each layer's head_dim / num_key_value_heads overrides: `per_layer_config` when given,
    else global_head_dim (default 512) and num_global_key_value_heads (only with
    attention_k_eq_v) on the full layers."""
    per_layer = raw.get("per_layer_config")
    if per_layer is None:
        full = {"head_dim": int_value(raw, "global_head_dim", 512)}
        if bool_value(raw, "attention_k_eq_v") and raw.get("num_global_key_value_heads"):
            full["num_key_value_heads"] = int_value(raw, "num_global_key_value_heads")
        return {i: full for i, t in enumerate(types) if t == FULL}
    if not isinstance(per_layer, dict):
        raise ValueError("model config: per_layer_config must map layer indices to settings")
    out = {}
    for key, over in per_layer.items():
        layer = int(key) if str(key).isdigit() else -1
        if not 0 <= layer < len(types) or not isinstance(over, dict):
            raise ValueError(f"model config: per_layer_config has a bad entry {key!r}")
        extra = set(over) - set(_LAYER_KEYS)
        if extra:
            raise ValueError(f"model config: per_layer_config.{key}.{sorted(extra)[0]} is not "
                             "supported")  # fmt: skip
        out[layer] = {k: int_value(over, k) for k in over}
    return out


def _layer_shapes(raw: dict[str, Any], types: tuple[str, ...]) -> dict[str, Any]:
    """layer_head_dims and layer_kv_heads, checked: one head dim per kind (one RoPE table
    each), query heads a multiple of each layer's KV heads, head dims even."""
    heads = int_value(raw, "num_attention_heads")
    base = {"head_dim": int_value(raw, "head_dim", int_value(raw, "hidden_size") // heads),
            "num_key_value_heads": int_value(raw, "num_key_value_heads", heads)}  # fmt: skip
    over = _overrides(raw, types)
    layers = [{**base, **over.get(i, {})} for i in range(len(types))]
    for kind in set(types):
        dims = {layers[i]["head_dim"] for i, t in enumerate(types) if t == kind}
        if len(dims) > 1:
            raise ValueError(f"model config: per_layer_config gives {kind} layers several head "
                             f"dims {sorted(dims)}, which is not supported")  # fmt: skip
    for i, layer in enumerate(layers):
        if heads % layer["num_key_value_heads"] or layer["head_dim"] % 2:
            raise ValueError(f"model config: layer {i} has {layer['num_key_value_heads']} KV "
                             f"heads of {layer['head_dim']} for {heads} query heads")  # fmt: skip
    return {"layer_head_dims": tuple(x["head_dim"] for x in layers),
            "layer_kv_heads": tuple(x["num_key_value_heads"] for x in layers)}  # fmt: skip


def _kv_sources(raw: dict[str, Any], types: tuple[str, ...]) -> tuple[int, ...] | None:
    """With num_kv_shared_layers = n, each of the last n layers reads the cache of the last
    earlier non-shared layer of its kind."""
    shared = raw.get("num_kv_shared_layers") or 0
    if shared == 0:
        return None
    first = len(types) - int_value(raw, "num_kv_shared_layers")
    if first <= 0:
        raise ValueError(f"model config: num_kv_shared_layers = {shared} leaves no layer "
                         "producing keys and values")  # fmt: skip
    sources = list(range(first))
    for t in types[first:]:
        owners = [j for j in range(first) if types[j] == t]
        if not owners:
            raise ValueError(f"model config: num_kv_shared_layers = {shared} leaves no {t} "
                             "layer producing keys and values")  # fmt: skip
        sources.append(owners[-1])
    return tuple(sources)


def _rope_local_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters")
    if not isinstance(params, dict) or not isinstance(params.get(SLIDING), dict):
        raise ValueError("model config: Gemma 4 needs rope_parameters with a "
                         f"{SLIDING!r} and a {FULL!r} entry")  # fmt: skip
    local = params[SLIDING]
    if local.get("rope_type", "default") != "default":
        raise ValueError("model config: RoPE scaling of sliding layers is not supported")
    return positive_float(local, "rope_theta", 10000.0)


def _per_layer_embeddings(raw: dict[str, Any]) -> int:
    """hidden_size_per_layer_input (transformers' default 256; 0: no PLE)."""
    size = raw.get("hidden_size_per_layer_input", 256)
    if not size:
        return 0
    size = int_value(raw, "hidden_size_per_layer_input", 256)
    vocab = raw.get("vocab_size_per_layer_input", 262_144)
    if vocab != raw.get("vocab_size"):
        raise ValueError(f"model config: vocab_size_per_layer_input = {vocab!r} apart from "
                         "vocab_size is not supported")  # fmt: skip
    return size


def _mlp_sizes(raw: dict[str, Any], sources: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """use_double_wide_mlp: the layers that share KV have twice the MLP inner size."""
    if not bool_value(raw, "use_double_wide_mlp") or sources is None:
        return None
    inner = int_value(raw, "intermediate_size")
    return tuple(inner * (2 if s != i else 1) for i, s in enumerate(sources))


def _experts(raw: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of `enable_moe_block` (module doc); none without it."""
    if not bool_value(raw, "enable_moe_block"):
        return {}
    num, k = int_value(raw, "num_experts"), int_value(raw, "top_k_experts")
    if k > num:
        raise ValueError(f"model config: top_k_experts = {k} exceeds num_experts = {num}")
    return {"num_experts": num, "num_experts_per_tok": k, "norm_topk_prob": True,
            "moe_intermediate_size": int_value(raw, "moe_intermediate_size"),
            "router_weights_float32": True, "router_input_scale": True,
            "router_expert_scale": True, "moe_beside_dense": True}  # fmt: skip


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    refuse(raw, "attn_logit_softcapping")
    if raw.get("use_bidirectional_attention") not in (None, "vision"):  # "vision": text is causal
        refuse(raw, "use_bidirectional_attention")
    types = _layer_types(raw, int_value(raw, "num_hidden_layers"))
    bias = bool_value(raw, "attention_bias")
    cap = raw.get("final_logit_softcapping")
    sources = _kv_sources(raw, types)
    k_eq_v = bool_value(raw, "attention_k_eq_v")
    return {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "norm_kind": "rms_float32",
        "norm_layout": "sandwich",
        "qk_norm": "head",
        "v_norm": True,
        "layer_scalar": True,
        "embedding_multiplier": int_value(raw, "hidden_size") ** 0.5,
        "attention_multiplier": 1.0,
        "final_logit_softcapping": None if cap is None else positive_float(
            raw, "final_logit_softcapping", 1.0),
        "layer_types": types,
        "attention_window": int_value(raw, "sliding_window", 512),
        "rope_local_theta": _rope_local_theta(raw),
        **_layer_shapes(raw, types),
        "k_eq_v_layers": tuple(k_eq_v and t == FULL for t in types) if k_eq_v else None,
        "kv_source_layers": sources,
        "layer_intermediate_sizes": _mlp_sizes(raw, sources),
        "per_layer_input_size": _per_layer_embeddings(raw),
        **_experts(raw),
    }


# the MoE tensors (module doc) onto moe.py's parameter names
_RENAMED = ((".router.proj.", ".moe.gate."), (".router.scale", ".moe.router_scale"),
            (".router.per_expert_scale", ".moe.per_expert_scale"),
            (".experts.", ".moe.experts."))  # fmt: skip

# the router's scales, which the gguf package's name map does not name (gemma4_gguf.py)
_GGUF_NAMES = ((".moe.router_scale", "blk.{bid}.ffn_gate_inp.scale"),
               (".moe.per_expert_scale", "blk.{bid}.ffn_down_exps.scale"))  # fmt: skip

GEMMA4 = Family("gemma4_text", "Gemma4ForCausalLM", _features, tie_word_embeddings=True,
                text_tower_of=("gemma4",), renamed=_RENAMED, gguf_architectures=("gemma4",),
                gguf_config=gemma4_gguf_config, gguf_names=_GGUF_NAMES)  # fmt: skip

"""config.json of a llama.cpp `gemma4` GGUF file (Gemma 4 text models, dense or with experts),
from its header and tensors (the family's `gguf_config`, model/gguf_config.py).

How llama.cpp's converter writes Gemma 4 (the keys below without the `gemma4.` prefix):

- layer kinds: `attention.sliding_window_pattern`, one bool per layer (true: sliding);
  `attention.sliding_window` the window;
- head dims: `attention.key_length` / `value_length` the full layers' (`global_head_dim`),
  `attention.key_length_swa` / `value_length_swa` the sliding layers' (`head_dim`);
- KV heads: `attention.head_count_kv`, one number, or one per layer where the full layers have
  their own (`num_global_key_value_heads`); a full layer without `attn_v` takes V from its k
  projection (`attention_k_eq_v`);
- RoPE: `rope.freq_base` the full layers' base, `rope.freq_base_swa` the sliding layers';
  the full layers' "proportional" RoPE as the `rope_freqs` tensor: head dim / 2 factors, 1.0
  for the pairs that turn and 1e30 (no turn) for the rest, over `rope.dimension_count` = the
  full head dim; the sliding layers rotate `rope.dimension_count_swa` = their whole head;
- `attention.shared_kv_layers` (num_kv_shared_layers), `embedding_length_per_layer_input`
  (hidden_size_per_layer_input, 0: no PLE), `feed_forward_length` one number or one per
  layer (the shared layers' doubled: use_double_wide_mlp), `final_logit_softcapping`;
- norm weights as they are (x * w; no 1 + w as Gemma 3), layer_scalar as
  `blk.N.layer_output_scale.weight`.

A mixture-of-experts file (26B-A4B, `enable_moe_block`): keys `expert_count` (num_experts),
`expert_used_count` (top_k_experts), `expert_feed_forward_length` (moe_intermediate_size), read
by moe_gguf.py (softmax, top-k renormalised: llama.cpp's gemma4 routing); per layer
`ffn_gate_inp.weight` [H, E] (router.proj, HF [E, H]), `ffn_gate_inp.scale` [H]
(router.scale, as is), `ffn_down_exps.scale` [E] (router.per_expert_scale; the gguf
package's name map names neither scale: the family's `gguf_names`), `ffn_gate_up_exps.weight`
[H, 2I, E] (experts.gate_up_proj [E, 2I, H], gate rows first; or separate `ffn_gate_exps` /
`ffn_up_exps` [H, I, E]), `ffn_down_exps.weight` [I, H, E] (experts.down_proj [E, H, I]),
`pre_ffw_norm_2` / `post_ffw_norm_1` / `post_ffw_norm_2` (pre_feedforward_layernorm_2 /
post_feedforward_layernorm_1 / _2), beside the dense MLP's `ffn_norm` / `ffn_gate` /
`ffn_up` / `ffn_down` / `post_ffw_norm`. Every layer routes (a layer without its router is
refused naming the tensor).

Refused by key or tensor: what moe_gguf.py refuses of the experts, attention logit
soft-capping, key and value lengths that differ, a last layer that slides (transformers
makes it full), `attn_v` missing on a sliding layer, per-layer values that do not follow
Gemma 4's (KV heads one per kind, the MLP size doubled exactly on the shared layers), RoPE
that rotates part of a sliding head, and `rope_freqs` values other than the 1.0 / 1e30 form.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eaglebatch.model.family import FULL, SLIDING
from eaglebatch.model.moe_gguf import moe_gguf_config

_ROPE_FREQS = "rope_freqs.weight"
_NO_TURN = 1e30  # the converter's factor of a pair that does not turn


def _refuse(key: str, what: str) -> ValueError:
    return ValueError(f"GGUF gemma4.{key}: {what}")


def _layer_types(own: dict[str, Any], layers: int) -> list[str]:
    pattern = own.get("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise _refuse("attention.sliding_window_pattern", f"must list {layers} layers, got "
                      f"{pattern!r}")  # fmt: skip
    if pattern[-1]:
        raise _refuse("attention.sliding_window_pattern", "a sliding last layer is not "
                      "supported (transformers makes it full)")  # fmt: skip
    return [SLIDING if p else FULL for p in pattern]


def _head_dims(own: dict[str, Any]) -> dict[str, Any]:
    full, swa = own.get("attention.key_length"), own.get("attention.key_length_swa")
    for key, value in (("value_length", full), ("value_length_swa", swa)):
        if own.get(f"attention.{key}", value) != value:
            raise _refuse(f"attention.{key}", "a value length other than the key length is "
                          "not supported")  # fmt: skip
    if not isinstance(full, int) or not isinstance(swa, int):
        raise _refuse("attention.key_length_swa", "Gemma 4 needs attention.key_length and "
                      "attention.key_length_swa")  # fmt: skip
    return {"head_dim": swa, "global_head_dim": full}


def _kv_heads(own: dict[str, Any], types: list[str], k_eq_v: bool) -> dict[str, Any]:
    """num_key_value_heads (sliding layers) and, with attention_k_eq_v, the full layers'."""
    kv = own.get("attention.head_count_kv", own["attention.head_count"])
    per = kv if isinstance(kv, list) else [kv] * len(types)
    swa = {n for n, t in zip(per, types) if t == SLIDING}
    full = {n for n, t in zip(per, types) if t == FULL}
    if len(per) != len(types) or len(swa) > 1 or len(full) != 1:
        raise _refuse("attention.head_count_kv", f"{kv!r} is not one KV head count per layer "
                      "kind")  # fmt: skip
    swa_heads = swa.pop() if swa else next(iter(full))
    out = {"num_key_value_heads": swa_heads}
    if full != {swa_heads}:
        if not k_eq_v:
            raise _refuse("attention.head_count_kv", "full layers with their own KV head "
                          "count need attention_k_eq_v (no attn_v on them)")  # fmt: skip
        out["num_global_key_value_heads"] = next(iter(full))
    return out


def _k_eq_v(tensors, types: list[str], shared: int) -> bool:
    """Whether the full layers take V from k (no attn_v), checked against every layer that
    has its own K/V."""
    owners = range(len(types) - shared)
    missing = {types[i] for i in owners if f"blk.{i}.attn_v.weight" not in tensors}
    if SLIDING in missing:
        raise ValueError("GGUF gemma4: a sliding layer without attn_v (V from k) is not "
                         "supported")  # fmt: skip
    if missing and any(f"blk.{i}.attn_v.weight" in tensors for i in owners if types[i] == FULL):
        raise ValueError("GGUF gemma4: full layers both with and without attn_v are not "
                         "supported")  # fmt: skip
    return bool(missing)


def _mlp(own: dict[str, Any], layers: int, shared: int) -> dict[str, Any]:
    ff = own["feed_forward_length"]
    if not isinstance(ff, list):
        return {"intermediate_size": ff, "use_double_wide_mlp": False}
    first = layers - shared
    if len(ff) == layers and len(set(ff)) == 1:
        return {"intermediate_size": ff[0], "use_double_wide_mlp": False}
    if len(ff) == layers and shared and ff == [ff[0] * (1 if i < first else 2) for i in
                                               range(layers)]:  # fmt: skip
        return {"intermediate_size": ff[0], "use_double_wide_mlp": True}
    raise _refuse("feed_forward_length", f"{ff!r} is not one size, or the size doubled on the "
                  "KV-shared layers only")  # fmt: skip


def _proportional(tensors, head_dim: int) -> dict[str, Any]:
    """The full layers' RoPE kind from the `rope_freqs` tensor (module doc)."""
    t = tensors.get(_ROPE_FREQS)
    if t is None:
        return {"rope_type": "default"}
    f = np.asarray(t.data, dtype=np.float64).reshape(-1) if t.ggml_type == 0 else None
    turning = int((f == 1.0).sum()) if f is not None else -1
    form = f is not None and len(f) == head_dim // 2 and (f[turning:] == np.float32(_NO_TURN)
                                                          ).all()  # fmt: skip
    partial = 2 * turning / head_dim
    if not form or (f[:turning] != 1.0).any() or int(partial * head_dim // 2) != turning:
        raise ValueError(f"GGUF tensor {_ROPE_FREQS}: only Gemma 4's proportional RoPE "
                         "factors (1.0 then 1e30, float32) are supported")  # fmt: skip
    return {"rope_type": "proportional", "partial_rotary_factor": partial}


def _rope(own: dict[str, Any], tensors, dims: dict[str, Any]) -> dict[str, Any]:
    full, swa = dims["global_head_dim"], dims["head_dim"]
    for key, want in (("rope.dimension_count", full), ("rope.dimension_count_swa", swa)):
        if own.get(key, want) != want:
            raise _refuse(key, f"{own[key]}: rotating part of a head of {want} is not "
                          "supported")  # fmt: skip
    if own.get("rope.scaling.factor", 1.0) != 1.0:
        raise _refuse("rope.scaling.factor", "RoPE scaling is not supported")
    base = own.get("rope.freq_base", 10000.0)
    return {"rope_parameters": {
        FULL: {**_proportional(tensors, full), "rope_theta": base},
        SLIDING: {"rope_type": "default", "rope_theta": own.get("rope.freq_base_swa", base)},
    }}  # fmt: skip


def _experts(own: dict[str, Any], tensors) -> dict[str, Any]:
    """enable_moe_block and its settings where the file has experts (module doc)."""
    if "expert_count" not in own and "blk.0.ffn_gate_inp.weight" not in tensors:
        return {"enable_moe_block": False}
    moe = moe_gguf_config(own, tensors, arch="gemma4", experts_key="num_experts",
                          inner_key="moe_intermediate_size", renormalise=True)  # fmt: skip
    return {"enable_moe_block": True, "num_experts": moe["num_experts"],
            "top_k_experts": moe["num_experts_per_tok"],
            "moe_intermediate_size": moe["moe_intermediate_size"]}  # fmt: skip


def gemma4_gguf_config(own: dict[str, Any], tensors) -> dict[str, Any]:
    experts = _experts(own, tensors)
    if "attn_logit_softcapping" in own:
        raise _refuse("attn_logit_softcapping", "attention logit soft-capping is not supported")
    layers = own["block_count"]
    shared = own.get("attention.shared_kv_layers", 0)
    types = _layer_types(own, layers)
    dims = _head_dims(own)
    k_eq_v = _k_eq_v(tensors, types, shared)
    ple = own.get("embedding_length_per_layer_input", 0)
    if SLIDING in types and "attention.sliding_window" not in own:
        raise _refuse("attention.sliding_window", "missing: the sliding layers' window")
    table = tensors.get("per_layer_token_embd.weight", tensors["token_embd.weight"])
    return {"layer_types": types, **dims, **_kv_heads(own, types, k_eq_v),
            "attention_k_eq_v": k_eq_v, "num_kv_shared_layers": shared,
            **_mlp(own, layers, shared), **_rope(own, tensors, dims),
            "sliding_window": own.get("attention.sliding_window"),
            "hidden_size_per_layer_input": ple, "vocab_size_per_layer_input": table.shape[1],
            "final_logit_softcapping": own.get("final_logit_softcapping"),
            "hidden_activation": "gelu_pytorch_tanh", **experts}  # fmt: skip

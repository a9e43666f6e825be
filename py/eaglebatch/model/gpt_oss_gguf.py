"""config.json of a llama.cpp `gpt-oss` GGUF file, from its header and tensors (the family's
`gguf_config`, model/gguf_config.py; transformers' GGUF loader names other tensors than
llama.cpp writes).

How llama.cpp's converter writes gpt-oss (the keys below without the `gpt-oss.` prefix):

- the shared keys (embedding_length, block_count, attention.head_count / head_count_kv,
  attention.key_length = head_dim, layer_norm_rms_epsilon, rope.freq_base, context_length);
- the experts (moe_gguf.py): `expert_count` (num_local_experts), `expert_used_count`,
  `expert_feed_forward_length` (intermediate_size: every MLP is routed); tensors
  ffn_gate_inp.weight / .bias (the router), ffn_{gate,up,down}_exps.weight ([E, rows, k], gate
  and up de-interleaved; or ffn_gate_up_exps, gate rows first) and their .bias ([E, rows]),
  attn_sinks.weight ([Hq]), q/k rows as they are (no RoPE permute);
- `attention.sliding_window`: the window of the sliding layers; which layers slide is
  `attention.sliding_window_pattern` as llama.cpp reads it: a period p (layer i slides when
  i % p < p - 1; 0: every layer) or one bool per layer (true: sliding), by default 2 (the even
  layers, as gpt-oss's default layer_types);
- RoPE: `rope.scaling.type` yarn, `rope.scaling.factor`, `rope.scaling.original_context_length`
  (default: context_length, as llama.cpp), `rope.scaling.yarn_beta_fast` / `yarn_beta_slow`
  where written (else 32 and 1, the defaults of llama.cpp and of gpt-oss's config). No key
  says whether the YaRN ramp is truncated: the config is gpt-oss's own (truncate false, as
  transformers' GptOssConfig computes it);
- llama.cpp computes softmax over the top-k router logits (gating function 3), no further
  renormalisation, and the clamped SwiGLU with alpha 1.702 and limit 7.0 (no key: gpt-oss's
  config defaults).

Refused by key: another gating function or renormalisation (moe_gguf.py), a value length
other than the key length, a malformed sliding_window_pattern, no sliding window, a RoPE base
of the sliding layers of its own (`rope.freq_base_swa`), RoPE scaling other than YaRN or YaRN
settings that gpt-oss's RoPE has no value for (an extrapolation or attention factor other than
1, a log multiplier other than 0, any other `rope.scaling.*` key).
"""

from __future__ import annotations

from typing import Any

from eaglebatch.model.family import FULL, SLIDING
from eaglebatch.model.moe_gguf import moe_gguf_config

_ARCH = "gpt-oss"
_TOPK_SOFTMAX = 3  # llama.cpp's expert_gating_func: softmax over the top k (SOFTMAX_WEIGHT)
_SCALING = "rope.scaling."
# rope.scaling.* keys gpt-oss's YaRN reads (finetuned: a note, nothing computed)
_YARN_KEYS = {"type", "factor", "original_context_length", "yarn_beta_fast", "yarn_beta_slow",
              "finetuned"}  # fmt: skip
# rope.scaling.* keys accepted only at the value that computes nothing
_NEUTRAL = {"yarn_ext_factor": 1.0, "yarn_attn_factor": 1.0, "attn_factor": 1.0,
            "yarn_log_multiplier": 0.0}  # fmt: skip


def _refuse(key: str, what: str) -> ValueError:
    return ValueError(f"GGUF {_ARCH}.{key}: {what}")


def _sliding(own: dict[str, Any], layers: int) -> list[bool]:
    """Per layer whether it slides, by `attention.sliding_window_pattern` (module doc)."""
    key = "attention.sliding_window_pattern"
    stated = own.get(key, 2)
    if isinstance(stated, list) and len(stated) == layers and all(
            isinstance(b, bool) for b in stated):  # fmt: skip
        return stated
    if isinstance(stated, int) and not isinstance(stated, bool) and stated >= 0:
        return [stated == 0 or i % stated < stated - 1 for i in range(layers)]
    raise _refuse(key, f"{stated!r}: neither a period nor one bool per layer ({layers})")


def _layer_types(own: dict[str, Any]) -> dict[str, Any]:
    """The sliding window and each layer's kind (module doc)."""
    window = own.get("attention.sliding_window")
    if not isinstance(window, int) or window < 1:
        raise _refuse("attention.sliding_window", f"{window!r}: a gpt-oss file needs its "
                      "sliding layers' window")  # fmt: skip
    sliding = _sliding(own, own["block_count"])
    return {"sliding_window": window,
            "layer_types": [SLIDING if slides else FULL for slides in sliding]}  # fmt: skip


def _yarn(own: dict[str, Any], theta: float) -> dict[str, Any]:
    for key, value in sorted(own.items()):
        name = key[len(_SCALING):]
        if not key.startswith(_SCALING) or name in _YARN_KEYS:
            continue
        if name not in _NEUTRAL or value != _NEUTRAL[name]:
            raise _refuse(key, f"{value!r}: a YaRN setting gpt-oss's RoPE does not have")
    factor = own.get(_SCALING + "factor")
    if not isinstance(factor, (int, float)) or factor < 1:
        raise _refuse(_SCALING + "factor", f"{factor!r}: YaRN needs a factor of at least 1")
    original = own.get(_SCALING + "original_context_length", own.get("context_length"))
    return {"rope_type": "yarn", "factor": float(factor),
            "original_max_position_embeddings": original,
            "beta_fast": float(own.get(_SCALING + "yarn_beta_fast", 32.0)),
            "beta_slow": float(own.get(_SCALING + "yarn_beta_slow", 1.0)),
            "truncate": False, "rope_theta": theta}  # fmt: skip


def _rope(own: dict[str, Any]) -> dict[str, Any]:
    theta = float(own.get("rope.freq_base", 10000.0))  # llama.cpp's default where unstated
    if own.get("rope.freq_base_swa", theta) != theta:
        raise _refuse("rope.freq_base_swa", f"{own['rope.freq_base_swa']!r}: the sliding "
                      "layers' own RoPE base is not supported (gpt-oss has one base)")  # fmt: skip
    kind = own.get(_SCALING + "type")
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "yarn":
        raise _refuse(_SCALING + "type", f"{kind!r}: gpt-oss's RoPE scaling is YaRN")
    return _yarn(own, theta)


def gpt_oss_gguf_config(own: dict[str, Any], tensors) -> dict[str, Any]:
    """The gpt_oss config.json keys of a `gpt-oss` file's header keys `own` (prefix dropped)
    and `tensors` beyond the shared ones (module doc)."""
    key = own.get("attention.key_length")
    if own.get("attention.value_length", key) != key:
        raise _refuse("attention.value_length", f"{own['attention.value_length']!r}: a value "
                      f"length other than the key length ({key}) is not supported")  # fmt: skip
    moe = moe_gguf_config(own, tensors, arch=_ARCH, experts_key="num_local_experts",
                          inner_key="intermediate_size", renormalise=False,
                          gating=_TOPK_SOFTMAX)  # fmt: skip
    return {**moe, **_layer_types(own), "rope_parameters": _rope(own)}

"""gpt-oss (`gpt_oss`): pre-norm layers with biased q/k/v/o projections, a learned attention
sink per query head (self_attn.sinks), sliding layers (the last `sliding_window` positions,
128 in the released models) alternating with full ones (`layer_types`, by default even layers
sliding), YaRN RoPE (by default x32 over 4096 positions, untruncated, base 150000), RMSNorms
cast last, and every MLP routed (moe.py): a biased router whose top-k logits are softmaxed,
`num_local_experts` experts of `intermediate_size` with biases and the clamped SwiGLU
(`swiglu_alpha`, `swiglu_limit`). Checkpoints store the router as mlp.router and the experts
fused and interleaved (expert_layout.py "interleaved"). `hidden_act` is not used by the
experts (as in transformers).

GGUF (`gpt-oss`): the header and tensors as llama.cpp writes them (gpt_oss_gguf.py)."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.config_values import bool_value, int_value, positive_float
from eaglebatch.model.family import FULL, SLIDING, Family
from eaglebatch.model.gpt_oss_gguf import gpt_oss_gguf_config
from eaglebatch.model.moe_config import moe_features

# transformers' GptOssConfig defaults where config.json states no RoPE
_THETA = 150000.0
_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "truncate": False, "original_max_position_embeddings": 4096}  # fmt: skip


def _standardize(raw: dict[str, Any]) -> dict[str, Any]:
    """RoPE as GptOssConfig completes it: its YaRN where config.json has no RoPE settings,
    its base where none states one."""
    theta = raw.get("rope_theta")
    if not (raw.get("rope_scaling") or raw.get("rope_parameters")):
        return {**raw, "rope_parameters": {**_YARN, "rope_theta": theta or _THETA}}
    params = raw.get("rope_parameters")
    if theta is None and not (isinstance(params, dict) and params.get("rope_theta") is not None):
        return {**raw, "rope_theta": _THETA}
    return raw


def _layer_types(raw: dict[str, Any]) -> tuple[str, ...] | None:
    """Per layer SLIDING or FULL; None (all full) without a sliding_window."""
    layers = int_value(raw, "num_hidden_layers")
    types = raw.get("layer_types")
    if types is None:
        types = [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"model config: layer_types must list {layers} of {SLIDING!r} / {FULL!r}")
    return tuple(types) if raw.get("sliding_window") is not None else None


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool_value(raw, "attention_bias", True)
    window = raw.get("sliding_window", 128)
    moe = moe_features(raw, experts=128, top_k=4, inner_key="intermediate_size",
                       renormalise=False)  # softmax over the top k: sums to 1
    return {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "norm_kind": "rms_cast_last",
        "attention_sinks": True,
        "layer_types": _layer_types({**raw, "sliding_window": window}),
        "attention_window": None if window is None else int_value(raw, "sliding_window", 128),
        **moe,
        "router_scoring": "topk_softmax",
        "router_bias": True,
        "expert_bias": True,
        "expert_activation": "clamped_swiglu",
        "swiglu_alpha": positive_float(raw, "swiglu_alpha", 1.702),
        "swiglu_limit": positive_float(raw, "swiglu_limit", 7.0),
    }


GPT_OSS = Family("gpt_oss", "GptOssForCausalLM", _features, standardize=_standardize,
                 renamed=(("mlp.router.", "mlp.gate."),), expert_layout="interleaved",
                 gguf_architectures=("gpt-oss",), gguf_experts=True,
                 gguf_config=gpt_oss_gguf_config)  # fmt: skip

"""Qwen2 MoE (`qwen2_moe`: Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases by
`qkv_bias`) with routed MLPs (moe.py) -- `num_experts` experts of `moe_intermediate_size`,
`num_experts_per_tok` per token, renormalised when `norm_topk_prob` -- plus a shared expert of
`shared_expert_intermediate_size` behind a sigmoid gate; the layers in `mlp_only_layers` or
off the `decoder_sparse_step` grid keep a dense MLP of `intermediate_size`.

Refused: `use_sliding_window` (windows on some layers only, below `max_window_layers`).

GGUF (`qwen2moe`): the experts and the shared expert from the header (moe_gguf.py); llama.cpp
never renormalises the top-k weights of this architecture (no header key), as Qwen2 MoE
checkpoints leave `norm_topk_prob` unset; q/k/v biases where the file has them."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.config_values import bool_value, int_value, refuse
from eaglebatch.model.family import Family
from eaglebatch.model.moe_config import moe_features, sparse_layers
from eaglebatch.model.moe_gguf import moe_gguf_config


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    refuse(raw, "use_sliding_window")
    moe = moe_features(raw, experts=60, top_k=4, inner_key="moe_intermediate_size")
    return {**moe, "sparse_layers": sparse_layers(raw),
            "attention_bias": bool_value(raw, "qkv_bias", True),
            "shared_expert_intermediate_size": int_value(raw, "shared_expert_intermediate_size",
                                                         5632)}  # fmt: skip


def _gguf_config(own: dict[str, Any], tensors) -> dict[str, Any]:
    moe = moe_gguf_config(own, tensors, arch="qwen2moe", experts_key="num_experts",
                          inner_key="moe_intermediate_size", renormalise=False, shared=True,
                          dense_ok=True)  # fmt: skip
    return {**moe, "norm_topk_prob": False, "qkv_bias": "blk.0.attn_q.bias" in tensors}


QWEN2_MOE = Family("qwen2_moe", "Qwen2MoeForCausalLM", _features,
                   gguf_architectures=("qwen2moe",), gguf_config=_gguf_config)  # fmt: skip

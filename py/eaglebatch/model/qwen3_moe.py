"""Qwen3 MoE (`qwen3_moe`): Qwen3's attention (per-head q/k norms) with routed MLPs (moe.py):
`num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok` per token, their
weights renormalised when `norm_topk_prob`; the layers in `mlp_only_layers` or off the
`decoder_sparse_step` grid keep a dense MLP of `intermediate_size`."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.family import Family
from eaglebatch.model.moe_config import moe_features, sparse_layers
from eaglebatch.model.qwen3 import QWEN3


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    moe = moe_features(raw, experts=128, top_k=8, inner_key="moe_intermediate_size")
    return {**QWEN3.features(raw), **moe, "sparse_layers": sparse_layers(raw)}


QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", _features)

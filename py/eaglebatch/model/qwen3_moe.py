"""Qwen3 MoE (`qwen3_moe`): Qwen3's attention (per-head q/k norms) with routed MLPs (moe.py):
`num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok` per token, their
weights renormalised when `norm_topk_prob`; the layers in `mlp_only_layers` or off the
`decoder_sparse_step` grid keep a dense MLP of `intermediate_size`.

GGUF (`qwen3moe`): the experts from the header (moe_gguf.py); llama.cpp always renormalises
the top-k weights of this architecture (the header has no key for it), as Qwen3-MoE
checkpoints set `norm_topk_prob`."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.family import Family
from eaglebatch.model.moe_config import moe_features, sparse_layers
from eaglebatch.model.moe_gguf import moe_gguf_config
from eaglebatch.model.qwen3 import QWEN3


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    moe = moe_features(raw, experts=128, top_k=8, inner_key="moe_intermediate_size")
    return {**QWEN3.features(raw), **moe, "sparse_layers": sparse_layers(raw)}


def _gguf_config(own: dict[str, Any], tensors) -> dict[str, Any]:
    moe = moe_gguf_config(own, tensors, arch="qwen3moe", experts_key="num_experts",
                          inner_key="moe_intermediate_size", renormalise=True, dense_ok=True)
    return {**moe, "norm_topk_prob": True}


QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", _features,
                   gguf_architectures=("qwen3moe",), gguf_config=_gguf_config)  # fmt: skip

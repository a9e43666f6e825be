"""Mixtral (`mixtral`): Mistral's attention (a length-capping `sliding_window`) with every MLP
routed (moe.py): `num_local_experts` experts of `intermediate_size`, `num_experts_per_tok` per
token, their weights always renormalised and applied in float32. Its checkpoints name the
routed MLP block_sparse_moe and the experts' projections w1 (gate), w3 (up), w2 (down).

GGUF: llama.cpp writes Mixtral as architecture `llama` with `llama.expert_count` (family.py
`gguf_experts`: such a file is this family's, never a dense Llama's), q/k rows permuted as
Llama's, the experts' size as `feed_forward_length`; its `llama` graph has no sliding
window."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.family import Family
from eaglebatch.model.moe_config import moe_features
from eaglebatch.model.moe_gguf import moe_gguf_config


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    moe = moe_features(raw, experts=8, top_k=2, inner_key="intermediate_size", renormalise=True)
    return {"sliding_window": raw.get("sliding_window"), **moe, "router_weights_float32": True}


def _gguf_config(own: dict[str, Any], tensors) -> dict[str, Any]:
    moe = moe_gguf_config(own, tensors, arch="llama", experts_key="num_local_experts",
                          inner_key="intermediate_size", renormalise=True)
    return {**moe, "sliding_window": None}


MIXTRAL = Family(
    "mixtral", "MixtralForCausalLM", _features,
    renamed=(("block_sparse_moe.", "mlp."), (".w1.weight", ".gate_proj.weight"),
             (".w3.weight", ".up_proj.weight"), (".w2.weight", ".down_proj.weight")),
    gguf_architectures=("llama",), gguf_experts=True, gguf_qk_permuted=True,
    gguf_config=_gguf_config,
)  # fmt: skip

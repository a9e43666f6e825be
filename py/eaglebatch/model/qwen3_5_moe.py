"""Qwen3.5 MoE (`qwen3_5_moe_text`, and the text tower of a multimodal `qwen3_5_moe`): Qwen3.5's
hybrid layers (qwen3_5.py) with a routed MLP on every layer (moe.py): `num_experts` experts of
`moe_intermediate_size`, `num_experts_per_tok` per token, their top-k weights always
renormalised, plus a shared expert of `shared_expert_intermediate_size` behind a sigmoid gate.
Its config has no dense `intermediate_size` (no layer has a dense MLP)."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.config_values import int_value
from eaglebatch.model.family import Family
from eaglebatch.model.hybrid_gguf import hybrid_gguf_keys
from eaglebatch.model.moe_config import moe_features
from eaglebatch.model.qwen3_5 import hybrid_features, with_partial_rotary


def _standardize(raw: dict[str, Any]) -> dict[str, Any]:
    inner = int_value(raw, "moe_intermediate_size", 512)
    return with_partial_rotary({**raw, "intermediate_size": inner, "moe_intermediate_size": inner})


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    moe = moe_features(raw, experts=256, top_k=8, inner_key="moe_intermediate_size",
                       renormalise=True)  # fmt: skip
    shared = int_value(raw, "shared_expert_intermediate_size", 512)
    return {**hybrid_features(raw), **moe, "shared_expert_intermediate_size": shared}


QWEN3_5_MOE = Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", _features,
                     standardize=_standardize, text_tower_of=("qwen3_5_moe",),
                     dropped=("mtp.",), **hybrid_gguf_keys("qwen35moe", experts=True))  # fmt: skip

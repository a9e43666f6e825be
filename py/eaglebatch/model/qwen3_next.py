"""Qwen3-Next (`qwen3_next`): the hybrid layers of Qwen3.5 (qwen3_5.py) with routed MLPs
(moe.py: `num_experts` of `moe_intermediate_size`, `num_experts_per_tok` per token,
renormalised when `norm_topk_prob`, a gated shared expert of
`shared_expert_intermediate_size`), dense MLPs of `intermediate_size` on the layers in
`mlp_only_layers` or off the `decoder_sparse_step` grid. Its linear layers store fused,
interleaved projections (`in_proj_qkvz`, `in_proj_ba`), split by deltanet_layout.py.
The checkpoints' `mtp.*` tensors are the MTP drafter's (`draft: mtp`, speculative/mtp.py)."""

from __future__ import annotations

from typing import Any

import torch

from eaglebatch.model.config_values import int_value
from eaglebatch.model.deltanet_layout import split_ba, split_qkvz
from eaglebatch.model.family import Family
from eaglebatch.model.hybrid_gguf import hybrid_gguf_keys
from eaglebatch.model.moe_config import moe_features, sparse_layers
from eaglebatch.model.qwen3_5 import hybrid_features, with_partial_rotary


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    moe = moe_features(raw, experts=512, top_k=10, inner_key="moe_intermediate_size",
                       renormalise=None if "norm_topk_prob" in raw else True)  # fmt: skip
    shared = int_value(raw, "shared_expert_intermediate_size", 512)
    return {**hybrid_features(raw), **moe, "sparse_layers": sparse_layers(raw),
            "shared_expert_intermediate_size": shared}  # fmt: skip


def _split(name: str, value, cfg) -> list[tuple[str, Any]] | None:
    """linear_attn.in_proj_qkvz / in_proj_ba (tensors or shapes) as the decoder's parameters."""
    for fused, split in (("in_proj_qkvz.weight", split_qkvz), ("in_proj_ba.weight", split_ba)):
        if name.endswith("linear_attn." + fused):
            prefix = name[: -len(fused)]
            if hasattr(value, "shape"):
                return [(f"{prefix}{n}.weight", t) for n, t in split(value, cfg.deltanet).items()]
            shape = tuple(value)  # the split of an empty tensor of that shape
            parts = split(torch.empty(shape, device="meta"), cfg.deltanet)
            return [(f"{prefix}{n}.weight", tuple(t.shape)) for n, t in parts.items()]
    return None


QWEN3_NEXT = Family("qwen3_next", "Qwen3NextForCausalLM", _features,
                    standardize=with_partial_rotary, splitter=_split,
                    dropped=("mtp.",), **hybrid_gguf_keys("qwen3next", experts=True))  # fmt: skip

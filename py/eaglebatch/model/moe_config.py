"""The MoE settings of a config.json as ModelConfig's MoE fields (config.py, moe.py), shared
by the MoE family files; transformers' defaults where a key is absent. Training-only keys
(router_aux_loss_coef, output_router_logits, router_jitter_noise) do not change generation
and are ignored."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.config_values import bool_value, int_value


def moe_features(raw: dict[str, Any], *, experts: int, top_k: int, inner_key: str,
                 renormalise: bool | None = None) -> dict[str, Any]:  # fmt: skip
    """`experts`, `top_k`: the defaults of num_experts (or num_local_experts) and
    num_experts_per_tok; `inner_key`: the key of the experts' inner size; `renormalise`: fixed
    top-k renormalisation, None to read norm_topk_prob (default false)."""
    key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
    num = int_value(raw, key, experts)
    k = int_value(raw, "num_experts_per_tok", top_k)
    if k > num:
        raise ValueError(f"model config: num_experts_per_tok = {k} exceeds {key} = {num}")
    norm = bool_value(raw, "norm_topk_prob") if renormalise is None else renormalise
    return {"num_experts": num, "num_experts_per_tok": k, "norm_topk_prob": norm,
            "moe_intermediate_size": int_value(raw, inner_key)}  # fmt: skip


def sparse_layers(raw: dict[str, Any]) -> tuple[bool, ...] | None:
    """Per layer whether its MLP is routed: not in `mlp_only_layers` and (layer + 1) a
    multiple of `decoder_sparse_step` (Qwen MoE); None when every layer is."""
    layers = int_value(raw, "num_hidden_layers")
    step = int_value(raw, "decoder_sparse_step", 1)
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in dense
    ):
        raise ValueError(f"model config: mlp_only_layers must list layer indices, got {dense!r}")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return None if all(sparse) else sparse

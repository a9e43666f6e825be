"""OLMo 2 (`olmo2`): Llama with its norms after the blocks instead of before them -- no
input_layernorm; post_attention_layernorm on the attention output and
post_feedforward_layernorm on the MLP output, each before it joins the residual -- an RMSNorm
over the whole q and the whole k projection output (before the head split), RMSNorms that apply
the weight in float32 and cast last, and `attention_bias` on q/k/v and o. llama.cpp names its
GGUF files `olmo2` (q/k rows as config.json has them); OLMo 3's are `olmo2` files with a
sliding window in the header, which are refused (its per-kind RoPE bases are not in the header).
"""

from __future__ import annotations

from typing import Any

from eaglebatch.model.config_values import bool_value, refuse
from eaglebatch.model.family import Family


def olmo_features(raw: dict[str, Any]) -> dict[str, Any]:
    """The features OLMo 2 and OLMo 3 share."""
    refuse(raw, "mlp_bias", "clip_qkv")  # not in their MLP / attention: never set by them
    bias = bool_value(raw, "attention_bias")
    return {"attention_bias": bias, "o_proj_bias": bias, "norm_kind": "rms_cast_last",
            "norm_layout": "post", "qk_norm": "projection"}  # fmt: skip


def _gguf_config(own: dict[str, Any], tensors) -> dict[str, Any]:
    if "attention.sliding_window" in own:
        raise ValueError("GGUF olmo2.attention.sliding_window: an OLMo 3 file (sliding-window "
                         "layers) is not supported from GGUF")  # fmt: skip
    return {}


OLMO2 = Family("olmo2", "Olmo2ForCausalLM", olmo_features, gguf_architectures=("olmo2",),
               gguf_config=_gguf_config)  # fmt: skip

"""`ModelConfig`: the subset of a Hugging Face `config.json` that the tensor side needs, as
features the decoder reads (never a family's name).

`from_dict` finds the checkpoint's family by `model_type` (registry.py; one file per family
under model/), reads what every family writes the same way (shapes, RoPE, vocabulary, special
tokens), and takes what is particular to the family from its `features`. A value a family file
does not implement is a ValueError naming the key, never a model run wrong.

Sliding windows come in two kinds. Real windowed attention (`layer_types` with
`attention_window`: Gemma 3 and later families): a sliding layer attends to the last
`attention_window` positions, the attention backends mask the rest. A length cap
(`sliding_window`: Mistral, Qwen2/Qwen3 with `use_sliding_window`, every layer windowed):
`max_model_len` is capped at the window, so no query ever sees a key further away than the
window and full attention is exactly windowed attention; longer requests are rejected by the
scheduler (prompt >= max_model_len) or stopped at max_model_len.

Both the transformers<5 layout (`rope_theta` + `rope_scaling`) and the transformers>=5 layout
(`rope_parameters`) are read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from eaglebatch.model.config_values import bool_value, int_value, positive_float, token_id
from eaglebatch.model.deltanet_shape import DeltaNetShape
from eaglebatch.model.family import LINEAR, SLIDING
from eaglebatch.model.registry import family_of, text_model_config
from eaglebatch.model.rope_config import (  # noqa: F401 (re-exported)
    SUPPORTED_ROPE_TYPES,
    RopeScaling,
    parse_rope,
    rotary_dim_of,
)

# hidden_act values -> the decoder's activation names
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_id: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None  # e.g. "bfloat16"; None when the checkpoint does not say
    # The features; the defaults are Llama's.
    attention_bias: bool = False  # bias on the q/k/v projections
    o_proj_bias: bool = False  # bias on o_proj (Llama's `attention_bias` sets both)
    mlp_bias: bool = False
    sliding_window: int | None = None  # a length cap (module doc); only set when really used
    activation: str = "silu"  # of the gated MLP: "silu" | "gelu" | "gelu_tanh"
    # "rms": w * (x / rms(x)) cast first; "rms_plus_one": (1 + w) * x / rms(x) in float32 (Gemma);
    # "rms_cast_last": w * (x / rms(x)) in float32, cast last (OLMo 2)
    norm_kind: str = "rms"
    # where the layer's norms sit: "pre" (input_layernorm, post_attention_layernorm before the
    # MLP), "sandwich" (Gemma: before and after attention and the MLP, four norms), "post"
    # (OLMo 2: post_attention_layernorm and post_feedforward_layernorm on the outputs only)
    norm_layout: str = "pre"
    # RMSNorm over q and k before RoPE: "none", "head" (each head's D values: Qwen3, Gemma 3),
    # "projection" (the whole q / k projection output: OLMo 2)
    qk_norm: str = "none"
    embedding_multiplier: float = 1.0  # embeddings * this, in the activation dtype (Gemma: sqrt H)
    residual_multiplier: float = 1.0  # each block's output * this before it joins the residual
    attention_multiplier: float | None = None  # the attention scale itself (else see below)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (else head_dim)
    logits_divisor: float = 1.0  # logits / this (Granite's logits_scaling)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # per layer SLIDING, FULL or LINEAR; None: all FULL. A LINEAR layer is a Gated DeltaNet
    # (decoder_layer.py `linear_attn`, shaped by `deltanet`): no KV cache, a recurrent state
    # per sequence instead (model/recurrent_state.py)
    layer_types: tuple[str, ...] | None = None
    deltanet: DeltaNetShape | None = None  # the LINEAR layers' shapes
    attention_window: int | None = None  # the window of SLIDING layers (real windowed attention)
    rope_local_theta: float | None = None  # the RoPE base of SLIDING layers (None: rope_theta)
    rope_layers: tuple[bool, ...] | None = None  # per layer whether RoPE applies; None: all
    rotary_dim: int | None = None  # the leading dims of a head RoPE rotates; None: head_dim
    # (beta, original_max): queries times 1 + beta * log(1 + floor(position / original_max))
    # after RoPE, per token (Llama 4's attention temperature, Ministral 3); None: unscaled
    query_position_scale: tuple[float, int] | None = None
    # Per-layer attention shapes (Gemma 4's full layers have their own head dim and KV heads);
    # None: every layer has num_key_value_heads KV heads of head_dim. Each layer's KV cache
    # has its own (Hkv, D) (heads_of; attention/base.py allocate_kv_cache).
    layer_head_dims: tuple[int, ...] | None = None
    layer_kv_heads: tuple[int, ...] | None = None
    # per layer, the earlier layer whose KV cache it attends to, writing none of its own
    # (Gemma 4's KV sharing; its cache is that layer's tensor); None: each layer its own
    kv_source_layers: tuple[int, ...] | None = None
    # per layer, whether V is the k projection's output (no v_proj; Gemma 4's attention_k_eq_v)
    k_eq_v_layers: tuple[bool, ...] | None = None
    # a *ForSequenceClassification checkpoint: its score head's outputs (checkpoint tensor
    # score.weight [outputs, H], loaded as the LM head: causal_lm.py); 0: a causal LM
    head_outputs: int = 0
    v_norm: bool = False  # a weightless float32 RMSNorm over each V head (Gemma 4)
    # a learned logit per query head (checkpoint tensor self_attn.sinks [Hq]) joining each
    # attention softmax's denominator: it takes probability mass and adds no value (gpt-oss)
    attention_sinks: bool = False
    # a sigmoid gate on the attention output (Qwen3.5, Qwen3-Next): q_proj is twice as wide,
    # each head's D query rows followed by its D gate rows; the heads' outputs are multiplied by
    # sigmoid(gate) before o_proj
    attention_output_gate: bool = False
    # a learned scalar per layer (checkpoint tensor layers.{i}.layer_scalar, [1]) that
    # multiplies the layer's output, residual included (Gemma 4)
    layer_scalar: bool = False
    # per layer, the MLP's inner size where layers differ (Gemma 4's double-wide MLP)
    layer_intermediate_sizes: tuple[int, ...] | None = None
    # Per-layer embeddings (Gemma 4's PLE): each layer i gets an extra [P] input per token,
    # P = per_layer_input_size, from a [vocab, L * P] table and a projection of the
    # embeddings (causal_lm.py per_layer_inputs), gated into the residual after the MLP
    # (decoder_layer.py). 0: none.
    per_layer_input_size: int = 0
    # Mixture of experts (moe.py): where `is_sparse(layer)`, the MLP is a router over
    # `num_experts` gated experts of `moe_intermediate_size`, `num_experts_per_tok` of them per
    # token; their top-k weights renormalised to sum to 1 when `norm_topk_prob`, and applied in
    # float32 (cast after) when `router_weights_float32`, else cast to the activations' dtype
    # first; a shared expert of `shared_expert_intermediate_size` (0: none) behind a sigmoid
    # gate is added. `sparse_layers`: per layer whether it is sparse (None: all, when
    # num_experts > 0). num_experts 0: every MLP dense (Llama).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_weights_float32: bool = False
    shared_expert_intermediate_size: int = 0
    sparse_layers: tuple[bool, ...] | None = None
    # Router variants (moe.py): `router_input_scale`, the router scores rms(x) * a learned [H]
    # scale / sqrt(H) instead of x; `router_expert_scale`, each routed weight (after any
    # renormalisation) times a learned per-expert [E] scale (both Gemma 4)
    router_input_scale: bool = False
    router_expert_scale: bool = False
    # a sparse layer keeps its dense MLP and adds the routed experts beside it, each branch
    # with its own pre- and post-norm, their sum post-normed again (decoder_layer.py; Gemma 4;
    # needs norm_layout "sandwich"); False: the experts replace the dense MLP
    moe_beside_dense: bool = False
    # the router's scoring (moe.py ROUTER_SCORINGS: "softmax" over every expert then the top
    # k; "topk_softmax": softmax over the top k logits, gpt-oss) and whether it has a bias [E];
    # biases on every expert projection; the experts' activation (moe.py EXPERT_ACTIVATIONS:
    # "gated" = the dense MLP's; "clamped_swiglu" with swiglu_alpha and swiglu_limit, gpt-oss)
    router_scoring: str = "softmax"
    router_bias: bool = False
    expert_bias: bool = False
    expert_activation: str = "gated"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # the text tower of a multimodal checkpoint (e.g. `gemma3` with a text_config): its tensors
    # are named language_model.* and the other towers' are skipped (weights.text_tower_name)
    text_tower: bool = False

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for full attention."""
        if self.layer_types is None or self.layer_types[layer] != SLIDING:
            return None
        return self.attention_window

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` is a Gated DeltaNet (linear-attention) layer: no KV cache."""
        return self.layer_types is not None and self.layer_types[layer] == LINEAR

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The indices of the Gated DeltaNet layers (empty: no recurrent state)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_linear(i))

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the routed one (moe.py)."""
        return self.num_experts > 0 and (self.sparse_layers is None or self.sparse_layers[layer])

    def heads_of(self, layer: int) -> tuple[int, int, int]:
        """(query heads, KV heads, head dim) of `layer`'s attention and KV cache."""
        kv = self.num_key_value_heads if self.layer_kv_heads is None else self.layer_kv_heads[layer]
        d = self.head_dim if self.layer_head_dims is None else self.layer_head_dims[layer]
        return self.num_attention_heads, kv, d

    def kv_source(self, layer: int) -> int:
        """The layer whose KV cache `layer` attends to (itself unless it shares one)."""
        return layer if self.kv_source_layers is None else self.kv_source_layers[layer]

    def attention_scale_of(self, layer: int) -> float:
        """`attention_scale`, with the layer's own head dim where none is configured."""
        if self.attention_multiplier is None and self.query_pre_attn_scalar is None:
            return self.heads_of(layer)[2] ** -0.5
        return self.attention_scale

    def uses_rope(self, layer: int) -> bool:
        return self.rope_layers is None or self.rope_layers[layer]

    @property
    def attention_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) the model serves: see the module doc on windows;
        longrope serves the lengths its short factors cover (rope_config.py)."""
        caps = (self.sliding_window, self.rope_scaling and self.rope_scaling.max_len_cap)
        return min((self.max_position_embeddings, *(c for c in caps if c)))

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> ModelConfig:
        file = os.path.join(os.fspath(path), "config.json")
        try:
            with open(file, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"model config not found: {file}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"model config {file} is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError(f"model config {file} is nested too deeply") from None
        if not isinstance(raw, dict):
            raise ValueError(f"model config {file} must be a JSON object")
        try:
            return cls.from_dict(raw)
        except (TypeError, AttributeError, KeyError, OverflowError) as e:  # a malformed value
            raise ValueError(f"model config {file} has a malformed value ({e})") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """The config of a parsed config.json; a ValueError naming the first bad setting (the
        settings are checked in a fixed order)."""
        raw, tower = text_model_config(raw)
        family = family_of(raw.get("model_type"))
        _check_not_quantized(raw)
        if family.standardize is not None:
            raw = family.standardize(raw)
        hidden, heads, kv_heads, head_dim = _attention_shape(raw)
        max_pos = int_value(raw, "max_position_embeddings")
        rope_theta, rope_scaling = parse_rope(raw, max_pos)
        rotary_dim = rotary_dim_of(raw, head_dim)
        if rope_scaling is not None:
            rope_scaling.check_rotary_dim(rotary_dim)
        head_outputs = _check_architecture(raw, family.model_type, family.architecture)
        features = family.features(raw)
        # a family may resolve the base itself (its own default where config.json states none)
        rope_theta = features.pop("rope_theta", rope_theta)
        window = features.get("sliding_window")
        if window is not None and not (isinstance(window, int) and not isinstance(window, bool)):
            raise ValueError(f"model config: sliding_window must be an integer, got {window!r}")
        return cls(
            model_type=family.model_type,
            architecture=family.architecture,
            hidden_size=hidden,
            intermediate_size=int_value(raw, "intermediate_size"),
            num_hidden_layers=int_value(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int_value(raw, "vocab_size"),
            rms_norm_eps=positive_float(raw, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool_value(raw, "tie_word_embeddings",
                                           family.tie_word_embeddings),  # fmt: skip
            mlp_bias=bool_value(raw, "mlp_bias"),
            activation=activation(raw),
            rotary_dim=None if rotary_dim == head_dim else rotary_dim,
            text_tower=tower,
            head_outputs=head_outputs,
            **{**features, "sliding_window": int(window) if window else None},
            **_special_tokens(raw),
        )


def activation(raw: dict[str, Any]) -> str:
    """The MLP's activation (`hidden_activation`, else `hidden_act`), one of ACTIVATIONS."""
    act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r} (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[act]


def _special_tokens(raw: dict[str, Any]) -> dict[str, Any]:
    """eos_token_id, bos_token_id and torch_dtype."""
    bos = raw.get("bos_token_id")
    if isinstance(bos, list):  # seen in the wild; the first one is the one prepended
        bos = bos[0] if bos else None
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    return {"eos_token_id": _eos_ids(raw),
            "bos_token_id": None if bos is None else token_id(bos, "bos_token_id"),
            "torch_dtype": str(dtype) if dtype else None}  # fmt: skip


def _attention_shape(raw: dict[str, Any]) -> tuple[int, int, int, int]:
    """(hidden_size, num_attention_heads, num_key_value_heads, head_dim), checked for
    grouped-query attention and RoPE."""
    hidden = int_value(raw, "hidden_size")
    heads = int_value(raw, "num_attention_heads")
    kv_heads = int_value(raw, "num_key_value_heads", heads)
    head_dim = int_value(raw, "head_dim", hidden // heads)
    if heads % kv_heads != 0:
        raise ValueError(
            f"num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    return hidden, heads, kv_heads, head_dim


def _check_not_quantized(raw: dict[str, Any]) -> None:
    """A checkpoint quantized by a method (GPTQ, AWQ, FP8, bitsandbytes, ...) stores other
    tensors than the weights the decoder loads: refused naming the method, before any work."""
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"model config: quantization_config.quant_method = {method!r} is not "
                         "supported (load an unquantized or GGUF checkpoint)")  # fmt: skip


def _check_architecture(raw: dict[str, Any], model_type: str, want: str) -> int:
    """The checkpoint's `architectures` must name its model_type's causal LM (or be absent) or
    its sequence classifier; returns the classifier head's outputs (`id2label`'s labels, else
    `num_labels`, else 2, transformers' default), 0 for a causal LM."""
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else want
    classifier = want.removesuffix("ForCausalLM") + "ForSequenceClassification"
    if arch == classifier:
        labels = raw.get("id2label")
        n = len(labels) if isinstance(labels, dict) and labels else raw.get("num_labels", 2)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"model config: num_labels must be a positive integer, got {n!r}")
        return n
    if arch != want:
        raise ValueError(f"unsupported architecture {arch!r} for model_type {model_type!r}")
    return 0


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    """`eos_token_id`: one id, a list of them, or none."""
    eos = raw.get("eos_token_id")
    return tuple(token_id(e, "eos_token_id") for e in (eos if isinstance(eos, list) else
                                                       [] if eos is None else [eos]))

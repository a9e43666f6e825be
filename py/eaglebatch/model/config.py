"""`ModelConfig`: the subset of a Hugging Face `config.json` that the tensor side needs.

Supported architectures: Llama (`llama`), Mistral (`mistral`), Qwen2 (`qwen2`) and Qwen3
(`qwen3`, dense). All are the same decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP);
they differ only in projection biases, the default of `tie_word_embeddings`, sliding-window
attention and, for Qwen3, an RMSNorm over each query and key head before RoPE (`qk_norm`).
Gemma 3 text models (`gemma3_text`, `family == "gemma3"`, model/gemma3.py) add embeddings
scaled by sqrt(hidden), (1 + weight) norms, four norms per layer, GeGLU (tanh GELU),
`query_pre_attn_scalar` and interleaved sliding-window attention: `layer_types[i]` is
"sliding_attention" (the last `attention_window` positions, RoPE base `rope_local_theta`) or
"full_attention" (every position, `rope_theta` and its scaling).

Sliding window (Mistral, Qwen2 with `use_sliding_window`): we do not implement windowed attention.
Instead `max_model_len` is capped at the window size, so no query ever sees a key further away
than the window and full attention is exactly windowed attention. Longer requests are rejected by
the scheduler (prompt >= max_model_len) or stopped at max_model_len.

Both the transformers<5 layout (`rope_theta` + `rope_scaling`) and the transformers>=5 layout
(`rope_parameters`) are read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from eaglebatch.model.rope_config import (  # noqa: F401 (re-exported)
    SUPPORTED_ROPE_TYPES,
    RopeScaling,
    parse_rope,
)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
SLIDING, FULL = "sliding_attention", "full_attention"  # Gemma 3's layer types


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
    attention_bias: bool  # bias on the q/k/v projections
    o_proj_bias: bool  # bias on o_proj (Llama's `attention_bias` sets both; Qwen2 has q/k/v only)
    mlp_bias: bool
    sliding_window: int | None  # only set when the checkpoint really uses it
    qk_norm: bool  # RMSNorm over each query / key head (head_dim) before RoPE (Qwen3, Gemma 3)
    eos_token_id: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None  # e.g. "bfloat16"; None when the checkpoint does not say
    # Gemma 3 (see the module doc); the defaults are the Llama family's.
    family: str = "llama"  # "llama" | "gemma3"
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (else head_dim)
    layer_types: tuple[str, ...] | None = None  # per layer SLIDING or FULL; None: all FULL
    attention_window: int | None = None  # the window of SLIDING layers (real windowed attention)
    rope_local_theta: float | None = None  # the RoPE base of SLIDING layers
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # the text tower of a multimodal checkpoint (`gemma3` with a text_config): its tensors are
    # named language_model.* and the other towers' are skipped (weights.text_tower_name)
    text_tower: bool = False

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for full attention."""
        if self.layer_types is None or self.layer_types[layer] != SLIDING:
            return None
        return self.attention_window

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) the model serves; see the module doc on windows."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

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
        raw, tower = _text_tower(raw)
        model_type = _model_type(raw)
        hidden, heads, kv_heads, head_dim = _attention_shape(raw)
        max_pos = _int(raw, "max_position_embeddings")
        rope_theta, rope_scaling = parse_rope(raw, max_pos)
        arch = _architecture(raw, model_type)
        attention_bias, o_proj_bias, window = _biases_and_window(raw, model_type)
        eos_ids = _eos_ids(raw)
        bos = raw.get("bos_token_id")
        if isinstance(bos, list):  # seen in the wild; the first one is the one prepended
            bos = bos[0] if bos else None
        if window is not None and not (isinstance(window, int) and not isinstance(window, bool)):
            raise ValueError(f"model config: sliding_window must be an integer, got {window!r}")
        dtype = raw.get("torch_dtype") or raw.get("dtype")
        gemma = _gemma3_settings(raw) if model_type == "gemma3_text" else {}

        return cls(
            model_type=model_type,
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=_int(raw, "intermediate_size"),
            num_hidden_layers=_int(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=_int(raw, "vocab_size"),
            rms_norm_eps=_positive_float(raw, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            # Llama, Mistral and Qwen default to untied embeddings, Gemma to tied ones.
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", model_type == "gemma3_text"),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=_bool(raw, "mlp_bias"),
            sliding_window=int(window) if window else None,
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            text_tower=tower,
            **gemma,
            eos_token_id=eos_ids,
            bos_token_id=None if bos is None else _token_id(bos, "bos_token_id"),
            torch_dtype=str(dtype) if dtype else None,
        )


def _model_type(raw: dict[str, Any]) -> str:
    """`model_type`, one of SUPPORTED_MODEL_TYPES, with the one activation implemented."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type == "gemma3_text":
        act, want = raw.get("hidden_activation") or raw.get("hidden_act"), "gelu_pytorch_tanh"
    else:
        act, want = raw.get("hidden_act", "silu"), "silu"
    if act != want:
        raise ValueError(f"unsupported hidden_act {act!r} for {model_type} (only {want!r})")
    return model_type


def _attention_shape(raw: dict[str, Any]) -> tuple[int, int, int, int]:
    """(hidden_size, num_attention_heads, num_key_value_heads, head_dim), checked for
    grouped-query attention and RoPE."""
    hidden = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    kv_heads = _int(raw, "num_key_value_heads", heads)
    head_dim = _int(raw, "head_dim", hidden // heads)
    if heads % kv_heads != 0:
        raise ValueError(
            f"num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    return hidden, heads, kv_heads, head_dim


def _architecture(raw: dict[str, Any], model_type: str) -> str:
    """The checkpoint's architecture name: the one of its model_type (default when absent)."""
    archs = raw.get("architectures") or []
    default_arch = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
    }[model_type]
    arch = archs[0] if isinstance(archs, list) and archs else default_arch
    if arch != default_arch:
        raise ValueError(f"unsupported architecture {arch!r} for model_type {model_type!r}")
    return arch


def _biases_and_window(raw: dict[str, Any], model_type: str) -> tuple[bool, bool, Any]:
    """(attention_bias, o_proj_bias, the sliding window as written or None) per model_type;
    from_dict checks the window's type."""
    if model_type == "qwen2":
        attention_bias, o_proj_bias = True, False  # Qwen2 always has q/k/v biases
        window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    elif model_type == "gemma3_text":  # windows are real (layer_types), never a length cap
        attention_bias = o_proj_bias = _bool(raw, "attention_bias")
        window = None
    elif model_type == "qwen3":
        attention_bias = o_proj_bias = _bool(raw, "attention_bias")  # q/k/v and o alike
        window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    elif model_type == "llama":
        attention_bias = o_proj_bias = _bool(raw, "attention_bias")
        window = None
    else:  # mistral: no biases
        attention_bias = o_proj_bias = False
        window = raw.get("sliding_window")
    return attention_bias, o_proj_bias, window


def _text_tower(raw: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A multimodal Gemma 3 config as its text model's (the top level's keys, then
    text_config's), and whether it was one."""
    if raw.get("model_type") != "gemma3":
        return raw, False
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("model config: a gemma3 config needs a text_config")
    top = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    merged = {**top, **text, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}
    return merged, True


def _gemma3_settings(raw: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's extra ModelConfig fields from its config.json (transformers 4 and 5 layouts)."""
    layers = _int(raw, "num_hidden_layers")
    types = raw.get("layer_types")
    if types is None:  # older configs: every `sliding_window_pattern`-th layer is global
        pattern = _int(raw, "sliding_window_pattern", 6)
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"model config: layer_types must list {layers} of {SLIDING!r} / {FULL!r}")
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if raw.get(key):
            raise ValueError(f"model config: {key} = {raw[key]!r} is not supported")
    params = raw.get("rope_parameters")
    local = params.get(SLIDING) if isinstance(params, dict) else None
    if isinstance(local, dict) and local.get("rope_type", "default") != "default":
        raise ValueError("model config: RoPE scaling of sliding layers is not supported")
    theta = local.get("rope_theta") if isinstance(local, dict) else raw.get("rope_local_base_freq")
    cap = raw.get("final_logit_softcapping")
    if cap is not None:
        cap = _positive_float(raw, "final_logit_softcapping", 1.0)
    return {
        "family": "gemma3",
        "query_pre_attn_scalar": _positive_float(raw, "query_pre_attn_scalar", 256.0),
        "layer_types": tuple(types),
        "attention_window": _int(raw, "sliding_window", 4096),
        "rope_local_theta": float(theta if theta is not None else 10000.0),
        "final_logit_softcapping": cap,
    }


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    """`eos_token_id`: one id, a list of them, or none."""
    eos = raw.get("eos_token_id")
    return tuple(_token_id(e, "eos_token_id") for e in (eos if isinstance(eos, list) else
                                                         [] if eos is None else [eos]))


def _int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer setting (`default` when absent or null)."""
    value = raw.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"model config is missing {key!r}")
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model config: {key} must be a positive integer, got {value!r}")
    return value


def _positive_float(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e300:
        raise ValueError(f"model config: {key} must be a positive number, got {value!r}")
    return float(value)


def _bool(raw: dict[str, Any], key: str, default: bool = False) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"model config: {key} must be true or false, got {value!r}")
    return value


def _token_id(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"model config: {key} must hold token ids, got {value!r}")
    return value

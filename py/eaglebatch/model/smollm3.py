"""SmolLM3 (`smollm3`): Llama (tied embeddings by default, `attention_bias` on q/k/v and o) with
layers that skip RoPE and optional sliding windows.

`no_rope_layers` lists per layer 1 (RoPE) or 0 (none); older configs leave it out and every
`no_rope_layer_interval`-th layer (default 4) goes without. A layer is windowed when
`layer_types` says "sliding_attention" (real windowed attention over the last `sliding_window`
positions); configs without `layer_types` make the no-RoPE layers sliding when
`use_sliding_window` is set and `sliding_window` is given. transformers windows a layer
`layer_types` calls sliding through its mask, yet its flash-attention path only when
`use_sliding_window` is set as well: the two disagree on such a config, which is refused.
transformers' RoPE base for SmolLM3 defaults to 2e6, not the 1e4 config.py assumes: a config
must state it. llama.cpp's `smollm3` files: Llama's (q/k rows permuted).
"""

from __future__ import annotations

from typing import Any

from eaglebatch.model.config_values import bool_value, int_value
from eaglebatch.model.family import FULL, SLIDING, Family


def _rope_layers(raw: dict[str, Any], layers: int) -> tuple[bool, ...]:
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = int_value(raw, "no_rope_layer_interval", 4)
        return tuple((i + 1) % interval != 0 for i in range(layers))
    if (not isinstance(flags, list) or len(flags) < layers
            or any(f not in (0, 1) or isinstance(f, float) for f in flags)):  # fmt: skip
        raise ValueError(f"model config: no_rope_layers must list {layers} values of 0 / 1, "
                         f"got {flags!r}")  # fmt: skip
    return tuple(bool(f) for f in flags[:layers])


def _layer_types(raw: dict[str, Any], rope: tuple[bool, ...]) -> tuple[str, ...]:
    types = raw.get("layer_types")
    use_window = bool_value(raw, "use_sliding_window")
    if types is None:
        windowed = use_window and raw.get("sliding_window") is not None
        return tuple(FULL if r or not windowed else SLIDING for r in rope)
    if not isinstance(types, list) or len(types) != len(rope) or set(types) - {SLIDING, FULL}:
        raise ValueError(f"model config: layer_types must list {len(rope)} of "
                         f"{SLIDING!r} / {FULL!r}, got {types!r}")  # fmt: skip
    if SLIDING in types and not use_window:
        raise ValueError(
            "model config: use_sliding_window = False with sliding layers in "
            "layer_types is not supported (transformers' attention paths differ)"
        )
    return tuple(types)


def _check_rope_theta(raw: dict[str, Any]) -> None:
    params = raw.get("rope_parameters")
    if raw.get("rope_theta") is None and not (
        isinstance(params, dict) and params.get("rope_theta") is not None
    ):
        raise ValueError(
            "model config: a smollm3 config must state rope_theta "
            "(transformers' default for it is 2000000.0)"
        )


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    _check_rope_theta(raw)
    bias = bool_value(raw, "attention_bias")
    rope = _rope_layers(raw, int_value(raw, "num_hidden_layers"))
    types = _layer_types(raw, rope)
    window = int_value(raw, "sliding_window") if SLIDING in types else None
    return {"attention_bias": bias, "o_proj_bias": bias,
            "rope_layers": None if all(rope) else rope,
            "layer_types": types if SLIDING in types else None,
            "attention_window": window}  # fmt: skip


def _gguf_config(own: dict[str, Any], tensors) -> dict[str, Any]:
    """llama.cpp's `smollm3` header states no RoPE pattern: llama.cpp hard-codes it (its
    `n_no_rope_layer_step` = 4: layer i rotates unless (i + 1) % 4 == 0) and windows none."""
    layers = own["block_count"]
    return {"no_rope_layers": [int((i + 1) % 4 != 0) for i in range(layers)],
            "use_sliding_window": False}  # fmt: skip


SMOLLM3 = Family("smollm3", "SmolLM3ForCausalLM", _features, tie_word_embeddings=True,
                 gguf_architectures=("smollm3",), gguf_qk_permuted=True,
                 gguf_config=_gguf_config)  # fmt: skip

"""config.json from a GGUF file's header, for the families whose llama.cpp architecture
transformers' GGUF loader has no config mapping for (a family with `gguf_config`, family.py).

The keys every llama.cpp text converter writes (`{arch}.embedding_length`, `block_count`,
`attention.head_count`, ...) map here once; the family's `gguf_config` maps its own keys (given
without the `{arch}.` prefix) to the rest of its config.json.

Invariants:
- a header key that changes what the model computes and that no mapping reads is refused by
  name (a ValueError), never dropped: RoPE scaling (`rope.scaling.type` other than none)
  where the family's mapping states no `rope_parameters` (which then maps it or refuses), a
  shared key given per layer (an array) that the family's `gguf_config` does not map, and the
  `rope_freqs` tensor (RoPE frequency factors) where the family's mapping states no
  `rope_parameters` from it, here; the family's own keys in its `gguf_config`;
- where the header is silent the value is llama.cpp's default (RoPE base 10000, RMS epsilon
  1e-5, head dim hidden / heads), so the model computes what llama.cpp computes;
- tied embeddings: the file has no `output.weight` (llama.cpp's converter then drops it);
  attention biases: it has `blk.0.attn_q.bias`.
"""

from __future__ import annotations

from typing import Any

from eaglebatch.model.family import Family

# {arch}.KEY -> config.json key
_SHARED = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
_TOKENS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
           "padding_token_id": "pad_token_id"}  # fmt: skip
_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-5}  # llama.cpp's where unstated
ROPE_FREQS = "rope_freqs.weight"


def arch_meta(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The header's `{arch}.` keys without the prefix."""
    prefix = f"{arch}."
    return {k[len(prefix):]: v for k, v in meta.items() if k.startswith(prefix)}


def _vocab_size(meta: dict[str, Any]) -> int | None:
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, tuple) and tokens[0] == "array":  # GgufFile leaves arrays as counts
        return int(tokens[1])
    return None


def _check_rope_scaling(own: dict[str, Any], arch: str) -> None:
    kind = own.get("rope.scaling.type")
    if kind not in (None, "none"):
        raise ValueError(f"GGUF {arch}.rope.scaling.type = {kind!r}: RoPE scaling from a GGUF "
                         f"file of architecture {arch!r} is not supported")  # fmt: skip


def _check_mapped(own: dict[str, Any], names, extra: dict[str, Any], arch: str) -> None:
    """Refuses what the shared mapping skipped and the family's did not map (module doc)."""
    for k, key in _SHARED.items():
        if isinstance(own.get(k), list) and key not in extra:
            raise ValueError(f"GGUF {arch}.{k}: per-layer values are not supported for "
                             f"architecture {arch!r}")  # fmt: skip
    if ROPE_FREQS in names and "rope_parameters" not in extra:
        raise ValueError(f"GGUF tensor {ROPE_FREQS}: RoPE frequency factors are not supported "
                         f"for architecture {arch!r}")  # fmt: skip


def gguf_config(meta: dict[str, Any], tensors, family: Family) -> dict[str, Any]:
    """config.json of a file of `family` with header `meta` (GgufFile.meta) and `tensors`
    (GgufFile.tensors: name -> TensorInfo). Raises ValueError naming a header key it cannot
    represent."""
    arch = meta["general.architecture"]
    own = arch_meta(meta, arch)
    config: dict[str, Any] = {"model_type": family.model_type,
                              "architectures": [family.architecture]}  # fmt: skip
    config.update(_DEFAULTS)
    config.update({key: own[k] for k, key in _SHARED.items()
                   if k in own and not isinstance(own[k], list)})  # fmt: skip
    config.setdefault("vocab_size", _vocab_size(meta))
    if "head_dim" not in config and "num_attention_heads" in config:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    for k, key in _TOKENS.items():
        if f"tokenizer.ggml.{k}" in meta:
            config[key] = meta[f"tokenizer.ggml.{k}"]
    names = set(tensors)
    config["tie_word_embeddings"] = "output.weight" not in names
    config["attention_bias"] = "blk.0.attn_q.bias" in names
    extra = family.gguf_config(own, tensors)
    if "rope_parameters" not in extra:  # a family that maps RoPE scaling states it there
        _check_rope_scaling(own, arch)
    _check_mapped(own, names, extra, arch)
    config.update(extra)
    return config

"""The config of a Gemma 4 assistant drafter (`model_type: gemma4_assistant`) checked against
its target before any work (speculative/assistant.py says what it computes).

A fit needs: a gemma4_text target (or a gemma4 text tower); backbone_hidden_size equal to the
target's hidden_size; the text_config's vocab_size equal to the target's; every layer of the
text_config sharing KV (num_kv_shared_layers == num_hidden_layers), no per-layer embeddings,
MoE block or double-wide MLP; each layer's (KV heads, head dim) equal to those of the target
layer whose keys and values it reads (`producers`); pre_projection [h, 2 * H] and
post_projection [H, h]. Each mismatch is one ValueError naming the key and both values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglebatch.model.config import ModelConfig
from eaglebatch.model.family import FULL, SLIDING

ASSISTANT = "gemma4_assistant"
TARGET_TYPE = "gemma4_text"


@dataclass(frozen=True)
class AssistantConfig:
    text: ModelConfig  # the assistant's tower; every layer reads the target's KV (kv_source -1)
    target_hidden_size: int  # H, backbone_hidden_size
    ordered_embeddings: bool  # use_ordered_embeddings: logits over centroids' tokens only
    num_centroids: int
    centroid_top_k: int  # centroid_intermediate_top_k
    producers: tuple[int, ...]  # per assistant layer, the target layer whose cache it reads
    kind: str = ASSISTANT

    @property
    def hidden_size(self) -> int:
        """The width of the draft state the worker keeps per row: [normed h | projected H]."""
        return self.text.hidden_size + self.target_hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size


def is_assistant(raw: Mapping[str, Any]) -> bool:
    return raw.get("model_type") == ASSISTANT


def producer_layers(target: ModelConfig) -> dict[str, int]:
    """The target layer whose K/V each kind of assistant layer reads: the last layer of that
    kind that writes a cache of its own (transformers' `store` layers)."""
    out = {}
    for i in range(target.num_hidden_layers):
        if target.kv_source(i) == i:
            out[SLIDING if target.window_of(i) is not None else FULL] = i
    return out


def _text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("text_config must be a gemma4_text config object")
    if text.get("model_type", TARGET_TYPE) != TARGET_TYPE:
        raise ValueError(f"text_config.model_type is {text.get('model_type')!r}, not "
                         f"{TARGET_TYPE!r}")  # fmt: skip
    layers = text.get("num_hidden_layers")
    shared = text.get("num_kv_shared_layers") or layers  # transformers' default: all
    if shared != layers:
        raise ValueError(f"text_config.num_kv_shared_layers is {shared}; every one of its "
                         f"{layers} layers must read the target's KV")  # fmt: skip
    for key in ("hidden_size_per_layer_input", "enable_moe_block", "use_double_wide_mlp"):
        if text.get(key):
            raise ValueError(f"text_config.{key} = {text[key]!r} is not supported in an "
                             "assistant (transformers refuses it too)")  # fmt: skip
    return {**text, "model_type": TARGET_TYPE, "num_kv_shared_layers": 0,
            "hidden_size_per_layer_input": 0}  # fmt: skip


def parse_assistant_config(raw: Mapping[str, Any], target: ModelConfig) -> AssistantConfig:
    """The assistant's config when it fits `target` (module doc); ValueError otherwise."""
    if target.model_type != TARGET_TYPE:
        raise ValueError(f"model_type: a {ASSISTANT} drafter drafts for a {TARGET_TYPE} model, "
                         f"the model is {target.model_type}")  # fmt: skip
    backbone = raw.get("backbone_hidden_size", 1536)
    if backbone != target.hidden_size:
        raise ValueError(f"backbone_hidden_size is {backbone}, the model's hidden_size is "
                         f"{target.hidden_size}")  # fmt: skip
    text = ModelConfig.from_dict(_text_config(raw))
    if text.vocab_size != target.vocab_size:
        raise ValueError(f"text_config.vocab_size is {text.vocab_size}, the model's vocab_size "
                         f"is {target.vocab_size}")  # fmt: skip
    producers = _producers(text, target)
    ordered = bool(raw.get("use_ordered_embeddings", False))
    centroids = int(raw.get("num_centroids", 2048))
    top_k = int(raw.get("centroid_intermediate_top_k", 32))
    if ordered and (text.vocab_size % centroids or not 0 < top_k <= centroids):
        raise ValueError(f"num_centroids {centroids} must divide vocab_size "
                         f"{text.vocab_size} and centroid_intermediate_top_k {top_k} be in "
                         f"1..{centroids}")  # fmt: skip
    text = dataclasses.replace(text, kv_source_layers=(-1,) * text.num_hidden_layers)
    return AssistantConfig(text, target.hidden_size, ordered, centroids, top_k, producers)


def _producers(text: ModelConfig, target: ModelConfig) -> tuple[int, ...]:
    """Per assistant layer, the target layer it reads, with the same (KV heads, head dim)."""
    owners = producer_layers(target)
    out = []
    for i in range(text.num_hidden_layers):
        kind = SLIDING if text.window_of(i) is not None else FULL
        if kind not in owners:
            raise ValueError(f"text_config.layer_types: layer {i} is {kind}, the model has no "
                             f"{kind} layer to read")  # fmt: skip
        mine, theirs = text.heads_of(i)[1:], target.heads_of(owners[kind])[1:]
        if mine != theirs:
            raise ValueError(f"text_config: layer {i} ({kind}) has {mine[0]} KV heads of "
                             f"{mine[1]}, the model's layer {owners[kind]} {theirs[0]} of "
                             f"{theirs[1]}")  # fmt: skip
        out.append(owners[kind])
    return tuple(out)


def check_assistant_shapes(cfg: AssistantConfig, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """pre_projection and post_projection tie the assistant to its target's hidden size."""
    h, big = cfg.text.hidden_size, cfg.target_hidden_size
    want = {"pre_projection.weight": (h, 2 * big), "post_projection.weight": (big, h)}
    for name, shape in want.items():
        got = shapes.get(name)
        if got is None:
            raise ValueError(f"missing tensor {name}")
        if tuple(got) != shape:
            raise ValueError(f"{name} has shape {tuple(got)}; hidden_size {h} and the model's "
                             f"hidden_size {big} need {shape}")  # fmt: skip

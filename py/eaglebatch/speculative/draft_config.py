"""`DraftConfig`: what an EAGLE draft folder says about its shape, checked against the target.

Two head kinds (names as in the checkpoints):

EAGLE-1/2 ("eagle1", e.g. yuhuili/EAGLE-llama2-chat-7B): `fc` Linear(2h -> h, bias by default)
over cat[token embedding, target feature], then one Llama decoder layer `layers.0.*` whose
`input_layernorm` is absent (identity), then the TARGET's lm_head applied to the layer output
with no final norm. The target feature is the target's final-normed last hidden state.

EAGLE-3 ("eagle3", e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): `fc` Linear(n*ht -> h, no bias)
over the concatenated hidden states of n (= 3) target layers, one decoder layer whose attention
reads cat[input_layernorm(embedding), hidden_norm(hidden)] (2h wide), with the hidden as
residual; then its own `norm` and `lm_head` over `draft_vocab_size` tokens, mapped to target ids
by `d2t` (target_id = draft_id + d2t[draft_id]). The layer's tensors are `midlayer.*` (EAGLE
repo, SpecForge) or `layers.0.*` (speculators, ModelOpt); the config layouts and the flags that
change the math (norm_before_residual, norm_before_fc, fc_norm, norm_output) are described in
draft_formats.

Which target hidden states EAGLE-3 reads ("aux layer ids", Hugging Face `output_hidden_states`
indexing: index i = the input of decoder layer i, 0 = the embeddings):
  * default (EAGLE reference, SGLang, vLLM): (2, L // 2, L - 3) for an L-layer target;
  * top-level `eagle_aux_hidden_state_layer_ids` (vLLM / speculators format): used as is;
  * `eagle_config.eagle_aux_hidden_state_layer_ids` (SpecForge / SGLang / ModelOpt format)
    counts layer OUTPUTS, so id j means index j + 1 (SGLang adds 1 the same way; ModelOpt
    collects them with forward hooks on the layers).
Every reference concatenates them in layer order, whatever order the config lists them in, so
they are sorted here. Index L is the target's final-normed state (what heads trained here
read; ModelOpt's layer-output id L - 1 would mean the last layer's output before that norm).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglebatch.model.config import ModelConfig
from eaglebatch.speculative.draft_formats import DRAFT_LAYER_TYPE, SPECULATORS_TYPE, flat_config

EAGLE1 = "eagle1"
EAGLE3 = "eagle3"
KINDS = (EAGLE1, EAGLE3)


@dataclass(frozen=True)
class DraftConfig:
    kind: str  # "eagle1" | "eagle3"
    # The draft decoder layer: hidden_size h, heads, head_dim, intermediate_size, eps, RoPE,
    # biases (taken from which tensors the checkpoint has). vocab_size = the target's.
    layer: ModelConfig
    draft_vocab_size: int  # rows of the draft's lm_head (EAGLE-1: the target vocabulary)
    target_hidden_size: int  # ht: width of each target hidden state the draft reads
    aux_layer_ids: tuple[int, ...]  # target hidden states read (HF output_hidden_states indices)
    fc_bias: bool  # config "bias" (EAGLE-1 default True, EAGLE-3 default False)
    has_input_layernorm: bool  # EAGLE-1: published heads have none (identity)
    layer_prefix: str = "midlayer."  # the checkpoint's names of the decoder layer's tensors
    # EAGLE-3 flags (draft_formats): each changes the math as vLLM's llama_eagle3 does
    norm_before_residual: bool = False  # residual = hidden_norm(feature)
    norm_before_fc: bool = False  # `input_norm` over the concatenated aux states
    fc_norm: bool = False  # `fc_norm.{i}` over each aux state
    norm_output: bool = False  # the draft's output (fed back as a feature) is norm(h)

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size


def detect_kind(names: set[str], raw: Mapping[str, Any] | None = None) -> str:
    """ "eagle3" if the checkpoint has `midlayer.*` or `layers.0.hidden_norm.weight` (or a
    speculators eagle3 config), "eagle1" if it has `fc.weight` and `layers.0.*`; otherwise a
    ValueError saying what was expected."""
    if any(n.startswith("midlayer.") for n in names) or "layers.0.hidden_norm.weight" in names:
        return EAGLE3
    if raw is not None and raw.get(SPECULATORS_TYPE) == EAGLE3:
        return EAGLE3
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
        return EAGLE1
    sample = ", ".join(sorted(names)[:6]) or "no tensors"
    raise ValueError(
        "not an EAGLE draft checkpoint: expected `fc.weight` with `layers.0.*` (EAGLE-1/2) "
        f"or `midlayer.*` / `layers.0.hidden_norm.weight` (EAGLE-3); found {sample}"
    )


def layer_prefix(kind: str, names: set[str]) -> str:
    """The checkpoint's prefix of the decoder layer: EAGLE-3 `midlayer.` (EAGLE repo,
    SpecForge) or `layers.0.` (speculators, ModelOpt); EAGLE-1 `layers.0.`."""
    if kind == EAGLE3 and any(n.startswith("midlayer.") for n in names):
        return "midlayer."
    return "layers.0."


def read_raw_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    file = os.path.join(os.fspath(path), "config.json")
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"draft config not found: {file}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"draft config {file} is not valid JSON: {e}") from None


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """The EAGLE-3 reference choice: inputs of layers 2, L // 2 and L - 3 (low, middle, high)."""
    n = num_target_layers
    return (2, n // 2, n - 3)


def resolve_aux_layer_ids(raw: Mapping[str, Any], num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3 aux layer ids in HF hidden_states indexing (see the module doc), sorted;
    validated to be distinct and in [0, L]."""
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top:
        ids, source = tuple(int(i) for i in top), "eagle_aux_hidden_state_layer_ids"
    elif nested:
        ids = tuple(int(i) + 1 for i in nested)
        source = "eagle_config.eagle_aux_hidden_state_layer_ids (+1: layer outputs)"
    else:
        ids, source = default_aux_layer_ids(num_target_layers), "the default (2, L//2, L-3)"
    last = num_target_layers
    bad = [i for i in ids if not 0 <= i <= last]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(
            f"EAGLE-3 target layers {list(ids)} from {source} do not fit the target's "
            f"{num_target_layers} layers (need distinct hidden-state indices in [0, {last}]); "
            "set eagle_config.eagle_aux_hidden_state_layer_ids in the draft's config.json"
        )
    return tuple(sorted(ids))


def parse_draft_config(
    raw: Mapping[str, Any],
    kind: str,
    target: ModelConfig,
    tensor_names: set[str],
) -> DraftConfig:
    """Builds the draft's config from its config.json (`raw`, any layout of draft_formats) and
    checks it against the target: same vocabulary and hidden size, a single draft layer, aux
    layers inside the target. ValueError naming the key and both values."""
    if kind not in KINDS:
        raise ValueError(f"unknown draft kind {kind!r}; known: {', '.join(KINDS)}")
    raw = flat_config(raw)
    prefix = layer_prefix(kind, tensor_names)
    layer = _draft_layer(raw, prefix, target, tensor_names)
    if kind == EAGLE1:
        return _eagle1_config(raw, layer, target, tensor_names)
    return _eagle3_config(raw, layer, target, prefix)


def _draft_layer(
    raw: Mapping[str, Any], prefix: str, target: ModelConfig, tensor_names: set[str]
) -> ModelConfig:
    """The draft decoder layer's config: config.json read as a Llama config (sizes the draft
    leaves out are the target's), one layer, the target's vocabulary, and the biases the
    checkpoint's tensors have."""
    layer_raw = dict(raw)
    layer_raw.setdefault("model_type", DRAFT_LAYER_TYPE)
    # The draft's architecture name (e.g. LlamaForCausalLMEagle3) is not a target architecture;
    # everything else (sizes, eps, RoPE) parses like a Llama config.
    layer_raw.pop("architectures", None)
    layer_raw.setdefault("intermediate_size", target.intermediate_size)
    layer_raw.setdefault("max_position_embeddings", target.max_position_embeddings)
    try:
        layer = ModelConfig.from_dict(layer_raw)
    except ValueError as e:
        raise ValueError(f"draft config: {e}") from None

    num_layers = int(raw.get("num_hidden_layers", 1))
    if num_layers != 1:
        raise ValueError(f"draft config: num_hidden_layers = {num_layers}; only 1 is supported")
    if layer.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft vocab_size {layer.vocab_size} does not match the target's vocab_size "
            f"{target.vocab_size}"
        )
    # Biases: whatever the checkpoint holds (published heads have none on q/k/v/o/MLP).
    return dataclasses.replace(
        layer,
        attention_bias=f"{prefix}self_attn.q_proj.bias" in tensor_names,
        o_proj_bias=f"{prefix}self_attn.o_proj.bias" in tensor_names,
        mlp_bias=f"{prefix}mlp.gate_proj.bias" in tensor_names,
    )


def _eagle1_config(
    raw: Mapping[str, Any], layer: ModelConfig, target: ModelConfig, tensor_names: set[str]
) -> DraftConfig:
    """EAGLE-1/2: the target's width, vocabulary and lm_head; reads its final-normed state."""
    if layer.hidden_size != target.hidden_size:
        raise ValueError(
            f"EAGLE-1 draft hidden_size {layer.hidden_size} does not match the target's "
            f"{target.hidden_size}"
        )
    return DraftConfig(
        kind=EAGLE1,
        layer=layer,
        draft_vocab_size=target.vocab_size,
        target_hidden_size=target.hidden_size,
        aux_layer_ids=(target.num_hidden_layers,),  # the final-normed hidden state
        fc_bias=bool(raw.get("bias", True)),  # the EAGLE reference's default
        has_input_layernorm="layers.0.input_layernorm.weight" in tensor_names,
    )


def _eagle3_config(
    raw: Mapping[str, Any], layer: ModelConfig, target: ModelConfig, prefix: str
) -> DraftConfig:
    """EAGLE-3: the target's width (it shares the target's embedding), reads target states of
    that width at its aux layers; its own lm_head over a draft vocabulary of at most the
    target's."""
    if layer.hidden_size != target.hidden_size:
        raise ValueError(
            f"EAGLE-3 draft hidden_size {layer.hidden_size} does not match the target's "
            f"hidden_size {target.hidden_size} (the draft embeds tokens with the target's "
            "embedding)"
        )
    target_hidden = int(raw.get("target_hidden_size") or layer.hidden_size)
    if target_hidden != target.hidden_size:
        raise ValueError(
            f"EAGLE-3 draft target_hidden_size {target_hidden} does not match the target's "
            f"hidden_size {target.hidden_size}"
        )
    draft_vocab = int(raw.get("draft_vocab_size") or layer.vocab_size)
    if not 0 < draft_vocab <= layer.vocab_size:
        raise ValueError(
            f"draft_vocab_size {draft_vocab} must be in [1, the target's vocab_size "
            f"{layer.vocab_size}]"
        )
    return DraftConfig(
        kind=EAGLE3,
        layer=layer,
        draft_vocab_size=draft_vocab,
        target_hidden_size=target_hidden,
        aux_layer_ids=resolve_aux_layer_ids(raw, target.num_hidden_layers),
        fc_bias=bool(raw.get("bias", False)),  # as SGLang reads EAGLE-3 configs
        has_input_layernorm=True,
        layer_prefix=prefix,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        norm_before_fc=bool(raw.get("norm_before_fc", False)),
        fc_norm=bool(raw.get("fc_norm", False)),
        norm_output=bool(raw.get("norm_output", False)),
    )

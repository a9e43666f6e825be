"""The published config.json layouts of EAGLE draft heads, read as one flat dict.

Accepted layouts (tensor names: see draft_config):
  * EAGLE repo / SpecForge / SGLang (`LlamaForCausalLMEagle3`): a flat Llama config plus the
    EAGLE-3 keys; optional `eagle_config` (aux layer ids as layer OUTPUTS).
  * NVIDIA ModelOpt export: the same flat config, with `eagle_config` holding
    `eagle_aux_hidden_state_layer_ids` (layer outputs, as ModelOpt's forward hooks collect
    them), `use_aux_hidden_state`, `use_input_layernorm_in_first_layer`, `use_last_layernorm`,
    `use_mtp_layernorm`, `parallel_draft_step` and (newer exports) `norm_before_fc`.
  * speculators (`speculators_model_type: eagle3`): the decoder layer in
    `transformer_layer_config` (written as transformers' `to_diff_dict`, so keys equal to
    LlamaConfig's defaults are absent), the EAGLE-3 keys at the top level, aux layer ids in HF
    hidden_states indexing.

The flat dict spells everything as the EAGLE-repo layout does, plus the flags that change the
math (each read as vLLM's llama_eagle3 reads it):
  * norm_before_residual: the residual of the draft layer is hidden_norm(feature), not the raw
    feature (speculators configs: default True, as vLLM reads them; elsewhere False);
  * norm_before_fc: an RMSNorm (`input_norm`, n * ht wide) over the concatenated aux states
    before fc (`eagle_config.norm_before_fc` wins over the top-level key);
  * fc_norm: one RMSNorm per aux state (`fc_norm.{i}`, ht wide) before fc;
  * norm_output (or `eagle_config.return_hidden_post_norm`): the draft's own output fed back as
    the next step's feature is norm(h), not h.
Settings that change the math in a way not implemented here are refused with a ValueError
naming the key (see `_refuse_unsupported`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eaglebatch.model.llama import LLAMA

# Every draft head's decoder layer is a Llama layer, whatever the target's family.
DRAFT_LAYER_TYPE = LLAMA.model_type

SPECULATORS_TYPE = "speculators_model_type"
LAYER_CONFIG = "transformer_layer_config"

# transformers' LlamaConfig defaults: what a speculators `transformer_layer_config` (a
# to_diff_dict) leaves out when the draft layer has these values
_LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}

# top-level speculators keys copied into the flat config as they are
_EAGLE3_KEYS = (
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "logit_scale",
)

# eagle_config keys (ModelOpt / TensorRT-LLM) whose only supported value is the default:
# key -> (default, what the other value would need)
_EAGLE_CONFIG_FIXED: dict[str, tuple[Any, str]] = {
    "use_aux_hidden_state": (True, "an EAGLE-1 style feature inside an EAGLE-3 layout"),
    "use_input_layernorm_in_first_layer": (True, "an embedding without its input norm"),
    "use_last_layernorm": (True, "a head without its final norm"),
    "use_mtp_layernorm": (False, "MTP-style norms"),
    "eh_proj_before_attn": (False, "a projection before attention"),
}


def flat_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The draft's config.json in the flat spelling above; ValueError naming the key of a
    layout or setting that is not supported."""
    flat = _from_speculators(raw) if SPECULATORS_TYPE in raw else dict(raw)
    eagle = flat.get("eagle_config")
    if eagle is not None and not isinstance(eagle, Mapping):
        raise ValueError(f"eagle_config must be a mapping, got {type(eagle).__name__}")
    eagle = eagle or {}
    if "norm_before_fc" in eagle:  # the nested key wins (NVIDIA checkpoints put it there)
        flat["norm_before_fc"] = eagle["norm_before_fc"]
    if "return_hidden_post_norm" in eagle:
        flat["norm_output"] = bool(eagle["return_hidden_post_norm"]) or bool(
            flat.get("norm_output", False))  # fmt: skip
    _refuse_unsupported(flat, eagle)
    return flat


def _from_speculators(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A speculators config flattened: the layer config (LlamaConfig's defaults filled in) and
    the EAGLE-3 keys beside it."""
    kind = raw.get(SPECULATORS_TYPE)
    if kind != "eagle3":
        raise ValueError(
            f"{SPECULATORS_TYPE} {kind!r} is not supported; only 'eagle3' speculators heads load "
            "(EAGLE-1/2 heads load in the EAGLE repo layout)"
        )
    algorithm = (raw.get("speculators_config") or {}).get("algorithm", "eagle3")
    if algorithm != "eagle3":
        raise ValueError(f"speculators_config.algorithm {algorithm!r} is not supported "
                         "(only 'eagle3')")  # fmt: skip
    layer = raw.get(LAYER_CONFIG)
    if not isinstance(layer, Mapping):
        raise ValueError(f"{LAYER_CONFIG} must be a mapping (the draft's decoder layer config)")
    model_type = layer.get("model_type", DRAFT_LAYER_TYPE)
    if model_type != DRAFT_LAYER_TYPE:
        raise ValueError(f"{LAYER_CONFIG}.model_type {model_type!r} is not supported: only "
                         "Llama draft layers load")  # fmt: skip
    flat = {**_LLAMA_DEFAULTS, **layer}
    if "rope_parameters" in layer:  # transformers>=5 keeps the base there
        flat.pop("rope_theta")
    for key in _EAGLE3_KEYS:
        if raw.get(key) is not None:
            flat[key] = raw[key]
    flat["norm_before_residual"] = bool(raw.get("norm_before_residual", True))
    flat[SPECULATORS_TYPE] = kind
    return flat


def _refuse_unsupported(flat: Mapping[str, Any], eagle: Mapping[str, Any]) -> None:
    """ValueError naming the first setting whose value changes the math in a way not
    implemented here."""
    for key, (default, needs) in _EAGLE_CONFIG_FIXED.items():
        if key in eagle and eagle[key] is not None and bool(eagle[key]) != default:
            raise ValueError(f"eagle_config.{key} = {eagle[key]!r} is not supported (it needs "
                             f"{needs}); only {default} loads")  # fmt: skip
    steps = eagle.get("parallel_draft_step")
    if steps is not None and int(steps) > 1:
        raise ValueError(f"eagle_config.parallel_draft_step = {steps} is not supported "
                         "(parallel drafting); only 1 loads")  # fmt: skip
    if flat.get("parallel_drafting"):
        raise ValueError("parallel_drafting = true is not supported (parallel drafting heads)")
    scale = flat.get("logit_scale")
    if scale is not None and not float(scale) > 0:
        raise ValueError(f"logit_scale = {scale!r} is not supported: only a positive scale "
                         "(which leaves the draft's argmax unchanged) loads")  # fmt: skip

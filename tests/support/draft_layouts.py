"""EAGLE-3 heads written in the foreign published layouts (speculators, NVIDIA ModelOpt), from a
head in our format (init_random_draft's), so that tests can load the same weights both ways.

`set_flags` turns a head of ours into one with the EAGLE-3 flags (norm_before_residual,
norm_before_fc, fc_norm, norm_output) and random norm weights everywhere (so that a norm read
in the wrong place, or a flag ignored, changes the output)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglebatch.speculative.draft_config import resolve_aux_layer_ids

FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
LAYOUTS = ("speculators", "modelopt")

# what LlamaConfig.to_diff_dict leaves out (the values equal to transformers' defaults)
_LLAMA_DEFAULTS = {"hidden_act": "silu", "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                   "max_position_embeddings": 2048}  # fmt: skip
# keys of ours that the speculators layout keeps beside transformer_layer_config
_TOP = ("draft_vocab_size", "target_hidden_size", "norm_before_fc", "fc_norm", "norm_output")


def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((path / "config.json").read_text()), load_file(path / "model.safetensors")


def _write(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    return path


def set_flags(path: Path, seed: int = 7, **flags: bool) -> Path:
    """Rewrites the head of ours in `path` with `flags` set in config.json, the tensors they need
    (`input_norm.weight`, `fc_norm.{i}.weight`) and every norm weight random around 1."""
    config, tensors = _read(path)
    gen = torch.Generator().manual_seed(seed)
    h = config["hidden_size"]
    n = tensors["fc.weight"].shape[1] // h
    config.update({k: bool(v) for k, v in flags.items()})
    if flags.get("norm_before_fc"):
        tensors["input_norm.weight"] = torch.ones(n * h)
    if flags.get("fc_norm"):
        tensors.update({f"fc_norm.{i}.weight": torch.ones(h) for i in range(n)})
    for name in sorted(tensors):
        if "norm" in name and name.endswith(".weight"):
            tensors[name] = 1 + 0.3 * torch.randn(tensors[name].shape, generator=gen)
    return _write(path, config, tensors)


def _layer_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.replace("midlayer.", "layers.0.", 1): v for k, v in tensors.items()}


def to_layout(src: Path, dst: Path, layout: str, num_target_layers: int) -> Path:
    """The head of ours in `src` written to `dst` in `layout` ("speculators" or "modelopt")."""
    config, tensors = _read(src)
    ids = list(resolve_aux_layer_ids(config, num_target_layers))  # HF hidden_states indices
    if layout == "speculators":
        return _write(dst, _speculators_config(config, ids), _layer_names(tensors))
    if layout != "modelopt":
        raise ValueError(f"unknown layout {layout!r}")
    tensors = _layer_names(tensors)
    tensors.pop("t2d")  # ModelOpt writes d2t only, and only for a reduced vocabulary
    if config["draft_vocab_size"] == config["vocab_size"]:
        tensors.pop("d2t")
    return _write(dst, _modelopt_config(config, ids), tensors)


def _speculators_config(config: dict, ids: list[int]) -> dict:
    layer = {k: v for k, v in config.items()
             if k not in (*_TOP, *FLAGS, "eagle_config", "architectures")
             and _LLAMA_DEFAULTS.get(k, object()) != v}  # fmt: skip
    top = {k: config[k] for k in _TOP if k in config}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer,
        "eagle_aux_hidden_state_layer_ids": ids,
        "norm_before_residual": bool(config.get("norm_before_residual", False)),
        **top,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "target"},
        },
    }


def _modelopt_config(config: dict, ids: list[int]) -> dict:
    flat = {k: v for k, v in config.items() if k not in ("eagle_config", "norm_before_fc")}
    flat["architectures"] = ["LlamaForCausalLMEagle3"]
    flat["eagle_config"] = {
        "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],  # layer outputs
        "use_aux_hidden_state": True,
        "use_input_layernorm_in_first_layer": True,
        "use_last_layernorm": True,
        "use_mtp_layernorm": False,
        "next_layer_regular": True,
        "parallel_draft_step": 1,
        "parallel_draft_heads_num_layers": 1,
        "norm_before_fc": bool(config.get("norm_before_fc", False)),
    }
    return flat

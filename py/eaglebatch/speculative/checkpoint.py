"""Draft-head folders on disk: reading their tensors, and writing randomly initialised heads.

A folder holds config.json plus weights as *.safetensors (optionally sharded with an index) or
pytorch_model.bin (loaded with `torch.load(weights_only=True)`: plain tensors only, no pickled
code). `init_random_draft` writes the EAGLE-repo layout of either kind (see draft_config), so
the same loader serves tests, real heads and heads trained from a random start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from eaglebatch.model.config import ModelConfig
from eaglebatch.model.weights import INDEX_FILE, iter_tensors
from eaglebatch.speculative.draft_config import EAGLE1, KINDS
from eaglebatch.speculative.draft_formats import DRAFT_LAYER_TYPE

BIN_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"


def read_draft_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the draft checkpoint in `path`, on the CPU, by name."""
    root = os.fspath(path)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"draft model folder not found: {root}")
    names = os.listdir(root)
    if INDEX_FILE in names or any(n.endswith(".safetensors") for n in names):
        return dict(iter_tensors(root))
    bins = [BIN_FILE] if BIN_FILE in names else []
    if BIN_INDEX_FILE in names:
        with open(os.path.join(root, BIN_INDEX_FILE), encoding="utf-8") as f:
            bins = sorted(set(json.load(f).get("weight_map", {}).values()))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or {BIN_FILE} draft checkpoint in {root}")
    tensors: dict[str, torch.Tensor] = {}
    for name in bins:
        state = torch.load(os.path.join(root, name), map_location="cpu", weights_only=True)
        tensors.update({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return tensors


def _rope_fields(cfg: ModelConfig) -> dict:
    s = cfg.rope_scaling
    if s is None:
        return {"rope_theta": cfg.rope_theta, "rope_scaling": None}
    scaling: dict = {"rope_type": s.rope_type, "factor": s.factor}
    if s.rope_type == "llama3":
        scaling.update(
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    if s.rope_type == "longrope":  # the head runs the target's (short-factor) RoPE
        scaling.update(
            short_factor=list(s.short_factor),
            long_factor=list(s.long_factor),
            original_max_position_embeddings=s.original_max_position_embeddings,
            attention_factor=s.attention_factor,
        )
    fields = {"rope_theta": cfg.rope_theta, "rope_scaling": scaling}
    if cfg.rotary_dim is not None:  # the factor lists cover the target's rotary dims only
        fields["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    return fields


def init_random_draft(
    out_dir: str | os.PathLike[str],
    target_dir_or_cfg: str | os.PathLike[str] | ModelConfig,
    kind: str = EAGLE1,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    *,
    aux_layer_ids: tuple[int, ...] | None = None,
    draft_token_ids: list[int] | None = None,
) -> Path:
    """Writes a randomly initialised draft head for the target into `out_dir` (config.json +
    model.safetensors) in the published format of `kind`, shaped like one target layer.

    Initialisation: projections N(0, 1/fan_in) (unit-scale activations), norms 1, biases 0.
    EAGLE-3 only: `draft_vocab_size` (default: the full vocabulary) keeps `draft_token_ids`
    (sorted target ids; default the first N) and stores d2t = target_id - draft_id and the t2d
    mask; `aux_layer_ids` (HF hidden_states indices) is written as
    eagle_config.eagle_aux_hidden_state_layer_ids (layer-output ids, i.e. minus 1); without it
    the default (2, L//2, L-3) applies at load time.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown draft kind {kind!r}; known: {', '.join(KINDS)}")
    if isinstance(target_dir_or_cfg, ModelConfig):
        target = target_dir_or_cfg
    else:
        target = ModelConfig.from_dir(target_dir_or_cfg)
    gen = torch.Generator().manual_seed(seed)
    config = _layer_config(target)
    if kind == EAGLE1:
        p = "layers.0."
        tensors = _eagle1_head(config, target, gen, draft_vocab_size, draft_token_ids)
    else:
        ids = _draft_ids(target.vocab_size, draft_vocab_size, draft_token_ids)
        p = "midlayer."
        tensors = _eagle3_head(config, target, gen, ids, aux_layer_ids)
    tensors.update(_layer_tensors(target, gen, p, eagle1=kind == EAGLE1))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    return out


def _proj(gen: torch.Generator, out_features: int, in_features: int) -> torch.Tensor:
    """float32 [out, in] drawn from N(0, 1/in)."""
    w = torch.randn(out_features, in_features, generator=gen)
    return w * in_features**-0.5


def _layer_config(target: ModelConfig) -> dict:
    """config.json of a one-layer head shaped like a layer of `target` (no kind fields yet)."""
    return {
        "model_type": DRAFT_LAYER_TYPE,
        "hidden_act": "silu",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": target.vocab_size,
        "rms_norm_eps": target.rms_norm_eps,
        "max_position_embeddings": target.max_position_embeddings,
        **_rope_fields(target),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _eagle1_head(
    config: dict,
    target: ModelConfig,
    gen: torch.Generator,
    draft_vocab_size: int | None,
    draft_token_ids: list[int] | None,
) -> dict[str, torch.Tensor]:
    """EAGLE-1's config fields (into `config`) and its fc; it has the target's vocabulary."""
    if draft_vocab_size not in (None, target.vocab_size) or draft_token_ids is not None:
        raise ValueError("EAGLE-1 heads use the target's vocabulary and lm_head")
    config.update(architectures=["LlamaForCausalLM"], bias=True)
    h = target.hidden_size
    return {"fc.weight": _proj(gen, h, 2 * h), "fc.bias": torch.zeros(h)}


def _eagle3_head(
    config: dict,
    target: ModelConfig,
    gen: torch.Generator,
    ids: torch.Tensor,
    aux_layer_ids: tuple[int, ...] | None,
) -> dict[str, torch.Tensor]:
    """EAGLE-3's config fields (into `config`) and tensors outside the decoder layer: fc over
    the aux layers, the norms, its lm_head over the draft vocabulary `ids` [N], d2t and t2d."""
    h = target.hidden_size
    config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(ids))
    if aux_layer_ids is not None:
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in aux_layer_ids]
        }
    num_aux = 3 if aux_layer_ids is None else len(aux_layer_ids)
    p = "midlayer."
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {
        "fc.weight": _proj(gen, h, num_aux * h),
        f"{p}input_layernorm.weight": torch.ones(h),
        f"{p}hidden_norm.weight": torch.ones(h),
        "norm.weight": torch.ones(h),
        "lm_head.weight": _proj(gen, len(ids), h),
        "d2t": ids - torch.arange(len(ids)),
        "t2d": t2d,
    }


def _layer_tensors(
    target: ModelConfig, gen: torch.Generator, p: str, eagle1: bool
) -> dict[str, torch.Tensor]:
    """The decoder layer's attention and MLP weights under prefix `p`; EAGLE-3's attention
    reads [embedding; hidden] (2h wide)."""
    h, d, inner = target.hidden_size, target.head_dim, target.intermediate_size
    q_size, kv_size = target.num_attention_heads * d, target.num_key_value_heads * d
    attn_in = h if eagle1 else 2 * h
    return {
        f"{p}self_attn.q_proj.weight": _proj(gen, q_size, attn_in),
        f"{p}self_attn.k_proj.weight": _proj(gen, kv_size, attn_in),
        f"{p}self_attn.v_proj.weight": _proj(gen, kv_size, attn_in),
        f"{p}self_attn.o_proj.weight": _proj(gen, h, q_size),
        f"{p}mlp.gate_proj.weight": _proj(gen, inner, h),
        f"{p}mlp.up_proj.weight": _proj(gen, inner, h),
        f"{p}mlp.down_proj.weight": _proj(gen, h, inner),
        f"{p}post_attention_layernorm.weight": torch.ones(h),
    }


def _draft_ids(vocab: int, size: int | None, ids: list[int] | None) -> torch.Tensor:
    """int64 [N] sorted distinct target ids the draft vocabulary covers."""
    if ids is None:
        n = vocab if size is None else int(size)
        if not 0 < n <= vocab:
            raise ValueError(f"draft_vocab_size {n} must be in [1, {vocab}]")
        return torch.arange(n)
    t = torch.tensor(sorted(set(int(i) for i in ids)), dtype=torch.int64)
    if len(t) != len(ids) or (size is not None and len(t) != size):
        raise ValueError("draft_token_ids must be distinct and draft_vocab_size long")
    if len(t) == 0 or t[0] < 0 or t[-1] >= vocab:
        raise ValueError(f"draft_token_ids must lie in [0, {vocab})")
    return t

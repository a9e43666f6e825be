"""The checkpoint's own MTP layer as a chain drafter (`draft: mtp`; topk == 1, argmax).

One step at position p of a sequence x_0, x_1, ... (the EAGLE-1 vocabulary of eagle.py: the
draft input at p is (feature at p, token x_{p+1}), its output predicts x_{p+2}):
  x = fc(cat[norm_e(E(x_{p+1})), norm_h(f_p)])       E: the model's embedding, fc [H, 2H]
  o = norm(layer(x))                                 one decoder layer of the model's
                                                     full-attention kind, at position p
  the draft d = argmax(lm_head(o))                   the model's LM head
The feature f_p is the model's final-normed hidden state at p (what it computes its logits
from) while the model has seen x_{p+1}; beyond that, the previous step's output o (the chain:
each of the k steps of a round feeds its own output and argmax token into the next, k runs of
the layer for k drafts). The norms are the model's kind ((1 + w) RMSNorm in Qwen3.5 /
Qwen3-Next). The layer keeps K/V of position p in its own one-layer paged cache at the model's
slot of p (the same block tables), as an EAGLE head does.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from eaglebatch.attention import get_backend
from eaglebatch.attention.base import AttentionMetadata
from eaglebatch.model.causal_lm import CausalLM
from eaglebatch.model.decoder_layer import DecoderLayer, make_norm, query_position_scale
from eaglebatch.model.registry import family_of
from eaglebatch.model.weights import checkpoint_shapes, iter_tensors, load_named_tensors
from eaglebatch.sampling.sampler import argmax
from eaglebatch.speculative.mtp_config import (
    MTP_PREFIX,
    MtpConfig,
    check_mtp_shapes,
    parse_mtp_config,
)


class MtpWeights(nn.Module):
    """The layer's parameters, named as the checkpoint names them under `mtp.`."""

    def __init__(self, cfg: MtpConfig, **factory) -> None:
        super().__init__()
        t, h = cfg.target, cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False, **factory)
        self.pre_fc_norm_embedding = make_norm(t, h, **factory)
        self.pre_fc_norm_hidden = make_norm(t, h, **factory)
        self.layers = nn.ModuleList([DecoderLayer(t, cfg.layer, **factory)])
        self.norm = make_norm(t, h, **factory)


class MtpDraft(nn.Module):
    """The MTP layer bound to its model (whose embedding, RoPE table and LM head it uses; the
    model is referenced, not registered as a submodule)."""

    fixed_position = False  # chain step j queries position L-2+j, as EAGLE heads

    def __init__(self, cfg: MtpConfig, target: CausalLM, *, dtype=torch.float32,
                 device=None) -> None:  # fmt: skip
        super().__init__()
        self.config = cfg
        self._target = (target,)
        self.mtp = MtpWeights(cfg, dtype=dtype, device=device)
        attn = self.mtp.layers[0].self_attn
        attn.layer_idx = 0  # its cache is the draft's one layer
        self.backend = get_backend(target.backend.name)
        self.backend.configure(attn.num_heads, attn.num_kv_heads, attn.head_dim, dtype, dtype,
                               attn.scale, sinks=attn.sinks is not None)  # fmt: skip

    @property
    def target(self) -> CausalLM:
        return self._target[0]

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return (self.config.target.num_hidden_layers,)  # the final-normed hidden state

    @property
    def dtype(self) -> torch.dtype:
        return self.mtp.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.mtp.fc.weight.device

    def rotaries(self) -> list:
        return []  # the model's full-attention table (grown with the model's)

    def target_features(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        return captured[self.capture_layers[0]].to(self.dtype)  # [T, H]

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor,
                select: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The step of the module doc over every row (writing each row's K/V at
        meta.slot_mapping): input_ids int64 [T] x_{p+1}, features [T, H] f_p, positions int64
        [T] p; returns the normed output o [S or T, H] of the `select`ed rows."""
        m = self.mtp
        emb = m.pre_fc_norm_embedding(self.target.embed(input_ids).to(self.dtype))
        x = m.fc(torch.cat((emb, m.pre_fc_norm_hidden(features.to(self.dtype))), dim=-1))
        t, j = self.config.target, self.config.layer
        cos = sin = None
        if t.uses_rope(j):
            cos, sin = self.target.model.rotary_emb(positions, x.dtype)  # [T, 1, D]
        q_scale = query_position_scale(t, positions, x.dtype)
        x = m.layers[0](x, cos, sin, meta, kv_cache, self.backend, q_scale)  # [T, H]
        if select is not None:
            x = x.index_select(0, select)
        return m.norm(x)

    def argmax_tokens(self, hidden: torch.Tensor, allowed=None) -> torch.Tensor:  # -> int64 [N]
        """The greedy draft of each row (no softmax); `allowed` as EagleDraft.argmax_tokens."""
        logits = self.target.lm_head_forward(hidden)  # [N, V]
        if allowed is not None:
            rows, mask = allowed
            logits = logits.clone()
            logits[rows] = logits[rows].masked_fill(~mask[:, : logits.shape[-1]], float("-inf"))
        return argmax(logits)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> f32 [N, V]
        return self.target.lm_head_forward(hidden).float()

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """The layer's zeroed paged cache: [2, num_blocks, block_size, Hkv, D]."""
        attn = self.mtp.layers[0].self_attn
        shape = (2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)


def _split_names(cfg: MtpConfig, items):
    """The checkpoint's mtp.* (name, tensor or shape) pairs as the layer's parameters name them
    (the family's fused tensors split), without the prefix."""
    family = family_of(cfg.target.model_type)
    for name, value in items:
        yield from family.split(name[len(MTP_PREFIX) :], value, cfg.target)


def check_mtp_dir(path: str | os.PathLike[str], raw: dict, target) -> MtpConfig:
    """The MTP layer of the checkpoint in `path` (config.json `raw`) when it fits `target` (its
    ModelConfig), from the headers only; ValueError naming what does not."""
    cfg = parse_mtp_config(raw, target)
    found = {n: s for n, s in checkpoint_shapes(path).items() if n.startswith(MTP_PREFIX)}
    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in MtpWeights(cfg).named_parameters()}
    check_mtp_shapes(expected, dict(_split_names(cfg, found.items())))
    return cfg


def load_mtp(path: str | os.PathLike[str], raw: dict, target_model: CausalLM, *, dtype=None,
             device=None) -> MtpDraft:  # fmt: skip
    """The MTP layer of the checkpoint in `path` for the model loaded from it; ValueError
    naming any mismatch."""
    source = f"checkpoint {os.fspath(path)} (its MTP layer)"
    try:
        cfg = check_mtp_dir(path, raw, target_model.config)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    with torch.device("meta"):
        draft = MtpDraft(cfg, target_model, dtype=dtype or target_model.dtype)
    draft.to_empty(device=device or target_model.device)
    tensors = iter_tensors(path, skip=lambda n: not n.startswith(MTP_PREFIX))
    named = ((MTP_PREFIX + n, t) for n, t in _split_names(cfg, tensors))
    load_named_tensors(draft, named, source=source)
    return draft.eval()

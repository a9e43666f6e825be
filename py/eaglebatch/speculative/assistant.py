"""Gemma 4's assistant drafter (`gemma4_assistant`) as a chain draft (topk == 1, argmax).

What one drafting step computes (transformers' Gemma4AssistantForCausalLM and its
SinglePositionMultiTokenCandidateGenerator), for a sequence whose last committed token x_c
sits at position c (the target's K/V valid for positions 0..c-1):
  * input: pre_projection(cat[E(t), s]) [h], with E the TARGET's scaled embedding
    (table[t] * sqrt(H)), t the step's token and s [H] the state: at the first step t = x_c
    and s = the target's final-normed hidden state at c-1; at step j > 1 t = d_{j-1}, the
    previous step's draft, and s = that step's post_projection output;
  * the assistant's gemma4_text layers (all KV-shared: q_proj, q_norm, RoPE, no k/v of their
    own), every query at position c -- the SAME position at every step of a round; a layer of
    each kind attends to the target's K/V of the last target layer of that kind which writes
    a cache (`producer_layers`): full layers to positions 0..c-1, sliding layers to
    c-1-window..c-1 (transformers' bidirectional window mask, flipped: the last window + 1
    keys); drafted tokens are never visible, they are not in the target's cache;
  * n = norm(h); the draft d_j = argmax of lm_head(n) (the tied embedding of the assistant),
    or with use_ordered_embeddings of the masked embedding (the centroids' top-k clusters'
    tokens scored, every other token below them all); the next state is post_projection(n).
The reference slices its shared K/V after a round with rejected drafts so that the rejected
draft at c still shows; here the context is always the verified prefix 0..c-1.

Plugged into SpecWorker as an EAGLE head is (speculative/worker.py): the worker's row "at p"
with (feature f_p, token x_{p+1}) is the step above with c = p + 1. The extend phases run it on
the selected rows only (nothing is written: no KV cache of its own); chain steps keep p (the
round's L-2: `fixed_position`). The slot state is [n | post_projection(n)], h + H wide, so
that the head reads n and the next step reads the projected state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eaglebatch.attention.base import AttentionMetadata
from eaglebatch.model.causal_lm import CausalLM, DecoderModel
from eaglebatch.model.weights import load_named_tensors
from eaglebatch.sampling.sampler import argmax
from eaglebatch.speculative.assistant_config import (
    AssistantConfig,
    check_assistant_shapes,
    parse_assistant_config,
)
from eaglebatch.speculative.checkpoint import read_draft_tensors

_IGNORED = ("rotary_emb.inv_freq",)


@dataclass
class _Query:
    """One query row per sequence reading the target's cache up to position p (module doc)."""

    slot_mapping: torch.Tensor  # int64 [S] the target's slot of p (the KV-shared layers read it)
    positions: torch.Tensor  # int64 [S] p
    gather: torch.Tensor  # int64 [S * M] the rows' first M block ids
    num_keys: int  # M * block_size


class CacheReader:
    """Attention of one query per row over a target layer's paged cache, writing nothing:
    key t is visible to the row at p iff t <= p and, in a window w, t >= p - w (w + 1 keys)."""

    name = "assistant"
    supports_cuda_graphs = False

    def prepare(self, meta) -> None:  # the query is planned by AssistantDraft itself
        pass

    def forward(self, layer_idx, q, k, v, kv_cache, meta: _Query, scale, window=None,
                sinks=None):  # fmt: skip
        if sinks is not None:  # an assistant's layers have no sinks (assistant_config.py)
            raise ValueError("attention sinks in an assistant drafter's layer")
        s, hkv, d = q.shape[0], kv_cache.shape[-2], kv_cache.shape[-1]
        kv = kv_cache.index_select(1, meta.gather).view(2, s, -1, hkv, d)  # [2, S, Lk, Hkv, D]
        keys = torch.arange(meta.num_keys, device=q.device)[None, :]  # [1, Lk]
        p = meta.positions[:, None]  # [S, 1]
        visible = keys <= p
        if window is not None:
            visible = visible & (keys >= p - window)
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [S, Hq, 1, D]
            kv[0].to(q.dtype).transpose(1, 2),  # [S, Hkv, Lk, D]
            kv[1].to(q.dtype).transpose(1, 2),
            attn_mask=visible[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )  # [S, Hq, 1, D]
        return out[:, :, 0, :]


class AssistantDraft(nn.Module):
    """The assistant bound to its target (whose embedding and KV caches it reads; referenced,
    not a submodule). Parameter names are the checkpoint's."""

    fixed_position = True  # every chain step queries the round's first position (module doc)

    def __init__(self, cfg: AssistantConfig, target: CausalLM, *, dtype=torch.float32,
                 device=None, max_positions: int | None = None) -> None:  # fmt: skip
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.config = cfg
        self._target = (target,)
        self.backend = CacheReader()
        h, big = cfg.text.hidden_size, cfg.target_hidden_size
        positions = max_positions or target.model.rotary_emb.max_positions
        self.model = DecoderModel(cfg.text, positions, **factory)
        self.pre_projection = nn.Linear(2 * big, h, bias=False, **factory)
        self.post_projection = nn.Linear(h, big, bias=False, **factory)
        self.lm_head = None if cfg.text.tie_word_embeddings else nn.Linear(
            h, cfg.vocab_size, bias=False, **factory)  # fmt: skip
        self.centroids = None
        if cfg.ordered_embeddings:
            self.centroids = nn.Linear(h, cfg.num_centroids, bias=False, **factory)
            self.register_buffer("token_ordering", torch.zeros(cfg.vocab_size, dtype=torch.long,
                                                               device=device))  # fmt: skip

    @property
    def target(self) -> CausalLM:
        return self._target[0]

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return (self.target.config.num_hidden_layers,)  # the final-normed hidden state

    @property
    def dtype(self) -> torch.dtype:
        return self.pre_projection.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.pre_projection.weight.device

    def rotaries(self) -> list:
        local = self.model.rotary_local
        return [self.model.rotary_emb] + ([] if local is None else [local])

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        return None  # it reads the target's

    def target_features(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        return captured[self.capture_layers[0]].to(self.dtype)  # [T, H]

    def forward(self, input_ids, features, positions, meta: AttentionMetadata, kv_cache=None,
                select=None) -> torch.Tensor:  # fmt: skip
        """The step of the module doc for the `select`ed rows (one per sequence, in order; all
        rows when None): [S, h + H] states. input_ids int64 [T] (t), features [T, H] target
        features or [T, h + H] states, positions int64 [T] p (the query sits at p + 1)."""
        if select is not None:
            rows = (x.index_select(0, select) for x in (input_ids, features, positions))
            input_ids, features, positions = rows
        if features.shape[-1] != self.config.target_hidden_size:
            features = features[:, self.config.text.hidden_size :]  # a state's projected part
        x = self.pre_projection(torch.cat((self.target.embed(input_ids).to(self.dtype),
                                           features.to(self.dtype)), dim=-1))  # fmt: skip
        query = self._query(positions, meta)
        n = self.model.norm(self._layers(x, positions + 1, query))  # [S, h]
        return torch.cat((n, self.post_projection(n)), dim=-1)

    def _query(self, positions: torch.Tensor, meta: AttentionMetadata) -> _Query:
        if positions.shape[0] != meta.num_seqs:
            raise ValueError("assistant draft: one query row per sequence")
        bs = meta.block_size
        blocks = -(-meta.max_seqlen_k // bs)  # every p < max_seqlen_k
        tables = meta.block_tables[:, :blocks].long()  # [S, M]
        rows = torch.arange(len(positions), device=tables.device)
        slots = tables[rows, positions // bs] * bs + positions % bs
        return _Query(slots, positions, tables.reshape(-1), blocks * bs)

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, query: _Query) -> torch.Tensor:
        cfg, local = self.config.text, self.model.rotary_local
        tables = {"full": self.model.rotary_emb(positions, x.dtype)}
        if local is not None:
            tables["local"] = local(positions, x.dtype)
        caches = self._caches
        for i, layer in enumerate(self.model.layers):
            cos, sin = tables["local" if local is not None and cfg.window_of(i) else "full"]
            x = layer(x, cos, sin, query, caches[self.config.producers[i]], self.backend)
        return x

    @property
    def _caches(self) -> list[torch.Tensor]:
        caches = getattr(self, "kv_caches", None)
        if caches is None:
            raise RuntimeError("assistant draft: bind the target's KV caches first (kv_caches)")
        return caches

    # ---- logits --------------------------------------------------------------------------------

    def _head(self, state: torch.Tensor) -> torch.Tensor:  # [N, h + H] -> [N, V]
        n = state[:, : self.config.text.hidden_size]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.centroids is None:
            return F.linear(n, weight)
        return self._ordered_logits(n, weight)

    def _ordered_logits(self, n: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The masked embedding: only the tokens of the top-k centroids are scored; every other
        token gets the lowest score less one (as transformers)."""
        cfg, rows = self.config, n.shape[0]
        top = torch.topk(self.centroids(n), k=cfg.centroid_top_k, dim=-1).indices  # [N, k]
        clusters = self.token_ordering.view(cfg.num_centroids, -1)  # [C, V/C]
        ids = clusters[top].reshape(rows, -1)  # [N, k * V/C]
        scores = (n[:, None, :] @ weight[ids].transpose(1, 2))[:, 0]  # [N, k * V/C]
        out = torch.full((rows, cfg.vocab_size), 0.0, dtype=n.dtype, device=n.device)
        out.fill_(scores.min().item() - 1.0)
        return out.scatter_(1, ids, scores)

    def argmax_tokens(self, hidden: torch.Tensor, allowed=None) -> torch.Tensor:  # -> int64 [N]
        """The greedy draft of each row (no softmax); `allowed` as EagleDraft.argmax_tokens."""
        logits = self._head(hidden)
        if allowed is not None:
            rows, mask = allowed
            logits = logits.clone()
            logits[rows] = logits[rows].masked_fill(~mask[:, : logits.shape[-1]], float("-inf"))
        return argmax(logits)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, h + H] -> f32 [N, V]
        return self._head(hidden).float()


def load_assistant(path: str | os.PathLike[str], raw: dict, target_model: CausalLM, *,
                   dtype=None, device=None, max_positions=None) -> AssistantDraft:  # fmt: skip
    """The assistant in `path` for the target; ValueError naming any mismatch."""
    source = f"draft checkpoint {os.fspath(path)} (gemma4_assistant)"
    try:
        cfg = parse_assistant_config(raw, target_model.config)
        tensors = read_draft_tensors(path)
        check_assistant_shapes(cfg, {k: tuple(v.shape) for k, v in tensors.items()})
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    dtype = dtype or target_model.dtype
    device = device or target_model.device
    with torch.device("meta"):
        draft = AssistantDraft(cfg, target_model, dtype=dtype, max_positions=max_positions)
    draft.to_empty(device=device)
    for rotary in draft.rotaries():
        rotary.rebuild()
    ordering = tensors.pop("masked_embedding.token_ordering", None)
    if "masked_embedding.centroids.weight" in tensors:
        tensors["centroids.weight"] = tensors.pop("masked_embedding.centroids.weight")
    if cfg.ordered_embeddings:
        if ordering is None or tuple(ordering.shape) != (cfg.vocab_size,):
            raise ValueError(f"{source}: masked_embedding.token_ordering must hold "
                             f"{cfg.vocab_size} token ids")  # fmt: skip
        draft.token_ordering.copy_(ordering.long())
    if draft.lm_head is None:
        tensors.pop("lm_head.weight", None)  # tied: the embedding
    load_named_tensors(draft, tensors.items(), ignore=_IGNORED, source=source)
    return draft.eval()

"""The three graph steps of a speculative round, per padded batch size bp and draft length k
(K: the head's longest chain; W = max_draft_tokens >= K: the widest round, prompt lookup's):

  loop[k, bp]    the whole draft chain: d_1 = argmax head(h0), then k-1 draft forwards, each
                 followed by an argmax -> draft ids [bp, k]          (1 <= k <= K)
  verify[k, bp]  the target over [x_{L-1}, d_1..d_k] -> final hidden states [bp*(k+1), H] (the LM
                 head runs eagerly on the real rows: graph outputs stay alive, and logits for
                 every bucket and k would not fit), and the draft features of those rows into
                 `feats[k]`                              (0 <= k <= W; k = 0: decode)
  extend[k, bp]  the draft over (feats[k], tokens[k]) at the verify positions, keeping the row of
                 each sequence's last accepted token -> h [bp, h]    (0 <= k <= W)

Acceptance (verify.py) runs eagerly between verify and extend: it is a few small ops, and its
outputs (the emitted tokens, the accepted counts) are copied into extend's input buffers.
Buffers are per k and sized for the largest bucket; bucket bp uses their first bp rows. The draft
chain's step j (1..K-1) has its own q=1 metadata, shared by every k > j. See graphs.py for
padding rows and the pad block.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from eaglebatch.graphs import GraphPool, StaticMeta, bucket_for, capture_sizes, fill_rows


class SpecGraphs:
    def __init__(self, sw, mode: str, max_batch_size: int) -> None:
        """`sw`: the SpecWorker (its target model, draft, KV caches, budget and K)."""
        self.sw = sw
        # K: the head's longest chain (loops); W >= K: the widest round (verify, extend)
        K, W, dev = sw.num_steps, sw.max_draft_tokens, sw.device
        bs, pad = sw.budget.block_size, sw.budget.num_blocks
        self.sizes = capture_sizes(max_batch_size)
        mx = max(self.sizes)
        # verify queries reach position max_model_len - 1 + W
        self.max_blocks = mb = math.ceil((sw.max_model_len + W) / bs)
        draft, target = sw.draft, sw.model
        hd = draft.config.hidden_size
        self.h0 = torch.zeros(mx, hd, dtype=draft.dtype, device=dev)  # [mx, h] h^d_{L-2}
        self.step_meta = [StaticMeta(mx, 1, mb, bs, pad, dev) for _ in range(K - 1)]
        self.step_pos = torch.zeros(max(K - 1, 1), mx, dtype=torch.long, device=dev)
        self.meta = {k: StaticMeta(mx, k + 1, mb, bs, pad, dev) for k in range(W + 1)}
        self.ids = {k: torch.zeros(mx * (k + 1), dtype=torch.long, device=dev) for k in self.meta}
        self.pos = {k: torch.zeros(mx * (k + 1), dtype=torch.long, device=dev) for k in self.meta}
        self.tokens = {k: torch.zeros(mx * (k + 1), dtype=torch.long, device=dev)
                       for k in self.meta}
        fdim = hd  # target_features output width
        self.feats = {k: torch.zeros(mx * (k + 1), fdim, dtype=draft.dtype, device=dev)
                      for k in self.meta}
        self.select = torch.zeros(mx, dtype=torch.long, device=dev)  # [mx]
        # per (k or j, bp): the draft's metadata views carry the draft backend's state, the
        # target's carry the target backend's; both read the same buffers
        self._step_views: dict[tuple[int, int], object] = {}
        self._ext_views: dict[tuple[int, int], object] = {}
        self._states: dict[tuple[str, int, int], object] = {}
        self.loop: dict[tuple[int, int], object] = {}
        self.verify: dict[tuple[int, int], object] = {}
        self.extend: dict[tuple[int, int], object] = {}
        self.pool = GraphPool(mode, self.sizes, dev)
        with torch.inference_mode(), self.pool as pool:
            for bp in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
                for j in range(1, K):
                    view = dataclasses.replace(self.step_meta[j - 1].view(bp), backend_state=None)
                    self._step_views[j, bp] = view
                    st = draft.backend.make_graph_state(bp, 1, mb, dev)
                    self._states["step", j, bp] = st
                    draft.backend.prepare_graph(view, st)
                for k in range(W + 1):
                    tview = self.meta[k].view(bp)
                    st = target.backend.make_graph_state(bp, k + 1, mb, dev)
                    self._states["verify", k, bp] = st
                    target.backend.prepare_graph(tview, st)
                    dview = dataclasses.replace(tview, backend_state=None)
                    self._ext_views[k, bp] = dview
                    st = draft.backend.make_graph_state(bp, k + 1, mb, dev)
                    self._states["extend", k, bp] = st
                    draft.backend.prepare_graph(dview, st)
                    if 1 <= k <= K:
                        self.loop[k, bp] = pool.capture(lambda k=k, bp=bp: self._loop(k, bp))
                    self.verify[k, bp] = pool.capture(lambda k=k, bp=bp: self._verify(k, bp))
                    self.extend[k, bp] = pool.capture(lambda k=k, bp=bp: self._extend(k, bp))

    @property
    def stats(self):
        return self.pool.stats

    def bucket(self, num_seqs: int) -> int | None:
        bp = bucket_for(num_seqs, self.sizes)
        if bp is None:
            self.stats.eager_steps += 1
        return bp

    # ---- the captured functions (read buffers, return graph-owned outputs) ---------------------

    def _loop(self, k: int, bp: int) -> torch.Tensor:  # int64 [bp, k] target ids
        sw = self.sw
        h = self.h0[:bp]
        d = sw.draft.argmax_tokens(h)
        out = [d]
        for j in range(1, k):
            h = sw.draft(d, h, self.step_pos[j - 1, :bp], self._step_views[j, bp], sw.draft_kv)
            d = sw.draft.argmax_tokens(h)
            out.append(d)
        return torch.stack(out, dim=1)

    def _verify(self, k: int, bp: int) -> torch.Tensor:  # [bp * (k+1), H]
        sw = self.sw
        n = bp * (k + 1)
        hidden, captured = sw.model(
            self.ids[k][:n], self.pos[k][:n], self.meta[k].view(bp), sw.kv_caches,
            capture_layers=sw.draft.capture_layers,
        )
        self.feats[k][:n].copy_(sw.draft.target_features(captured))
        return hidden

    def _extend(self, k: int, bp: int) -> torch.Tensor:  # [bp, h]
        sw = self.sw
        n = bp * (k + 1)
        return sw.draft(self.tokens[k][:n], self.feats[k][:n], self.pos[k][:n],
                        self._ext_views[k, bp], sw.draft_kv, select=self.select[:bp])

    # ---- one round, from the SpecWorker's host-side plan arrays --------------------------------

    def draft_chain(self, bp, k, h0, start, block_tables, kv_slots) -> torch.Tensor:
        """Draft ids [b, k]; h0 [b, h] = h^d_{L-2}, start [b] = L-1 (host)."""
        b = len(start)
        self.h0[:b].copy_(h0)
        for j in range(1, k):
            p = start + j - 1  # this step's position L-2+j
            self.step_meta[j - 1].fill(bp, p + 1, block_tables, kv_slots[:, j - 1])
            fill_rows(self.step_pos[j - 1], p, bp)
            self.sw.draft.backend.prepare_graph(self._step_views[j, bp],
                                                self._states["step", j, bp])
        self.stats.replays += 1
        return self.loop[k, bp]()[:b]

    def target_verify(self, bp, k, first, draft_ids, start, block_tables, kv_slots):
        """Logits [b, k+1, V] over [x_{L-1}, d_1..d_k]; first: int64 [b] device, x_{L-1}."""
        b = len(start)
        meta = self.meta[k].fill(bp, start + k + 1, block_tables,
                                 kv_slots[:, : k + 1].reshape(-1))
        ids = self.ids[k].view(-1, k + 1)
        ids[:b, 0] = first
        if k:
            ids[:b, 1:] = draft_ids
        ids[b:bp].zero_()
        fill_rows(self.pos[k], (start[:, None] + np.arange(k + 1)).reshape(-1), bp * (k + 1))
        self.sw.model.backend.prepare_graph(meta, self._states["verify", k, bp])
        self.stats.replays += 1
        hidden = self.verify[k, bp]()[: b * (k + 1)]
        return self.sw.model.compute_logits(hidden).view(b, k + 1, -1)

    def draft_extend(self, bp, k, tokens, accepted) -> torch.Tensor:
        """h^d [b, h] at each row's last accepted position; tokens [b, k+1], accepted [b]."""
        b = tokens.shape[0]
        tok = self.tokens[k].view(-1, k + 1)
        tok[:b] = tokens
        tok[b:bp].zero_()
        rows = torch.arange(bp, device=self.select.device) * (k + 1)
        self.select[:bp] = rows
        self.select[:b] += accepted
        self.sw.draft.backend.prepare_graph(self._ext_views[k, bp], self._states["extend", k, bp])
        self.stats.replays += 1
        return self.extend[k, bp]()[:b]

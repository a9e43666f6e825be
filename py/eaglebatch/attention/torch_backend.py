"""Paged attention in plain PyTorch (CPU and any device): the reference and the CPU backend.

`prepare` splits the step's sequences into chunks (sequences sorted by context length, so each
chunk pads to a similar length) and precomputes, per chunk:
  * `tok_index` / `pad_index`: where the chunk's packed query rows come from and where they sit
    in the padded [C, max_q] layout;
  * `block_index`: the chunk's block ids; K/V are gathered from the cache a whole block at a time
    into a reused workspace [2, C, Lk, Hkv, D] (a fresh buffer per layer costs more in page faults
    than the copy itself on CPU), small enough to stay in cache while attention reads it;
  * `mask` [C, 1, max_q, max_k] (True = visible):
        key t visible to query row j of sequence i  <=>  t <= k_i - q_i + j
    i.e. keys up to the query's own absolute position. Padded query rows (j >= q_i) still see
    key 0, so no softmax row is empty; their output is dropped. `mask` is None where it would be
    all-visible (decode at equal lengths) or plain causal: prefills, padded or not (a row is
    padded at its end, so its real queries see none of its padding under the causal rule).
Sequences whose query starts at position 0 (q_i == k_i) attend over the fresh k/v directly and
skip the gather; chunks never mix them with rows after K/V in the cache, nor rows of a few
queries (decode, verify) with prefill-sized ones. Rows whose queries follow cached K/V no
longer than the queries (a prefix-cached prompt, a later chunk) are "placed": each row's
queries go to their absolute positions of a zero-padded [C, max_k] query grid, so plain causal
attention over the gathered keys (the fast kernel, no mask) is exactly each row's rule; the
grid's other rows are dropped. A prompt (or chunk) of at least `solo_prefill_tokens` shares its
chunk only with rows of its own length: unpadded, it runs as plain causal attention, which
skips the masked upper triangle that a padded, masked chunk computes in full (two prompts of
~1,700 tokens padded together took as long as one of 3,500 alone). Attention itself is
`scaled_dot_product_attention` with grouped-query heads (enable_gqa).

Attention sinks (gpt-oss; `forward`'s `sinks`): the explicit softmax of attention/sinks.py in
place of SDPA, over the same chunks, masks and uniform steps.

Sliding-window layers (`windows`, from `configure`): a second mask per chunk and window,
        key t visible  <=>  q_pos - window < t <= q_pos,
made in `prepare` with the first one (none where no query reaches past its window).

Uniform steps replayed from CUDA graphs (`prepare_graph`) cannot depend on host-side lengths:
every row gathers all max_blocks columns of its block table (Lk = max_blocks * block_size keys)
and the mask is computed on the device from seq_lens into a persistent buffer, so the captured
per-layer work has fixed shapes. It costs O(max_model_len) per row: flashinfer is the fast path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from eaglebatch.attention.base import AttentionBackend, AttentionMetadata, write_kv_cache
from eaglebatch.attention.sinks import attention_with_sinks

# Query rows per sequence up to which a row is a decode / verify row for chunking (`_group`).
SHORT_QUERY = 16


@dataclass
class _Chunk:
    num_seqs: int  # C
    max_q: int
    max_k: int
    tok_index: torch.Tensor | None  # int64 [Tc] packed rows of the chunk; None: all T, in order
    pad_index: torch.Tensor | None  # int64 [Tc] row in flat [C * max_q]; None: no padding
    block_index: torch.Tensor | None  # int64 [C * Mk] blocks to gather; None: prefill
    mask: torch.Tensor | None  # bool [C, 1, max_q, max_k]
    causal: bool  # with mask None: plain causal (prefill) vs all keys visible (decode)
    # window -> bool [C, 1, max_q, Lk] for sliding-window layers (absent: the window hides
    # nothing in this chunk, `mask` / `causal` apply)
    window_masks: dict[int, torch.Tensor]


@dataclass
class _Plan:
    chunks: list[_Chunk]


@dataclass
class _Uniform:
    """Graph-step state (one per captured shape); tensors are updated in place by prepare_graph."""

    num_seqs: int  # B
    q_len: int  # q, the same for every row
    block_index: torch.Tensor  # int64 [B * M] block ids to gather, row-major
    offsets: torch.Tensor  # int64 [q] 0..q-1
    mask: torch.Tensor | None = None  # bool [B, 1, q, Lk] (allocated at the first prepare_graph)
    key_pos: torch.Tensor | None = None  # int64 [Lk] 0..Lk-1
    window_masks: dict | None = None  # window -> bool [B, 1, q, Lk], as `mask`


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_cuda_graphs = True

    def __init__(self, chunk_tokens: int = 4096, solo_prefill_tokens: int = 256) -> None:
        """`chunk_tokens` bounds a chunk's padded size, C * max(max_k, max_q), i.e. how many
        K/V rows one gather holds (4096 rows = 6 MiB for 3 KV heads of 64 in float32).
        `solo_prefill_tokens`: prompts at least this long are not padded in a prefill step."""
        if chunk_tokens <= 0 or solo_prefill_tokens <= 0:
            raise ValueError("chunk_tokens and solo_prefill_tokens must be > 0")
        self.chunk_tokens = chunk_tokens
        self.solo_prefill_tokens = solo_prefill_tokens
        self._workspace: torch.Tensor | None = None
        self._windows: tuple[int, ...] = ()  # configure: the sliding windows of the model

    def configure(self, num_qo_heads, num_kv_heads, head_dim, kv_dtype, q_dtype,
                  sm_scale=None, windows=(), layer_heads=(), sinks=False) -> None:  # fmt: skip
        # every path reads a layer's (Hq, Hkv, D) from its q and cache: layer_heads need
        # nothing; every path attends with the sinks `forward` is given
        self._windows = tuple(windows)

    # ---- planning (once per step) -------------------------------------------------------------

    def prepare(self, meta: AttentionMetadata) -> None:
        cu, lens = meta.host_lengths()
        cu_np = cu.numpy().astype(np.int64)  # [B+1]
        k_np = lens.numpy().astype(np.int64)  # [B]
        q_np = cu_np[1:] - cu_np[:-1]  # [B]
        fresh = q_np == k_np  # [B] queries from position 0: attend over the fresh k/v
        groups = self._group(k_np, q_np, fresh)
        if len(groups) == 1:
            groups = [np.arange(len(k_np))]  # keep plan order: no reordering of rows needed
        chunks = [
            self._plan_chunk(meta, seqs, cu_np, q_np, k_np, bool(fresh[seqs].all()),
                             single=len(groups) == 1)  # fmt: skip
            for seqs in groups
        ]
        meta.backend_state = _Plan(chunks)

    def _group(self, k_np: np.ndarray, q_np: np.ndarray, fresh: np.ndarray) -> list[np.ndarray]:
        """Chunks of sequences: rows from position 0 apart from those after K/V in the cache
        (prefix-cached or chunked prefills: the first attend over their own k/v, the others
        gather), and of those, rows of a few queries (decode, verify) apart from prefill-sized
        ones (padded together, a decode row would compute as many query rows as the longest);
        each sorted by context length so a chunk pads to a similar length, within
        `chunk_tokens`; a long fresh prompt is not padded with longer ones (module doc)."""
        long = q_np > SHORT_QUERY
        order = np.lexsort((k_np, long, ~fresh))  # fresh rows first, then by query kind, length
        kind = fresh * 2 + long
        groups: list[np.ndarray] = []
        start, num_seqs = 0, len(k_np)
        while start < num_seqs:
            end = start + 1
            first = order[start]
            # sorted ascending, so the chunk's padded length is that of its last sequence
            while end < num_seqs and (end + 1 - start) * k_np[order[end]] <= self.chunk_tokens:
                if kind[order[end]] != kind[first]:
                    break
                longer = k_np[order[end]] != k_np[first]
                if long[first] and longer and k_np[order[end]] >= self.solo_prefill_tokens:
                    break  # a long prompt (or chunk) is not padded (see the module doc)
                end += 1
            groups.append(order[start:end])
            start = end
        return groups

    def _plan_chunk(
        self,
        meta: AttentionMetadata,
        seqs: np.ndarray,  # [C] sequence indices of this chunk
        cu: np.ndarray,
        q_lens: np.ndarray,
        k_lens: np.ndarray,
        prefill: bool,
        single: bool,
    ) -> _Chunk:
        device = meta.seq_lens.device
        q, k = q_lens[seqs], k_lens[seqs]  # [C]
        max_q, max_k = int(q.max()), int(k.max())
        num = len(seqs)

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

        tok = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in seqs])  # [Tc]
        within = tok - np.repeat(cu[seqs], q)  # query row j inside its sequence
        # queries after K/V in the cache no longer than themselves (a prefix-cached prompt, a
        # later chunk): placed at their absolute positions of a [C, max_k] grid, plain causal
        # attention over it is exact and runs the fast kernel without a mask (module doc)
        placed = not prefill and not self._windows and max_q > SHORT_QUERY and max_k <= 2 * max_q
        if placed:
            within = within + np.repeat(k - q, q)
            max_q = max_k  # the padded query length of this chunk
        local = np.repeat(np.arange(num), q) * max_q  # chunk-local sequence * max_q
        padded = placed or bool((q != max_q).any())

        block_index = None
        if not prefill:
            blocks = -(-max_k // meta.block_size)
            rows = meta.block_tables[:, :blocks].index_select(0, dev(seqs))  # [C, Mk]
            block_index = rows.reshape(-1).long()

        if placed:  # the grid's own causal rule is each row's
            mask, causal, window_masks = None, True, {}
        else:
            mask, causal, window_masks = self._masks(q, k, max_q, max_k, prefill, device)
        return _Chunk(
            num_seqs=num,
            max_q=max_q,
            max_k=max_k,
            tok_index=None if single else dev(tok),
            pad_index=dev(local + within) if padded else None,
            block_index=block_index,
            mask=mask,
            causal=causal,
            window_masks=window_masks,
        )

    def _masks(self, q, k, max_q: int, max_k: int, prefill: bool, device):
        """(mask, causal, window_masks) of a chunk whose rows have q / k [C] queries / keys
        (module doc): no mask where attention is plain causal or sees every key."""
        mask, causal = None, prefill
        q_pos = (k - q)[:, None] + np.arange(max_q)[None, :]  # [C, max_q] absolute position
        key_pos = np.arange(max_q if prefill else max_k)[None, None, :]  # [1, 1, Lk]
        if not prefill and ((k != max_k).any() or max_q > 1):
            visible = key_pos <= q_pos[:, :, None]  # [C, max_q, Lk]
            mask = torch.from_numpy(visible[:, None]).to(device)
            causal = False
        window_masks = {}
        for w in self._windows:
            if int(q_pos.max()) >= w:  # some query sees past its window
                seen = (key_pos <= q_pos[:, :, None]) & (key_pos > q_pos[:, :, None] - w)
                window_masks[w] = torch.from_numpy(seen[:, None]).to(device)
        return mask, causal, window_masks

    # ---- uniform steps (CUDA graphs) ------------------------------------------------------------

    def make_graph_state(
        self, num_seqs: int, q_len: int, max_blocks: int, device: torch.device
    ) -> _Uniform:
        return _Uniform(
            num_seqs=num_seqs,
            q_len=q_len,
            block_index=torch.zeros(num_seqs * max_blocks, dtype=torch.int64, device=device),
            offsets=torch.arange(q_len, device=device),
        )

    def prepare_graph(self, meta: AttentionMetadata, state: _Uniform) -> None:
        b, m = meta.block_tables.shape
        if b != state.num_seqs or meta.num_tokens != b * state.q_len:
            raise ValueError(f"graph step shape {b}x{meta.num_tokens // b} != the state's "
                             f"{state.num_seqs}x{state.q_len}")
        lk = m * meta.block_size
        if state.mask is None:  # first call: before capture, so the graph sees this buffer
            state.mask = torch.zeros(b, 1, state.q_len, lk, dtype=torch.bool,
                                     device=meta.seq_lens.device)
            state.key_pos = torch.arange(lk, device=meta.seq_lens.device)
            state.window_masks = {w: torch.zeros_like(state.mask) for w in self._windows}
        state.block_index.copy_(meta.block_tables.reshape(-1))
        # key t visible to query j of row i  <=>  t <= seq_lens[i] - q + j
        q_pos = meta.seq_lens[:, None].long() - state.q_len + state.offsets  # [B, q]
        keys = state.key_pos[None, None, :]
        torch.le(keys, q_pos[:, :, None], out=state.mask[:, 0])
        for w, m in state.window_masks.items():  # ... and t > that position - window
            torch.logical_and(state.mask[:, 0], keys > q_pos[:, :, None] - w, out=m[:, 0])
        meta.backend_state = state

    def _attend_uniform(self, st: _Uniform, q, kv_cache, scale: float, window=None, sinks=None):
        b, hkv, d = st.num_seqs, kv_cache.shape[-2], kv_cache.shape[-1]
        gathered = kv_cache.index_select(1, st.block_index)  # [2, B * M, block_size, Hkv, D]
        k_pad, v_pad = gathered.view(2, b, -1, hkv, d).unbind(0)  # [B, Lk, Hkv, D] each
        out = _attention(
            q.view(b, st.q_len, -1, d).transpose(1, 2),  # [B, Hq, q, D]
            k_pad.to(q.dtype).transpose(1, 2),
            v_pad.to(q.dtype).transpose(1, 2),
            st.mask if window is None else st.window_masks[window],
            False, scale, sinks,
        )  # [B, Hq, q, D]
        return out.transpose(1, 2).reshape(b * st.q_len, -1, d)

    # ---- per layer ----------------------------------------------------------------------------

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,  # [Hq]
    ) -> torch.Tensor:  # [T, Hq, D]
        plan = meta.backend_state
        if isinstance(plan, _Uniform):
            write_kv_cache(k, v, kv_cache, meta.slot_mapping)
            return self._attend_uniform(plan, q, kv_cache, scale, window, sinks)
        if not isinstance(plan, _Plan):
            raise RuntimeError("TorchAttentionBackend.prepare(meta) was not called for this step")
        if window is not None and window not in self._windows:
            raise ValueError(f"window {window} was not configured (configure(windows=...))")
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        args = (q, k, v, kv_cache, scale, window, sinks)
        if len(plan.chunks) == 1:
            return self._attend(plan.chunks[0], *args)
        out = torch.empty_like(q)
        for chunk in plan.chunks:
            out.index_copy_(0, chunk.tok_index, self._attend(chunk, *args))
        return out

    def _attend(
        self,
        chunk: _Chunk,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,
        scale: float,
        window: int | None,
        sinks: torch.Tensor | None,  # [Hq]
    ) -> torch.Tensor:  # [Tc, Hq, D] for the chunk's tokens in tok_index order
        num, head_dim = chunk.num_seqs, q.shape[-1]
        q_pad = self._pad(q, chunk)  # [C, max_q, Hq, D]
        if chunk.block_index is None:  # queries from position 0: their own k/v is all there is
            k_pad = self._pad(k, chunk)  # [C, max_q, Hkv, D]
            v_pad = self._pad(v, chunk)
        else:
            assert chunk.block_index is not None
            # [2, C * Mk, block_size, Hkv, D] -> K, V each [C, Lk, Hkv, D], Lk = Mk * block_size
            shape = (2, chunk.block_index.shape[0], *kv_cache.shape[2:])
            gathered = self._buffer(shape, kv_cache)
            torch.index_select(kv_cache, 1, chunk.block_index, out=gathered)
            k_pad, v_pad = gathered.view(2, num, -1, *kv_cache.shape[3:]).unbind(0)
            k_pad, v_pad = k_pad[:, : chunk.max_k], v_pad[:, : chunk.max_k]  # [C, max_k, Hkv, D]

        mask = chunk.window_masks.get(window, chunk.mask)  # window None: never a key
        out = _attention(
            q_pad.transpose(1, 2),  # [C, Hq, max_q, D]
            k_pad.to(q.dtype).transpose(1, 2),  # [C, Hkv, Lk, D]
            v_pad.to(q.dtype).transpose(1, 2),
            mask, chunk.causal, scale, sinks,
        )  # [C, Hq, max_q, D]
        out = out.transpose(1, 2).reshape(num * chunk.max_q, -1, head_dim)  # [C * max_q, Hq, D]
        return out if chunk.pad_index is None else out.index_select(0, chunk.pad_index)

    @staticmethod
    def _pad(x: torch.Tensor, chunk: _Chunk) -> torch.Tensor:
        """Packed [T, H, D] -> the chunk's padded [C, max_q, H, D] (padding rows are zero)."""
        if chunk.tok_index is not None:
            x = x.index_select(0, chunk.tok_index)  # [Tc, H, D]
        if chunk.pad_index is None:
            return x.view(chunk.num_seqs, chunk.max_q, *x.shape[1:])
        padded = x.new_zeros(chunk.num_seqs * chunk.max_q, *x.shape[1:])
        padded.index_copy_(0, chunk.pad_index, x)
        return padded.view(chunk.num_seqs, chunk.max_q, *x.shape[1:])

    def _buffer(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A `shape` view of the workspace (contents undefined), with `like`'s dtype and device.
        Valid until the next call: each layer's gather overwrites the previous one."""
        numel = int(np.prod(shape))
        ws = self._workspace
        if ws is None or ws.numel() < numel or ws.dtype != like.dtype or ws.device != like.device:
            ws = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._workspace = ws
        return ws[:numel].view(shape)


def _attention(q, k, v, mask, causal: bool, scale: float, sinks) -> torch.Tensor:
    """[C, Hq, Lq, D] attention over k, v [C, Hkv, Lk, D] (grouped-query heads): SDPA, or with
    `sinks` [Hq] the explicit softmax with a sink column (attention/sinks.py). `mask` bool
    [C, 1, Lq, Lk] (True = visible); None: plain causal when `causal`, else every key."""
    if sinks is not None:
        return attention_with_sinks(q, k, v, sinks, scale, mask, causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          is_causal=mask is None and causal, scale=scale,
                                          enable_gqa=True)  # fmt: skip

"""Paged attention for CPU runs (the "cpu" attention backend): the extension's kernel
(`rust/src/cpu/paged_attention.rs`) for decode and verify steps, the torch backend for everything
else.

A step whose sequences all have at most MAX_NATIVE_QUERY rows, with a float32 cache and float32
queries, attends straight from the paged cache through the block table: no gather into a
padded buffer, no mask, one pass of online softmax per query row. Such a step's plan is also
what the native decoder layers (cpu/decoder.py) run on: `native_plan`. A step that mixes such
rows with longer queries (decode rows with prompt chunks, chunked prefill) splits: the short
rows through the kernel, the long ones through TorchAttentionBackend's path (which this class
inherits), as do prefill-sized steps, models with attention sinks, other dtypes, CUDA-graph
steps (`prepare_graph`) and anything that needs autograd.

Each query row's result depends only on its own query and keys, so a verify step's rows equal
the decode steps' bit for bit (with the native GEMM, so do the logits at batch 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from eaglebatch import _native
from eaglebatch.attention.base import AttentionMetadata, NativeAttentionPlan, write_kv_cache
from eaglebatch.attention.torch_backend import TorchAttentionBackend
from eaglebatch.cpu.tensors import native_ptr

# Query rows per sequence up to which a step runs natively: decode (1), verify (k + 1) and
# short prefills. Above it SDPA's blocked GEMMs are faster than one pass per row.
MAX_NATIVE_QUERY = 16


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, chunk_tokens: int = 4096) -> None:
        super().__init__(chunk_tokens)
        self._native_dtypes = False  # configure: float32 queries and cache

    def configure(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: torch.dtype,
        q_dtype: torch.dtype,
        sm_scale: float | None = None,
        windows: tuple[int, ...] = (),
        layer_heads: tuple[tuple[int, int, int], ...] = (),
        sinks: bool = False,
    ) -> None:
        super().configure(num_qo_heads, num_kv_heads, head_dim, kv_dtype, q_dtype, sm_scale,
                          windows, layer_heads, sinks)  # fmt: skip
        # the native kernel attends to every earlier key with one head shape and no sinks:
        # windowed models, models whose layers differ in heads and models with attention
        # sinks run torch's path (no step of theirs is ever planned for the kernel)
        self._native_dtypes = kv_dtype == torch.float32 and q_dtype == torch.float32
        self._native_dtypes &= not windows and len(set(layer_heads)) <= 1 and not sinks

    def prepare(self, meta: AttentionMetadata) -> None:
        if not self._native_dtypes or meta.seq_lens.device.type != "cpu":
            super().prepare(meta)
            return
        cu, lens = (t.numpy() for t in meta.host_lengths())  # int32 [B+1], [B]
        q_lens = np.diff(cu)  # [B]
        short = q_lens <= MAX_NATIVE_QUERY  # [B]
        if short.all():
            meta.backend_state = self._native(cu, lens, meta.block_tables.numpy())
        elif short.any():
            meta.backend_state = self._split(meta, q_lens, lens, short)
        else:
            super().prepare(meta)

    @staticmethod
    def _native(cu: np.ndarray, lens: np.ndarray, tables: np.ndarray) -> NativeAttentionPlan:
        return NativeAttentionPlan(
            cu_seqlens_q=np.ascontiguousarray(cu, dtype=np.int32),
            seq_lens=np.ascontiguousarray(lens, dtype=np.int32),
            block_tables=np.ascontiguousarray(tables, dtype=np.int32),
            threads=torch.get_num_threads(),
        )

    def _split(self, meta, q_lens: np.ndarray, lens: np.ndarray, short: np.ndarray) -> _SplitPlan:
        """A step of short queries (decode, verify) and long ones (prompt chunks): the short
        rows through the kernel, the long rows through torch's path (its own metadata)."""
        in_short = np.repeat(short, q_lens)  # [T] whether each query token's row is short
        short_tok, long_tok = np.flatnonzero(in_short), np.flatnonzero(~in_short)
        tables = meta.block_tables.numpy()
        native = self._native(np.concatenate(([0], np.cumsum(q_lens[short]))), lens[short],
                              tables[short])
        long_cu = np.concatenate(([0], np.cumsum(q_lens[~short])))
        long_meta = AttentionMetadata.from_numpy(
            long_cu, lens[~short], tables[~short], meta.slot_mapping.numpy()[long_tok],
            meta.block_size, meta.seq_lens.device)
        super().prepare(long_meta)
        return _SplitPlan(native, torch.from_numpy(short_tok), torch.from_numpy(long_tok),
                          long_meta)

    def native_plan(self, meta: AttentionMetadata) -> NativeAttentionPlan | None:
        plan = meta.backend_state
        return plan if isinstance(plan, NativeAttentionPlan) else None

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
        native = isinstance(plan, (NativeAttentionPlan, _SplitPlan))
        if native and sinks is not None:  # the kernel has no sinks: configure keeps them off it
            raise RuntimeError("attention sinks on a step planned for the native kernel: "
                               "configure(sinks=True) was not called")  # fmt: skip
        if native and torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
        ):
            super().prepare(meta)  # the kernel has no backward: torch's path for this step
            native = False
        if not native:
            return super().forward(layer_idx, q, k, v, kv_cache, meta, scale, window, sinks)
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)  # every row's, before any reads it
        if isinstance(plan, NativeAttentionPlan):
            return _attend_native(plan, q, kv_cache, scale)
        out = torch.empty_like(q)
        out[plan.short_tokens] = _attend_native(plan.native, q[plan.short_tokens], kv_cache,
                                                scale)
        long = plan.long_tokens
        out[long] = super().forward(layer_idx, q[long], k[long], v[long], kv_cache,
                                    plan.long_meta, scale, window)
        return out


@dataclass(frozen=True)
class _SplitPlan:
    """A mixed step (CpuAttentionBackend._split): the short-query rows' kernel plan and the
    long-query rows' torch metadata, each over its own query tokens."""

    native: NativeAttentionPlan
    short_tokens: torch.Tensor  # int64 [Ts] the short rows' query tokens, in order
    long_tokens: torch.Tensor  # int64 [Tl]
    long_meta: AttentionMetadata


def _attend_native(plan: NativeAttentionPlan, q: torch.Tensor, kv_cache: torch.Tensor,
                   scale: float) -> torch.Tensor:  # [T, Hq, D]
    """The kernel over queries q [T, Hq, D] whose K/V are already in the cache."""
    t, num_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    q = q.contiguous()
    q_ptr = native_ptr(q, torch.float32, (t, num_heads, head_dim))
    cache_shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache_ptr = native_ptr(kv_cache, torch.float32, cache_shape)
    out = torch.empty_like(q)
    # the Rust side checks every index before reading
    _native.paged_attention(
        q_ptr, cache_ptr, native_ptr(out, torch.float32, (t, num_heads, head_dim)), t,
        plan.cu_seqlens_q, plan.seq_lens, plan.block_tables,
        num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, plan.threads,
    )  # fmt: skip
    return out

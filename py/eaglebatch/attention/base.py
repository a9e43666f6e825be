"""The paged-KV attention contract shared by every backend.

Vocabulary (as in vLLM): a step packs B sequences' query tokens into T rows, no padding.
Sequence i owns rows cu_seqlens_q[i] : cu_seqlens_q[i+1] (q_i of them) and, after this step, has
k_i = seq_lens[i] tokens of context. Its queries are the LAST q_i tokens of that context, so query
row j of sequence i sits at absolute position k_i - q_i + j and attends to keys at positions
<= its own. This one rule covers prefill from 0 (q_i == k_i), decode (q_i == 1), speculative
verification and recompute (1 < q_i < k_i).

KV cache layout, one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = K, 1 = V), each layer with its own (num_kv_heads, head_dim) (KVCacheConfig.heads_of);
a layer that shares another's cache (kv_source) holds that layer's tensor, no memory of its own.
The K/V of a sequence's token at position p lives in block
block_tables[i, p // block_size] at offset p % block_size; slot = block * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from eaglebatch.transfer import to_device


class KVCacheConfig(Protocol):
    """What the cache layout reads of a model's config (model/config.py's ModelConfig): a
    structural type, so that this package does not import the model package, which imports it."""

    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    def heads_of(self, layer: int) -> tuple[int, int, int]: ...  # (Hq, Hkv, D)
    def kv_source(self, layer: int) -> int: ...  # the layer whose cache `layer` uses
    def is_linear(self, layer: int) -> bool: ...  # a recurrent layer: no KV cache


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, as tensors on the model's device."""

    cu_seqlens_q: torch.Tensor  # int32 [B+1], cu_seqlens_q[0] == 0, cu_seqlens_q[B] == T
    seq_lens: torch.Tensor  # int32 [B] kv length after this step (context incl. the query)
    block_tables: torch.Tensor  # int32 [B, M] block ids; entries past a row's need are ignored
    slot_mapping: torch.Tensor  # int64 [T] kv slot each query token's K/V is written to
    block_size: int
    max_seqlen_q: int  # max_i q_i
    max_seqlen_k: int  # max_i k_i
    is_prefill: bool  # True iff q_i == k_i for every sequence (all queries start at position 0)
    # Host (CPU) copies of cu_seqlens_q / seq_lens for planning without a device sync; optional.
    cu_seqlens_q_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    # Filled by AttentionBackend.prepare(): whatever the backend precomputes once per step and
    # reuses in every layer (gather indices, masks, planner state).
    backend_state: Any = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def host_lengths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu_seqlens_q [B+1], seq_lens [B]) on the host, for planning: the host copies when
        given (no device sync), else copies of the device tensors."""
        cu = self.cu_seqlens_q if self.cu_seqlens_q_cpu is None else self.cu_seqlens_q_cpu
        lens = self.seq_lens if self.seq_lens_cpu is None else self.seq_lens_cpu
        return cu.cpu(), lens.cpu()

    @classmethod
    def from_numpy(
        cls,
        cu_seqlens_q: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray | torch.Tensor,
        slot_mapping: np.ndarray,
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Builds metadata from host arrays (e.g. a StepPlan's), deriving the max lengths and
        `is_prefill` on the host so that no device synchronisation is ever needed. block_tables
        may already be an int32 [B, M] tensor on `device` (the steps of one speculative round
        share it): it is used as is, not copied."""
        cu = np.asarray(cu_seqlens_q, dtype=np.int32)
        lens = np.asarray(seq_lens, dtype=np.int32)
        q_lens = cu[1:] - cu[:-1]
        if len(lens) == 0 or (q_lens <= 0).any() or (q_lens > lens).any():
            raise ValueError("every sequence needs 1 <= q_i <= seq_lens[i]")
        if np.ndim(block_tables) != 2 or len(block_tables) != len(lens):
            raise ValueError("block_tables must be [num_seqs, max_blocks]")
        if len(slot_mapping) != cu[-1] or cu[0] != 0:
            raise ValueError("slot_mapping must have cu_seqlens_q[-1] entries, cu_seqlens_q[0] = 0")
        device = torch.device(device)

        def put(t: torch.Tensor) -> torch.Tensor:  # a host tensor on `device` (CPU: itself)
            return t if device.type == "cpu" else to_device(t.numpy(), device)

        def host(a: np.ndarray, dtype: type) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))

        if isinstance(block_tables, torch.Tensor):
            if block_tables.dtype != torch.int32 or block_tables.device.type != device.type:
                raise ValueError(f"block_tables must be int32 on {device}")
        else:
            block_tables = put(host(block_tables, np.int32))
        cu_cpu = torch.from_numpy(cu.copy())
        lens_cpu = torch.from_numpy(lens.copy())
        return cls(
            cu_seqlens_q=put(cu_cpu),
            seq_lens=put(lens_cpu),
            block_tables=block_tables,
            slot_mapping=put(host(slot_mapping, np.int64)),
            block_size=int(block_size),
            max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=int(lens.max()),
            is_prefill=bool((q_lens == lens).all()),
            cu_seqlens_q_cpu=cu_cpu,
            seq_lens_cpu=lens_cpu,
        )


@dataclass
class NativeAttentionPlan:
    """A step planned for the extension's CPU kernels (paged attention, and the native decoder
    layers that run it, eaglebatch/cpu): host index arrays, made once per step."""

    cu_seqlens_q: np.ndarray  # int32 [B+1]
    seq_lens: np.ndarray  # int32 [B]
    block_tables: np.ndarray  # int32 [B, M], C-contiguous
    threads: int


class AttentionBackend:
    """Paged attention. `prepare` runs once per step outside any CUDA graph; `forward` runs once
    per layer and must not synchronise with the host.

    CUDA graphs (see eaglebatch/graphs.py) replay UNIFORM steps: num_seqs rows of exactly q_len
    query tokens each, with block_tables [num_seqs, max_blocks] and every metadata tensor a
    persistent buffer whose contents change between replays but whose shape and address do not.
    A backend that can run such a step inside a graph sets `supports_cuda_graphs` and implements
    `make_graph_state` / `prepare_graph`; the graph runner asks this flag (no allow-list)."""

    name: str = "base"
    supports_cuda_graphs: bool = False

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
        """The head config of the attention this backend serves; the model calls it once, when
        it is built, so that planning (prepare, prepare_graph) can happen before any forward.
        `windows`: the sliding windows of the model's windowed layers (Gemma 3), each passed
        to `forward` as `window`. `layer_heads`: every layer's (Hq, Hkv, D) when they are not
        all the same (Gemma 4), else empty: q, k, v and the cache of a layer have its shape.
        `sinks`: the layers pass attention sinks to `forward` (gpt-oss); a backend that cannot
        attend with them refuses here. Backends that do not plan per head config ignore
        windows and head shapes."""

    def prepare(self, meta: AttentionMetadata) -> None:
        """Precomputes `meta.backend_state` for this step; called before the model's forward."""
        raise NotImplementedError

    def native_plan(self, meta: AttentionMetadata) -> NativeAttentionPlan | None:
        """The step's plan when `prepare` planned it for the extension's CPU kernels (then the
        native decoder layers may run it, eaglebatch/cpu/decoder.py), else None: the step runs
        on torch's layers. Only the "cpu" backend plans such steps."""
        return None

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
        """Writes k, v into `kv_cache` at `meta.slot_mapping`, then attends; with a `window`, a
        query at position p sees only the keys at positions > p - window (the last `window`,
        itself included), as transformers' sliding-window mask. With `sinks`, head h's softmax
        has one more logit, sinks[h], in its denominator (no value: the weights of the keys sum
        to less than 1)."""
        raise NotImplementedError

    def make_graph_state(
        self, num_seqs: int, q_len: int, max_blocks: int, device: torch.device
    ) -> Any:
        """Persistent state for one captured uniform step shape (called once, before capture)."""
        raise NotImplementedError(f"attention backend {self.name!r} does not support CUDA graphs")

    def prepare_graph(self, meta: AttentionMetadata, state: Any) -> None:
        """`prepare` for a uniform step replayed from a graph: updates `state` IN PLACE (the graph
        holds its addresses; never reallocate) from `meta`'s buffers and host copies, and sets
        meta.backend_state = state. Runs outside the graph, before capture and every replay."""
        raise NotImplementedError(f"attention backend {self.name!r} does not support CUDA graphs")


def write_kv_cache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64 [T], every entry a valid slot
) -> None:
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_blocks * block_size, Hkv, D]
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def kv_layer_bytes_per_block(kv_heads: int, head_dim: int, block_size: int,
                             dtype: torch.dtype) -> int:  # fmt: skip
    """Bytes one block of one layer's cache takes (K and V)."""
    return 2 * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_cache_bytes_per_block(cfg: KVCacheConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V); layers that share another's cache
    and recurrent (linear-attention) layers take none."""
    owners = [i for i in range(cfg.num_hidden_layers)
              if cfg.kv_source(i) == i and not cfg.is_linear(i)]  # fmt: skip
    return sum(kv_layer_bytes_per_block(*cfg.heads_of(i)[1:], block_size, dtype) for i in owners)


def allocate_kv_cache(
    cfg: KVCacheConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, Hkv, D] tensor per layer, of the layer's own
    (Hkv, D); a layer that shares an earlier layer's cache gets that layer's tensor; a
    recurrent layer an empty [2, num_blocks, block_size, 0, D] one (it has no KV: its state is
    model/recurrent_state.py's), so that whatever walks the caches needs no special case."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
    caches: list[torch.Tensor] = []
    for i in range(cfg.num_hidden_layers):
        source = cfg.kv_source(i)
        if source != i:
            caches.append(caches[source])  # source < i (ModelConfig)
            continue
        kv_heads, dim = cfg.heads_of(i)[1:]
        shape = (2, num_blocks, block_size, 0 if cfg.is_linear(i) else kv_heads, dim)
        caches.append(torch.zeros(shape, dtype=dtype, device=device))
    return caches


def copy_blocks(caches: list[torch.Tensor], copies: np.ndarray) -> None:
    """Copies whole KV blocks in every cache [2, num_blocks, block_size, Hkv, D]: copies is
    int32 [C, 2] of (src, dst) block ids (a plan's `block_copies`); dst blocks are distinct
    and no dst is a src. A cache listed twice (layers sharing one) is copied once."""
    if len(copies) == 0:
        return
    caches = list({id(c): c for c in caches}.values())
    device = caches[0].device
    src = to_device(copies[:, 0], device, np.int64)  # [C]
    dst = to_device(copies[:, 1], device, np.int64)  # [C]
    for cache in caches:
        cache.index_copy_(1, dst, cache.index_select(1, src))

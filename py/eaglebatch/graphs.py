"""CUDA graphs for uniform steps: every row has the same number of query tokens.

A graph replays fixed kernels on fixed addresses, so a captured step reads its inputs from
persistent buffers and writes its outputs to tensors the graph owns:

  * batch sizes are padded up to a capture bucket (`capture_sizes`: 1, 2, 4, 8, then steps of 8
    up to max_batch_size); a batch above the largest bucket runs eagerly;
  * `StaticMeta` holds the attention metadata buffers of up to `max_seqs` rows of `q_len` tokens.
    `fill` writes the real rows and turns rows b..bp-1 into PADDING rows: context q_len, every
    block-table entry and slot on the pad block (one extra KV block the scheduler never hands
    out), so padding writes only there and reads only there, and its outputs are sliced away;
  * the backend's per-step planning runs outside the graph (`AttentionBackend.prepare_graph`),
    updating its persistent state in place before every replay;
  * `CapturedStep` is one step function over those buffers, captured as a graph (mode "cuda") or
    run eagerly on the same buffers (mode "eager": the CPU tests run every graph step this way).

All graphs of a worker share one memory pool; they are captured largest bucket first, and the
pool's size is reported (it is reserved out of the KV budget before the cache is allocated).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from eaglebatch.attention.base import AttentionMetadata
from eaglebatch.transfer import copy_into

GRAPH_MODES = ("off", "eager", "cuda")


def capture_sizes(max_batch_size: int) -> list[int]:
    """Padded batch sizes that get a graph: 1, 2, 4, 8, 16, 24, ... and max_batch_size."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch_size}
    sizes.update(range(16, max_batch_size + 1, 8))
    sizes.add(max_batch_size)
    return sorted(sizes)


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest size >= num_seqs, or None (run eagerly) if num_seqs exceeds them all."""
    for s in sizes:
        if s >= num_seqs:
            return s
    return None


class StaticMeta:
    """Persistent uniform-step metadata for up to `max_seqs` rows of `q_len` query tokens."""

    def __init__(
        self,
        max_seqs: int,
        q_len: int,
        max_blocks: int,
        block_size: int,
        pad_block: int,
        device: torch.device,
    ) -> None:
        self.max_seqs, self.q_len, self.max_blocks = max_seqs, q_len, max_blocks
        self.block_size, self.pad_block, self.device = block_size, pad_block, device
        cu = torch.arange(max_seqs + 1, dtype=torch.int32) * q_len
        self.cu_seqlens_q_cpu = cu  # constant: row i owns tokens i*q .. i*q+q-1
        self.cu_seqlens_q = cu.to(device)
        self.seq_lens_cpu = torch.full((max_seqs,), q_len, dtype=torch.int32)
        self.seq_lens = self.seq_lens_cpu.to(device)  # int32 [max_seqs]
        self.block_tables = torch.full(
            (max_seqs, max_blocks), pad_block, dtype=torch.int32, device=device
        )
        self.pad_slots = pad_block * block_size + np.arange(q_len) % block_size  # [q]
        self.slot_mapping = torch.from_numpy(np.tile(self.pad_slots, max_seqs)).to(device)
        self._views: dict[int, AttentionMetadata] = {}
        # host staging for one copy per buffer per step
        self._tables = np.full((max_seqs, max_blocks), pad_block, dtype=np.int32)

    def view(self, bp: int) -> AttentionMetadata:
        """Metadata over the first `bp` rows; the same object (and addresses) on every call."""
        if bp not in self._views:
            self._views[bp] = AttentionMetadata(
                cu_seqlens_q=self.cu_seqlens_q[: bp + 1],
                seq_lens=self.seq_lens[:bp],
                block_tables=self.block_tables[:bp],
                slot_mapping=self.slot_mapping[: bp * self.q_len],
                block_size=self.block_size,
                max_seqlen_q=self.q_len,
                max_seqlen_k=self.max_blocks * self.block_size,
                is_prefill=False,
                cu_seqlens_q_cpu=self.cu_seqlens_q_cpu[: bp + 1],
                seq_lens_cpu=self.seq_lens_cpu[:bp],
            )
        return self._views[bp]

    def fill(
        self,
        bp: int,
        seq_lens: np.ndarray,  # [b] context incl. the query
        block_tables: np.ndarray,  # [b, w] with w <= max_blocks
        slot_mapping: np.ndarray,  # [b * q_len]
    ) -> AttentionMetadata:
        """Writes b real rows and bp - b padding rows; returns view(bp)."""
        b = len(seq_lens)
        if not 0 < b <= bp <= self.max_seqs:
            raise ValueError(f"{b} rows do not fit bucket {bp} (max {self.max_seqs})")
        w = block_tables.shape[1]
        if w > self.max_blocks:
            raise ValueError(f"block tables of {w} columns exceed the graphs' {self.max_blocks}")
        lens = self.seq_lens_cpu.numpy()
        lens[:b] = seq_lens
        lens[b:bp] = self.q_len
        copy_into(self.seq_lens[:bp], self.seq_lens_cpu[:bp])
        tables = self._tables
        tables[:bp] = self.pad_block
        tables[:b, :w] = block_tables
        copy_into(self.block_tables[:bp], tables[:bp])
        slots = np.empty((bp, self.q_len), dtype=np.int64)
        slots[:b] = np.asarray(slot_mapping).reshape(b, self.q_len)
        slots[b:] = self.pad_slots
        copy_into(self.slot_mapping[: bp * self.q_len], slots.reshape(-1))
        return self.view(bp)


def fill_rows(buf: torch.Tensor, values: np.ndarray | torch.Tensor, bp_rows: int) -> None:
    """buf[:n] = values, buf[n:bp_rows] = 0 (padding rows: token 0, position 0, ...)."""
    n = len(values)
    copy_into(buf[:n], values)
    if bp_rows > n:
        buf[n:bp_rows].zero_()


class CapturedStep:
    """`fn()` reads persistent inputs and returns tensors; "cuda" captures it once (after two
    warm-up runs on a side stream) and replays the graph, "eager" just calls it."""

    def __init__(self, fn: Callable[[], object], mode: str, pool=None) -> None:
        self.fn, self.mode = fn, mode
        self.graph = None
        self.out = None
        if mode == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy inits, autotuning, allocator growth
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.out = fn()

    def __call__(self):
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


@dataclass
class GraphStats:
    """What the run summary reports about graphs."""

    mode: str = "off"
    sizes: list[int] = field(default_factory=list)
    graphs: int = 0
    capture_s: float = 0.0
    memory_bytes: int = 0  # the shared pool after capture (CUDA)
    reserved_bytes: int = 0  # what the KV budget set aside for it
    replays: int = 0  # steps run through a captured step
    eager_steps: int = 0  # uniform steps too large for any bucket, run eagerly

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "sizes": self.sizes,
            "graphs": self.graphs,
            "capture_s": round(self.capture_s, 3),
            "memory_mib": round(self.memory_bytes / 2**20, 1),
            "reserved_mib": round(self.reserved_bytes / 2**20, 1),
            "replays": self.replays,
            "eager_steps": self.eager_steps,
        }


class GraphPool:
    """The shared memory pool and the capture bookkeeping of one worker."""

    def __init__(self, mode: str, sizes: list[int], device: torch.device) -> None:
        if mode not in GRAPH_MODES:
            raise ValueError(f"graph mode {mode!r} not in {GRAPH_MODES}")
        if mode == "cuda" and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.mode, self.sizes, self.device = mode, sizes, device
        self.pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.stats = GraphStats(mode=mode, sizes=list(sizes))
        self._t0 = 0.0
        self._mem0 = 0

    def __enter__(self) -> GraphPool:
        self._t0 = time.perf_counter()
        if self.mode == "cuda":
            # cached-but-free blocks would skew the difference: torch.cuda.graph() empties the
            # cache itself, so without this the pool could even come out negative
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self._mem0 = torch.cuda.memory_reserved(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.mode == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the warm-up runs' activations; the graphs' pool stays
            self.stats.memory_bytes += torch.cuda.memory_reserved(self.device) - self._mem0
        self.stats.capture_s += time.perf_counter() - self._t0

    def capture(self, fn: Callable[[], object]) -> CapturedStep:
        self.stats.graphs += 1
        return CapturedStep(fn, self.mode, self.pool)


def graph_reserve_bytes(cfg, rows: int, q_len: int, max_model_len: int, itemsize: int) -> int:
    """A bound on the graph pool: the largest captured step's live activations for `rows`
    sequences of `q_len` tokens (a few layer-wide intermediates, and the torch backend's per-row
    K/V gather, mask and scores over max_model_len keys), times two for the allocator's rounding
    and the warm-up buffers, plus every graph's output (hidden states, at most [rows * q_len,
    H] per bucket and draft length: bounded by 16x the largest). Logits are computed outside the
    graphs. Routed MLPs (moe.py's grouped GEMMs) hold each token's k expert rows at once:
    their gathered inputs, gate/up, activation and outputs (moe_grouped.grouped_experts)."""
    t = rows * q_len
    h, k = cfg.hidden_size, cfg.num_experts_per_tok if cfg.num_experts else 0
    layer = t * max(3 * cfg.intermediate_size + 8 * h,
                    k * (3 * cfg.moe_intermediate_size + 4 * h) + 2 * h) * itemsize
    keys = rows * max_model_len
    kv_width = max(hkv * d for _, hkv, d in map(cfg.heads_of, range(cfg.num_hidden_layers)))
    attn = keys * (2 * kv_width * itemsize
                   + q_len * (cfg.num_attention_heads * 4 + 1))
    outputs = 16 * t * cfg.hidden_size * itemsize
    return 2 * (layer + attn) + outputs + (64 << 20)

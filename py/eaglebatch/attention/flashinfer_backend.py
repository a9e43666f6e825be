"""Paged attention with FlashInfer's paged-KV wrappers (CUDA only; flashinfer-python 0.5/0.6 API:
`Batch{Decode,Prefill}WithPagedKVCacheWrapper(...).plan(...)` once per step, `.run(q, (k, v))` per
layer).

Design
  * Head config (num_qo_heads, num_kv_heads, head_dim, q/kv dtypes, softmax scale) is needed by
    plan() but prepare() never sees q. The models pass it to `configure(...)` when they are
    built (AttentionBackend.configure), so prepare()/prepare_graph() plan right away. A backend
    used without a model learns it from the first forward() of the first step, which then plans
    (outside any graph capture; see below); a forward() whose q/KV differ re-plans.
  * One step = one plan, then `run` per layer with that plan (the model calls forward() for every
    layer with the same metadata). A step with every q_i == 1 uses the decode wrapper (if the
    GQA group size has decode kernels), any other step the prefill wrapper with causal=True.
    FlashInfer's causal mask is bottom-right aligned (query row j of a sequence with qo_len q and
    kv_len k sees keys <= k - q + j; prefill.cuh masks `kv_idx + qo_len > kv_len + q_idx`),
    which is exactly base.py's rule.
  * KV cache [2, num_blocks, block_size, Hkv, D]: kv_cache[0] / kv_cache[1] are contiguous
    "NHD" paged caches [num_pages, page_size, Hkv, D], passed as the (k_cache, v_cache) tuple.
  * No device sync: page indptr / last_page_len / qo_indptr are built on the host from the host
    copies of the lengths (paged_layout.py); page indices are gathered on the device from
    block_tables. plan() then only does asynchronous host-to-device copies.
  * plan() stages its schedule in a pinned host buffer per wrapper and copies it to the device
    asynchronously; re-planning the same wrapper before that copy ran would corrupt it. So eager
    steps alternate between two wrappers per kind, and each wrapper records an event after its
    plan and waits for it before its next plan (it only waits when the host is two steps ahead
    of the GPU). That wait is in prepare(); forward() plans (and so might wait) only when the
    step was not planned yet: the very first step, before the head config is known.
  * Each wrapper holds an int workspace on the device plus a pinned-host twin: FlashInfer's
    8 MiB for the four eager wrappers, `graph_int_kib` (1 MiB) for each graph state's.
  * One zeroed float workspace (default 128 MiB) per backend instance, shared by all its wrappers
    and graph states: it is scratch within a run, and runs of one instance are stream-ordered.
    The target model and the draft head own separate instances (and workspaces).
  * CUDA graphs: make_graph_state() makes a wrapper with use_cuda_graph=True over fixed buffers
    (indptr [S+1], indices [S*M], last_page_len [S], qo_indptr [S+1]); prepare_graph() re-plans
    into them before capture and before every replay. Capture needs a plan: the head config must
    be known (configure(), or any forward() before, e.g. the usual eager warm-up run after
    prepare_graph()); forward() refuses to plan while a graph is being captured.
  * Sliding-window layers (Gemma 3, `configure(windows=...)`): a plan fixes the window, so a
    step has one wrapper per attention kind: full attention (key None) and each window w, planned
    with window_left = w - 1 (FlashInfer keeps keys >= position - window_left, i.e. the last w,
    the query's own included: base.py's rule). Each kind alternates its own two wrappers; a graph
    state holds one graph wrapper per kind over its own fixed buffers.
  * Queries must be float16/bfloat16 (FlashInfer has no float32 kernels).
  * Attention sinks (gpt-oss) are refused in configure(): the engine's `auto` picks the torch
    backend for such models (job/engine_settings.py resolve_backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from eaglebatch.attention.base import AttentionBackend, AttentionMetadata, write_kv_cache
from eaglebatch.attention.paged_layout import PagedLayout, gather_page_indices, paged_layout

try:
    import flashinfer
except ImportError as e:  # the registry reports this message for get_backend("flashinfer")
    raise ImportError(
        "flashinfer is not installed: pip install 'eaglebatch[flashinfer]' (flashinfer-python; "
        f"needs a CUDA GPU, and nvcc for its JIT-compiled kernels) [{e}]"
    ) from e

# GQA group sizes (query heads per kv head) that FlashInfer's CUDA-core decode kernels are built
# for (DISPATCH_GQA_GROUP_SIZE in include/flashinfer/utils.cuh); decode steps of other models run
# through the prefill wrapper (q_len 1, causal), which takes any group size.
_DECODE_GROUP_SIZES = (1, 2, 3, 4, 8)


class _Heads(NamedTuple):
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    sm_scale: float


@dataclass
class _Slot:
    """A wrapper and what was last planned into it."""

    wrapper: Any  # flashinfer Batch{Decode,Prefill}WithPagedKVCacheWrapper
    decode: bool
    event: torch.cuda.Event | None = None  # recorded after the last plan's copies
    step: _Step | None = None  # the step whose plan the wrapper holds


Kind = int | None  # the attention of a layer: None = full, w = sliding window of w keys


@dataclass(eq=False)
class _Step:
    """meta.backend_state: one step's layout and its wrapper per attention kind (identity
    matters, not equality)."""

    slots: dict[Kind, _Slot]
    block_size: int
    qo_indptr: torch.Tensor | None = None  # int32 [B+1] host
    layout: PagedLayout | None = None
    indices: torch.Tensor | None = None  # int32 [num_pages] device
    heads: _Heads | None = None  # the config the slots' wrappers were planned with for this step


@dataclass(eq=False)
class _GraphState(_Step):
    """Persistent per captured shape; each of its slots' wrappers owns fixed-address buffers."""

    num_seqs: int = 0
    q_len: int = 0
    max_blocks: int = 0


def _require_cuda(meta: AttentionMetadata) -> None:
    if meta.seq_lens.device.type != "cuda":
        raise ValueError("the flashinfer attention backend runs on CUDA devices only")


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graphs = True

    def __init__(
        self, workspace_mib: int = 128, prefill_backend: str = "fa2", graph_int_kib: int = 1024
    ) -> None:
        """`prefill_backend`: FlashInfer's prefill implementation ("fa2", "fa3" or "auto", which
        picks fa3 on Hopper); fa2 is the widest-tested path and the quickest to JIT-compile.
        `graph_int_kib`: the int workspace of each graph state's wrapper, instead of FlashInfer's
        8 MiB: a plan stores a few int32 per CTA tile and per query row (tens of KiB for graph
        steps; scheduler.cuh); one that does not fit fails in plan() with an error."""
        self.workspace_bytes = workspace_mib * 2**20
        self.graph_int_bytes = graph_int_kib * 2**10
        self.prefill_backend = prefill_backend
        self._heads: _Heads | None = None
        self._kinds: tuple[Kind, ...] = (None,)  # configure: full attention + each window
        self._workspace: torch.Tensor | None = None
        self._slots: dict[tuple[bool, Kind], list[_Slot]] = {}  # (decode?, kind) -> 2 wrappers
        self._turn: dict[tuple[bool, Kind], int] = {}  # steps so far per (decode?, kind)

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
        """The head config (the models call this when built), so prepare() can plan before the
        first forward(); `windows`: the sliding windows its layers pass to forward(). One plan
        serves every layer: layers of different head shapes (`layer_heads`) are refused, and so
        are attention sinks (`sinks`: the wrappers this backend plans take none)."""
        if sinks:
            raise ValueError("attention backend 'flashinfer' does not attend with attention sinks "
                             "(gpt-oss); use engine.attention_backend=torch")  # fmt: skip
        if len(set(layer_heads)) > 1:
            raise ValueError(
                "attention backend 'flashinfer' plans one head shape for every layer, and this "
                f"model's layers have several (query heads, KV heads, head dim): "
                f"{sorted(set(layer_heads))}; use engine.attention_backend=torch"
            )
        if any(w < 1 for w in windows):
            raise ValueError(f"sliding windows must be >= 1 key, got {windows}")
        scale = head_dim**-0.5 if sm_scale is None else float(sm_scale)
        self._heads = _Heads(num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, scale)
        self._kinds = (None, *sorted(set(windows)))

    # ---- planning (outside forward and outside graphs) ----------------------------------------

    def prepare(self, meta: AttentionMetadata) -> None:
        _require_cuda(meta)
        decode = self._use_decode(meta.max_seqlen_q)
        device = meta.seq_lens.device
        step = _Step({kind: self._next_slot(decode, kind, device) for kind in self._kinds},
                     meta.block_size)  # fmt: skip
        self._lay_out(step, meta)
        meta.backend_state = step
        if self._heads is not None:
            self._plan(step, self._heads)

    def make_graph_state(
        self, num_seqs: int, q_len: int, max_blocks: int, device: torch.device
    ) -> _GraphState:
        decode = self._use_decode(q_len)
        slots = {k: self._graph_slot(decode, num_seqs, q_len, max_blocks, device)
                 for k in self._kinds}  # fmt: skip
        return _GraphState(slots, 0, num_seqs=num_seqs, q_len=q_len, max_blocks=max_blocks)

    def _graph_slot(
        self, decode: bool, num_seqs: int, q_len: int, max_blocks: int, device: torch.device
    ) -> _Slot:
        """A use_cuda_graph wrapper over its own fixed buffers (indptr [S+1], indices [S*M],
        last_page_len [S], and qo_indptr [S+1] for prefill)."""
        i32 = {"dtype": torch.int32, "device": device}
        indptr = torch.zeros(num_seqs + 1, **i32)
        indices = torch.zeros(num_seqs * max_blocks, **i32)
        last = torch.ones(num_seqs, **i32)
        if decode:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace_for(device),
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last,
            )
        else:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace_for(device),
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=torch.arange(0, (num_seqs + 1) * q_len, q_len, **i32),
                paged_kv_indptr_buf=indptr,
                paged_kv_indices_buf=indices,
                paged_kv_last_page_len_buf=last,
                backend=self.prefill_backend,
            )
        # a small int workspace: the spec decoder captures dozens of states per bucket
        int_ws = torch.empty(self.graph_int_bytes, dtype=torch.uint8, device=device)
        wrapper.reset_workspace_buffer(self._workspace_for(device), int_ws)
        return _Slot(wrapper, decode)

    def prepare_graph(self, meta: AttentionMetadata, state: _GraphState) -> None:
        _require_cuda(meta)
        if meta.num_seqs != state.num_seqs or meta.block_tables.shape[1] > state.max_blocks:
            raise ValueError(
                f"step of {meta.num_seqs} sequences x {meta.block_tables.shape[1]} blocks does "
                f"not fit the graph's {state.num_seqs} x {state.max_blocks}"
            )
        state.block_size = meta.block_size
        self._lay_out(state, meta)
        q_lens = state.qo_indptr[1:] - state.qo_indptr[:-1]
        if not bool((q_lens == state.q_len).all()):
            raise ValueError(f"a graph step needs exactly {state.q_len} queries per sequence")
        meta.backend_state = state
        if self._heads is not None:
            self._plan(state, self._heads)

    def _lay_out(self, step: _Step, meta: AttentionMetadata) -> None:
        """Host layout + device page indices for `meta`; forgets any plan made for `step`."""
        cu, lens = meta.host_lengths()
        step.qo_indptr = cu.to(torch.int32)
        step.layout = paged_layout(lens.numpy(), meta.block_size, meta.block_tables.shape[1])
        step.indices = gather_page_indices(meta.block_tables, step.layout.gather)
        step.heads = None

    def _plan(self, step: _Step, heads: _Heads) -> None:
        """Plans every attention kind of `step` for `heads`."""
        if heads.q_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"flashinfer attention needs float16/bfloat16 queries, got {heads.q_dtype}; "
                "use dtype bfloat16 or the torch attention backend"
            )
        decode = next(iter(step.slots.values())).decode
        if decode and not self._use_decode(1, heads):
            if isinstance(step, _GraphState):
                raise ValueError(
                    f"flashinfer decode kernels have no {heads.num_qo_heads // heads.num_kv_heads}"
                    "-query-head groups: call configure() before make_graph_state()"
                )
            device = step.indices.device  # first step only: its kind was guessed
            step.slots = {kind: self._next_slot(False, kind, device) for kind in step.slots}
        for kind, slot in step.slots.items():
            self._plan_slot(step, slot, heads, -1 if kind is None else kind - 1)
        step.heads = heads

    def _plan_slot(self, step: _Step, slot: _Slot, heads: _Heads, window_left: int) -> None:
        lay = step.layout
        assert lay is not None and step.indices is not None and step.qo_indptr is not None
        if slot.event is not None:
            slot.event.synchronize()  # the previous plan's pinned staging buffer was consumed
        dims = (heads.num_qo_heads, heads.num_kv_heads, heads.head_dim, step.block_size)
        kw = {
            "sm_scale": heads.sm_scale,
            "q_data_type": heads.q_dtype,
            "kv_data_type": heads.kv_dtype,
            "window_left": window_left,
        }
        if slot.decode:
            slot.wrapper.plan(lay.indptr, step.indices, lay.last_page_len, *dims, **kw)
        else:
            qo, last = step.qo_indptr, lay.last_page_len
            slot.wrapper.plan(qo, lay.indptr, step.indices, last, *dims, causal=True, **kw)
        if slot.event is None:
            slot.event = torch.cuda.Event()
        slot.event.record()
        slot.step = step

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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        step = meta.backend_state
        if not isinstance(step, _Step):
            raise RuntimeError("FlashInferAttentionBackend.prepare(meta) was not called")
        if sinks is not None:
            raise ValueError("attention backend 'flashinfer' does not attend with attention sinks")
        if window not in step.slots:
            raise ValueError(f"window {window} was not configured (configure(windows=...))")
        heads = _Heads(q.shape[1], kv_cache.shape[3], q.shape[2], q.dtype, kv_cache.dtype, scale)
        slot = step.slots[window]
        if slot.step is not step or step.heads != heads:  # first layer of a lazy step
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "flashinfer: no plan for this graph step; call configure() or run the step "
                    "once eagerly after prepare_graph() before capturing"
                )
            self._heads = heads
            self._plan(step, heads)
            slot = step.slots[window]
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        # kv_cache[0] / [1]: K / V as NHD paged caches [num_pages, page_size, Hkv, D]
        return slot.wrapper.run(q, (kv_cache[0], kv_cache[1]), out=q.new_empty(q.shape))

    # ---- helpers ------------------------------------------------------------------------------

    def _workspace_for(self, device: torch.device | str) -> torch.Tensor:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        ws = self._workspace
        if ws is None or ws.device != device:
            ws = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
            self._workspace = ws
        return ws

    def _use_decode(self, q_len: int, heads: _Heads | None = None) -> bool:
        """Decode wrapper for q_len == 1 unless the GQA group size has no decode kernel."""
        heads = heads or self._heads
        group = None if heads is None else heads.num_qo_heads // heads.num_kv_heads
        return q_len == 1 and (group is None or group in _DECODE_GROUP_SIZES)

    def _next_slot(self, decode: bool, kind: Kind, device: torch.device) -> _Slot:
        """The eager wrapper for the next step of a (decode?, kind): two each, created on first
        use and then alternated (see the pinned staging buffer above)."""
        key = (decode, kind)
        slots = self._slots.setdefault(key, [])
        if len(slots) < 2:
            ws = self._workspace_for(device)
            if decode:
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
            else:
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    ws, "NHD", backend=self.prefill_backend
                )
            slots.append(_Slot(wrapper, decode))
        turn = self._turn.get(key, 0)
        self._turn[key] = turn + 1
        return slots[turn % len(slots)]

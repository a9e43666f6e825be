"""The flashinfer attention backend.

On CPU: the install hint when flashinfer is missing, the page layout helper, and the backend's
planning/graph plumbing against a FAKE flashinfer module whose wrappers implement FlashInfer's
documented paged-KV semantics (CSR pages, bottom-right causal mask) in plain torch. With a GPU and
flashinfer: the real kernels against the torch backend, eagerly and replayed from a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch

from eaglebatch.attention import get_backend
from eaglebatch.attention.base import AttentionMetadata
from eaglebatch.attention.paged_layout import gather_page_indices, paged_layout
from eaglebatch.attention.torch_backend import TorchAttentionBackend
from paged_kv import PagedSequences

MODULE = "eaglebatch.attention.flashinfer_backend"
HQ, HKV, D = 4, 2, 64
SCALE = 0.7 / math.sqrt(D)  # not the default 1 / sqrt(D): plan() must be given it


def _has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


GPU = torch.cuda.is_available() and _has_flashinfer()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and flashinfer")


# ---- without flashinfer ---------------------------------------------------------------------


def test_missing_flashinfer_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    with pytest.raises(ImportError) as info:
        get_backend("flashinfer")
    message = str(info.value)
    assert "flashinfer" in message and "pip install 'eaglebatch[flashinfer]'" in message


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_layout_matches_a_plain_loop(block_size: int) -> None:
    rng = np.random.default_rng(block_size)
    lens = rng.integers(1, 70, size=7)
    width = int(-(-lens.max() // block_size)) + 2  # block tables wider than needed
    tables = rng.permutation(7 * width).reshape(7, width).astype(np.int32)
    lay = paged_layout(torch.from_numpy(lens), block_size, width)
    indices = gather_page_indices(torch.from_numpy(tables), lay.gather)

    indptr, want_indices, last = [0], [], []
    for i, k in enumerate(lens):
        n = (k + block_size - 1) // block_size
        indptr.append(indptr[-1] + n)
        want_indices.extend(tables[i, :n])
        last.append(k - (n - 1) * block_size)
    assert lay.indptr.dtype == lay.last_page_len.dtype == indices.dtype == torch.int32
    assert lay.indptr.tolist() == indptr
    assert indices.tolist() == want_indices
    assert lay.last_page_len.tolist() == last
    assert all(1 <= x <= block_size for x in last) and lay.num_pages == indptr[-1]


def test_paged_layout_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError, match="kv length"):
        paged_layout(np.array([3, 0]), 4, 4)
    with pytest.raises(ValueError, match="blocks"):
        paged_layout(np.array([3, 17]), 4, 4)  # 17 tokens need 5 blocks of 4


# ---- the backend against a fake flashinfer (CPU) --------------------------------------------


def _paged_attention(q, k_cache, v_cache, qo_indptr, indptr, indices, last, scale, causal,
                     window_left=-1):  # fmt: skip
    """FlashInfer's paged attention semantics, in float32: sequence i's pages are
    indices[indptr[i]:indptr[i+1]], its kv length (pages - 1) * page_size + last[i]; causal
    masks are aligned bottom-right (query j of q_len sees keys <= kv_len - q_len + j); with
    window_left >= 0 a query at position p sees keys >= p - window_left only (its docs: "the
    left (inclusive) window size")."""
    page_size, out = k_cache.shape[1], torch.empty_like(q)
    for i in range(len(last)):
        pages = indices[int(indptr[i]) : int(indptr[i + 1])].long()
        kv_len = (len(pages) - 1) * page_size + int(last[i])
        k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:kv_len].float()
        v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:kv_len].float()
        lo, hi = int(qo_indptr[i]), int(qo_indptr[i + 1])
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), k) * scale
        q_pos = torch.arange(kv_len - (hi - lo), kv_len)[:, None]
        key = torch.arange(kv_len)[None, :]
        if causal:
            scores = scores.masked_fill(key > q_pos, float("-inf"))
        if window_left >= 0:
            scores = scores.masked_fill(key < q_pos - window_left, float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


class _FakeWrapper:
    """Plan/run with FlashInfer's signatures; in graph mode plan copies into the fixed buffers
    and run reads only those, like the real wrappers."""

    decode: bool

    def _init(self, workspace, kv_layout, use_cuda_graph, qo, indptr, indices, last) -> None:
        assert workspace.dtype == torch.uint8 and kv_layout == "NHD"
        self.graph = use_cuda_graph
        if use_cuda_graph:
            assert all(torch.is_tensor(t) for t in (indptr, indices, last))
            assert len(indptr) == len(last) + 1
            assert self.decode or len(qo) == len(indptr)
        self.bufs = (qo, indptr, indices, last)
        self.plans = 0

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer) -> None:
        assert int_workspace_buffer.dtype == torch.uint8
        self.int_workspace_bytes = int_workspace_buffer.numel()

    def _plan(self, qo, indptr, indices, last, hq, hkv, d, page, sm_scale, q_dt, kv_dt, causal,
              window_left):  # fmt: skip
        assert qo.device.type == indptr.device.type == last.device.type == "cpu"  # host arrays
        assert indptr.dtype == indices.dtype == last.dtype == qo.dtype == torch.int32
        if self.graph:
            bq, bp, bi, bl = self.bufs
            assert len(last) == len(bl) and len(indices) <= len(bi)
            if bq is not None:
                bq.copy_(qo)
            bp.copy_(indptr)
            bl.copy_(last)
            bi[: len(indices)].copy_(indices)
            qo, indptr, indices, last = bq if bq is not None else qo, bp, bi, bl
        self.cfg = (qo, indptr, indices, last, hq, hkv, d, page, sm_scale, q_dt, kv_dt, causal)
        self.window_left = window_left
        self.plans += 1

    def run(self, q, paged_kv_cache, *, out=None):
        qo, indptr, indices, last, hq, hkv, d, page, scale, q_dt, kv_dt, causal = self.cfg
        k_cache, v_cache = paged_kv_cache
        assert q.dtype == q_dt and k_cache.dtype == kv_dt and q.shape[1:] == (hq, d)
        assert k_cache.shape[1:] == (page, hkv, d) and v_cache.shape == k_cache.shape
        assert q.shape[0] == int(qo[-1])
        scale = 1 / math.sqrt(d) if scale is None else scale
        res = _paged_attention(
            q, k_cache, v_cache, qo, indptr, indices, last, scale, causal, self.window_left
        )
        if out is None:
            return res
        assert out.shape == q.shape and out.dtype == q.dtype
        return out.copy_(res)


class _FakeDecode(_FakeWrapper):
    decode = True

    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
        backend="auto",
    ):
        self._init(
            float_workspace_buffer,
            kv_layout,
            use_cuda_graph,
            None,
            paged_kv_indptr_buffer,
            paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer,
        )

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        *,
        sm_scale=None,
        q_data_type="float16",
        kv_data_type=None,
        window_left=-1,
    ):
        assert num_qo_heads // num_kv_heads in (1, 2, 3, 4, 8)  # FlashInfer's decode kernels
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(
            qo,
            indptr,
            indices,
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            sm_scale,
            q_data_type,
            kv_data_type or q_data_type,
            False,
            window_left,
        )


class _FakePrefill(_FakeWrapper):
    decode = False

    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        qo_indptr_buf=None,
        paged_kv_indptr_buf=None,
        paged_kv_indices_buf=None,
        paged_kv_last_page_len_buf=None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend="auto",
    ):
        self._init(
            float_workspace_buffer,
            kv_layout,
            use_cuda_graph,
            qo_indptr_buf,
            paged_kv_indptr_buf,
            paged_kv_indices_buf,
            paged_kv_last_page_len_buf,
        )

    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        *,
        causal=False,
        sm_scale=None,
        q_data_type="float16",
        kv_data_type=None,
        window_left=-1,
    ):
        self._plan(
            qo_indptr,
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            page_size,
            sm_scale,
            q_data_type,
            kv_data_type or q_data_type,
            causal,
            window_left,
        )


class _FakeEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.fixture
def fake_fi(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The backend module imported against the fake flashinfer, allowed to run on CPU."""
    return _import_against_fake(monkeypatch)


def _import_against_fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = _FakeDecode
    fake.BatchPrefillWithPagedKVCacheWrapper = _FakePrefill
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.delitem(sys.modules, MODULE, raising=False)  # restored at teardown if it was there
    module = importlib.import_module(MODULE)
    # Not through monkeypatch: its undo would put this fake-bound module back into sys.modules,
    # where the real-kernel tests below would then get the fake.
    del sys.modules[MODULE]
    monkeypatch.setattr(module, "_require_cuda", lambda meta: None)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return module


def test_fake_bound_module_does_not_outlive_its_patches() -> None:
    before = sys.modules.get(MODULE)
    with pytest.MonkeyPatch.context() as mp:
        module = _import_against_fake(mp)
    assert sys.modules.get(MODULE) is before and module is not before  # later imports: real


class Harness:
    """Runs steps through `backend` on 2 layers and checks them against the torch backend run on
    float32 copies of the same inputs and caches."""

    def __init__(
        self, backend, device, dtype, block_size=16, layers=2, hq=HQ, tol=None, num_blocks=128,
        windows=None,
    ):  # fmt: skip
        """`windows`: each layer's sliding window (None: full attention), `layers` of None if
        not given; the reference is configured with them."""
        self.backend, self.device, self.dtype = backend, torch.device(device), dtype
        self.hq = hq
        self.windows = list(windows) if windows is not None else [None] * layers
        layers = len(self.windows)
        self.ref = TorchAttentionBackend()
        kinds = tuple(w for w in self.windows if w is not None)
        if kinds:
            self.ref.configure(hq, HKV, D, torch.float32, torch.float32, SCALE, windows=kinds)
        self.seqs = PagedSequences(num_blocks, block_size, seed=block_size)
        gen = torch.Generator(device=self.device).manual_seed(0)
        shape = (2, num_blocks, block_size, HKV, D)
        self.caches = [
            torch.randn(shape, generator=gen, device=self.device).to(dtype) for _ in range(layers)
        ]  # random where not yet written: both backends must ignore it
        self.ref_caches = [c.float() for c in self.caches]
        self.gen = gen
        self.tol = tol or {"atol": 2e-3, "rtol": 2e-3}

    def meta(self, batch: list[tuple[int, int]]) -> AttentionMetadata:
        return self.seqs.step([(s, [0] * n) for s, n in batch], self.device)[2]

    def qkv(self, t: int) -> list[torch.Tensor]:
        shapes = [(t, self.hq, D), (t, HKV, D), (t, HKV, D)]
        return [
            torch.randn(s, generator=self.gen, device=self.device).to(self.dtype) for s in shapes
        ]

    def check(self, meta: AttentionMetadata, outs: list[torch.Tensor], inputs: list) -> None:
        ref_meta = dataclasses.replace(meta, backend_state=None)
        self.ref.prepare(ref_meta)
        for layer, (out, (q, k, v)) in enumerate(zip(outs, inputs)):
            want = self.ref.forward(
                layer, q.float(), k.float(), v.float(), self.ref_caches[layer], ref_meta, SCALE,
                self.windows[layer],
            )  # fmt: skip
            torch.testing.assert_close(out.float(), want, **self.tol)
            torch.testing.assert_close(self.caches[layer].float(), self.ref_caches[layer])

    def run(self, meta: AttentionMetadata) -> None:
        """Every layer (its window) through the backend on `meta`, prepared, then checked."""
        inputs = [self.qkv(meta.num_tokens) for _ in self.caches]
        outs = [
            self.backend.forward(layer, q, k, v, self.caches[layer], meta, SCALE, w)
            for layer, ((q, k, v), w) in enumerate(zip(inputs, self.windows))
        ]
        self.check(meta, outs, inputs)

    def step(self, batch: list[tuple[int, int]]) -> None:
        meta = self.meta(batch)
        self.backend.prepare(meta)
        self.run(meta)

    def graph_meta(self, batch: list[tuple[int, int]], tables: torch.Tensor) -> AttentionMetadata:
        """`batch`'s metadata over `tables`, the graph runner's persistent [S, M] block table."""
        meta = self.meta(batch)
        tables.zero_()
        tables[:, : meta.block_tables.shape[1]] = meta.block_tables
        return dataclasses.replace(meta, block_tables=tables)


STEPS = [
    [(0, 5), (1, 1), (2, 40), (3, 17)],  # prefill, mixed lengths (one of a single token)
    [(0, 1), (1, 1), (2, 1), (3, 1)],  # decode
    [(3, 1), (1, 1)],  # decode, a subset in another order
    [(2, 4), (0, 4), (1, 4), (3, 4)],  # verify: q = 4 on top of a prefix
    [(2, 3), (4, 33), (0, 1)],  # mixed with a new prefill
]


@pytest.mark.parametrize("block_size", [1, 16])
def test_fake_matches_torch_backend(fake_fi: Any, block_size: int) -> None:
    backend = fake_fi.FlashInferAttentionBackend(workspace_mib=1)
    h = Harness(backend, "cpu", torch.float16, block_size=block_size)
    for batch in STEPS:
        h.step(batch)
    # one plan per step (the first lazily in forward, then in prepare), reused by both layers
    plans = sum(s.wrapper.plans for slots in backend._slots.values() for s in slots)
    assert plans == len(STEPS)
    assert all(len(slots) == 2 for slots in backend._slots.values())


# Gemma 3's pattern: local layers of two windows around a global one; steps whose queries reach
# past a window (40-token prefill, verify rows at 44..47, a 33-token prefill) and some that do not
WINDOWED = (5, None, 12)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_fake_sliding_windows_match_torch_backend(fake_fi: Any, block_size: int) -> None:
    backend = fake_fi.FlashInferAttentionBackend(workspace_mib=1)
    backend.configure(HQ, HKV, D, torch.float16, torch.float16, SCALE, windows=(12, 5, 12))
    h = Harness(backend, "cpu", torch.float16, block_size=block_size, windows=WINDOWED)
    for batch in STEPS:
        h.step(batch)
    kinds = {kind for _, kind in backend._slots}
    assert kinds == {None, 5, 12}  # one wrapper pair per kind and step kind, each planned once
    for (_, kind), slots in backend._slots.items():
        assert all(s.wrapper.window_left == (-1 if kind is None else kind - 1) for s in slots)
    assert sum(s.wrapper.plans for slots in backend._slots.values() for s in slots) == 3 * 5
    with pytest.raises(ValueError, match="window 7 was not configured"):
        meta = h.meta([(0, 1)])
        backend.prepare(meta)
        q, k, v = h.qkv(1)
        backend.forward(0, q, k, v, h.caches[0], meta, SCALE, 7)


def test_fake_sliding_window_graph_states(fake_fi: Any) -> None:
    backend = fake_fi.FlashInferAttentionBackend(workspace_mib=1)
    backend.configure(HQ, HKV, D, torch.float16, torch.float16, SCALE, windows=(5, 12))
    h = Harness(backend, "cpu", torch.float16, block_size=4, windows=WINDOWED)
    h.step([(s, 9 + 7 * s) for s in range(3)])
    for q_len in (1, 3):
        state = backend.make_graph_state(3, q_len, 16, torch.device("cpu"))
        assert set(state.slots) == {None, 5, 12}
        buffers = {b.data_ptr() for s in state.slots.values() for b in s.wrapper.bufs[1:]}
        assert len(buffers) == 3 * 3  # each kind's wrapper has its own fixed buffers
        tables = torch.zeros(3, 16, dtype=torch.int32)
        for _ in range(2):
            meta = h.graph_meta([(s, q_len) for s in range(3)], tables)
            backend.prepare_graph(meta, state)
            h.run(meta)


def test_attention_sinks_are_refused_at_configure(fake_fi: Any) -> None:
    """The wrappers take no sinks: a model with them is refused when it is built, naming the
    feature (the engine's auto choice runs such models on torch)."""
    backend = fake_fi.FlashInferAttentionBackend(workspace_mib=1)
    with pytest.raises(ValueError, match="attention sinks"):
        backend.configure(4, 2, 16, torch.bfloat16, torch.bfloat16, sinks=True)


def test_fake_group_without_decode_kernels_uses_prefill(fake_fi: Any) -> None:
    backend = fake_fi.FlashInferAttentionBackend(workspace_mib=1)
    h = Harness(backend, "cpu", torch.float16, hq=6 * HKV)  # 6 query heads per kv head
    h.step([(0, 1), (1, 1)])  # decode first: the head config is learnt in its forward
    for batch in STEPS:
        h.step(batch)
    assert sum(s.wrapper.plans for s in backend._slots[True, None]) == 0
    state = backend.make_graph_state(2, 1, 8, torch.device("cpu"))
    assert not state.slots[None].decode


def test_fake_interleaved_prepares_replan(fake_fi: Any) -> None:
    backend = fake_fi.FlashInferAttentionBackend(workspace_mib=1)
    backend.configure(HQ, HKV, D, torch.float16, torch.float16)
    h = Harness(backend, "cpu", torch.float16)
    h.step([(0, 9), (1, 3)])
    metas = [h.meta([(0, 1), (1, 1)]) for _ in range(3)]  # A, B, C: C reuses A's wrapper
    for meta in metas:
        backend.prepare(meta)
    for meta in metas:  # A re-plans (its wrapper holds C's plan), C then re-plans again
        h.run(meta)


def test_fake_rejects_float32_and_cpu(fake_fi: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = fake_fi.FlashInferAttentionBackend(workspace_mib=1)
    h = Harness(backend, "cpu", torch.float32)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        h.step([(0, 3)])
    monkeypatch.undo()  # the real _require_cuda
    meta = h.meta([(1, 2)])
    with pytest.raises(ValueError, match="CUDA"):
        fake_fi.FlashInferAttentionBackend().prepare(meta)


@pytest.mark.parametrize("q_len", [1, 4])
def test_fake_graph_state_replans_into_fixed_buffers(fake_fi: Any, q_len: int) -> None:
    backend = fake_fi.FlashInferAttentionBackend(workspace_mib=1)
    h = Harness(backend, "cpu", torch.float16, block_size=4)
    h.step([(s, 3 + 5 * s) for s in range(3)])
    state = backend.make_graph_state(3, q_len, 16, torch.device("cpu"))
    wrapper = state.slots[None].wrapper
    assert wrapper.int_workspace_bytes == 2**20
    addresses = [b.data_ptr() for b in wrapper.bufs if b is not None]
    tables = torch.zeros(3, 16, dtype=torch.int32)  # the graph runner's persistent buffer
    for _ in range(3):
        meta = h.graph_meta([(s, q_len) for s in range(3)], tables)
        backend.prepare_graph(meta, state)
        assert meta.backend_state is state and wrapper.graph
        h.run(meta)
    assert [b.data_ptr() for b in wrapper.bufs if b is not None] == addresses
    assert wrapper.plans == 3  # the first lazily (heads learnt from the eager step), 2 in prepare
    with pytest.raises(ValueError, match="queries per sequence"):
        backend.prepare_graph(h.meta([(0, q_len), (1, q_len), (2, q_len + 1)]), state)


# ---- the real kernels (GPU) -----------------------------------------------------------------


def _real_backend() -> Any:
    backend = get_backend("flashinfer")
    # the real kernels, not the fake module of the CPU tests above
    assert getattr(sys.modules[type(backend).__module__].flashinfer, "__file__", None)
    return backend


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("hq", [HQ, 3 * HKV])  # GQA groups of 2 and of 3 (SmolLM2's)
def test_gpu_matches_torch_backend(dtype: torch.dtype, block_size: int, hq: int) -> None:
    backend = _real_backend()
    h = Harness(
        backend, "cuda", dtype, block_size=block_size, hq=hq, tol={"atol": 2e-2, "rtol": 2e-2}
    )
    for batch in STEPS:
        h.step(batch)


@needs_gpu
@pytest.mark.parametrize("q_len", [1, 4])
def test_gpu_graph_replay_matches_torch_backend(q_len: int) -> None:
    backend = _real_backend()
    h = Harness(backend, "cuda", torch.bfloat16, layers=1, tol={"atol": 2e-2, "rtol": 2e-2})
    num_seqs, max_blocks = 4, 8
    h.step([(s, 7 + 11 * s) for s in range(num_seqs)])  # eager prefill: the head config is learnt
    state = backend.make_graph_state(num_seqs, q_len, max_blocks, h.device)
    t = num_seqs * q_len
    q, k, v = (torch.zeros_like(x) for x in h.qkv(t))  # persistent inputs
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=h.device)
    slots = torch.zeros(t, dtype=torch.int64, device=h.device)

    def load(meta: AttentionMetadata) -> AttentionMetadata:
        """Copies a step into the persistent buffers; returns the metadata that points at them."""
        tables.zero_()
        tables[:, : meta.block_tables.shape[1]] = meta.block_tables
        slots.copy_(meta.slot_mapping)
        for dst, src in zip((q, k, v), h.qkv(t)):
            dst.copy_(src)
        return dataclasses.replace(meta, block_tables=tables, slot_mapping=slots)

    meta = load(h.meta([(s, q_len) for s in range(num_seqs)]))
    backend.prepare_graph(meta, state)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph, as capture wants
        backend.forward(0, q, k, v, h.caches[0], meta, SCALE)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(0, q, k, v, h.caches[0], meta, SCALE)
    for step in range(4):
        if step:  # the first replay re-runs the captured step itself
            meta = load(h.meta([(s, q_len) for s in range(num_seqs)]))
            backend.prepare_graph(meta, state)
        graph.replay()
        h.check(meta, [out.clone()], [(q.clone(), k.clone(), v.clone())])


@needs_gpu
@pytest.mark.parametrize("block_size", [1, 16])
def test_gpu_sliding_windows_match_torch_backend(block_size: int) -> None:
    backend = _real_backend()
    backend.configure(HQ, HKV, D, torch.bfloat16, torch.bfloat16, SCALE, windows=(5, 12))
    tol = {"atol": 2e-2, "rtol": 2e-2}
    h = Harness(backend, "cuda", torch.bfloat16, block_size=block_size, tol=tol, windows=WINDOWED)
    for batch in STEPS:
        h.step(batch)


def test_layers_of_several_head_shapes_are_refused(fake_fi: Any) -> None:
    """One plan serves every layer: a model whose layers differ in heads (Gemma 4) is refused
    when it is built, naming the shapes and the backend to use instead."""
    backend = fake_fi.FlashInferAttentionBackend(workspace_mib=1)
    same = ((HQ, HKV, D),) * 3
    backend.configure(HQ, HKV, D, torch.float16, torch.float16, layer_heads=same)
    with pytest.raises(ValueError, match=r"several .*\(4, 1, 128\).*attention_backend=torch"):
        backend.configure(HQ, HKV, D, torch.float16, torch.float16,
                          layer_heads=((HQ, HKV, D), (HQ, 1, 128)))  # fmt: skip

"""The torch and cpu paged-attention backends against dense causal attention per sequence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from eaglebatch.attention import get_backend
from eaglebatch.attention.base import AttentionMetadata
from paged_kv import PagedSequences

HQ, HKV, D = 4, 2, 16


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q [q_len, HQ, D] are the last q_len positions of k/v [k_len, HKV, D]; with `sinks`
    [HQ], one more logit per head in each softmax whose weight is dropped (no value); with a
    `window`, each query sees its last `window` positions only."""
    q_len, k_len = q.shape[0], k.shape[0]
    group = HQ // HKV
    k = k.repeat_interleave(group, dim=1)  # [k_len, HQ, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)  # [HQ, q_len, k_len]
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    hidden = torch.arange(k_len)[None, :] > q_pos
    if window is not None:
        hidden |= torch.arange(k_len)[None, :] <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    column = sinks[:, None, None].expand(HQ, q_len, 1)
    probs = torch.cat((scores, column), dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


class Harness:
    """Runs steps through the backend while keeping every sequence's full K/V for reference."""

    def __init__(
        self, block_size: int, chunk_tokens: int = 4096, num_blocks: int = 256,
        backend: str = "torch", sinks: torch.Tensor | None = None, window: int | None = None,
    ) -> None:
        self.backend = get_backend(backend, chunk_tokens=chunk_tokens)
        self.backend.configure(HQ, HKV, D, torch.float32, torch.float32,
                               windows=() if window is None else (window,),
                               sinks=sinks is not None)  # fmt: skip
        self.sinks, self.window = sinks, window
        self.seqs = PagedSequences(num_blocks, block_size, seed=block_size)
        self.cache = torch.randn(2, num_blocks, block_size, HKV, D)  # garbage where unwritten
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.gen = torch.Generator().manual_seed(0)

    def step(self, batch: list[tuple[int, int]]) -> None:
        """batch: (seq, number of new query tokens)."""
        _, _, meta = self.seqs.step([(s, [0] * n) for s, n in batch])
        t = meta.num_tokens
        q = torch.randn(t, HQ, D, generator=self.gen)
        k = torch.randn(t, HKV, D, generator=self.gen)
        v = torch.randn(t, HKV, D, generator=self.gen)
        self.backend.prepare(meta)
        self.last_meta = meta
        out = self.backend.forward(0, q, k, v, self.cache, meta, D**-0.5, window=self.window,
                                   sinks=self.sinks)  # fmt: skip
        assert out.shape == (t, HQ, D)
        for i, (s, n) in enumerate(batch):
            lo, hi = int(meta.cu_seqlens_q[i]), int(meta.cu_seqlens_q[i + 1])
            assert hi - lo == n
            self.k[s] = torch.cat([self.k.get(s, k[:0]), k[lo:hi]])
            self.v[s] = torch.cat([self.v.get(s, v[:0]), v[lo:hi]])
            assert self.k[s].shape[0] == self.seqs.lengths[s]
            ref = dense_reference(q[lo:hi], self.k[s], self.v[s], self.sinks, self.window)
            torch.testing.assert_close(out[lo:hi], ref, atol=1e-5, rtol=1e-5)

    def backend_state_chunks(self):
        """The torch path's chunks of the last step (empty for a native cpu step; a split cpu
        step's long rows)."""
        state = self.last_meta.backend_state
        state = getattr(state, "long_meta", None) and state.long_meta.backend_state or state
        return getattr(state, "chunks", [])

    def rollback(self, seq: int, length: int) -> None:
        self.seqs.truncate(seq, length)
        self.k[seq] = self.k[seq][:length]
        self.v[seq] = self.v[seq][:length]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("chunk_tokens", [4096, 8])
def test_prefill_decode_and_verify(block_size: int, chunk_tokens: int, backend: str) -> None:
    h = Harness(block_size, chunk_tokens, backend=backend)
    h.step([(0, 5), (1, 1), (2, 17), (3, 9)])  # prefill, mixed lengths
    for _ in range(3):
        h.step([(0, 1), (1, 1), (2, 1), (3, 1)])  # decode
    h.step([(1, 1), (3, 1)])  # decode, a subset in another order
    h.step([(2, 4), (0, 3), (1, 1), (3, 2)])  # verify-like: q_i > 1 on top of a prefix
    h.rollback(2, h.seqs.lengths[2] - 2)  # rejected tokens are overwritten next step
    h.step([(2, 3), (4, 6), (0, 1)])  # mixed with a new prefill


def test_cpu_mixed_steps_split_short_rows_to_the_kernel() -> None:
    """Decode rows beside prompt chunks run through the kernel (the same bits as in a decode
    step of their own), the chunks through torch's path; both against dense attention."""
    h = Harness(4, backend="cpu")
    h.step([(0, 9), (1, 30), (2, 5)])
    h.step([(0, 1), (1, 1), (3, 40), (2, 3)])  # decode, a new prompt, a verify-like row
    state = h.last_meta.backend_state
    assert type(state).__name__ == "_SplitPlan"
    assert state.short_tokens.tolist() == [0, 1, 42, 43, 44]
    assert state.long_tokens.tolist() == list(range(2, 42))
    assert state.native.cu_seqlens_q.tolist() == [0, 1, 2, 5]
    # the short rows alone, through the kernel: the same outputs bit for bit
    cache = h.cache.clone()
    seqs = h.seqs
    for s in (0, 1, 2):
        seqs.truncate(s, seqs.lengths[s] - (3 if s == 2 else 1))
    _, _, meta = seqs.step([(0, [0]), (1, [0]), (2, [0] * 3)])
    assert meta.seq_lens.tolist() == state.native.seq_lens.tolist()
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(45, HQ, D, generator=gen)
    k, v = torch.randn(45, HKV, D, generator=gen), torch.randn(45, HKV, D, generator=gen)
    h.backend.prepare(h.last_meta)
    mixed = h.backend.forward(0, q, k, v, cache.clone(), h.last_meta, D**-0.5)
    short = state.short_tokens
    h.backend.prepare(meta)
    alone = h.backend.forward(0, q[short], k[short], v[short], cache.clone(), meta, D**-0.5)
    assert torch.equal(mixed[short], alone)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_single_sequence_prefill_is_causal(backend: str) -> None:
    h = Harness(4, backend=backend)
    h.step([(0, 23)])
    h.step([(0, 1)])
    h.step([(0, 12)])  # a short prefill-like step on top of a prefix (cpu: native)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_equal_lengths_use_unmasked_paths(backend: str) -> None:
    h = Harness(4, backend=backend)
    h.step([(0, 8), (1, 8)])  # equal-length prefill: plain causal
    h.step([(0, 1), (1, 1)])  # equal-length decode: no mask


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_long_prompts_are_not_padded_in_a_prefill_step(backend: str) -> None:
    h = Harness(4, backend=backend)
    h.backend.solo_prefill_tokens = 30
    batch = [(0, 40), (1, 33), (2, 5), (3, 40), (4, 9), (5, 31)]
    _, _, meta = h.seqs.step([(s, [0] * n) for s, n in batch])
    h.backend.prepare(meta)
    # the cpu backend runs the short prompts through its kernel, the long ones as torch does
    torch_meta = getattr(meta.backend_state, "long_meta", meta)
    n = len(torch_meta.seq_lens)
    lengths = [sorted(int(torch_meta.seq_lens[i]) for i in range(n)
                      if c.tok_index is None or int(torch_meta.cu_seqlens_q[i]) in c.tok_index)
               for c in torch_meta.backend_state.chunks]
    short = [[5, 9]] if backend == "torch" else []  # short prompts still share
    assert sorted(lengths) == short + [[31], [33], [40, 40]]
    for c in torch_meta.backend_state.chunks:
        if c.max_q >= 30:
            assert c.mask is None and c.causal and c.pad_index is None
    for s, _ in batch:
        h.seqs.truncate(s, 0)
    h.step(batch)  # against dense causal attention per sequence
    h.step([(s, 1) for s, _ in batch])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("chunk_tokens", [4096, 64])
def test_queries_after_cached_kv_prefix_cache_and_chunks(backend: str, chunk_tokens: int) -> None:
    """Prefill-sized queries that follow K/V already in the cache (a prefix-cached prompt, a
    later chunk), mixed with fresh prompts and decode rows in one step: short prefixes take the
    placed causal grid, long ones the mask; rows of each kind are chunked apart."""
    h = Harness(4, chunk_tokens, backend=backend)
    h.step([(0, 8), (1, 3), (2, 40), (3, 2)])  # prefixes of 8, 3, 40 and 2 tokens
    h.step([(0, 20), (1, 45), (2, 17), (4, 30), (3, 1), (5, 2)])
    kinds = {(bool(c.mask is None and c.causal), c.block_index is None)
             for c in h.backend_state_chunks()}
    assert (True, False) in kinds  # a placed chunk: causal, gathered, no mask
    h.step([(0, 1), (1, 1), (2, 1), (4, 1), (3, 1), (5, 1)])


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_kv_written_at_slot_mapping(backend_name: str) -> None:
    backend = get_backend(backend_name)
    backend.configure(HQ, HKV, D, torch.float32, torch.float32)
    seqs = PagedSequences(num_blocks=8, block_size=4, seed=3)
    _, _, meta = seqs.step([(0, [0] * 6)])
    cache = torch.zeros(2, 8, 4, HKV, D)
    k, v = torch.randn(6, HKV, D), torch.randn(6, HKV, D)
    backend.prepare(meta)
    backend.forward(0, torch.randn(6, HQ, D), k, v, cache, meta, 1.0)
    flat = cache.view(2, -1, HKV, D)
    torch.testing.assert_close(flat[0, meta.slot_mapping], k)
    torch.testing.assert_close(flat[1, meta.slot_mapping], v)


def test_metadata_from_numpy_derives_lengths() -> None:
    import numpy as np

    meta = AttentionMetadata.from_numpy(
        np.array([0, 3, 4]), np.array([3, 7]), np.zeros((2, 2)), np.arange(4), 4, "cpu"
    )
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.is_prefill) == (3, 7, False)
    assert meta.cu_seqlens_q.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    with pytest.raises(ValueError):
        AttentionMetadata.from_numpy(
            np.array([0, 3]), np.array([2]), np.zeros((1, 1)), np.arange(3), 4, "cpu"
        )


def test_metadata_from_numpy_reuses_a_device_block_table() -> None:
    import numpy as np

    tables = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    meta = AttentionMetadata.from_numpy(
        np.array([0, 1, 2]), np.array([5, 2]), tables, np.array([9, 12]), 4, "cpu"
    )
    assert meta.block_tables is tables  # the steps of one round share it: no copy
    assert meta.max_seqlen_k == 5 and meta.slot_mapping.tolist() == [9, 12]
    with pytest.raises(ValueError, match="int32"):
        AttentionMetadata.from_numpy(
            np.array([0, 1]), np.array([5]), tables[:1].long(), np.array([9]), 4, "cpu"
        )


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_backend("nope")


def test_forward_without_prepare_fails() -> None:
    seqs = PagedSequences(num_blocks=4, block_size=4)
    _, _, meta = seqs.step([(0, [0, 0])])
    with pytest.raises(RuntimeError, match="prepare"):
        get_backend("torch").forward(
            0,
            torch.zeros(2, HQ, D),
            torch.zeros(2, HKV, D),
            torch.zeros(2, HKV, D),
            torch.zeros(2, 4, 4, HKV, D),
            meta,
            1.0,
        )


def _cpu_step(seqs: PagedSequences, batch, cache, gen, qkv=None):
    """One step through the cpu backend on random q/k/v (or `qkv`):
    (backend, out [T, HQ, D], (q, k, v), metadata)."""
    from eaglebatch.cpu.attention import CpuAttentionBackend

    backend = CpuAttentionBackend()
    backend.configure(HQ, HKV, D, torch.float32, torch.float32)
    _, _, meta = seqs.step(batch)
    t = meta.num_tokens
    q = torch.randn(t, HQ, D, generator=gen)
    k, v = torch.randn(t, HKV, D, generator=gen), torch.randn(t, HKV, D, generator=gen)
    q, k, v = qkv if qkv is not None else (q, k, v)
    backend.prepare(meta)
    return backend, backend.forward(0, q, k, v, cache, meta, D**-0.5), (q, k, v), meta


def test_cpu_backend_runs_decode_and_verify_natively_and_prefill_on_torch() -> None:
    from eaglebatch.attention.base import NativeAttentionPlan as _Native
    from eaglebatch.cpu.attention import MAX_NATIVE_QUERY

    seqs = PagedSequences(num_blocks=64, block_size=4, seed=5)
    cache, gen = torch.randn(2, 64, 4, HKV, D), torch.Generator().manual_seed(1)
    _, _, _, meta = _cpu_step(seqs, [(0, [0] * (MAX_NATIVE_QUERY + 1))], cache, gen)
    assert not isinstance(meta.backend_state, _Native)  # prefill-sized: SDPA
    _, _, _, meta = _cpu_step(seqs, [(0, [0] * 4)], cache, gen)
    assert isinstance(meta.backend_state, _Native)
    backend = get_backend("cpu")
    backend.configure(HQ, HKV, D, torch.bfloat16, torch.bfloat16)
    meta = seqs.step([(0, [0])])[2]
    backend.prepare(meta)
    assert not isinstance(meta.backend_state, _Native)  # bf16: torch's path


def test_cpu_backend_verify_rows_equal_decode_rows_bit_for_bit() -> None:
    # A 4-row verify query and a 1-row decode query at the same position give the same bits,
    # whatever else is in the step: greedy speculative decoding reproduces plain decoding.
    seqs = PagedSequences(num_blocks=64, block_size=4, seed=6)
    cache, gen = torch.randn(2, 64, 4, HKV, D), torch.Generator().manual_seed(2)
    _cpu_step(seqs, [(0, [0] * 13), (1, [0] * 7)], cache, gen)
    _, verify, (q, k, v), _ = _cpu_step(seqs, [(1, [0] * 2), (0, [0] * 4)], cache, gen)
    seqs.truncate(0, seqs.lengths[0] - 1)  # decode the verify step's last row of sequence 0 again
    last = (q[-1:], k[-1:], v[-1:])
    _, decode, _, meta = _cpu_step(seqs, [(0, [0])], cache, gen, qkv=last)
    assert torch.equal(decode[0], verify[-1])


def test_cpu_backend_rejects_block_ids_outside_the_cache() -> None:
    from eaglebatch.cpu.attention import CpuAttentionBackend

    backend = CpuAttentionBackend()
    backend.configure(HQ, HKV, D, torch.float32, torch.float32)
    seqs = PagedSequences(num_blocks=8, block_size=4, seed=3)
    _, _, meta = seqs.step([(0, [0] * 6)])
    meta.block_tables[0, 1] = 99
    backend.prepare(meta)
    with pytest.raises(ValueError, match="block id 99"):
        backend.forward(0, torch.randn(6, HQ, D), torch.randn(6, HKV, D),
                        torch.randn(6, HKV, D), torch.zeros(2, 8, 4, HKV, D), meta, 1.0)


def test_cpu_backend_keeps_autograd_on_torch() -> None:
    seqs = PagedSequences(num_blocks=8, block_size=4, seed=3)
    _, _, meta = seqs.step([(0, [0] * 3)])
    backend = get_backend("cpu")
    backend.configure(HQ, HKV, D, torch.float32, torch.float32)
    backend.prepare(meta)
    q = torch.randn(3, HQ, D, requires_grad=True)
    out = backend.forward(0, q, torch.randn(3, HKV, D), torch.randn(3, HKV, D),
                          torch.zeros(2, 8, 4, HKV, D), meta, 1.0)
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


class _Layers:
    """A KVCacheConfig of 4 layers: layer 1 has its own (Hkv, D), layer 3 shares layer 1's."""

    num_hidden_layers, num_key_value_heads, head_dim = 4, 2, 16

    def heads_of(self, layer: int) -> tuple[int, int, int]:
        return (4, 1, 32) if layer in (1, 3) else (4, 2, 16)

    def kv_source(self, layer: int) -> int:
        return 1 if layer == 3 else layer

    def is_linear(self, layer: int) -> bool:
        return False


def test_kv_cache_per_layer_shapes_and_shared_layers() -> None:
    """Each layer's cache has its own (Hkv, D); a sharing layer holds its source's tensor and
    counts no bytes; copy_blocks copies a block in every cache."""
    from eaglebatch.attention.base import allocate_kv_cache, copy_blocks
    from eaglebatch.attention.base import kv_cache_bytes_per_block as bytes_per_block

    cfg = _Layers()
    caches = allocate_kv_cache(cfg, 6, 4, torch.float32, "cpu")
    assert [tuple(c.shape) for c in caches] == [(2, 6, 4, 2, 16), (2, 6, 4, 1, 32)] * 2
    assert caches[3] is caches[1] and caches[2] is not caches[0]
    assert bytes_per_block(cfg, 4, torch.float32) == 2 * 4 * (32 + 32 + 32) * 4
    for c in caches[:3]:
        c.normal_()
    before = [c.clone() for c in caches]
    copy_blocks(caches, np.array([[0, 5]], dtype=np.int32))
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[:, 5], b[:, 0]) and torch.equal(c[:, :5], b[:, :5])


def test_cpu_backend_runs_layers_of_several_head_shapes_on_torch() -> None:
    """The native kernel serves one head shape: with several, every step runs torch's path."""
    backend = get_backend("cpu")
    backend.configure(HQ, HKV, D, torch.float32, torch.float32)
    assert backend._native_dtypes
    backend.configure(HQ, HKV, D, torch.float32, torch.float32,
                      layer_heads=((HQ, HKV, D), (HQ, 1, 2 * D)))  # fmt: skip
    assert not backend._native_dtypes


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("window", [None, 6])
def test_attention_sinks_take_softmax_mass_on_every_path(backend: str, window) -> None:
    """Sinks (a logit per head in each softmax's denominator, no value) on prefill, decode,
    verify, prefix-cached and mixed steps, padded and placed chunks, with and without a
    window; the cpu backend keeps such steps off its kernel (which has no sinks)."""
    from eaglebatch.attention.base import NativeAttentionPlan

    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0])  # large enough to take visible mass
    h = Harness(4, chunk_tokens=48, backend=backend, sinks=sinks, window=window)
    h.step([(0, 5), (1, 1), (2, 17), (3, 9)])
    h.step([(0, 1), (1, 1), (2, 1), (3, 1)])
    h.step([(2, 4), (0, 3), (1, 1), (3, 2)])
    h.step([(4, 30), (0, 1)])  # a prompt beside a decode row
    h.step([(4, 20)])  # a later chunk after its cached K/V (placed on a grid without windows)
    assert not isinstance(h.last_meta.backend_state, NativeAttentionPlan)


def test_attention_sinks_sliced_rows_equal_one_pass(monkeypatch) -> None:
    """Query rows computed in slices (bounded scores) give the one-pass values."""
    from eaglebatch.attention import sinks as mod

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 9, D, generator=gen) for h in (HQ, HKV, HKV))
    sinks = torch.randn(HQ, generator=gen)
    mask = torch.rand(2, 1, 9, 9, generator=gen) > 0.3
    mask[..., 0] = True
    for m, causal in ((mask, False), (None, True), (None, False)):
        whole = mod.attention_with_sinks(q, k, v, sinks, 0.25, m, causal)
        monkeypatch.setattr(mod, "SCORE_ELEMENTS", 2 * HQ * 9 * 2)  # two rows at a time
        sliced = mod.attention_with_sinks(q, k, v, sinks, 0.25, m, causal)
        monkeypatch.undo()
        torch.testing.assert_close(sliced, whole, rtol=1e-6, atol=1e-6)


def test_uniform_steps_attend_with_sinks() -> None:
    """The CUDA-graph (uniform) steps, run eagerly: sinks on their masks, against dense
    attention per row."""
    backend = get_backend("torch")
    backend.configure(HQ, HKV, D, torch.float32, torch.float32, sinks=True)
    seqs = PagedSequences(num_blocks=32, block_size=4, seed=9)
    cache = torch.zeros(2, 32, 4, HKV, D)
    gen = torch.Generator().manual_seed(4)
    sinks = torch.tensor([1.0, 3.0, -2.0, 0.0])
    ks, vs = {}, {}
    for batch in ([(0, 7), (1, 3)], [(0, 2), (1, 2)]):
        _, _, meta = seqs.step([(s, [0] * n) for s, n in batch])
        t = meta.num_tokens
        q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HQ, HKV, HKV))
        if batch[0][1] == batch[1][1]:  # uniform: 2 rows of 2 queries, 4 block columns
            pad = 4 - meta.block_tables.shape[1]
            meta.block_tables = torch.nn.functional.pad(meta.block_tables, (0, pad))
            state = backend.make_graph_state(2, 2, 4, torch.device("cpu"))
            backend.prepare_graph(meta, state)
        else:
            backend.prepare(meta)
        out = backend.forward(0, q, k, v, cache, meta, D**-0.5, sinks=sinks)
        for i, (s, _) in enumerate(batch):
            lo, hi = int(meta.cu_seqlens_q[i]), int(meta.cu_seqlens_q[i + 1])
            ks[s] = torch.cat([ks.get(s, k[:0]), k[lo:hi]])
            vs[s] = torch.cat([vs.get(s, v[:0]), v[lo:hi]])
            ref = dense_reference(q[lo:hi], ks[s], vs[s], sinks)
            torch.testing.assert_close(out[lo:hi], ref, atol=1e-5, rtol=1e-5)
    assert type(meta.backend_state).__name__ == "_Uniform"

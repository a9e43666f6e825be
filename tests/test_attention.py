"""The torch paged-attention backend against dense causal attention per sequence."""

from __future__ import annotations

import math

import pytest
import torch

from eaglebatch.attention import get_backend
from eaglebatch.attention.base import AttentionMetadata
from paged_kv import PagedSequences

HQ, HKV, D = 4, 2, 16


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [q_len, HQ, D] are the last q_len positions of k/v [k_len, HKV, D]."""
    q_len, k_len = q.shape[0], k.shape[0]
    group = HQ // HKV
    k = k.repeat_interleave(group, dim=1)  # [k_len, HQ, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)  # [HQ, q_len, k_len]
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    scores = scores.masked_fill(torch.arange(k_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class Harness:
    """Runs steps through the backend while keeping every sequence's full K/V for reference."""

    def __init__(self, block_size: int, chunk_tokens: int = 4096, num_blocks: int = 256) -> None:
        self.backend = get_backend("torch", chunk_tokens=chunk_tokens)
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
        out = self.backend.forward(0, q, k, v, self.cache, meta, D**-0.5)
        assert out.shape == (t, HQ, D)
        for i, (s, n) in enumerate(batch):
            lo, hi = int(meta.cu_seqlens_q[i]), int(meta.cu_seqlens_q[i + 1])
            assert hi - lo == n
            self.k[s] = torch.cat([self.k.get(s, k[:0]), k[lo:hi]])
            self.v[s] = torch.cat([self.v.get(s, v[:0]), v[lo:hi]])
            assert self.k[s].shape[0] == self.seqs.lengths[s]
            ref = dense_reference(q[lo:hi], self.k[s], self.v[s])
            torch.testing.assert_close(out[lo:hi], ref, atol=1e-5, rtol=1e-5)

    def rollback(self, seq: int, length: int) -> None:
        self.seqs.truncate(seq, length)
        self.k[seq] = self.k[seq][:length]
        self.v[seq] = self.v[seq][:length]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("chunk_tokens", [4096, 8])
def test_prefill_decode_and_verify(block_size: int, chunk_tokens: int) -> None:
    h = Harness(block_size, chunk_tokens)
    h.step([(0, 5), (1, 1), (2, 17), (3, 9)])  # prefill, mixed lengths
    for _ in range(3):
        h.step([(0, 1), (1, 1), (2, 1), (3, 1)])  # decode
    h.step([(1, 1), (3, 1)])  # decode, a subset in another order
    h.step([(2, 4), (0, 3), (1, 1), (3, 2)])  # verify-like: q_i > 1 on top of a prefix
    h.rollback(2, h.seqs.lengths[2] - 2)  # rejected tokens are overwritten next step
    h.step([(2, 3), (4, 6), (0, 1)])  # mixed with a new prefill


def test_single_sequence_prefill_is_causal() -> None:
    h = Harness(4)
    h.step([(0, 23)])
    h.step([(0, 1)])


def test_equal_lengths_use_unmasked_paths() -> None:
    h = Harness(4)
    h.step([(0, 8), (1, 8)])  # equal-length prefill: plain causal
    h.step([(0, 1), (1, 1)])  # equal-length decode: no mask


def test_kv_written_at_slot_mapping() -> None:
    backend = get_backend("torch")
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

"""Prompt lookup (speculative/ngram.py) against a brute-force search over the same history."""

from __future__ import annotations

import numpy as np
import pytest

from eaglebatch.speculative.ngram import NgramLookup


def brute_force(seq: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix (max_n..min_n tokens) seen before: its latest occurrence followed by k
    tokens, else its earliest (followed by the most)."""
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        suffix = seq[len(seq) - n :]
        starts = [s for s in range(len(seq) - n) if seq[s : s + n] == suffix]
        if starts:
            full = [s for s in starts if s + n + k <= len(seq)]
            start = full[-1] if full else starts[0]
            return seq[start + n : start + n + k]
    return []


def lookup_of(seq, min_n=2, max_n=4, capacity=64) -> NgramLookup:
    lk = NgramLookup(2, capacity, min_n, max_n)
    lk.reset(1, np.array(seq, dtype=np.int32))
    return lk


def test_the_longest_recurring_suffix_wins_over_a_later_shorter_one() -> None:
    seq = [1, 2, 3, 7, 8, 9, 2, 3, 5, 6, 1, 2, 3]
    # "1 2 3" recurs at 0 (then 7 8 9); "2 3" also at 6 (then 5 6), later but shorter
    assert lookup_of(seq).propose(1, 3).tolist() == [7, 8, 9]


def test_the_latest_occurrence_among_equals_and_k_truncates() -> None:
    seq = [4, 5, 1, 4, 5, 2, 3, 4, 5]
    assert lookup_of(seq).propose(1, 2).tolist() == [2, 3]
    assert lookup_of(seq).propose(1, 1).tolist() == [2]
    assert lookup_of(seq).propose(1, 0).tolist() == []


def test_no_proposal_below_min_n_or_without_recurrence() -> None:
    assert lookup_of([1, 2, 3, 4, 5]).propose(1, 3).tolist() == []
    assert lookup_of([1, 2, 9, 3, 2]).propose(1, 3).tolist() == []  # "3 2" never seen before
    assert lookup_of([1, 2, 9, 3, 2], min_n=1).propose(1, 3).tolist() == [9, 3, 2]
    assert lookup_of([7]).propose(1, 3).tolist() == []


def test_a_short_period_loop_proposes_k_tokens() -> None:
    # the latest "4 4 4 4" is followed by one token only, the one before by two
    assert lookup_of([4] * 8).propose(1, 3).tolist() == [4, 4, 4]
    assert lookup_of([1, 2] * 4).propose(1, 3).tolist() == [1, 2, 1]
    assert lookup_of([4] * 5).propose(1, 3).tolist() == [4]  # the only "4 4 4 4" before


def test_extend_and_reset_and_the_capacity_bound() -> None:
    lk = lookup_of([1, 2, 3], capacity=8)
    lk.extend(1, np.array([9, 1, 2, 3, 4, 5], dtype=np.int32))  # 9 tokens > capacity 8
    assert lk.lengths[1] == 8 and lk.tokens[1].tolist() == [1, 2, 3, 9, 1, 2, 3, 4]
    lk.reset(1, np.array([5, 6], dtype=np.int32))
    assert lk.propose(1, 3).tolist() == [] and lk.lengths[0] == 0


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force_on_random_histories(seed) -> None:
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 6))  # small vocabularies: many overlapping matches
    seq = rng.integers(0, vocab, int(rng.integers(1, 60))).tolist()
    for min_n, max_n in [(1, 1), (1, 4), (2, 5), (3, 3)]:
        for k in (1, 3, 6):
            want = brute_force(seq, k, min_n, max_n)
            got = lookup_of(seq, min_n, max_n).propose(1, k).tolist()
            assert got == want, (seq, min_n, max_n, k)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramLookup(1, 8, 3, 2)
    with pytest.raises(ValueError, match="min_n"):
        NgramLookup(1, 8, 0, 2)

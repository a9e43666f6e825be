"""Prompt lookup: draft tokens copied from earlier in the sequence itself (n-gram matching).

Outputs often repeat their own context: code that edits the prompt's code, quoted passages,
lists whose items share a stem, and the loops small models fall into under greedy decoding. Where
the last n tokens of a sequence (n = max_n down to min_n) occurred before, the tokens that followed
an earlier occurrence (the latest one followed by k tokens, else the one followed by the most)
are a free draft: no draft-model forward, only a search of the
sequence's own tokens. The target verifies them like any draft, so output is unchanged.

State: per slot, the sequence's committed tokens x_0..x_{L-1} (prompt, then every token the
rounds emitted), in one preallocated int32 array [slots, capacity]; memory does not grow with
the input size (np.zeros pages are only backed once written, so resident memory follows the
sequences' actual lengths). `reset` at prefill, `extend` after each round.
"""

from __future__ import annotations

import numpy as np


class NgramLookup:
    def __init__(self, num_slots: int, capacity: int, min_n: int, max_n: int) -> None:
        """capacity: the most tokens a sequence can hold (max_model_len + the drafts of a round)."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens = np.zeros((num_slots, capacity), dtype=np.int32)
        self.lengths = np.zeros(num_slots, dtype=np.int64)

    def reset(self, slot: int, tokens: np.ndarray) -> None:
        """The slot now holds a new sequence: `tokens` are all its committed tokens."""
        n = len(tokens)
        self.tokens[slot, :n] = tokens
        self.lengths[slot] = n

    def extend(self, slot: int, tokens: np.ndarray) -> None:
        """Appends tokens a round committed (silently bounded by the capacity)."""
        start = int(self.lengths[slot])
        n = min(len(tokens), self.tokens.shape[1] - start)
        self.tokens[slot, start : start + n] = tokens[:n]
        self.lengths[slot] = start + n

    def propose(self, slot: int, k: int) -> np.ndarray:
        """Up to k tokens that followed an earlier occurrence of the sequence's longest recurring
        suffix of max_n down to min_n tokens: the latest occurrence followed by k tokens, else the
        one followed by the most (in a loop of period < k the latest is followed by fewer than k).
        Empty when no suffix recurs. Depends on this slot's tokens only."""
        length = int(self.lengths[slot])
        seq = self.tokens[slot, :length]
        if length <= self.min_n or k <= 0:
            return seq[:0].copy()
        # ends p < length - 1 of earlier occurrences of the last token, and how far back each
        # occurrence keeps matching the suffix (capped at max_n)
        ends = np.flatnonzero(seq[: length - 1] == seq[length - 1])
        matched = np.ones(len(ends), dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for i in range(1, min(self.max_n, length - 1)):
            back = ends - i
            alive &= (back >= 0) & (seq[np.maximum(back, 0)] == seq[length - 1 - i])
            if not alive.any():
                break
            matched += alive
        best = np.flatnonzero(matched >= self.min_n)
        if len(best) == 0:
            return seq[:0].copy()
        best = best[matched[best] == matched[best].max()]  # the longest; ends ascending
        full = best[ends[best] + k < length]  # followed by k tokens
        top = full[-1] if len(full) else best[0]
        start = int(ends[top]) + 1
        return seq[start : start + k].copy()

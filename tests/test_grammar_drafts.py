"""The speculative worker's grammar hook (speculative/grammar_drafts.py) on its own: forced
drafts widen a round, the scheduler's validation cuts drafts and counts them, masked drafting
asks the scheduler only for plans with constrained rows."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eaglebatch.speculative.grammar_drafts import GrammarDrafts
from eaglebatch.speculative.round import RoundShape

CPU = torch.device("cpu")


def shape(n, k, k_head, by_lookup=None) -> RoundShape:
    n = np.asarray(n, dtype=np.int64)
    lookup = np.zeros(len(n), bool) if by_lookup is None else np.asarray(by_lookup)
    return RoundShape(k, k_head, n, lookup, [np.zeros(0, np.int32)] * len(n), False)


def forced_plan(forced: list[list[int]], mask_rows=None):
    cu = np.concatenate(([0], np.cumsum([len(f) for f in forced]))).astype(np.int32)
    ids = np.array([t for f in forced for t in f], dtype=np.int64)
    rows = np.full(len(forced), -1, np.int32) if mask_rows is None else np.asarray(mask_rows)
    return SimpleNamespace(cu_forced=cu, forced_ids=ids, mask_rows=rows.astype(np.int32))


def test_forced_drafts_come_first_and_widen_an_eager_round_up_to_w():
    plan = forced_plan([[7, 8], [], [9, 9, 9, 9, 9, 9]])
    out, ids, lens = GrammarDrafts(True, CPU).forced(plan, shape([2, 2, 2], 2, 2), 5, False)
    assert lens.tolist() == [2, 0, 5]  # at most W (k_plan) forced tokens a row
    assert out.k == 5 and out.k_head == 5  # forced + the head's own, capped at W
    assert out.n.tolist() == [4, 2, 5]  # head rows draft their n after the forced ones
    assert ids.tolist() == [[7, 8, 0, 0, 0], [0] * 5, [9] * 5]


def test_graph_rounds_keep_their_width_and_no_forced_tokens_change_nothing():
    plan = forced_plan([[7, 8, 9], [1]])
    out, ids, lens = GrammarDrafts(True, CPU).forced(plan, shape([2, 2], 2, 2), 5, True)
    assert out.k == 2 and lens.tolist() == [2, 1] and ids.tolist() == [[7, 8], [1, 0]]
    s = shape([2, 2], 2, 2)
    assert GrammarDrafts(False, CPU).forced(plan, s, 5, False) == (s, None, None)  # off
    assert GrammarDrafts(True, CPU).forced(forced_plan([[], []]), s, 5, False) == (s, None, None)


def test_validation_cuts_each_constrained_row_at_its_grammar_and_counts_the_cut():
    words = 1
    calls = []

    def draft_masks(drafts):
        calls.append(drafts.copy())
        return (np.array([0, 2], np.int32), np.array([1, 3], np.int32),
                np.full((2, drafts.shape[1] + 1, words), 0xFFFFFFFF, np.uint32))  # fmt: skip

    hook = GrammarDrafts(True, CPU)
    hook.bind(SimpleNamespace(draft_masks=draft_masks, draft_step_masks=None))
    plan = forced_plan([[], [], []], mask_rows=[0, -1, 1])
    n = np.array([3, 3, 2], dtype=np.int64)
    drafts = torch.arange(9).reshape(3, 3)
    mask, cut = hook.verify_masks(plan, n, drafts)
    assert n.tolist() == [1, 3, 2] and cut == 2  # row 0: 3 -> 1; row 2 keeps its 2 (valid 3)
    assert mask.rows.tolist() == [0, 2] and calls[0].tolist() == drafts.tolist()


def test_validation_needs_the_scheduler_bound_only_for_constrained_rows():
    hook = GrammarDrafts(True, CPU)
    n = np.array([2, 2], dtype=np.int64)
    free = forced_plan([[], []])
    assert hook.verify_masks(free, n, torch.zeros(2, 2, dtype=torch.long)) == (None, 0)
    assert hook.head_masks(free, None) is None
    with pytest.raises(RuntimeError, match="draft_masks"):
        hook.verify_masks(forced_plan([[], []], mask_rows=[-1, 0]), n,
                          torch.zeros(2, 2, dtype=torch.long))  # fmt: skip


def test_masked_drafting_asks_the_scheduler_with_the_drafts_just_chosen():
    asked = []

    def step_masks(tokens):
        asked.append(None if tokens is None else tokens.tolist())
        return np.array([1], np.int32), np.array([[0b101]], np.uint32)  # tokens 0 and 2

    hook = GrammarDrafts(False, CPU)
    hook.bind(SimpleNamespace(draft_masks=None, draft_step_masks=step_masks))
    plan = forced_plan([[], []], mask_rows=[-1, 0])
    rows, allowed = hook.head_masks(plan, None)
    hook.head_masks(plan, torch.tensor([4, 2]))
    assert asked == [None, [4, 2]]
    assert rows.tolist() == [1] and allowed[0, :4].tolist() == [True, False, True, False]

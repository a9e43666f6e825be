"""The speculative worker's per-slot states (speculative/slots.py): each transition on its own,
against the states the module doc names."""

from __future__ import annotations

import numpy as np
import torch

from eaglebatch.speculative.slots import (
    DRAFTING,
    EMPTY,
    MAX_DEFERRED,
    PREFILLING,
    STALE,
    SlotStates,
)


def states(n: int = 4) -> SlotStates:
    return SlotStates(n, 3, torch.float32, torch.device("cpu"))


def names(s: SlotStates) -> list[str]:
    return [s.state(i) for i in range(len(s.ready))]


def test_a_prompt_in_chunks_goes_from_empty_through_prefilling_to_drafting() -> None:
    s = states()
    assert names(s) == [EMPTY] * 4
    slots = np.array([1, 2])
    s.start(s.starting(slots), plain=False)
    s.prefilled(slots, partial=np.array([True, False]))  # slot 1: more chunks to come
    assert names(s) == [EMPTY, PREFILLING, DRAFTING, EMPTY]
    assert s.starting(slots).tolist() == [2]  # slot 1 is mid-prompt: its prompt does not start
    s.prefilled(np.array([1]), partial=np.array([False]))
    assert names(s) == [EMPTY, DRAFTING, DRAFTING, EMPTY]
    assert s.ready.tolist() == [False, True, True, False]


def test_rows_joining_where_drafting_cannot_pay_start_stale() -> None:
    s = states()
    slots = np.array([0, 3])
    s.start(slots, plain=True)
    s.prefilled(slots, partial=np.array([False, False]))
    assert names(s) == [STALE, EMPTY, EMPTY, STALE]
    assert not s.drafting(slots).any()


def test_a_plain_step_makes_every_row_stale_and_drops_its_deferred_extends() -> None:
    s = states()
    slots = np.array([0, 1])
    s.start(slots, plain=False)
    s.prefilled(slots, partial=np.array([False, False]))
    s.defer(slots, torch.tensor([5, 6]), {})
    assert s.deferred[slots].tolist() == [1, 1]
    s.to_plain(slots, partial=np.array([False, True]))
    assert names(s)[:2] == [STALE, PREFILLING]
    assert s.deferred[slots].tolist() == [0, 0]
    assert s.waiting(slots).tolist() == []


def test_deferred_extends_keep_their_inputs_until_max_then_the_row_leaves_the_head() -> None:
    s = states(2)
    slots = np.array([1, 0])
    s.start(slots, plain=False)
    s.prefilled(slots, partial=np.array([False, False]))
    for i in range(MAX_DEFERRED):
        state = torch.tensor([[1.0 * i, 0], [2.0 * i, 0]])  # [B, H] per row
        assert s.defer(slots, torch.tensor([10 + i, 20 + i]), {3: state}) == (2, 0)
    assert s.deferred.tolist() == [MAX_DEFERRED] * 2
    assert s.deferred_ids[1].tolist() == [10 + i for i in range(MAX_DEFERRED)]  # row 0: slot 1
    assert s.deferred_ids[0].tolist() == [20 + i for i in range(MAX_DEFERRED)]
    assert s.deferred_states[3][0, :, 0].tolist() == [2.0 * i for i in range(MAX_DEFERRED)]
    assert s.waiting(slots).tolist() == [0, 1]  # plan rows, both waiting
    # one more k = 0 round: slot 0 (row 1) leaves the head; a caught-up slot 1 keeps drafting
    s.caught_up(np.array([1]), torch.tensor([1]), torch.ones(1, 3))
    assert s.defer(slots, torch.tensor([7, 8]), {}) == (1, 1)
    assert names(s) == [STALE, DRAFTING]
    assert s.deferred[1] == 1 and s.hidden[1].tolist() == [1.0, 1.0, 1.0]
    assert s.waiting(slots).tolist() == [0]  # a stale row never catches up


def test_hidden_is_written_per_slot() -> None:
    s = states()
    h = torch.tensor([[1.0] * 3, [2.0] * 3])  # [R, h]
    s.set_hidden(torch.tensor([3, 1]), h)
    assert s.hidden[:, 0].tolist() == [0.0, 2.0, 0.0, 1.0]


def test_a_new_prompt_in_a_stale_slot_follows_the_head_again() -> None:
    s = states(1)
    slot = np.array([0])
    s.start(slot, plain=True)
    s.prefilled(slot, partial=np.array([False]))
    assert names(s) == [STALE]
    s.start(s.starting(slot), plain=False)  # the slot's request finished; a new one starts
    s.prefilled(slot, partial=np.array([False]))
    assert names(s) == [DRAFTING]

"""The speculative worker's per-slot state: where each request slot stands with the draft head.

A slot (0..max_batch_size-1, the scheduler's request slot) is in one of these states:

  EMPTY       never prefilled since the worker started (a verify plan may not use it);
  PREFILLING  some chunks of its prompt are computed, not all (chunked prefill);
  DRAFTING    the head follows it: hidden[s] = h^d at its last extended position, and its
              draft K/V is valid up to L-2-deferred[s] (deferred[s] in 0..MAX_DEFERRED: rounds
              of k = 0 whose extend waits, with their inputs in deferred_ids / deferred_states);
  STALE       it left the head for good: it drafts by prompt lookup or not at all. A slot gets
              here when its extend waited more than MAX_DEFERRED rounds, when a plain step ran it,
              or from its start when it joined where drafting cannot pay ("plain" prefill).

Transitions (each a method below):
  start(slots, plain)        EMPTY/any -> PREFILLING or DRAFTING/STALE when the prompt starts
                             (a finished request's slot is not reported: the next prompt in it
                             starts it over);
  prefilled(slots, partial)  the prefill plan ran: PREFILLING while chunks remain;
  to_plain(slots)            a plain step ran it -> STALE;
  defer(...)                 a k = 0 round: DRAFTING with one more deferred extend, or STALE when
                             MAX_DEFERRED are kept already;
  caught_up(slots, h)        the deferred extends ran: deferred = 0, hidden updated.
"""

from __future__ import annotations

import numpy as np
import torch

from eaglebatch.transfer import to_device

# the most k = 0 rounds a row's draft extend waits for before the row leaves the head
MAX_DEFERRED = 8

EMPTY, PREFILLING, DRAFTING, STALE = "empty", "prefilling", "drafting", "stale"


class SlotStates:
    def __init__(self, max_batch_size: int, hidden_size: int, dtype, device) -> None:
        self.device = device
        self.hidden = torch.zeros(
            max_batch_size, hidden_size, dtype=dtype, device=device
        )  # [max_batch_size, h] h^d at each slot's last extended position
        self.ready = np.zeros(max_batch_size, dtype=bool)  # prefilled at least once
        self.deferred = np.zeros(max_batch_size, dtype=np.int64)  # extends waiting
        self.stale = np.zeros(max_batch_size, dtype=bool)  # left the head
        self.prefilling = np.zeros(max_batch_size, dtype=bool)  # a prompt is partly prefilled
        self.deferred_ids = torch.zeros(
            max_batch_size, MAX_DEFERRED, dtype=torch.long, device=device
        )  # [max_batch_size, MAX_DEFERRED] the new token of each deferred round
        self.deferred_states: dict[int, torch.Tensor] = {}  # layer -> [slots, MAX_DEFERRED, H]

    def state(self, slot: int) -> str:
        """The slot's state by name (module doc)."""
        if self.prefilling[slot]:
            return PREFILLING
        if not self.ready[slot]:
            return EMPTY
        return STALE if self.stale[slot] else DRAFTING

    def starting(self, slots: np.ndarray) -> np.ndarray:
        """The slots among `slots` whose prompt starts in this plan (not mid-prompt)."""
        return slots[~self.prefilling[slots]]

    def start(self, slots: np.ndarray, plain: bool) -> None:
        """Prompts start in `slots`: they follow the head unless `plain` (joined where drafting
        cannot pay: they start STALE)."""
        self.stale[slots] = plain

    def prefilled(self, slots: np.ndarray, partial: np.ndarray) -> None:
        """A prefill plan ran over `slots`; partial [B]: the row's chunk stops before its prompt's
        end (PREFILLING). The head's state of the others is at their last prompt position."""
        self.prefilling[slots] = partial
        self.ready[slots] = True
        self.deferred[slots] = 0

    def to_plain(self, slots: np.ndarray, partial: np.ndarray) -> None:
        """A plain step ran over `slots`: every row leaves the head (STALE)."""
        self.stale[slots] = self.ready[slots] = True
        self.deferred[slots] = 0
        self.prefilling[slots] = partial

    def drafting(self, slots: np.ndarray) -> np.ndarray:
        """bool [B]: the slot still follows the head."""
        return ~self.stale[slots]

    def defer(self, slots: np.ndarray, tokens: torch.Tensor,
              captured: dict[int, torch.Tensor]) -> tuple[int, int]:  # fmt: skip
        """Keeps a k = 0 round's draft-extend input per row: the new token x_L (int64 [B]) and
        the target's captured states at L-1 ({layer: [B, H]}). A row with MAX_DEFERRED already
        kept becomes STALE instead. Returns (rows kept, rows that became stale)."""
        live = ~self.stale[slots]
        full = live & (self.deferred[slots] >= MAX_DEFERRED)
        self.stale[slots[full]] = True
        keep = np.flatnonzero(live & ~full)
        if len(keep):
            rows = to_device(keep, self.device, np.int64)
            kept = slots[keep]
            at = (to_device(kept, self.device, np.int64),
                  to_device(self.deferred[kept], self.device, np.int64))  # fmt: skip
            self.deferred_ids.index_put_(at, tokens.index_select(0, rows))
            for layer, state in captured.items():
                self._deferred_state(layer, state).index_put_(at, state.index_select(0, rows))
            self.deferred[kept] += 1
        return len(keep), int(full.sum())

    def _deferred_state(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        if layer not in self.deferred_states:
            self.deferred_states[layer] = torch.zeros(
                *self.deferred_ids.shape, like.shape[-1], dtype=like.dtype, device=self.device
            )  # [slots, MAX_DEFERRED, H]
        return self.deferred_states[layer]

    def waiting(self, slots: np.ndarray) -> np.ndarray:
        """Plan rows (indices into `slots`) with deferred extends to catch up on."""
        return np.flatnonzero((self.deferred[slots] > 0) & ~self.stale[slots])

    def caught_up(self, slots: np.ndarray, on_device: torch.Tensor, h: torch.Tensor) -> None:
        """The deferred extends of `slots` (on_device: the same, int64 on the device) ran; h
        [R, h] is their draft state now."""
        self.set_hidden(on_device, h)
        self.deferred[slots] = 0

    def set_hidden(self, slots: torch.Tensor, h: torch.Tensor) -> None:
        """hidden[slots] = h [R, h] (slots: int64 [R] on the device; the draft output at each
        slot's last extended position)."""
        self.hidden.index_copy_(0, slots, h)

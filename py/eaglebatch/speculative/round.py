"""A verify round's values, one small frozen value per phase (speculative/worker.py's module doc):

  RoundShape  its width and who drafts how much (chosen from the policies and lookup proposals);
  Round       the shape with what the phases read from the plan, fixed before drafting starts;
  Verified    the target's logits over the round's query, with what the eager extend reuses;
  Accepted    the emitted tokens and accepted counts (and their logprobs when asked for);
  Marks       the round's clock marks (worker.py's Clock), for the adaptive policies' costs.

B is the plan's number of rows, k the round's width, W the plan's placeholders per row
(max_draft_tokens at most).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from eaglebatch.attention.base import AttentionMetadata


@dataclass(frozen=True, slots=True)
class RoundShape:
    k: int  # the round's width: a query of k + 1 tokens per row
    k_head: int  # the head's chain length (0: the head does not run)
    n: np.ndarray  # int64 [B] each row's own number of drafts (<= k)
    by_lookup: np.ndarray  # bool [B] the row drafts by prompt lookup
    proposals: list[np.ndarray]  # each row's lookup proposal
    lookup_round: bool  # every row drafts by lookup (the lookup policy's round)


@dataclass(frozen=True, slots=True)
class Round:
    """The round's shape (copied from its RoundShape: plain fields, no properties, as the
    phases read them on every step) and what the phases read from the plan."""

    k: int
    k_head: int
    n: np.ndarray
    by_lookup: np.ndarray
    lookup_round: bool
    plan: Any
    b: int
    cu: np.ndarray  # int64 [B+1] the plan's query offsets
    stale: np.ndarray  # bool [B] rows the head no longer serves, at the start
    head_rows: bool  # the head still serves some row: the target's states are captured
    lookup_ids: np.ndarray  # int64 [B, k] lookup rows' drafts, 0 after n
    head_drafts: bool  # the head drafts for some row
    start: np.ndarray  # int64 [B] L-1
    kv_slots: np.ndarray  # [B, W+1] the plan's KV slots of L-1..L-1+W
    block_tables: torch.Tensor  # int32 [B, M] on the device
    request_slots: torch.Tensor  # int64 [B] the rows' request slots, on the device
    per_row: np.ndarray  # [B+1] 0..B: offsets of one query token a row
    bp: int | None  # padded batch size of the graph steps; None: eager
    defer: bool  # the draft extend waits (worker.py's module doc)
    # structured output: the tokens each constrained row's grammar forces next, drafted first
    forced_ids: torch.Tensor | None = None  # int64 [B, k] (0 past a row's forced_lens)
    forced_lens: np.ndarray | None = None  # int64 [B] <= k
    constrained: bool = False  # some row is under a grammar (the grammar hook's calls run)


@dataclass(frozen=True, slots=True)
class Verified:
    logits: torch.Tensor  # [B, k+1, V]
    captured: dict[int, torch.Tensor] | None = None  # eager: layer -> [B*(k+1), H]
    positions: torch.Tensor | None = None  # eager: int64 [B*(k+1)]
    meta: AttentionMetadata | None = None  # eager: the verify query's


@dataclass(frozen=True, slots=True)
class Accepted:
    tokens: torch.Tensor  # int64 [B, k+1] accepted drafts, then the target's token
    accepted: torch.Tensor  # int64 [B]
    logprobs: tuple | None  # of tokens at all B*(k+1) positions (logprobs.py)
    # bool [B]: the row's emitted token (at `accepted`) had no allowed token (NO_TOKEN)
    no_token: torch.Tensor | None = None


@dataclass(slots=True)
class Marks:
    """Clock marks of a round: before the catch-up, before drafting, before verify, after the
    synchronisation."""

    tc: Any = None
    t0: Any = None
    t1: Any = None
    t2: Any = None

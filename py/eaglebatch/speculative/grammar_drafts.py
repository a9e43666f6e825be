"""Structured output in speculative rounds (docs/structured-output.md): the grammar hook of
`SpecWorker`. The scheduler owns the grammars; a round asks it three things, here:

  * forced drafts, when the round is shaped: the tokens a constrained row's grammar forces
    next (the plan's forced_ids) are drafted first, ahead of the head's;
  * masked drafting, at each step of an eager chain: the constrained rows' allowed tokens at
    the next draft position (`Scheduler.draft_step_masks`);
  * validation, before the target verifies: the drafts each grammar accepts, with the masks per
    verify position that keep verification exact (`Scheduler.draft_masks`).

`bind` takes the two scheduler methods (runner.build_scheduler calls it through
`SpecWorker.bind`); a round with constrained rows and nothing bound is an error.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from eaglebatch.sampling.logits_processing import GrammarMask
from eaglebatch.speculative.round import RoundShape
from eaglebatch.transfer import to_device


class GrammarDrafts:
    def __init__(self, forced_drafts: bool, device: torch.device) -> None:
        """forced_drafts: whether the tokens a grammar forces are drafted ahead of the head's
        (the worker's forced_tokens set)."""
        self.forced_drafts = forced_drafts
        self.device = device
        self.masks = None  # Scheduler.draft_masks (bind)
        self.step_masks = None  # Scheduler.draft_step_masks (bind)

    def bind(self, scheduler) -> None:
        """The scheduler whose grammars the rounds draft under and validate against."""
        self.masks, self.step_masks = scheduler.draft_masks, scheduler.draft_step_masks

    def forced(self, plan, shape: RoundShape, k_plan: int, graphs: bool) -> tuple:
        """The round's forced drafts: (shape, ids int64 [B, k] on the device, lens int64 [B]),
        each constrained row's forced tokens, at most W (k_plan). A row drafts those first; a
        row the head serves then drafts its own n head tokens after them (the head's chain runs
        through the forced tokens and on), so the round widens to fit, up to W, also where the
        policy chose not to draft (forced drafts cost no draft step). Eager rounds only widen:
        graphs (`graphs`: the worker runs graph steps) are captured per K. (shape, None, None)
        without any."""
        lens = np.minimum(np.diff(plan.cu_forced.astype(np.int64)), k_plan)  # [B]
        if not self.forced_drafts or not lens.any() or (graphs and shape.k == 0):
            return shape, None, None
        head = ~shape.by_lookup & (shape.k_head > 0)  # [B] rows whose drafts the head makes
        n = np.where(lens > 0, np.where(head, lens + shape.n, np.maximum(lens, shape.n)), shape.n)
        k = shape.k if graphs else min(max(shape.k, int(n.max())), k_plan)
        lens, n = np.minimum(lens, k), np.minimum(n, k)
        ids = np.zeros((len(lens), k), dtype=np.int64)
        for i in np.flatnonzero(lens):
            start = int(plan.cu_forced[i])
            ids[i, : lens[i]] = plan.forced_ids[start : start + lens[i]]
        k_head = k if shape.k_head > 0 else 0
        shape = dataclasses.replace(shape, k=k, k_head=k_head, n=n)
        return shape, to_device(ids, self.device, np.int64), lens

    def head_masks(self, plan, drafts: torch.Tensor | None):
        """Masked drafting (eager chains): the constrained rows' allowed tokens at the next
        draft position, from the scheduler (`drafts` [B]: the ones just chosen; None starts the
        round), as `argmax_tokens` takes them; None when the plan has no constrained row."""
        if self.step_masks is None or not bool((plan.mask_rows >= 0).any()):
            return None
        rows, packed = self.step_masks(None if drafts is None else drafts.cpu().numpy())
        mask = GrammarMask.of_drafts(rows, packed[:, None, :], self.device)
        return None if mask is None else (mask.rows, mask.allowed[:, 0])

    def verify_masks(
        self, plan, n: np.ndarray, draft_ids: torch.Tensor
    ) -> tuple[GrammarMask | None, int]:
        """The constrained rows' masks per verify position, from the scheduler, which validates
        their drafts: a row's drafts are cut (its n [B] lowered in place) at the first one its
        grammar refuses. Returns the masks (None when the plan has no constrained row) and how
        many drafts were cut."""
        if not bool((plan.mask_rows >= 0).any()):
            return None, 0
        if self.masks is None:  # verifying without the masks would not be exact
            raise RuntimeError("a verify plan with constrained rows needs the scheduler's "
                               "draft_masks (SpecWorker.bind, called by build_scheduler)")
        rows, valid, masks = self.masks(draft_ids.cpu().numpy())
        cut = np.minimum(n[rows], valid)
        refused = int((n[rows] - cut).sum())
        n[rows] = cut
        return GrammarMask.of_drafts(rows, masks, self.device), refused

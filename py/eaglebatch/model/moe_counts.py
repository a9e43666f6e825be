"""How many tokens one pass over an expert's weights serves in generation: the (token, expert)
pairs a run's routed MLPs (moe.py) computed and the experts active in each layer's step,
summed over layers and the steps that only generated (decode and verify; prefills route many
tokens at once and would hide what batching buys). `count_routing` turns it on for a model's
routed MLPs; the engine does for CPU runs, where the host already holds a step's expert ids
(on CUDA counting would add a host sync), and closes each step with its kind."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

GENERATION_KINDS = ("decode", "verify")  # the engine's step kinds that only generate


@dataclass
class RoutingCounts:
    pairs: int = 0  # (token, expert) pairs of the generation steps
    active: int = 0  # experts with at least one token, per layer and generation step
    _step_pairs: int = 0  # ... of the step running, until `close_step`
    _step_active: int = 0

    def add(self, rows: torch.Tensor) -> None:  # int64 [E]: one layer step's `expert_rows`
        self._step_pairs += int(rows.sum())
        self._step_active += int((rows > 0).sum())

    def close_step(self, kind: str) -> None:
        """The step's counts go to the totals when it only generated, else are dropped."""
        if kind in GENERATION_KINDS:
            self.pairs += self._step_pairs
            self.active += self._step_active
        self._step_pairs = self._step_active = 0

    @property
    def rows_per_active(self) -> float | None:
        """Tokens per active expert per layer and generation step (None before any)."""
        return self.pairs / self.active if self.active else None


def count_routing(model: nn.Module) -> RoutingCounts | None:
    """One RoutingCounts shared by every routed MLP of `model`; None when it has none."""
    from eaglebatch.model.moe import SparseMoeBlock  # moe.py reads only the attribute

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return None
    counts = RoutingCounts()
    for b in blocks:
        b.routing_counts = counts
    return counts

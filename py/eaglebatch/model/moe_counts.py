"""How many tokens one pass over an expert's weights serves: the (token, expert) pairs a run's
routed MLPs (moe.py) computed and the experts active in each layer's step, summed over layers
and steps. `count_routing` turns it on for a model's routed MLPs; the engine does for CPU runs,
where the host already holds a step's expert ids (on CUDA counting would add a host sync)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class RoutingCounts:
    pairs: int = 0  # (token, expert) pairs computed
    active: int = 0  # experts with at least one token, per layer and step

    def add(self, experts: torch.Tensor) -> None:  # int64 [T, k] one layer's step
        flat = experts.reshape(-1)
        self.pairs += flat.numel()
        self.active += int(torch.unique(flat).numel())

    @property
    def rows_per_active(self) -> float | None:
        """Tokens per active expert per layer step (None before any step)."""
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

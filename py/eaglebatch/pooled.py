"""A pooled task's step (`task: embed | classify | reward`, rust/src/pooled.rs): from the final
hidden states of a plan's query tokens, each plan row's contribution to its row's pooled
value, which the scheduler sums over the row's chunks (`Scheduler.commit`'s `pooled`).

A row's contribution is the sum over its chunk's positions that the pooling selects (every
prompt position for mean, the last prompt position for last, position 0 for cls; zeros when
the chunk holds none of them) of the hidden state (embed) or of the score head's logits over
it (classify, reward). The head is linear without bias, so a sum of zeros is zero and the
row's sum is the head over its pooled hidden state.
"""

from __future__ import annotations

import numpy as np
import torch


def selected_positions(plan, pooling: str) -> tuple[np.ndarray, np.ndarray]:
    """(query token indices, their plan rows) of the positions `pooling` selects."""
    cu = plan.cu_seqlens_q.astype(np.int64)
    rows = np.repeat(np.arange(plan.num_seqs), np.diff(cu))  # [T]
    pos = plan.positions.astype(np.int64)
    if pooling == "mean":
        keep = np.ones(len(pos), dtype=bool)
    elif pooling == "last":
        keep = pos == plan.prompt_lens.astype(np.int64)[rows] - 1
    else:  # cls: the first token
        keep = pos == 0
    index = np.flatnonzero(keep)
    return index, rows[index]


def pooled_sums(model, hidden: torch.Tensor, plan, pooling: str, head: bool) -> torch.Tensor:
    """float32 [B, W] contributions (module doc) from hidden [T, H] of the plan's query
    tokens; `head`: through the model's score head (W its outputs), else W = H."""
    index, rows = selected_positions(plan, pooling)
    dev = hidden.device
    picked = hidden.index_select(0, torch.from_numpy(index).to(dev))  # [N, H]
    values = model.compute_logits(picked) if head else picked.float()  # [N, W] float32
    out = torch.zeros(plan.num_seqs, values.shape[-1], dtype=torch.float32, device=dev)
    return out.index_add_(0, torch.from_numpy(rows).to(dev), values)

"""The recurrent-state pool of a hybrid (linear-attention) model: how many rows, how often the
scheduler checkpoints a prompt's state, and what it costs in memory. Counted in the KV budget
before any KV block (worker.plan_kv_budget), shown on the memory line (job/memory.py).

Rows: one per request slot (engine.max_batch_size: a running sequence keeps its row) plus the
checkpoints prefix caching restores from (2 x max_batch_size with prefix caching on, else none:
a hit then never happens, since no saved state matches a cached block). The checkpoint
interval: every CHECKPOINT_TOKENS tokens, rounded up to a multiple of engine.block_size (the
scheduler cuts a prefix-cache hit back to the deepest block boundary that has a checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eaglebatch.errors import JobError

CHECKPOINT_TOKENS = 64  # the interval before rounding to whole blocks: the prefill form's chunk
CHECKPOINTS_PER_SLOT = 2  # checkpoint rows per request slot, with prefix caching on


@dataclass(frozen=True)
class StatePlan:
    slots: int  # request rows (engine.max_batch_size)
    checkpoints: int  # checkpoint rows (0: prefix caching never hits)
    interval: int  # tokens between checkpoints, a multiple of the block size
    row_bytes: int  # one row over every linear layer (conv + SSM, float32)

    @property
    def nbytes(self) -> int:
        return (self.slots + self.checkpoints) * self.row_bytes

    def describe(self) -> str:
        return (f"{self.nbytes / 2**30:.2f} GiB of recurrent states ({self.slots} request "
                f"slots (engine.max_batch_size) + {self.checkpoints} prefix-cache "
                f"checkpoints, {self.row_bytes / 2**20:.1f} MiB each)")  # fmt: skip


def state_plan(eng, cfg) -> StatePlan | None:
    """The pool of `cfg`'s linear layers under engine section `eng`; None: the model has no
    recurrent state."""
    layers = cfg.linear_layers
    if not layers:
        return None
    interval = math.ceil(CHECKPOINT_TOKENS / eng.block_size) * eng.block_size
    checkpoints = CHECKPOINTS_PER_SLOT * eng.max_batch_size if eng.prefix_caching else 0
    return StatePlan(eng.max_batch_size, checkpoints, interval,
                     cfg.deltanet.state_bytes * len(layers))  # fmt: skip


def check_states_fit(plan: StatePlan | None, usable: int, where: str) -> None:
    """JobError naming engine.max_batch_size when the pool alone exceeds `usable` bytes (the
    memory the KV budget may take: `where` says which)."""
    if plan is not None and plan.nbytes > usable:
        raise JobError(
            f"engine.max_batch_size: {plan.describe()} do not fit in {usable / 2**30:.2f} GiB "
            f"({where}); lower engine.max_batch_size (or turn engine.prefix_caching off: its "
            f"checkpoints double the pool)"
        )

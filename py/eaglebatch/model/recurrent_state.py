"""The recurrent states of a hybrid model's Gated DeltaNet layers, and what one step does with
them (the scheduler's contract: rust/ StepPlan `state_from` / `state_saves`).

Storage (`RecurrentStates`): per linear layer, conv [R, conv_dim, K-1] and SSM [R, Hv, Dk, Dv],
float32, R = `slots` request rows (the plan's `request_slots`: a running sequence keeps its
row) + `checkpoints` rows (checkpoint c is row slots + c: a sequence's state saved at a block
boundary, restored on a prefix-cache hit). A row always holds the state after every token of
its sequence the model has consumed, never more.

One step (`StepContext`, set by the worker before the model's forward): each query row's state
row, its query length, its form (the chunked prefill form, else the recurrent step form), the
checkpoints to save after given query offsets, and whether to keep the state after every
token of the step-form rows (a speculative verify keeps the one after its last accepted
token: exact rollback, no replay). `run_linear` applies one linear layer under it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from eaglebatch.model.deltanet_shape import DeltaNetShape

STATE_CONTINUE, STATE_ZERO = -1, -2  # StepPlan.state_from's codes (else a checkpoint index)


@dataclass
class StepContext:
    slots: list[int]  # per query row: its state row (< the pool's `slots`)
    lengths: list[int]  # per query row: its query tokens (>= 1), the packed order
    chunked: list[bool]  # per query row: the chunked prefill form (else the step form)
    # (row b, query offset j, pool row): that row must hold row b's state after its token j
    saves: list[tuple[int, int, int]] = field(default_factory=list)
    keep: bool = False  # keep the step-form rows' states after every token (`kept`)
    # layer -> (conv [N, C, K-1], SSM [N, Hv, Dk, Dv]) after each of the N step-form tokens,
    # packed in query order (filled by run_linear when `keep`)
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def of_plan(cls, plan, slots: int, keep: bool = False) -> StepContext:
        """A scheduler plan's rows: query length 1 (decode) or `keep` (verify): the step form;
        longer prefill queries the chunked form. `slots`: the pool's request rows."""
        lengths = np.diff(np.asarray(plan.cu_seqlens_q)).tolist()
        saves = [(int(b), int(j), slots + int(c)) for b, j, c in np.asarray(plan.state_saves)]
        return cls(slots=np.asarray(plan.request_slots).tolist(), lengths=lengths,
                   chunked=[n > 1 and not keep for n in lengths], saves=saves,
                   keep=keep)  # fmt: skip


class LayerStates:
    """One linear layer's rows: conv [R, conv_dim, K-1] and SSM [R, Hv, Dk, Dv], float32."""

    def __init__(self, shape: DeltaNetShape, rows: int, device, pool: RecurrentStates) -> None:
        self.conv = torch.zeros(rows, *shape.conv_state_shape, device=device)
        self.ssm = torch.zeros(rows, *shape.ssm_state_shape, device=device)
        self.pool = pool

    @property
    def context(self) -> StepContext:
        if self.pool.context is None:
            raise RuntimeError("a hybrid model's forward needs a StepContext (RecurrentStates)")
        return self.pool.context


class RecurrentStates:
    """Every linear layer's `LayerStates` over `slots` request rows + `checkpoints` rows."""

    def __init__(self, shape: DeltaNetShape, layers: Sequence[int], slots: int,
                 checkpoints: int, device) -> None:  # fmt: skip
        self.slots, self.checkpoints = slots, checkpoints
        self.context: StepContext | None = None
        rows = slots + checkpoints
        self.layers = {i: LayerStates(shape, rows, device, self) for i in layers}

    @staticmethod
    def bytes_per_row(shape: DeltaNetShape, num_layers: int) -> int:
        return shape.state_bytes * num_layers

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for s in self.layers.values() for t in (s.conv, s.ssm))  # fmt: skip

    def restore(self, slots: Sequence[int], state_from: Sequence[int]) -> None:
        """Before a step: row b's slot zeroed (STATE_ZERO) or copied from checkpoint c >= 0;
        STATE_CONTINUE leaves it."""
        zero = [s for s, f in zip(slots, state_from) if f == STATE_ZERO]
        copies = [(self.slots + f, s) for s, f in zip(slots, state_from) if f >= 0]
        for states in self.layers.values():
            for t in (states.conv, states.ssm):
                if zero:
                    t[zero] = 0.0
                if copies:
                    src, dst = zip(*copies)
                    t[list(dst)] = t[list(src)]

    def keep_accepted(self, ctx: StepContext, accepted: Sequence[int]) -> None:
        """After a verify (every row in the step form, `ctx.keep`): row b's slot := its state
        after query token accepted[b] (0 = its first query token: no draft accepted)."""
        starts = np.cumsum([0, *ctx.lengths[:-1]])
        tokens = [int(s) + int(a) for s, a in zip(starts, accepted)]
        for i, states in self.layers.items():
            conv, ssm = ctx.kept.pop(i)
            states.conv[ctx.slots] = conv[tokens]
            states.ssm[ctx.slots] = ssm[tokens]


def run_linear(module, x: torch.Tensor, states: LayerStates, layer: int) -> torch.Tensor:
    """One Gated DeltaNet layer (model/gated_deltanet.py) over a step's packed tokens x [T, H]
    under its StepContext: chunked rows one at a time (split after each saved offset), the
    step-form rows together; every row's slot ends holding the state after its query."""
    ctx = states.context
    out = torch.empty_like(x)
    starts = np.cumsum([0, *ctx.lengths[:-1]]).tolist()
    saves: dict[int, list[tuple[int, int]]] = {}
    for b, j, row in ctx.saves:
        saves.setdefault(b, []).append((j, row))
    step_rows = [b for b, chunked in enumerate(ctx.chunked) if not chunked]
    for b, chunked in enumerate(ctx.chunked):
        if chunked:
            _prefill_row(module, x, out, states, ctx, b, starts[b], saves.get(b, []))
    if step_rows:
        _step_rows(module, x, out, states, ctx, step_rows, starts, saves, layer)
    return out


def _prefill_row(module, x, out, states: LayerStates, ctx: StepContext, b: int, start: int,
                 saves: list[tuple[int, int]]) -> None:  # fmt: skip
    """Row b's query x[start:start+n] in the chunked form, cut after each saved offset."""
    n, slot = ctx.lengths[b], ctx.slots[b]
    conv, ssm = states.conv[slot], states.ssm[slot]
    cuts = sorted({j + 1 for j, _ in saves} | {n})
    done = 0
    for cut in cuts:
        part = slice(start + done, start + cut)
        out[part], conv, ssm = module.prefill(x[part], conv, ssm)
        for j, row in saves:
            if j + 1 == cut:
                states.conv[row], states.ssm[row] = conv, ssm
        done = cut
    states.conv[slot], states.ssm[slot] = conv, ssm


def _step_rows(module, x, out, states: LayerStates, ctx: StepContext, rows: list[int],
               starts: list[int], saves: dict, layer: int) -> None:  # fmt: skip
    """The step-form rows together: outputs, each slot after its last token, saves, and with
    `ctx.keep` every token's state (ctx.kept[layer])."""
    lengths = [ctx.lengths[b] for b in rows]
    index = torch.cat([torch.arange(starts[b], starts[b] + ctx.lengths[b]) for b in rows])
    index = index.to(x.device)
    slots = [ctx.slots[b] for b in rows]
    o, conv_after, ssm_after = module.step(x.index_select(0, index), lengths,
                                           states.conv[slots], states.ssm[slots])  # fmt: skip
    out[index] = o
    first = np.cumsum([0, *lengths[:-1]])
    last = (first + np.asarray(lengths) - 1).tolist()
    states.conv[slots], states.ssm[slots] = conv_after[last], ssm_after[last]
    for k, b in enumerate(rows):
        for j, row in saves.get(b, []):
            states.conv[row], states.ssm[row] = conv_after[first[k] + j], ssm_after[first[k] + j]
    if ctx.keep:
        ctx.kept[layer] = (conv_after, ssm_after)

"""The recurrent states of a hybrid model's Gated DeltaNet layers, and what one step does with
them (the scheduler's contract: rust/ StepPlan `state_from` / `state_saves`).

Storage (`RecurrentStates`): per linear layer, conv [R, conv_dim, K-1] and SSM [R, Hv, Dk, Dv],
float32, R = `slots` request rows (the plan's `request_slots`: a running sequence keeps its
row) + `checkpoints` rows (checkpoint c is row slots + c: a sequence's state saved at a block
boundary, restored on a prefix-cache hit). A row always holds the state after every token of
its sequence the model has consumed, never more.

One step (`StepContext`, set by the worker before the model's forward): each query row's state
row, its query length, its form (the chunked prefill form, else the recurrent step form), the
checkpoints to save after given query offsets, and whether the round is a speculative verify:
then the slots keep the states before the round and each layer keeps what its tokens fed the
states (a few values per token, not a state per position), and after acceptance every row
replays its accepted tokens from there (`keep_accepted`: the same operations, so the same
states as a step over those tokens alone). `run_linear` applies one linear layer under it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from eaglebatch.model.deltanet_shape import DeltaNetShape
from eaglebatch.model.gated_deltanet import row_index

STATE_CONTINUE, STATE_ZERO = -1, -2  # StepPlan.state_from's codes (else a checkpoint index)


@dataclass
class StepContext:
    slots: list[int]  # per query row: its state row (< the pool's `slots`)
    lengths: list[int]  # per query row: its query tokens (>= 1), the packed order
    chunked: list[bool]  # per query row: the chunked prefill form (else the step form)
    # (row b, query offset j, pool row): that row must hold row b's state after its token j
    saves: list[tuple[int, int, int]] = field(default_factory=list)
    # a verify: the slots keep the states before the round, and `kept` what each layer's
    # tokens fed them (`RecurrentStates.keep_accepted` replays the accepted ones)
    keep: bool = False
    # layer -> (its GatedDeltaNet, StepInputs of the N step-form tokens in query order)
    kept: dict[int, tuple] = field(default_factory=dict)

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
        """After a verify (every row in the step form, `ctx.keep`; the slots still hold the
        states before the round): row b's slot := its state after query token accepted[b]
        (0 = its first query token: no draft accepted), replayed from the round's inputs."""
        lengths = [int(a) + 1 for a in accepted]
        index = _packed_index(np.cumsum([0, *ctx.lengths[:-1]]).tolist(), lengths)
        for i, states in self.layers.items():
            module, inputs = ctx.kept.pop(i)
            conv, ssm = states.conv[ctx.slots], states.ssm[ctx.slots]
            index_on = index.to(conv.device)
            states.conv[ctx.slots], states.ssm[ctx.slots] = module.advance(
                inputs, index_on, lengths, conv, ssm)


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
    index = _packed_index([starts[b] for b in rows], lengths).to(x.device)
    slots = [ctx.slots[b] for b in rows]
    o, conv_after, ssm_after, inputs = module.step_with_inputs(
        x.index_select(0, index), lengths, states.conv[slots], states.ssm[slots])
    out[index] = o
    if ctx.keep:  # the slots keep the states before the round until keep_accepted
        ctx.kept[layer] = (module, inputs)
        return
    first = np.cumsum([0, *lengths[:-1]])
    last = (first + np.asarray(lengths) - 1).tolist()
    states.conv[slots], states.ssm[slots] = conv_after[last], ssm_after[last]
    for k, b in enumerate(rows):
        for j, row in saves.get(b, []):
            states.conv[row], states.ssm[row] = conv_after[first[k] + j], ssm_after[first[k] + j]


def _packed_index(starts: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """int64 [sum(lengths)]: starts[i], starts[i] + 1, ... (lengths[i] of them), row after row."""
    rows, pos = row_index(lengths, "cpu")
    return torch.tensor(list(starts), dtype=torch.int64)[rows] + pos

"""The extension's gated delta rule (`_native.delta_rule_steps`) for a hybrid model's decode
and verify steps: swapped into every GatedDeltaNet of a float32 CPU model (`accelerate`).

torch runs the recurrent form (model/delta_rule.py's `stepwise_delta_rule`, the reference) as
about fifteen small ops per position over [B, Hv, Dk, Dv] tensors; the kernel makes two passes
over each (token, head)'s Dk x Dv state instead. The same operations in another summation
order: float32 rounding apart, the same values (tests/test_cpu_deltanet.py). Float64 states
(the layer tests' exact algebra) and anything needing a gradient stay on torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from eaglebatch import _native
from eaglebatch.cpu.swap import become, restore
from eaglebatch.cpu.tensors import native_ptr
from eaglebatch.model.delta_rule import stepwise_delta_rule
from eaglebatch.model.gated_deltanet import GatedDeltaNet


def native_steps(
    q: torch.Tensor,  # float32 [T, Hv, Dk]
    k: torch.Tensor,  # float32 [T, Hv, Dk]
    v: torch.Tensor,  # float32 [T, Hv, Dv]
    g: torch.Tensor,  # float32 [T, Hv]
    beta: torch.Tensor,  # float32 [T, Hv]
    lengths: Sequence[int],
    states: torch.Tensor,  # float32 [B, Hv, Dk, Dv]
) -> tuple[torch.Tensor, torch.Tensor]:  # (o [T, Hv, Dv], after [T, Hv, Dk, Dv])
    """`stepwise_delta_rule` on the extension when every tensor is float32 on the CPU and no
    gradient is wanted; torch's otherwise."""
    tensors = (q, k, v, g, beta, states)
    if torch.is_grad_enabled() or any(t.dtype != torch.float32 or not t.is_cpu for t in tensors):
        return stepwise_delta_rule(q, k, v, g, beta, lengths, states)
    t, heads, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta, states = (x.contiguous() for x in tensors)
    o = v.new_empty((t, heads, dv))
    after = states.new_empty((t, heads, dk, dv))
    f32 = torch.float32
    addrs = [native_ptr(q, f32, (t, heads, dk)), native_ptr(k, f32, (t, heads, dk)),
             native_ptr(v, f32, (t, heads, dv)), native_ptr(g, f32, (t, heads)),
             native_ptr(beta, f32, (t, heads)),
             native_ptr(states, f32, (len(lengths), heads, dk, dv)),
             native_ptr(o, f32, (t, heads, dv)), native_ptr(after, f32, (t, heads, dk, dv))]
    _native.delta_rule_steps(addrs, [int(n) for n in lengths], heads, dk, dv)  # fmt: skip
    return o, after


class NativeDeltaNet:
    """A GatedDeltaNet whose step form runs the extension's delta rule (`native_steps`)."""

    state = ()

    def _recurrence(self, q, k, v, g, beta, lengths, states):
        return native_steps(q, k, v, g, beta, lengths, states)


def use_native_deltanet(model: nn.Module, threads: int) -> None:
    """Swaps `NativeDeltaNet` into every GatedDeltaNet of `model` (threads > 0), or makes them
    plain torch again (0)."""
    for m in model.modules():
        if isinstance(m, GatedDeltaNet) and threads > 0:
            become(m, NativeDeltaNet)
        elif isinstance(m, GatedDeltaNet):
            restore(m)

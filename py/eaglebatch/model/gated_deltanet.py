"""The Gated DeltaNet (linear-attention) layer of Qwen3.5 (`qwen3_5_text`, the text tower of
`qwen3_5`, `qwen3_5_moe`) and Qwen3-Next (`qwen3_next`), over explicit per-row states.

Per token x [H]: q, k, v (in_proj_qkv), z (in_proj_z), b (in_proj_b), a (in_proj_a); q, k, v go
through a causal depthwise convolution of K taps (its state: the last K - 1 inputs) and SiLU;
q and k are L2-normalised per head (q also times Dk ** -0.5); beta = sigmoid(b); the log decay
g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule (delta_rule.py) gives o per value
head, normed by a gated RMSNorm (w * o / rms(o) * silu(z)) and projected back by out_proj.
Parameter names are the checkpoints' (`linear_attn.*` of Qwen3.5; Qwen3-Next's fused
`in_proj_qkvz` / `in_proj_ba` are split by deltanet_layout.py).

Two forms, equal to transformers' torch implementation (tests/test_gated_deltanet.py):
  `prefill`: one sequence of T tokens from its (conv, SSM) state, chunked; returns the outputs
             and the states after its last token (split prefills chain exactly).
  `step`:    B rows of 1..k+1 tokens each (decode, speculative verify), from per-row states;
             returns the states after EVERY token, so a verify keeps the state after the last
             accepted one (exact rollback without a replay).
States are float32 (deltanet_shape.py has their shapes) and the delta rule runs in the
states' dtype (float64 states make the tests' exact comparisons); the conv state holds the
activation dtype's values exactly (bf16/fp16 widen to float32 without rounding).

In the engine: decoder_layer.py holds one as `linear_attn` on the layers ModelConfig marks
linear; model/recurrent_state.py stores the states per request slot and checkpoint and runs a
step's rows in the right form (`run_linear`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eaglebatch.model.delta_rule import CHUNK, chunked_delta_rule, stepwise_delta_rule
from eaglebatch.model.deltanet_shape import DeltaNetShape

L2_EPS = 1e-6  # in rsqrt(sum(x^2) + eps) of the q/k normalisation


class GatedRMSNorm(nn.Module):
    """w * (o / rms(o)) * silu(z) over each value head's Dv values: normalised in float32, cast
    back, scaled, gated in float32, cast back last (the reference's order)."""

    def __init__(self, size: int, eps: float, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # [..., Dv] x2
        wide = torch.promote_types(o.dtype, torch.float32)  # float64 stays float64 (tests)
        o32 = o.to(wide)
        normed = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(o.dtype) * F.silu(z.to(wide))).to(o.dtype)


@dataclass(frozen=True)
class StepInputs:
    """What a step's T tokens fed the states: the convolution's inputs mixed [T, conv_dim] and
    the delta rule's (q, k, v, g, beta), all in the states' dtype (`GatedDeltaNet.advance`)."""

    mixed: torch.Tensor
    delta: tuple[torch.Tensor, ...]


class GatedDeltaNet(nn.Module):
    def __init__(self, shape: DeltaNetShape, **factory) -> None:
        super().__init__()
        self.shape = s = shape
        self.in_proj_qkv = nn.Linear(s.hidden_size, s.conv_dim, bias=False, **factory)
        self.in_proj_z = nn.Linear(s.hidden_size, s.value_dim, bias=False, **factory)
        self.in_proj_b = nn.Linear(s.hidden_size, s.num_v_heads, bias=False, **factory)
        self.in_proj_a = nn.Linear(s.hidden_size, s.num_v_heads, bias=False, **factory)
        # depthwise: [conv_dim, 1, K], the checkpoint's nn.Conv1d weight, no bias
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim,
                                bias=False, **factory)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads, **factory))  # [Hv]
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads, **factory))  # [Hv]
        self.norm = GatedRMSNorm(s.head_v_dim, s.eps, **factory)
        self.out_proj = nn.Linear(s.value_dim, s.hidden_size, bias=False, **factory)

    def new_states(self, rows: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed states of `rows` fresh sequences: conv [B, conv_dim, K-1], SSM [B, Hv, Dk, Dv]."""
        s = self.shape
        return (torch.zeros(rows, *s.conv_state_shape, device=device),
                torch.zeros(rows, *s.ssm_state_shape, device=device))  # fmt: skip

    def prefill(
        self,
        x: torch.Tensor,  # [T, H] one sequence's tokens, T >= 1
        conv_state: torch.Tensor,  # float32 [conv_dim, K-1] before token 0
        ssm_state: torch.Tensor,  # float32 [Hv, Dk, Dv] before token 0
        chunk: int = CHUNK,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # out [T, H], conv, SSM after token T-1
        """The chunked form; the states given are not modified."""
        mixed = self.in_proj_qkv(x)  # [T, conv_dim]
        window = torch.cat((conv_state, mixed.to(conv_state.dtype).t()), dim=-1)  # [C, K-1+T]
        conv_out = self._convolve(window.unsqueeze(0), x.dtype)[0].t()  # [T, conv_dim]
        q, k, v, g, beta = self._delta_inputs(x, conv_out, ssm_state.dtype)
        o, ssm_after = chunked_delta_rule(q, k, v, g, beta, ssm_state, chunk)
        conv_after = window[:, window.shape[-1] - conv_state.shape[-1]:].clone()
        return self._output(x, o), conv_after, ssm_after

    def step(
        self,
        x: torch.Tensor,  # [T, H] packed rows
        lengths: Sequence[int],  # B host ints >= 1 summing to T
        conv_states: torch.Tensor,  # float32 [B, conv_dim, K-1]
        ssm_states: torch.Tensor,  # float32 [B, Hv, Dk, Dv]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(out [T, H], conv after each token [T, conv_dim, K-1], SSM after each token
        [T, Hv, Dk, Dv]): the recurrent form. The states given are not modified."""
        out, conv_after, ssm_after, _ = self.step_with_inputs(x, lengths, conv_states, ssm_states)
        return out, conv_after, ssm_after

    def step_with_inputs(
        self, x: torch.Tensor, lengths: Sequence[int], conv_states: torch.Tensor,
        ssm_states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, StepInputs]:  # fmt: skip
        """`step`, and what its tokens fed the states (`advance` replays a prefix of them)."""
        mixed = self.in_proj_qkv(x).to(conv_states.dtype)  # [T, conv_dim]
        windows, conv_after = _row_windows(mixed, lengths, conv_states)
        conv_out = self._convolve(windows, x.dtype)  # [B, conv_dim, L]
        conv_out = _packed(conv_out.transpose(1, 2), lengths)  # [T, conv_dim]
        q, k, v, g, beta = self._delta_inputs(x, conv_out, ssm_states.dtype)
        o, ssm_after = self._recurrence(q, k, v, g, beta, lengths, ssm_states)
        inputs = StepInputs(mixed, (q, k, v, g, beta))
        return self._output(x, o), conv_after, ssm_after, inputs

    def advance(
        self,
        inputs: StepInputs,  # an earlier step's, over T packed tokens
        index: torch.Tensor,  # int64 [T'] the tokens to replay, each row's first ones, packed
        lengths: Sequence[int],  # B' host ints >= 1 summing to T': tokens replayed per row
        conv_states: torch.Tensor,  # float32 [B', conv_dim, K-1] before each row's first token
        ssm_states: torch.Tensor,  # float32 [B', Hv, Dk, Dv]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # conv [B', conv_dim, K-1], SSM [B', Hv, Dk, Dv]
        """The states after each row's replayed tokens: a verify's rows advance over the tokens
        they accepted only (the same operations as the step, so the same values), which keeps
        a round's memory to its inputs instead of a state per position."""
        _, conv_after = _row_windows(inputs.mixed[index], lengths, conv_states)
        parts = (t[index] for t in inputs.delta)
        _, ssm_after = self._recurrence(*parts, lengths, ssm_states)
        last = torch.cumsum(torch.tensor(list(lengths)), 0) - 1
        return conv_after[last], ssm_after[last.to(ssm_after.device)]

    def _recurrence(self, q, k, v, g, beta, lengths, states):
        """The step form's delta rule (`stepwise_delta_rule`; the CPU fast path swaps in its
        native kernel: cpu/deltanet.py)."""
        return stepwise_delta_rule(q, k, v, g, beta, lengths, states)

    def _convolve(self, windows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """windows float32 [B, conv_dim, K-1+L] -> silu(conv) [B, conv_dim, L] in `dtype`,
        convolved in the weight's dtype (the reference's)."""
        weight = self.conv1d.weight  # [conv_dim, 1, K]
        out = F.conv1d(windows.to(weight.dtype), weight, groups=weight.shape[0])
        return F.silu(out).to(dtype)

    def _delta_inputs(self, x: torch.Tensor, conv_out: torch.Tensor, dt: torch.dtype):
        """x [T, H], conv_out [T, conv_dim] -> q, k [T, Hv, Dk], v [T, Hv, Dv], g, beta [T, Hv]
        in `dt` (the states' dtype), as the module doc defines them."""
        s, n = self.shape, x.shape[0]
        q, k, v = conv_out.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        repeat = s.num_v_heads // s.num_k_heads  # each key head serves `repeat` value heads
        q, k = (_l2_normalised(t.reshape(n, s.num_k_heads, s.head_k_dim).to(dt))
                .repeat_interleave(repeat, dim=1) for t in (q, k))  # fmt: skip
        q = q * s.head_k_dim**-0.5
        beta = self.in_proj_b(x).sigmoid().to(dt)  # sigmoid in the activations' dtype
        g = -self.A_log.to(dt).exp() * F.softplus(self.in_proj_a(x).to(dt) + self.dt_bias)
        return q, k, v.reshape(n, s.num_v_heads, s.head_v_dim).to(dt), g.to(dt), beta

    def _output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:  # o f32 [T, Hv, Dv]
        z = self.in_proj_z(x).view(o.shape)  # [T, Hv, Dv]
        return self.out_proj(self.norm(o.to(x.dtype), z).reshape(x.shape[0], -1))  # [T, H]


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:  # [..., D] in the states' dtype
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _row_windows(
    mixed: torch.Tensor,  # [T, C] packed rows' conv inputs, in the states' dtype
    lengths: Sequence[int],
    conv_states: torch.Tensor,  # float32 [B, C, K-1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(windows [B, C, K-1+L]: each row's state then its tokens, zero-padded to L = the longest
    row; conv state after each packed token [T, C, K-1]: the K-1 inputs ending at it)."""
    rows, channels, keep = conv_states.shape
    longest = max(lengths)
    padded = mixed.new_zeros(rows, longest, channels)
    index = row_index(lengths, mixed.device)  # (row, position) of each packed token
    padded[index] = mixed
    windows = torch.cat((conv_states, padded.transpose(1, 2)), dim=-1)
    # unfold: [B, C, L+1, K-1]; entry j+1 is the window of the K-1 inputs ending at position j
    after = windows.unfold(-1, keep, 1)[:, :, 1:].permute(0, 2, 1, 3)  # [B, L, C, K-1]
    return windows, after[index].contiguous()


def _packed(per_row: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """[B, L, ...] padded rows -> [T, ...] packed tokens."""
    return per_row[row_index(lengths, per_row.device)]


def row_index(lengths: Sequence[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, position in its row) of each packed token, int64 [T] each."""
    lens = torch.tensor(list(lengths))
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lens)  # [T]
    starts = torch.cumsum(lens, 0) - lens  # [B] each row's first packed token
    pos = torch.arange(rows.shape[0]) - starts[rows]
    return rows.to(device), pos.to(device)

"""The gated delta rule over an explicit float32 state: a chunked form for prefill and a
token-by-token form that keeps the state after every position (decode and speculative verify).

Notation, per value head (Hv heads, each query/key head already repeated over the value heads it
serves): q_t, k_t [Dk] (L2-normalised; q_t also times Dk ** -0.5), v_t [Dv], g_t <= 0 the log
decay, beta_t in (0, 1). The state S [Dk, Dv] evolves, for each token t:

    S  <- exp(g_t) * S
    u_t = beta_t * (v_t - S^T k_t)          (the delta: what S does not predict yet)
    S  <- S + k_t u_t^T
    o_t = S^T q_t

Chunked form (C tokens at a time, the within-chunk cumulative log decay c_i = g_1 + ... + g_i,
S_0 the state entering the chunk): every u of the chunk solves one unit lower-triangular system

    u_i + sum_{j<i} beta_i exp(c_i - c_j) (k_i . k_j) u_j = beta_i v_i - beta_i exp(c_i) S_0^T k_i

after which o_i = exp(c_i) S_0^T q_i + sum_{j<=i} exp(c_i - c_j) (q_i . k_j) u_j and the state
leaving the chunk is exp(c_C) S_0 + sum_j exp(c_C - c_j) k_j u_j^T. Both forms equal the
recurrence above up to float32 rounding (tests/test_gated_deltanet.py).

All arithmetic is in the inputs' dtype: float32 in the engine, whatever the activations' dtype
(the caller casts the outputs); float64 in tests that check the algebra exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CHUNK = 64  # tokens per chunk of the prefill form (transformers' torch path uses the same)


def chunked_delta_rule(
    q: torch.Tensor,  # float32 [T, Hv, Dk], normalised and scaled
    k: torch.Tensor,  # float32 [T, Hv, Dk], normalised
    v: torch.Tensor,  # float32 [T, Hv, Dv]
    g: torch.Tensor,  # float32 [T, Hv] log decay (<= 0)
    beta: torch.Tensor,  # float32 [T, Hv]
    state: torch.Tensor,  # float32 [Hv, Dk, Dv], the state before token 0 (not modified)
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:  # (o float32 [T, Hv, Dv], final state [Hv, Dk, Dv])
    """One sequence of T tokens from `state`: its outputs and the state after its last token."""
    outs = []
    for start in range(0, q.shape[0], chunk):
        part = slice(start, start + chunk)
        o, state = _one_chunk(*(x[part].transpose(0, 1) for x in (q, k, v, g, beta)), state)
        outs.append(o.transpose(0, 1))  # [C, Hv, Dv]
    if not outs:
        return v.new_zeros(v.shape), state.clone()
    return torch.cat(outs), state


def _one_chunk(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [Hv, C, Dk]; v [Hv, C, Dv]; g, beta [Hv, C]; state [Hv, Dk, Dv] -> (o [Hv, C, Dv],
    the state after the chunk). The module doc's chunk equations, for every head at once."""
    size = q.shape[1]
    c = g.cumsum(-1)  # [Hv, C]
    later = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)  # j > i
    # decay[h, i, j] = exp(c_i - c_j) for j <= i, 0 above the diagonal (masked before exp)
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()
    # the unit lower-triangular system I + beta_i exp(c_i - c_j) (k_i . k_j), j < i: the solve
    # reads the strict lower triangle only (unitriangular), so the diagonal needs no masking
    system = (k @ k.transpose(-1, -2)) * decay * beta.unsqueeze(-1)  # [Hv, C, C]
    start = c.exp().unsqueeze(-1)  # [Hv, C, 1] decay from the chunk's start to token i
    rhs = beta.unsqueeze(-1) * (v - start * (k @ state))  # [Hv, C, Dv]
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # [Hv, C, C], zero above the diagonal
    o = start * (q @ state) + scores @ u  # [Hv, C, Dv]
    to_end = (c[:, -1:] - c).exp().unsqueeze(-1)  # [Hv, C, 1] decay from token i to the end
    state = c[:, -1].exp()[:, None, None] * state + (k * to_end).transpose(-1, -2) @ u
    return o, state


def stepwise_delta_rule(
    q: torch.Tensor,  # float32 [T, Hv, Dk] packed rows, normalised and scaled
    k: torch.Tensor,  # float32 [T, Hv, Dk]
    v: torch.Tensor,  # float32 [T, Hv, Dv]
    g: torch.Tensor,  # float32 [T, Hv]
    beta: torch.Tensor,  # float32 [T, Hv]
    lengths: Sequence[int],  # B host ints >= 1 summing to T: row b owns the next lengths[b] tokens
    states: torch.Tensor,  # float32 [B, Hv, Dk, Dv], each row's state before its first token
) -> tuple[torch.Tensor, torch.Tensor]:  # (o float32 [T, Hv, Dv], after float32 [T, Hv, Dk, Dv])
    """The recurrence token by token over B rows at once: `after[t]` is the state of token t's row
    right after token t (a verify keeps the one after its last accepted token). `states` is
    not modified."""
    starts, rows_at = _positions(lengths, q.device)
    o = v.new_empty(v.shape)
    after = states.new_empty((q.shape[0], *states.shape[1:]))
    s = states.clone()
    for j, rows in enumerate(rows_at):  # position j of every row at least j + 1 long
        tok = starts[rows] + j  # [b_j] packed token index
        cur = s[rows] * g[tok].exp()[..., None, None]  # [b_j, Hv, Dk, Dv]
        kt = k[tok]  # [b_j, Hv, Dk]
        predicted = (cur * kt.unsqueeze(-1)).sum(-2)  # [b_j, Hv, Dv] = S^T k
        delta = beta[tok].unsqueeze(-1) * (v[tok] - predicted)
        cur = cur + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        o[tok] = (cur * q[tok].unsqueeze(-1)).sum(-2)
        after[tok] = cur
        s[rows] = cur
    return o, after


def _positions(
    lengths: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(starts int64 [B]: each row's first packed token, [rows at least j + 1 long] per j)."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"every row needs at least one token, got lengths {list(lengths)}")
    lens = torch.tensor(list(lengths), dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    rows_at = [torch.nonzero(lens > j).flatten().to(device) for j in range(int(lens.max()))]
    return starts.to(device), rows_at

"""Verification of k deterministic (argmax) draft tokens per row against the target's logits.

Row i of a round has target logits at the k+1 query positions L-1 .. L-1+k; logits[i, j]
predicts the token after position L-1+j, and draft[i, j] (j < k) is the draft's guess for it.
The row emits its accepted drafts followed by one target token: out[i, :accepted[i] + 1].

Greedy rows (temperature <= 0 or top_k == 1, as in sampling.sample): accept the longest prefix
with draft[j] == argmax logits[j]; the emitted tokens are then exactly argmax logits[:a+1] (the
correction at the first mismatch, or the bonus after all k). Only argmax: no softmax.

Sampling rows (speculative sampling with a point-mass draft q = delta(d)): with p_j the target's
distribution at j after temperature / top-k / top-p (sampling/sampler.py's order), accept d_j with
probability min(1, p_j(d_j) / q(d_j)) = p_j(d_j); at the first rejection emit a token from the
residual max(0, p_j - q) normalised, i.e. p_j with d_j removed; if all k are accepted, emit the
bonus from p_k. Each emitted token is then distributed exactly as the target's own sample.

Randomness is keyed by (seed, counter = num_generated + j): stream 1 for the acceptance test at
j, stream 0 (the plain sampler's) for the token emitted at j, so a row's draws do not depend on
the batch, and with k = 0 the bonus is exactly the plain sampler's token.

Rows may carry fewer drafts than the round's k (`num_drafts`, n_i <= k): draft[i, n_i:] is
padding that is never accepted, and the row emits exactly what a round of k = n_i would (its
bonus is the plain sampler's token at num_generated + n_i).
"""

from __future__ import annotations

import numpy as np
import torch

from eaglebatch.sampling.distribution import filtered_probs, inverse_cdf
from eaglebatch.sampling.sampler import (
    argmax,
    deterministic_rows,
    sample,
    uniform_from_counter,
)

ACCEPT_STREAM = 1  # uniform_from_counter stream of the acceptance tests


def verify_greedy_host(
    logits: torch.Tensor,  # float32 [B, k+1, V] target logits, on the CPU
    draft: torch.Tensor,  # int64 [B, k], on the CPU
    num_drafts: np.ndarray | None = None,  # [B] n_i <= k; None: k for every row
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens int64 [B, k+1], accepted int64 [B]
    """`verify` for a batch of deterministic rows on the CPU, in numpy: the same tokens and
    counts from ~5 array operations instead of ~20 torch ones, each of which costs 20-30 µs in a
    CPU verify round (the step's weight streaming leaves torch's dispatch code cold)."""
    target = argmax(logits).numpy()  # [B, k+1]
    accepted = np.cumprod(target[:, :-1] == draft.numpy(), axis=1, dtype=np.int64).sum(axis=1)
    if num_drafts is not None:
        accepted = np.minimum(accepted, np.asarray(num_drafts, dtype=np.int64))
    return torch.from_numpy(target), torch.from_numpy(accepted)


def verify_greedy(
    logits: torch.Tensor,  # [B, k+1, V] target logits
    draft: torch.Tensor,  # int64 [B, k]
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens int64 [B, k+1], accepted int64 [B]
    target = argmax(logits)  # [B, k+1]
    return target, accepted_prefix(target[:, :-1] == draft)


def accepted_prefix(match: torch.Tensor) -> torch.Tensor:  # bool [B, k] -> int64 [B]
    """Length of the leading run of True in each row."""
    return match.long().cumprod(dim=-1).sum(dim=-1)


def verify_sampling(
    logits: torch.Tensor,  # [B, k+1, V] target logits (all rows sampled: temperature > 0)
    draft: torch.Tensor,  # int64 [B, k]
    temperature: torch.Tensor,  # float32 [B]
    top_p: torch.Tensor,  # float32 [B]
    top_k: torch.Tensor,  # int32 [B]
    seeds: torch.Tensor,  # int64 [B]
    num_generated: torch.Tensor,  # int [B] tokens generated before this round
    num_drafts: torch.Tensor | None = None,  # int64 [B] n_i <= k; None: k for every row
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens int64 [B, k+1], accepted int64 [B]
    """Speculative sampling (module doc). tokens[i, :a] = draft[i, :a], tokens[i, a] = the
    correction (first rejection) or the bonus; entries after a are unspecified."""
    b, k1, vocab = logits.shape
    k = k1 - 1
    counters = num_generated.long()[:, None] + torch.arange(k1, device=logits.device)  # [B, k+1]
    tokens = torch.zeros(b, k1, dtype=torch.long, device=logits.device)  # valid ids throughout
    if k > 0:
        rep = lambda x: x.repeat_interleave(k)  # noqa: E731 per-row values for [B*k] rows
        probs = filtered_probs(
            logits[:, :k].reshape(b * k, vocab), rep(temperature), rep(top_k), rep(top_p)
        )  # [B*k, V]
        p_draft = probs.gather(1, draft.reshape(-1, 1)).view(b, k)  # [B, k]
        u_accept = uniform_from_counter(
            seeds.repeat_interleave(k), counters[:, :k].reshape(-1), ACCEPT_STREAM
        ).view(b, k)
        accepted = accepted_prefix(u_accept < p_draft.double())  # [B]
        if num_drafts is not None:
            accepted = torch.minimum(accepted, num_drafts)
        # residual at every position (only the first rejected one is used): p without d
        residual = probs.scatter(1, draft.reshape(-1, 1), 0.0)  # [B*k, V]
        # p(d) == 1 leaves an empty residual, but then d is always accepted (u < 1): any
        # non-empty row will do there
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
        u_token = uniform_from_counter(seeds.repeat_interleave(k), counters[:, :k].reshape(-1))
        tokens[:, :k] = inverse_cdf(residual, u_token).view(b, k)
        j = torch.arange(k, device=logits.device)
        tokens[:, :k] = torch.where(j[None, :] < accepted[:, None], draft, tokens[:, :k])
    else:
        accepted = torch.zeros(b, dtype=torch.long, device=logits.device)
    # bonus (emitted when all n_i are accepted): exactly the plain sampler at num_generated + n_i
    if num_drafts is None:
        tokens[:, k] = sample(logits[:, k], temperature, top_p, top_k, seeds, counters[:, k])
    else:
        rows = torch.arange(b, device=logits.device)
        bonus = sample(logits[rows, num_drafts], temperature, top_p, top_k, seeds,
                       counters[rows, num_drafts])  # [B]
        tokens.scatter_(1, num_drafts[:, None], bonus[:, None])  # past a when a < n_i: unused
    return tokens, accepted


def verify(
    logits: torch.Tensor,  # [B, k+1, V]
    draft: torch.Tensor,  # int64 [B, k]
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    num_generated: torch.Tensor,
    num_drafts: torch.Tensor | None = None,  # int64 [B] n_i <= k; None: k for every row
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens int64 [B, k+1], accepted int64 [B]
    """Greedy verification for deterministic rows, speculative sampling for the others. A batch
    of greedy rows only never materialises a probability."""
    greedy = deterministic_rows(temperature, top_k)
    tokens, accepted = verify_greedy(logits, draft)
    if num_drafts is not None:
        accepted = torch.minimum(accepted, num_drafts)
    if bool(greedy.all()):
        return tokens, accepted
    rows = (~greedy).nonzero().squeeze(1)
    t, a = verify_sampling(
        logits.index_select(0, rows),
        draft.index_select(0, rows),
        temperature[rows],
        top_p[rows],
        top_k[rows],
        seeds[rows],
        num_generated[rows],
        None if num_drafts is None else num_drafts[rows],
    )
    tokens[rows] = t
    accepted[rows] = a
    return tokens, accepted

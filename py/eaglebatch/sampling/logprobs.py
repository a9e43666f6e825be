"""Log-probabilities of sampled tokens, for the output's `logprobs` column (output.logprobs).

Two distributions (output.logprobs_mode):
- "raw": the model's own, log_softmax of the target's logits before any processing (vLLM's
  default);
- "processed": the one the token was drawn from: after min_new_tokens and the penalties, and
  for sampled rows after temperature, top-k and top-p (tokens those cut are -inf). Greedy rows
  (temperature 0) take no temperature and no filter.
With speculative decoding the values come from the target's verify logits at each position, so
they equal plain decoding's. Computed only for steps with a row that asks for them: a job
without logprobs never computes a softmax here.
"""

from __future__ import annotations

import numpy as np
import torch

from eaglebatch.sampling.distribution import filtered_probs
from eaglebatch.sampling.sampler import deterministic_rows


def wanted(plan) -> int:
    """The most alternatives a row of the plan asks for (0: the step computes no logprobs)."""
    return int(plan.logprobs.max()) if len(plan.logprobs) else 0


def distribution(
    raw: torch.Tensor,  # [N, V] the target's logits
    processed: torch.Tensor | None,  # [N, V] after LogitsControls (None: none applied)
    temperature: torch.Tensor,  # float32 [N]
    top_k: torch.Tensor,  # int [N]
    top_p: torch.Tensor,  # float32 [N]
    mode: str,
) -> torch.Tensor:  # float32 [N, V] log-probabilities
    if mode == "raw":
        return torch.log_softmax(raw.float(), dim=-1)
    logits = (raw if processed is None else processed).float()
    greedy = deterministic_rows(temperature, top_k) & (temperature <= 0)
    out = torch.log_softmax(logits, dim=-1)
    sampled = (~greedy).nonzero().squeeze(1)
    if len(sampled):
        probs = filtered_probs(logits[sampled], temperature[sampled], top_k[sampled],
                               top_p[sampled])
        out[sampled] = torch.log(probs)
    return out


def top_logprobs_on_device(
    logprobs: torch.Tensor,  # float32 [N, V]
    tokens: torch.Tensor,  # int64 [N] the chosen tokens
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen float32 [N], top ids int32 [N, k], top logprobs float32 [N, k]), most likely
    first, where `logprobs` lives."""
    chosen = logprobs.gather(1, tokens.long()[:, None]).squeeze(1)
    values, ids = logprobs.topk(k, dim=-1)
    return chosen.float(), ids.to(torch.int32), values.float()


def top_logprobs(
    logprobs: torch.Tensor,  # float32 [N, V]
    tokens: torch.Tensor,  # int64 [N] the chosen tokens
    k: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """top_logprobs_on_device's arrays on the host: what `Scheduler.commit` takes."""
    return tuple(t.cpu().numpy() for t in top_logprobs_on_device(logprobs, tokens, k))


def prompt_logprobs(compute_logits, hidden: torch.Tensor, plan) -> tuple | None:
    """The prompt logprobs of a prefill (or chunk) step, or None when no row asks: for each
    row with plan.prompt_logprobs > 0, every query position t >= plan.prompt_logprobs_from
    whose next token t + 1 is a prompt token, from the raw logits at t (hidden [T, H] of all
    query tokens). Returns what `Scheduler.commit` takes: (row_counts int32 [B], positions
    int32 [N], chosen, top ids, top logprobs)."""
    k = int(plan.prompt_logprobs.max()) if len(plan.prompt_logprobs) else 0
    if k == 0:
        return None
    cu = plan.cu_seqlens_q.astype(np.int64)
    index, nxt, counts = [], [], np.zeros(plan.num_seqs, dtype=np.int32)
    for r in np.flatnonzero(plan.prompt_logprobs > 0):
        start, end = cu[r], cu[r + 1]
        following = np.append(plan.input_ids[start + 1 : end], plan.next_ids[r])  # token t + 1
        pos = plan.positions[start:end]
        # a scored part needs no logits before its first scored token (score.rs)
        keep = (pos + 1 < plan.prompt_lens[r]) & (pos >= plan.prompt_logprobs_from[r])
        index.append(np.arange(start, end)[keep])
        nxt.append(following[keep])
        counts[r] = int(keep.sum())
    index = np.concatenate(index)
    if len(index) == 0:
        return None
    rows = torch.from_numpy(index).to(hidden.device)
    logits = compute_logits(hidden.index_select(0, rows)).float()  # [N, V]
    next_ids = torch.from_numpy(np.concatenate(nxt).astype(np.int64)).to(hidden.device)
    positions = plan.positions[index].astype(np.int32)
    return (counts, positions, *raw_top_logprobs(logits, next_ids, min(k, logits.shape[-1])))


def raw_top_logprobs(
    logits: torch.Tensor,  # float32 [N, V] raw logits
    tokens: torch.Tensor,  # int64 [N]
    k: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """top_logprobs of log_softmax(logits) without materialising it: a logit minus the row's
    logsumexp (the top k of the logits are the top k of their log-probabilities)."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, 1]
    chosen = (logits.gather(1, tokens[:, None]) - lse).squeeze(1)
    values, ids = logits.topk(k, dim=-1)
    out = (chosen, ids.to(torch.int32), values - lse)
    return tuple(t.cpu().numpy() for t in out)

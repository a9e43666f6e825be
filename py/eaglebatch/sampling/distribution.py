"""The distributions a sampled token is drawn from, shared by the plain sampler (sampler.py),
speculative verification (speculative/verify.py) and logprobs (logprobs.py): the filtered
distribution (temperature, then top-k, then top-p on the renormalised top-k set) and the
inverse-CDF draw from it."""

from __future__ import annotations

import torch


def filtered_probs(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # float32 [N], > 0
    top_k: torch.Tensor,  # int [N], 0 = off
    top_p: torch.Tensor,  # float32 [N], 1 = off
) -> torch.Tensor:  # float32 [N, V], rows sum to 1, zero outside the kept set
    """The distribution sampling.sample draws from: softmax(logits / T), then top-k, then top-p
    on the renormalised top-k set (the smallest most-likely set reaching top_p; the most likely
    token is always kept)."""
    probs = torch.softmax(logits.float() / temperature[:, None].float(), dim=-1)  # [N, V]
    vocab = probs.shape[-1]
    k_on = (top_k > 0) & (top_k < vocab)
    if not bool((k_on | (top_p < 1)).any()):
        return probs
    values, order = probs.sort(dim=-1, descending=True)  # [N, V]
    rank = torch.arange(vocab, device=probs.device)
    k_cap = torch.where(k_on, top_k.long(), vocab)  # [N]
    values = values * (rank[None, :] < k_cap[:, None])
    mass = values.sum(dim=-1, keepdim=True)  # [N, 1] the renormalised top-k mass
    before = torch.cumsum(values, dim=-1) - values  # exclusive prefix sums
    keep = (before < top_p[:, None].float() * mass) | (rank[None, :] == 0)
    values = values * keep
    kept = torch.zeros_like(probs).scatter_(1, order, values)
    return kept / kept.sum(dim=-1, keepdim=True)



def inverse_cdf(
    probs: torch.Tensor,  # [B, V], rows non-negative with a positive sum (need not be 1)
    u: torch.Tensor,  # float64 [B] in [0, 1)
) -> torch.Tensor:  # int64 [B]
    """Index i with cdf[i-1] <= u * total < cdf[i]; never a zero-probability entry."""
    cdf = torch.cumsum(probs.double(), dim=-1)  # [B, V], non-decreasing
    total = cdf[:, -1:]  # [B, 1]
    # Strictly below total even where u * total rounds up to it, so cdf[index] > target >=
    # cdf[index - 1] exists and that step (the token's probability) is positive.
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)

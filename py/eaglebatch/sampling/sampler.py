"""Token sampling: greedy, temperature, top-k, top-p, reproducible per request.

Reproducibility: a row's randomness is one uniform number derived by a counter-based hash
(splitmix64) from (seed, num_generated) of that row only, so a request's output does not depend on
which other requests share its batch, on row order, or on how many steps it was preempted for.
The token is drawn by inverse-CDF: the first token whose cumulative probability (float64, in
vocabulary order, or in descending-probability order when top-k/top-p filter) exceeds u * total.

Filtering order (as in Hugging Face / vLLM): temperature, then top-k, then top-p on the
renormalised top-k distribution. top_p keeps the smallest set of most likely tokens whose mass
reaches top_p (the most likely token is always kept).
"""

from __future__ import annotations

import numpy as np
import torch

from eaglebatch.sampling.distribution import inverse_cdf
from eaglebatch.transfer import to_device

_MASK64 = (1 << 64) - 1



def deterministic_rows(temperature, top_k):
    """bool [B]: rows decoded by argmax (temperature <= 0 or top_k == 1), over tensors or a
    plan's numpy arrays alike. The one rule: sample() and verification both use it."""
    return (temperature <= 0) | (top_k == 1)

def _signed(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors; multiplication wraps modulo 2**64."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def uniform_from_counter(
    seeds: torch.Tensor,  # int64 [B]
    counters: torch.Tensor,  # int [B]
    stream: int = 0,
) -> torch.Tensor:  # float64 [B] in [0, 1)
    """Deterministic uniform numbers: a pure function of (seed, counter, stream) per row.
    Different `stream`s give independent numbers for the same (seed, counter), e.g. for the
    several random draws speculative decoding needs per step."""
    key = _splitmix64(seeds.long() ^ _signed((stream * 0xD1B54A32D192ED03) & _MASK64))
    h = _splitmix64(key + counters.long())
    return _shr(h, 11).double() * (1.0 / (1 << 53))


def argmax(x: torch.Tensor) -> torch.Tensor:  # [..., V] -> int64 [...]
    """x.argmax(-1), the first index among equal maxima (a NaN counts as the maximum). On the
    CPU through numpy, whose argmax is vectorised: a verify step's 9 x 49152 float32 logits take
    ~30 µs instead of torch's ~210 µs on this project's CPU; the same indices."""
    if x.is_cpu and x.dtype == torch.float32 and not x.requires_grad and x.dim() > 0:
        return torch.from_numpy(np.asarray(x.numpy().argmax(axis=-1), dtype=np.int64))
    return x.argmax(dim=-1)


def sample(
    logits: torch.Tensor,  # float32 [B, V]
    temperature: torch.Tensor,  # float32 [B]; 0 = greedy
    top_p: torch.Tensor,  # float32 [B]; 1.0 = off
    top_k: torch.Tensor,  # int32 [B]; 0 = off
    seeds: torch.Tensor,  # int64 [B]
    num_generated: torch.Tensor,  # int32 [B]; tokens already generated (the sampling counter)
    host: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> torch.Tensor:  # int64 [B]
    """One token per row. Greedy rows (temperature <= 0) and top_k == 1 rows take the argmax of
    the raw logits (the first index among equal maxima). `host`: temperature, top_p and top_k
    as host arrays (a plan's), so that which rows sample is decided without reading the device
    (on CUDA: no synchronisation for greedy rows; top-k / top-p rows still size their search
    on the device's values)."""
    greedy = argmax(logits)  # [B]
    if host is None:
        host = tuple(t.cpu().numpy() for t in (temperature, top_p, top_k))
    h_temp, h_top_p, h_top_k = host
    deterministic = deterministic_rows(h_temp, h_top_k)  # bool [B] (host)
    if deterministic.all():
        return greedy

    vocab = logits.shape[-1]
    keep = to_device(deterministic, logits.device)
    temp = torch.where(keep, torch.ones_like(temperature), temperature).float()
    probs = torch.softmax(logits.float() / temp[:, None], dim=-1)  # [B, V]
    u = uniform_from_counter(seeds, num_generated)  # float64 [B]
    k_on = (h_top_k > 0) & (h_top_k < vocab)
    filtered = ~deterministic & (k_on | (h_top_p < 1))  # [B]
    plain = ~deterministic & ~filtered  # [B] sampled from the whole distribution

    token = greedy.clone()
    if plain.any():
        rows = to_device(np.flatnonzero(plain), logits.device)
        token[rows] = inverse_cdf(probs[rows], u[rows])
    if filtered.any():
        rows = to_device(np.flatnonzero(filtered), logits.device)
        k_cap = torch.where(to_device(k_on[filtered], logits.device),
                            top_k[rows].long(), vocab)  # [b] vocab = no top-k
        token[rows] = _sample_filtered(probs[rows], u[rows], k_cap, top_p[rows].float())
    return token


def _sample_filtered(
    probs: torch.Tensor,  # float32 [b, V]
    u: torch.Tensor,  # float64 [b]
    k_cap: torch.Tensor,  # int64 [b] top-k (V when off)
    top_p: torch.Tensor,  # float32 [b] (>= 1 when off)
) -> torch.Tensor:  # int64 [b]
    """Top-k then top-p, then inverse-CDF over the kept tokens in descending-probability order.

    A full sort of the vocabulary is slow on CPU, so candidates come from `topk(K)` with K grown
    until the result is provably the same as with a full sort: for each row either all of its
    top-k tokens are candidates, or (no top-k) the candidates already hold top_p of the mass, so
    every later token would be cut by top-p anyway.
    """
    vocab = probs.shape[-1]
    limit = min(vocab, int(k_cap.max()))
    p_on = top_p < 1
    size = min(limit, 256) if bool(p_on.any()) else limit
    total = probs.sum(dim=-1)  # [b] (1 up to rounding)
    while True:
        if size == vocab:  # a full sort is faster than topk(V)
            values, order = probs.sort(dim=-1, descending=True)  # [b, V]
        else:
            values, order = probs.topk(size, dim=-1)  # [b, K] descending
        rank = torch.arange(size, device=probs.device)  # [K]
        in_top_k = rank[None, :] < k_cap[:, None]  # [b, K]
        values = values * in_top_k
        kept_mass = values.sum(dim=-1)  # [b]
        # mass the top-p threshold applies to: the renormalised top-k set
        mass = torch.where(k_cap <= size, kept_mass, total)  # [b]
        # exact: all of the row's top-k are candidates, or it has no top-k and the candidates
        # already reach top_p of the whole distribution
        exact = (k_cap <= size) | ((k_cap >= vocab) & (kept_mass >= top_p * total))
        if size == limit or bool(exact.all()):
            break
        size = min(limit, size * 16)
    mass_before = torch.cumsum(values, dim=-1) - values  # [b, K] exclusive prefix sums
    keep = in_top_k & ((mass_before < (top_p * mass)[:, None]) | (rank[None, :] == 0))
    index = inverse_cdf(values * keep, u)  # [b] into the candidates
    return order.gather(1, index[:, None]).squeeze(1)

"""Adaptive draft length: pick k in 0..K each verify round to maximise expected tokens per second.

Model (per batch-size bucket, i.e. the batch size rounded up to a power of two):
  * a round with k drafts costs  cost(k) = k * t_draft + t_verify(k)
    - t_draft: drafting time per draft token (the first token's lm_head argmax plus k - 1
      autoregressive draft steps, divided by k; EMA of measured times);
    - t_verify(k) = c0 + c1 * k: the target's verify forward over k+1 query tokens plus the
      draft-extend and bookkeeping of the round, a straight line through the EMAs measured at
      each k used so far (flat, i.e. c1 = 0, while only one k has been measured);
  * with per-token acceptance a (each draft accepted with probability a given its predecessors
    were), a round emits  E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)  tokens per row;
  * choose k = argmax E(k) / cost(k) (ties: the smaller k).

`a` is estimated from all rounds (decayed counts): accepted / (accepted + rejections), where a
row that stopped short of its k drafts counts one rejection; with Laplace smoothing (+1 / +2).

Exploration, deterministic: a new bucket starts at k = K, then measures k = 0 once, so both ends
of the line are known; after that every `probe_every`-th round of a bucket uses k + 1 (or 1 when
the choice is 0) so that acceptance and costs keep being measured where the choice would move.
Nothing here is random: given the same timings and acceptances the choices are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(a: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): tokens one round emits per row with k drafts."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class _Bucket:
    t_draft: float | None = None  # EMA seconds of one draft step
    t_verify: dict[int, float] = field(default_factory=dict)  # k -> EMA seconds of the rest
    rounds: int = 0


class AdaptiveDraftLength:
    def __init__(
        self,
        max_k: int,
        *,
        ema: float = 0.2,
        decay: float = 0.995,
        probe_every: int = 16,
    ) -> None:
        if max_k < 0:
            raise ValueError("max_k must be >= 0")
        self.max_k = max_k
        self.ema = ema
        self.decay = decay
        self.probe_every = probe_every
        self.accepted = 0.0  # decayed counts for the acceptance estimate
        self.rejected = 0.0
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        return 1 << max(0, (batch_size - 1).bit_length())

    @property
    def acceptance(self) -> float:
        return (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)

    def cost(self, batch_size: int, k: int) -> float | None:
        """Estimated seconds of a round with k drafts; None before any measurement."""
        b = self.buckets.get(self.bucket_of(batch_size))
        if b is None or not b.t_verify:
            return None
        ks = sorted(b.t_verify)
        if len(ks) == 1:
            verify = b.t_verify[ks[0]]
        else:  # least-squares line through the per-k EMAs
            n = len(ks)
            mean_k = sum(ks) / n
            mean_t = sum(b.t_verify[x] for x in ks) / n
            var = sum((x - mean_k) ** 2 for x in ks)
            slope = sum((x - mean_k) * (b.t_verify[x] - mean_t) for x in ks) / var
            verify = max(mean_t + slope * (k - mean_k), 1e-9)
        return k * (b.t_draft or 0.0) + verify

    def choose(self, batch_size: int) -> int:
        if self.max_k == 0:
            return 0
        b = self.buckets.setdefault(self.bucket_of(batch_size), _Bucket())
        if not b.t_verify:
            return self.max_k
        if 0 not in b.t_verify:
            return 0
        a = self.acceptance
        best, best_rate = 0, -1.0
        for k in range(self.max_k + 1):
            rate = expected_tokens(a, k) / self.cost(batch_size, k)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        if b.rounds % self.probe_every == self.probe_every - 1:
            best = min(self.max_k, best + 1)
        return best

    def record(
        self,
        batch_size: int,
        k: int,
        draft_seconds_per_token: float | None,
        verify_seconds: float,
        accepted: list[int],
    ) -> None:
        """One round: its k, its drafting time per draft token (None when k == 0), the time of
        the rest of the round, and the accepted drafts of each row."""
        b = self.buckets.setdefault(self.bucket_of(batch_size), _Bucket())
        b.rounds += 1
        if draft_seconds_per_token is not None:
            b.t_draft = _ema(b.t_draft, draft_seconds_per_token, self.ema)
        b.t_verify[k] = _ema(b.t_verify.get(k), verify_seconds, self.ema)
        if k > 0:
            self.accepted = self.accepted * self.decay + sum(accepted)
            self.rejected = self.rejected * self.decay + sum(1 for x in accepted if x < k)


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new

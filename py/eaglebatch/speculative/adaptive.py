"""Adaptive draft length: pick k in 0..K each verify round to maximise expected tokens per second.

Per batch-size bucket (the batch size rounded up to a power of two):
  * cost(k): seconds of a whole round with k drafts (drafting, the target's verify forward over
    k+1 query tokens, draft-extend, bookkeeping), an EMA per k of the rounds measured at that k.
    Measured, not modelled as a line: verify cost is a step function of the query length where
    GEMM kernels change strategy (on a 2-core x86 CPU, a SmolLM2 forward over 3 tokens per row
    costs about what 1 token costs, over 4 tokens about 1.3x; GPUs have tile boundaries).
    A k not measured yet: the widest measured round below it plus, per further draft, the
    larger of t_draft and that round's measured step over the one before (the narrowest
    measured round less t_draft per draft when none is below).
  * acceptance per draft position: a_j = P(draft j accepted | drafts 1..j-1 were), from decayed
    counts over all rounds (a row with k drafts and x accepted tried positions 1..min(x+1, k)
    and passed 1..x), smoothed towards a_{j-1} (a_0 = 1/2) with a pseudo-count of 2. Later
    drafts are usually accepted less often than earlier ones; a single geometric rate would
    overrate long chains.
  * a round emits E(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k tokens per row that drafts, 1 per
    row that cannot (`drafting` of the batch's rows can: the worker's rows that left the head
    verify k + 1 query tokens like the others but draft nothing); choose
    k = argmax (rows + drafting (E(k) - 1)) / cost(k) (ties: the smaller k), and k = 0 when no
    row can draft. At batch sizes where a verify row costs about what a decode row does (a CPU
    at large batches) widening a round for a few drafting rows does not pay, and this says so.

Exploration, deterministic: a new bucket measures k = 0 first, then k = 1, 2, ... in turn while
the next one could still win: k is measured when its expected rate, priced at the cost of the
widest round measured so far (a round with more drafts costs at least as much), beats the best
measured rate. Where widening a round costs about what it emits (a CPU at large batches, every
query token a row adds costing about a decode row), one round of k = 1 shows it and the wider k
are never tried. After that, every probe interval's round (first `probe_every`, doubling up to
`max_probe_every` while the probes leave the choice unchanged, back to `probe_every` when it
changes) uses a neighbour of the choice, alternately k + 1 and k - 1, so neighbouring costs and
the acceptance of one more draft keep being measured at a cost that shrinks over a long run.
Nothing here is random: the same timings and acceptances give the same choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(a: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): tokens one round emits per row with k drafts accepted each with
    probability a."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def chain_expected_tokens(rates: list[float], k: int) -> float:
    """1 + a_1 + a_1 a_2 + ... + a_1...a_k: tokens one round emits per row with k drafts, where
    rates[j-1] = a_j is the chance draft j is accepted given drafts 1..j-1 were."""
    total, run = 1.0, 1.0
    for a in rates[:k]:
        run *= a
        total += run
    return total


@dataclass
class _Bucket:
    t_draft: float | None = None  # EMA seconds of drafting per draft token
    t_round: dict[int, float] = field(default_factory=dict)  # k -> EMA seconds of a whole round
    rounds: int = 0
    swept: bool = False  # the first measurements are done (module doc, exploration)
    probe_at: int = 0  # the round index of the next probe
    probe_every: int = 0  # the current probe interval (0: not set yet)
    probes: int = 0  # probes so far (their direction alternates)
    probed_best: int | None = None  # the choice when the last probe was made


class AdaptiveDraftLength:
    def __init__(
        self,
        max_k: int,
        *,
        ema: float = 0.2,
        decay: float = 0.995,
        probe_every: int = 16,
        max_probe_every: int = 256,
    ) -> None:
        if max_k < 0:
            raise ValueError("max_k must be >= 0")
        self.max_k = max_k
        self.ema = ema
        self.decay = decay
        self.probe_every = probe_every
        self.max_probe_every = max(probe_every, max_probe_every)
        # decayed counts per draft position j = 1..K (index j - 1)
        self.tried = [0.0] * max_k
        self.passed = [0.0] * max_k
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        return 1 << max(0, (batch_size - 1).bit_length())

    def rates(self) -> list[float]:
        """[a_1..a_K]: smoothed acceptance of draft j given drafts 1..j-1 were accepted."""
        out, prior = [], 0.5
        for tried, passed in zip(self.tried, self.passed):
            prior = (passed + 2.0 * prior) / (tried + 2.0)
            out.append(prior)
        return out

    @property
    def acceptance(self) -> float:
        """Pooled per-draft acceptance (every position together), Laplace-smoothed."""
        return (sum(self.passed) + 1.0) / (sum(self.tried) + 2.0)

    def cost(self, batch_size: int, k: int) -> float | None:
        """Estimated seconds of a round with k drafts; None before any measurement."""
        b = self.buckets.get(self.bucket_of(batch_size))
        if b is None or not b.t_round:
            return None
        if k in b.t_round:
            return b.t_round[k]
        slope = b.t_draft or 0.0
        below = [j for j in b.t_round if j < k]
        if below:  # wider than any measured: the widest one's cost, growing per draft by the
            m = max(below)  # drafting time or the last measured step, whichever is more
            if m - 1 in b.t_round:
                slope = max(slope, b.t_round[m] - b.t_round[m - 1])
            return b.t_round[m] + (k - m) * slope
        near = min(b.t_round)
        return max(b.t_round[near] - (near - k) * slope, 1e-9)

    def choose(self, batch_size: int, drafting: int | None = None) -> int:
        """k for a round over `batch_size` rows of which `drafting` (default: all) can draft."""
        drafting = batch_size if drafting is None else min(drafting, batch_size)
        if self.max_k == 0 or drafting <= 0:
            return 0
        b = self.buckets.setdefault(self.bucket_of(batch_size), _Bucket())
        rates = self.rates()

        def rate(k: int, cost: float) -> float:
            return (batch_size + drafting * (chain_expected_tokens(rates, k) - 1.0)) / cost

        if not b.swept:
            k = next(j for j in range(self.max_k + 2) if j not in b.t_round)  # the next to try
            if k == 0:
                return 0
            best = _best(range(k), lambda j: rate(j, b.t_round[j]))
            # a round with more drafts costs at least the widest measured one below it
            if k <= self.max_k and rate(k, max(b.t_round[j] for j in range(k))) > rate(
                best, b.t_round[best]
            ):
                return k
            b.swept = True
            b.probe_every, b.probe_at = self.probe_every, b.rounds + self.probe_every
        best = _best(range(self.max_k + 1), lambda k: rate(k, self.cost(batch_size, k)))
        if b.rounds >= b.probe_at:
            return self._probe(b, best)
        return best

    def drafting_cannot_pay(self, batch_size: int) -> bool:
        """Whether drafting cannot pay at the bucket of `batch_size` whatever the acceptance:
        after its sweep, a round of k = 1 (at most 2 tokens a row) costs at least twice a round
        of k = 0 (1 token a row). A CPU at batch 8 and more; not a head that is merely often
        wrong, whose acceptance may change with the prompts."""
        b = self.buckets.get(self.bucket_of(batch_size))
        if b is None or not b.swept or 0 not in b.t_round or 1 not in b.t_round:
            return False
        return b.t_round[1] >= 2.0 * b.t_round[0]

    def _probe(self, b: _Bucket, best: int) -> int:
        """The probe round's k: a neighbour of `best`, alternately k + 1 and k - 1; sets the
        next probe (the interval doubles while the choice stays, module doc)."""
        if b.probed_best == best:
            b.probe_every = min(2 * b.probe_every, self.max_probe_every)
        else:
            b.probe_every = self.probe_every
        b.probed_best, b.probe_at = best, b.rounds + b.probe_every
        step = -1 if b.probes % 2 else 1
        b.probes += 1
        if not 0 <= best + step <= self.max_k:
            step = -step
        return min(self.max_k, max(0, best + step))

    def record(
        self,
        batch_size: int,
        k: int,
        draft_seconds_per_token: float | None,
        verify_seconds: float,
        accepted: list[int],
        drafted: list[int] | None = None,
    ) -> None:
        """One round: its k, its drafting time per draft token (None when k == 0 or the drafts
        cost nothing to make), the time of the rest of the round, and the accepted drafts of each
        row (`drafted`: each row's own number of drafts when some had fewer than k; `accepted`
        empty: a round of width k whose drafts, if any, the rates must not learn from)."""
        b = self.buckets.setdefault(self.bucket_of(batch_size), _Bucket())
        b.rounds += 1
        drafting = 0.0
        if draft_seconds_per_token is not None and k > 0:
            b.t_draft = _ema(b.t_draft, draft_seconds_per_token, self.ema)
            drafting = draft_seconds_per_token * k
        b.t_round[k] = _ema(b.t_round.get(k), drafting + verify_seconds, self.ema)
        if k == 0 or not accepted:  # no drafts tried: the rates neither learn nor decay
            return
        self.tried = [t * self.decay for t in self.tried]
        self.passed = [p * self.decay for p in self.passed]
        for x, n in zip(accepted, drafted if drafted is not None else [k] * len(accepted)):
            for j in range(min(x + 1, n)):
                self.tried[j] += 1.0
            for j in range(min(x, n)):
                self.passed[j] += 1.0


def _best(ks, rate) -> int:
    """The k of the highest rate(k); on a tie (within rounding) the smaller k."""
    best, best_rate = 0, -1.0
    for k in ks:
        r = rate(k)
        if r > best_rate * (1 + 1e-9):
            best, best_rate = k, r
    return best


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new

"""Seconds and tokens per kind of step, kept by the step loop for the progress line's ETA: how
long a prompt token takes, and how long a generation step takes for the rows it carries."""

from __future__ import annotations

# A step's kind as the step loop names it: "prefill", "mixed" (a decode step that also carried
# prompt chunks), "decode", "verify".
GENERATION = ("decode", "verify")


class StepWork:
    """Per kind of step: [seconds, prompt tokens computed, output tokens] so far; and over the
    generation steps `generation`: (steps, rows, query tokens, seconds, output tokens). `add`
    after each committed step, with the scheduler's counters then (one dict read a step)."""

    def __init__(self):
        self.kinds: dict[str, list[float]] = {}
        self.generation = [0.0] * 5
        self._last = (0, 0)  # (prefill_tokens, output_tokens) after the previous step

    def add(self, kind: str, seconds: float, counters: dict, rows: int, tokens: int) -> None:
        """`rows`, `tokens`: the step's sequences and query tokens (plan.num_seqs, num_tokens)."""
        now = (counters["prefill_tokens"], counters["output_tokens"])
        prompt, output = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        row = self.kinds.setdefault(kind, [0.0, 0, 0])
        row[0] += seconds
        row[1] += prompt
        row[2] += output
        if kind in GENERATION:
            for i, v in enumerate((1, rows, tokens, seconds, output)):
                self.generation[i] += v

    def snapshot(self) -> dict:
        return {"kinds": {k: tuple(v) for k, v in self.kinds.items()},
                "generation": tuple(self.generation)}  # fmt: skip


def _sum(kinds: dict, names) -> tuple[float, float, float]:
    rows = [kinds[k] for k in names if k in kinds]
    return tuple(sum(r[i] for r in rows) for i in range(3))  # type: ignore[return-value]


def token_costs(kinds: dict) -> tuple[float, float] | None:
    """(seconds per prompt token, seconds per output token) from `StepWork.snapshot()["kinds"]`:
    the prompt token's from prefill steps, the output token's from decode and verify steps;
    mixed steps, which do both, give whichever of the two the others leave unmeasured (the
    other one's share of their time taken out), both at their pooled rate when neither is
    measured. None before any token."""
    s_p, p_p, _ = _sum(kinds, ("prefill",))
    s_g, _, o_g = _sum(kinds, GENERATION)
    s_m, p_m, o_m = _sum(kinds, ("mixed",))
    a = s_p / p_p if p_p > 0 else None
    b = s_g / o_g if o_g > 0 else None
    if a is None and b is not None and p_m > 0:
        a = max(0.0, s_m - b * o_m) / p_m
    elif b is None and a is not None and o_m > 0:
        b = max(0.0, s_m - a * p_m) / o_m
    if a is None or b is None:
        seconds, tokens = s_p + s_g + s_m, p_p + p_m + o_g + o_m
        if tokens <= 0:
            return None
        pooled = seconds / tokens
        a, b = (pooled if a is None else a), (pooled if b is None else b)
    return a, b


def generation_time(generation: tuple, per_token: float, tokens: float, rows: int,
                    batch: int) -> float | None:
    """Seconds to generate `tokens` more output tokens over `rows` unfinished rows, `batch` at
    most at a time. A generation step is taken to cost a fixed part plus `per_token` (the
    prompt token's cost) for each query token it computes; the fixed part is what the
    generation steps so far took beyond their query tokens (a step's fixed cost is why few
    rows make each token dear). Rows gain the output tokens, and compute the query tokens, a
    row did per generation step so far. None before a generation step."""
    steps, row_steps, queries, seconds, output = generation
    if steps <= 0 or row_steps <= 0 or output <= 0:
        return None
    per_token = min(per_token, seconds / max(queries, 1))
    fixed = (seconds - per_token * queries) / steps
    left = tokens / (output / row_steps)  # row-steps still to run
    return fixed * left / max(1, min(rows, batch)) + per_token * left * queries / row_steps

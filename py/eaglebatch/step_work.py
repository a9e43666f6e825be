"""Seconds and tokens per kind of step, kept by the step loop for the progress line's ETA: how
long a prompt token takes, and how long a generation step takes for the tokens it produces.

Measured on speculative runs (a 2-core CPU, the builtin model and head): a generation step's
time follows the output tokens it produces (accepted drafts cost nearly as much as the bonus
token: the draft is extended over them) far more than its rows or query tokens, and acceptance
changes over a run; so a step is modelled as a fixed part plus a part per output token, fitted
by least squares over the generation steps so far."""

from __future__ import annotations

# A step's kind as the step loop names it: "prefill", "mixed" (a decode step that also carried
# prompt chunks), "decode", "verify".
GENERATION = ("decode", "verify")


class StepWork:
    """Per kind of step: [seconds, prompt tokens computed, output tokens] so far; and over the
    generation steps `generation`: (steps, rows, query tokens, seconds, output tokens, and the
    least-squares sums over the steps of output tokens squared and of seconds * output
    tokens). `add` after each committed step, with the scheduler's counters then (one dict read
    a step)."""

    def __init__(self):
        self.kinds: dict[str, list[float]] = {}
        self.generation = [0.0] * 7
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
            for i, v in enumerate((1, rows, tokens, seconds, output, output * output,
                                   seconds * output)):  # fmt: skip
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


def step_cost(generation: tuple) -> tuple[float, float] | None:
    """(seconds a generation step takes regardless of its output, seconds per output token):
    the least-squares line through the generation steps' (output tokens, seconds), neither
    part negative; None before two generation steps."""
    steps, _, _, seconds, output, out_sq, sec_out = generation
    if steps < 2 or output <= 0:
        return None
    spread = steps * out_sq - output * output  # steps^2 * the variance of output tokens
    if spread <= 1e-9 * out_sq:  # every step gave as many tokens (plain decoding, one batch)
        return seconds / steps, 0.0
    per_token = (steps * sec_out - output * seconds) / spread
    if per_token < 0:  # more output taking less time: the time per token
        return 0.0, seconds / output
    fixed = (seconds - per_token * output) / steps
    if fixed < 0:  # the line through the origin
        return 0.0, sec_out / out_sq
    return fixed, per_token


def generation_time(generation: tuple, tokens: float, rows: int, batch: int) -> float | None:
    """Seconds to generate `tokens` more output tokens over `rows` unfinished rows, `batch` at
    most at a time: `step_cost`'s fixed part for each step still to run (rows gain the output
    tokens a row gained per generation step so far) and its part per output token. None
    before two generation steps."""
    cost = step_cost(generation)
    if cost is None:
        return None
    row_steps, output = generation[1], generation[4]
    steps_left = tokens / (output / row_steps) / max(1, min(rows, batch))
    return cost[0] * steps_left + cost[1] * tokens

"""Seconds and tokens per kind of step, kept by the step loop for the progress line's ETA: how
long a prompt token takes, and how long a generation step takes for the rows it carries."""

from __future__ import annotations

# A step's kind as the step loop names it: "prefill", "mixed" (a decode step that also carried
# prompt chunks), "decode", "verify".
GENERATION = ("decode", "verify")


class StepWork:
    """Per kind of step: [seconds, prompt tokens computed, output tokens] so far; and over the
    generation steps the sums that fit a step's seconds to its rows (`generation`: steps, rows,
    rows^2, seconds, rows x seconds, output tokens). `add` after each committed step, with the
    scheduler's counters then (one dict read a step)."""

    def __init__(self):
        self.kinds: dict[str, list[float]] = {}
        self.generation = [0.0] * 6
        self._last = (0, 0)  # (prefill_tokens, output_tokens) after the previous step

    def add(self, kind: str, seconds: float, counters: dict, rows: int) -> None:
        now = (counters["prefill_tokens"], counters["output_tokens"])
        prompt, output = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        row = self.kinds.setdefault(kind, [0.0, 0, 0])
        row[0] += seconds
        row[1] += prompt
        row[2] += output
        if kind in GENERATION:
            for i, v in enumerate((1, rows, rows * rows, seconds, rows * seconds, output)):
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
    """(f, c): a generation step takes f + c x its rows seconds, by least squares over the
    generation steps so far (a step's fixed cost is why few rows make each token dear); c alone
    where their rows hardly varied or the fit says a cost is negative. None before one."""
    n, sr, srr, st, srt, _ = generation
    if n <= 0 or sr <= 0:
        return None
    mean = sr / n
    var = srr / n - mean * mean
    if var > (0.05 * mean) ** 2:  # rows varied enough to tell the two costs apart
        c = (srt / n - mean * st / n) / var
        f = st / n - c * mean
        if f >= 0 and c >= 0:
            return f, c
    return 0.0, st / sr


def generation_time(generation: tuple, tokens: float, rows: int, batch: int) -> float | None:
    """Seconds to generate `tokens` more output tokens over `rows` unfinished rows, `batch` at
    most at a time, at `step_cost`; rows gain the output tokens a row gained per generation step
    so far (the acceptance length with a draft). None before a generation step."""
    cost = step_cost(generation)
    if cost is None:
        return None
    f, c = cost
    per_row_step = generation[5] / generation[1]
    row_steps = tokens / max(per_row_step, 1e-9)
    return f * row_steps / max(1, min(rows, batch)) + c * row_steps

"""What the user sees: a live progress bar on a terminal, periodic log lines otherwise, and a
summary table at the end. Reads only the scheduler's counters; never slows the step loop."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from eaglebatch.step_work import generation_time, token_costs

# Seconds between the log lines written when stderr is not a terminal (default 30).
INTERVAL_ENV = "EAGLEBATCH_PROGRESS_INTERVAL_S"

# The counters the work-based ETA reads (Scheduler.progress plus the step loop's
# max_new_tokens, max_batch_size and step_work); without them (a Ray driver's sums) the ETA
# falls back to the request rate.
WORK_KEYS = ("requests_total", "requests_done", "requests_read", "prompt_tokens_read",
             "prompt_tokens", "cached_tokens", "prefill_tokens", "output_tokens",
             "finished_output_tokens", "requests_stopped", "running", "max_new_tokens",
             "max_batch_size", "step_work")


@dataclass(frozen=True)
class Prefill:
    """Prompt tokens of this run's requests (the unread ones at the mean read so far), of
    them computed or served from the prefix cache, and still to compute."""

    total: float
    done: float
    left: float


def prefill_work(p: dict) -> Prefill | None:
    """The prefill still to do, from progress counters; None before any request was read.
    Prompts admitted count what their rows have not computed; prompts not yet admitted (read
    and waiting, or not read) count their tokens less the share the prefix cache served so far."""
    read = p["requests_read"]
    if read <= 0:
        return None
    unread = max(0, p["requests_total"] - read)
    total = p["prompt_tokens_read"] * (1 + unread / read)
    admitted, cached = p["prompt_tokens"], p["cached_tokens"]
    done = min(admitted, cached + p["prefill_tokens"])  # recomputation counts once
    uncached = 1 - cached / admitted if admitted else 1.0
    return Prefill(total, done, admitted - done + max(0.0, total - admitted) * uncached)


def _tokens_left(generated: float, cap: float, hazard: float) -> float:
    """Expected further tokens of a row with `generated` tokens: each token ends it with
    probability `hazard`, and it ends at `cap` tokens at the latest."""
    n = max(0.0, cap - generated)
    return n if hazard <= 0 else (1 - (1 - hazard) ** n) / hazard


def output_work(p: dict) -> float:
    """Output tokens the unfinished requests are still expected to generate. A row's length is
    taken as capped at max_new_tokens with a constant chance per token of stopping, measured as
    rows stopped / tokens generated (the running rows' tokens included: rows still running are
    the long ones, so the mean of finished rows alone would make the rest look short); before
    any row stopped every row is expected to run to the cap."""
    unfinished = max(0, p["requests_total"] - p["requests_done"])
    running = min(p["running"], unfinished)
    generated = max(0, p["output_tokens"] - p["finished_output_tokens"])
    hazard = p["requests_stopped"] / p["output_tokens"] if p["output_tokens"] else 0.0
    cap = p["max_new_tokens"]
    mean = generated / running if running else 0.0
    return (running * _tokens_left(mean, cap, hazard)
            + (unfinished - running) * _tokens_left(0, cap, hazard))  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    seconds: float
    prefill: Prefill
    prefill_bound: bool  # the prefill left takes longer than the output left


def estimate(p: dict) -> Estimate | None:
    """Seconds left: the prefill still to do at the seconds per prompt token so far, and the
    output at the generation steps' cost (step_work); before two generation steps ran, an
    output token is taken to cost a prompt token. None while nothing was read or computed."""
    work = p["step_work"]
    costs, prefill = token_costs(work["kinds"]), prefill_work(p)
    if costs is None or prefill is None:
        return None
    tokens = output_work(p)
    rows = max(0, p["requests_total"] - p["requests_done"])
    out = generation_time(work["generation"], tokens, rows, p["max_batch_size"])
    pre, out = costs[0] * prefill.left, costs[0] * tokens if out is None else out
    return Estimate(pre + out, prefill, pre > out)


class ProgressView:
    """Call with `scheduler.progress()` dicts (the step loop adds max_new_tokens,
    max_batch_size and step_work: engine.progress_counters); use as a context manager."""

    def __init__(self, total: int, console: Console | None = None,
                 log_every_s: float | None = None):  # fmt: skip
        self.console = console or Console(stderr=True)
        self.total = total
        self.start = time.monotonic()
        self.log_every_s = log_every_s if log_every_s is not None else _interval()
        self._last_log = self.start
        # (time, requests done, output tokens) at the first generated token: rates and the
        # ETA count from there, not from the model load and the first prefills
        self._first: tuple[float, int, int] | None = None
        self._bar: Progress | None = None
        if self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]generating"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[tok_s]:>8.1f} tok/s"),
                TextColumn("run {task.fields[running]} wait {task.fields[waiting]}"),
                TextColumn("{task.fields[eta]}"),
                console=self.console,
                transient=False,
            )
            self._task = self._bar.add_task("gen", total=total, tok_s=0.0, running=0, waiting=0,
                                            eta="ETA -")  # fmt: skip

    def __enter__(self) -> ProgressView:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def eta(self, now: float, done: int, total: int) -> str:
        """Seconds left at the rate of requests finished since the first generated token;
        "unknown" before one finished since then. Only where the work counters are missing."""
        if self._first is None or done <= self._first[1]:
            return "unknown"
        t0, done0, _ = self._first
        return f"{(now - t0) / (done - done0) * (total - done):.0f}s"

    def work_eta(self, now: float, p: dict, total: int) -> str:
        """The ETA from the work left (`estimate`), with the prefill's progress while the
        prefill left takes longer than the output left."""
        if not all(k in p for k in WORK_KEYS):
            return f"ETA {self.eta(now, p['requests_done'], total)}"
        est = estimate({**p, "requests_total": total})
        if est is None:
            return "ETA unknown"
        eta = f"ETA {est.seconds:.0f}s"
        if not est.prefill_bound:
            return eta
        return f"prefill {est.prefill.done:.0f}/{est.prefill.total:.0f} tok, {eta}"

    def __call__(self, p: dict) -> None:
        now = time.monotonic()
        if self._first is None and p["output_tokens"] > 0:
            self._first = (now, p["requests_done"], p["output_tokens"])
        t0, _, tokens0 = self._first or (now, 0, 0)
        tok_s = (p["output_tokens"] - tokens0) / (now - t0) if now > t0 else 0.0
        done, total = p["requests_done"], max(p["requests_total"], self.total, 1)
        eta = self.work_eta(now, p, total)
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total, tok_s=tok_s,
                             running=p["running"], waiting=p["waiting"], eta=eta)  # fmt: skip
        elif now - self._last_log >= self.log_every_s:
            self._last_log = now
            print(f"[eaglebatch] {done}/{total} requests, {tok_s:.1f} output tok/s, {eta}",
                  file=sys.stderr, flush=True)  # fmt: skip


def _interval() -> float:
    """EAGLEBATCH_PROGRESS_INTERVAL_S, else 30 s (also for a value that is no number >= 0)."""
    try:
        value = float(os.environ.get(INTERVAL_ENV, "30"))
    except ValueError:
        return 30.0
    return value if value >= 0 else 30.0


def _f(x, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.3f}{unit}"


def accept_length(stats: dict) -> float | None:
    """Mean tokens per verify round (accepted drafts + the target's own token)."""
    steps = stats.get("spec_steps") or 0
    return stats["spec_tokens"] / steps if steps else None


def graph_line(g: dict | None) -> str:
    """Whether graphs were used, and how much (engine stats["cuda_graphs"])."""
    if not g or g["mode"] == "off":
        return "off"
    used = "used" if g["mode"] == "cuda" else "eager (static steps, no capture)"
    return (f"{used}: {g['graphs']} graphs for batch {g['sizes'][0]}-{g['sizes'][-1]}, "
            f"{g['replays']} replays, {g['eager_steps']} larger steps eager, "
            f"{g['memory_mib']} MiB (reserved {g['reserved_mib']})")


def lookup_line(drafts: dict | None) -> str | None:
    """Prompt-lookup rows and their acceptance, from SpecWorker's stats; None when none."""
    if not drafts or not drafts.get("lookup_rows"):
        return None
    rows, drafted, accepted = (drafts[k] for k in ("lookup_rows", "lookup_drafted",
                                                   "lookup_accepted"))
    return f"{rows} rows of rounds, {accepted}/{drafted} drafts accepted"


def structured_line(stats: dict) -> str | None:
    """Structured output: rows with a format, grammars compiled, mask time per step and the
    share of output tokens from forced drafts; None without constrained rows."""
    rows = stats.get("structured_rows")
    if not rows:
        return None
    line = f"{rows} rows, {stats.get('grammar_compiles', 0)} grammars compiled"
    if stats.get("mask_seconds_p50") is not None:
        line += (f", masks {stats['mask_seconds_p50'] * 1e3:.2f} / "
                 f"{stats['mask_seconds_p99'] * 1e3:.2f} ms a step (p50 / p99)")  # fmt: skip
    forced = (stats.get("drafts") or {}).get("forced_accepted", 0)
    if forced and stats.get("output_tokens"):
        line += f", {forced / stats['output_tokens']:.1%} of output tokens forced drafts"
    return line


def cache_line(stats: dict) -> str:
    """Prompt tokens served from the prefix cache and tokens prefilled, from a summary."""
    prompt, cached = stats.get("prompt_tokens", 0), stats.get("cached_tokens", 0)
    rate = f"{cached / prompt:.1%}" if prompt else "-"
    return f"{cached} prompt tokens cached ({rate}), {stats.get('prefill_tokens', 0)} prefilled"


def generation_seconds(step_seconds: dict | None) -> float | None:
    """Seconds of the steps that only generated (decode and verify steps; not prefills nor
    the decode steps that also carried prompt chunks); None when not measured."""
    if not step_seconds:
        return None
    return sum(v for k, v in step_seconds.items() if k in ("decode", "verify"))


def step_time_line(step_seconds: dict | None) -> str:
    """Seconds of prefill steps (with the mixed ones) / of generation steps."""
    gen = generation_seconds(step_seconds)
    if gen is None:
        return "-"
    return f"{sum(step_seconds.values()) - gen:.1f}s / {gen:.1f}s"


def summary_table(stats: dict, wall_s: float, title: str = "eaglebatch summary") -> Table:
    t = Table(title=title, show_header=False)
    t.add_column("metric")
    t.add_column("value", justify="right")
    out = stats["output_tokens"]
    rows = [
        ("requests", f"{stats['requests']} ({stats['errors']} errors)"),
        ("prompt tokens", f"{stats['prompt_tokens']}"),
        ("prefix cache", cache_line(stats)),
        ("output tokens", f"{out}"),
        ("wall time", f"{wall_s:.1f}s"),
        ("output tok/s", f"{out / wall_s:.1f}" if wall_s > 0 else "-"),
        ("prefill / generation time", step_time_line(stats.get("step_seconds"))),
        (
            "latency p50 / p90 / p99",
            " / ".join(_f(stats.get(k)) for k in ("latency_p50", "latency_p90", "latency_p99")),
        ),
        ("TTFT p50 / p99", " / ".join(_f(stats.get(k)) for k in ("ttft_p50", "ttft_p99"))),
        ("TPOT p50 / p99", " / ".join(_f(stats.get(k)) for k in ("tpot_p50", "tpot_p99"))),
        ("preemptions", f"{stats.get('preemptions', 0)}"),
    ]
    if stats.get("skipped"):
        rows.insert(1, ("skipped (done by an earlier run)", f"{stats['skipped']}"))
    if out == 0 and stats["prompt_tokens"] and wall_s > 0:  # a scoring job: prompts only
        rows.insert(6, ("prompt tok/s", f"{stats['prompt_tokens'] / wall_s:.1f}"))
    if stats.get("spec_steps"):
        rows.append(("acceptance length", f"{accept_length(stats):.2f}"))
        rows.append(("verify rounds", f"{stats['spec_steps']}"))
        if line := lookup_line(stats.get("drafts")):
            rows.append(("  drafted by prompt lookup", line))
    if line := structured_line(stats):
        rows.append(("structured output", line))
    rows.append(("CUDA graphs", graph_line(stats.get("cuda_graphs"))))
    if stats.get("weights"):
        rows.append(("weights", stats["weights"]))
    if stats.get("expert_rows_per_active"):  # a mixture of experts on the CPU
        rows.append(("tokens per active expert", f"{stats['expert_rows_per_active']:.2f} "
                     "(a layer's generation step)"))  # fmt: skip
    if stats.get("threads"):
        rows.append(("CPU threads", stats["threads"]))
    if "resident_mib" in stats:
        mem = f"{stats['resident_mib']:.0f} MiB (peak {stats['peak_resident_mib']:.0f} MiB)"
        rows.append(("resident memory", mem))
    for k, v in rows:
        t.add_row(k, v)
    return t


def ray_summary_table(stats: dict) -> Table:
    """A Ray run's units and each actor's share (ray_executor.summary)."""
    t = Table(title=f"Ray: {stats['units']} units ({stats['units_retried']} retried), "
              f"{stats['actors']} actors, startup {stats['startup_s']:.1f}s")  # fmt: skip
    for name in ("actor", "units", "rows", "output tokens", "tok/s while busy"):
        t.add_column(name, justify="left" if name == "actor" else "right")
    for where, a in sorted(stats["per_actor"].items()):
        rate = a["tokens"] / a["busy_s"] if a["busy_s"] > 0 else 0.0
        t.add_row(where, str(a["units"]), str(a["rows"]), str(a["tokens"]), f"{rate:.1f}")
    return t

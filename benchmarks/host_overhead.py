"""Host time per step: the real scheduler and output writer, driven by a worker without model math.

    python benchmarks/host_overhead.py [--batch-sizes 1 8 64 256 512] [--steps 200]
        [--output-tokens 128] [--k 3] [--prep none worker] [--device-ms 5] [--no-overlap]
        [--json PATH]

What a GPU step costs the host, measured on the CPU: the Rust scheduler plans each step from
ShareGPT first-turn prompts (the embedded dataset, tokenized by the model's tokenizer as in a
real run), a fake worker answers it, and the scheduler commits the answer (stop checks,
detokenization, finished rows to the writer thread). The fake worker's tokens follow a fixed
pattern (never an end token); rows end at their own `max_new_tokens`, drawn per row from
16..2 x `--output-tokens` (a `sampling_columns` column), so rows finish and join every step as in
a real batch. Speculative runs (`--k` > 0: verify plans of K + 1 query tokens a row) accept
drafts in a fixed pattern: row i of step s accepts (s + i) mod (K + 1). Each step sleeps
`--device-ms` as a device would compute (the input reader tokenizes ahead meanwhile, as in a
real run); that time is not counted.

`--prep`: `none` converts nothing (the scheduler's and commit's own time); `worker` adds the real
worker's host-side preparation of each plan (attention metadata, the CPU attention backend's
plan for the embedded model's attention shapes, the step's id / position tensors, logits
controls and sampling tensors), without a forward.

The fake device is asynchronous like a GPU: `launch` queues a step, which starts when the
device is free and lasts `--device-ms`; `collect` waits for it. The steps are driven by the
engine's own loops: one step at a time, and (plain, unless `--no-overlap`) with engine.overlap,
where step t+1 is planned and launched before step t is committed.

Printed per batch size and mode, over the decode (or verify) steps: rows per step, and host
microseconds per step split into planning (`next_plan`, `next_plan_ahead`), preparation,
commit, and the writer thread's time to build and write parts (spread over all steps; it runs
beside the step loop); and the device's idle time, between finishing one step (prefills
included) and being given the next, over the run per decode / verify step: the host time a
step really costs (hidden by overlap when the host's work is shorter than the device's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from rich.console import Console
from rich.table import Table

from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import build_scheduler, overlapped_steps, serial_steps

ROOT = Path(__file__).resolve().parent.parent
GOAL_US = 200  # per step at batch 256, plain and speculative (issue 32)


def write_prompts(out: Path, rows: int, output_tokens: int) -> Path:
    """The first `rows` ShareGPT first-turn prompts with a per-row max_tokens column."""
    job = load_job(ROOT / "jobs" / "quickstart.yaml", [f"output.path={out.parent / 'unused'}"])
    batches, have = [], 0
    for f in prepare(job).input_files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=1024, columns=["id", "messages"]):
            batches.append(batch)
            have += batch.num_rows
            if have >= rows:
                break
    table = pa.Table.from_batches(batches).slice(0, rows)
    lengths = 16 + (np.arange(table.num_rows) * 7919) % (2 * output_tokens - 15)
    pq.write_table(table.append_column("max_tokens", pa.array(lengths, pa.int32())), out)
    return out


class FakeWorker:
    """Answers plans without model math (module doc); times its host-side preparation."""

    plain_steps = False  # what the engine's serial loop asks of a worker
    pool = None  # Worker.pool: no pooled task
    state_plan = None  # Worker.state_plan: no recurrent state

    @property
    def target(self):
        """Worker.target: this one (it is the target's worker)."""
        return self

    def bind(self, scheduler) -> None:
        """What build_scheduler hands every worker (Worker.bind): this one needs nothing."""

    def __init__(self, num_blocks: int, max_model_len: int, prep: str, block_size: int,
                 device_s: float):
        self.num_blocks, self.max_model_len = num_blocks, max_model_len
        self.prep, self.block_size, self.device_s = prep, block_size, device_s
        self.prep_s = self.idle_s = self.busy_until = 0.0
        self.steps = 0
        if prep == "worker":
            from eaglebatch.attention import get_backend
            from eaglebatch.sampling.logits_processing import LogitsControls
            from eaglebatch.transfer import to_device
            from eaglebatch.worker import fill_placeholders, plan_metadata, sampling_tensors

            self.backend = get_backend("cpu")  # configured as the embedded model's layers
            self.backend.configure(9, 3, 64, torch.float32, torch.float32)
            self.cpu = torch.device("cpu")
            self.host_steps = (to_device, fill_placeholders, LogitsControls.from_plan,
                               plan_metadata, sampling_tensors)

    def step(self, plan) -> tuple:
        return self.collect(self.launch(plan))

    def launch(self, plan, prev=None) -> tuple:
        """Queues the plan on the fake device: it starts when the device is free and the host
        has launched it (the gap before is device idle time) and lasts device_s."""
        if prev is None and (plan.prev_rows >= 0).any():
            raise RuntimeError("placeholders without the step in flight")
        start = time.perf_counter()
        if self.prep == "worker":
            self._prepare(plan, prev)
        now = time.perf_counter()
        if plan.kind != "prefill":
            self.prep_s += now - start
        if self.steps:  # idle before any step, prefills included
            self.idle_s += max(0.0, now - self.busy_until)
        self.busy_until = max(now, self.busy_until) + self.device_s
        answer = self._answer(plan)
        tokens = torch.from_numpy(answer[0].astype(np.int64))  # as Launched.tokens
        return self.busy_until, answer, SimpleNamespace(tokens=tokens)

    def collect(self, launched) -> tuple:
        """Waits for the fake device (sleeps, then spins the last 0.2 ms: a GPU's event wait
        does not oversleep by a scheduler tick); meanwhile the input is read ahead."""
        done, answer, _ = launched
        time.sleep(max(0.0, done - time.perf_counter() - 2e-4))
        while time.perf_counter() < done:
            pass
        return answer

    def _answer(self, plan) -> tuple:
        self.steps += 1
        b = plan.num_seqs
        rows = np.arange(b, dtype=np.int64)
        if plan.kind != "verify":  # one token a row
            return _pattern(plan.num_generated, rows), np.ones(b, dtype=np.int32)
        k = int(plan.cu_seqlens_q[1] - plan.cu_seqlens_q[0]) - 1
        accepted = ((self.steps + rows) % (k + 1)).astype(np.int32)
        counts = accepted + 1
        emitted = np.repeat(plan.num_generated.astype(np.int64), counts) + _ranks(counts)
        tokens = _pattern(emitted, np.repeat(rows, counts))
        return tokens, counts.astype(np.int32), accepted

    def _prepare(self, plan, prev) -> None:
        """What Worker.launch does on the host before its forward (worker.py)."""
        to_device, fill_placeholders, controls, plan_metadata, sampling_tensors = self.host_steps
        self.backend.prepare(plan_metadata(plan, self.block_size, self.cpu))
        fill_placeholders(to_device(plan.input_ids, self.cpu), plan, None if prev is None
                          else prev[2])
        to_device(plan.positions, self.cpu)
        controls(plan, self.cpu)  # the plan carries each row's end ids
        sampling_tensors(plan, self.cpu)


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each count c, concatenated."""
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(int(counts.sum())) - starts


def _pattern(generated: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Token ids from a fixed pattern in 1000..20999 (never an end token)."""
    return (1000 + (generated * 31 + rows * 17) % 20000).astype(np.int32)


def measure(prompts: Path, out: Path, batch: int, steps: int, k: int, prep: str,
            device_s: float, overlap: bool = False) -> dict:
    """One run at max batch size `batch` until `steps` decode / verify steps are done."""
    overrides = [
        f"input.path={prompts}", "input.limit=null", f"output.path={out}",
        f"engine.max_batch_size={batch}",
        "input.sampling_columns={max_new_tokens: max_tokens}", "output.part_rows=256",
        "engine.max_num_batched_tokens=16384", "engine.prefix_caching=false",
        f"engine.overlap={str(overlap).lower()}", "engine.device=cpu",
    ]
    if k == 0:
        overrides.append("draft=null")
    else:
        overrides += [f"speculative.num_steps={k}", "speculative.prompt_lookup_min=0"]
    job = load_job(ROOT / "jobs" / "quickstart.yaml", overrides)
    prep_job = prepare(job)
    worker = FakeWorker(1 << 20, 8192, prep, job.engine.block_size, device_s)
    scheduler = build_scheduler(prep_job, worker, {})
    return _loop(scheduler, worker, steps, overlap)


class TimedScheduler:
    """The scheduler as the engine's step loops call it, its planning and commits timed for
    decode / verify steps (commits are in plan order)."""

    def __init__(self, scheduler) -> None:
        self.scheduler, self.in_flight = scheduler, deque()
        self.seconds = {"plan": 0.0, "commit": 0.0}
        self.decode = self.rows = 0

    def _planned(self, plan, start: float):
        if plan is None or plan.kind != "prefill":
            self.seconds["plan"] += time.perf_counter() - start
        if plan is not None:
            self.in_flight.append(plan)
        return plan

    def next_plan(self):
        start = time.perf_counter()
        return self._planned(self.scheduler.next_plan(), start)

    def next_plan_ahead(self):
        start = time.perf_counter()
        return self._planned(self.scheduler.next_plan_ahead(), start)

    def commit(self, *answer) -> None:
        start = time.perf_counter()
        self.scheduler.commit(*answer)
        plan = self.in_flight.popleft()
        if plan.kind != "prefill":
            self.seconds["commit"] += time.perf_counter() - start
            self.decode, self.rows = self.decode + 1, self.rows + plan.num_seqs


def _loop(scheduler, worker: FakeWorker, steps: int, overlap: bool) -> dict:
    """The engine's step loop (overlapped or not) until `steps` decode / verify steps are
    committed (then the rest is aborted: the writer closes the finished rows); the mean host
    time per such step, and the fake device's idle time between its steps."""
    timed = TimedScheduler(scheduler)
    for _ in (overlapped_steps if overlap else serial_steps)(timed, worker):
        if timed.decode >= steps:
            break
    decode = timed.decode
    stats = scheduler.abort() if decode >= steps else scheduler.finish()
    per = 1e6 / max(decode, 1)
    seconds = {**timed.seconds, "prep": worker.prep_s}
    out = {f"{k}_us": v * per for k, v in seconds.items()}
    out.update(steps=decode, rows_per_step=timed.rows / max(decode, 1),
               writer_us=float(stats["writer_seconds"] or 0.0) * per,
               total_us=sum(seconds.values()) * per, device_idle_us=worker.idle_s * per)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256, 512])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="draft tokens of the speculative runs")
    ap.add_argument("--prep", nargs="+", default=["none", "worker"], choices=["none", "worker"])
    ap.add_argument("--device-ms", type=float, default=5.0,
                    help="the fake device's time per step (the reader tokenizes meanwhile)")
    ap.add_argument("--no-overlap", dest="overlap", action="store_false",
                    help="skip the plain runs with engine.overlap on")
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def _modes(args) -> list[tuple[int, bool]]:
    """(draft tokens, overlap) of each run: plain, plain overlapped, speculative."""
    return [(0, False), *([(0, True)] if args.overlap else []),
            *([(args.k, False)] if args.k > 0 else [])]


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    console = Console(width=160)
    table = Table(title="host microseconds per decode / verify step")
    for col in ("mode", "prep", "batch", "rows/step", "plan", "prep", "commit", "on the step "
                "thread", "writer thread", "device idle"):
        table.add_column(col, justify="right")
    results = []
    with tempfile.TemporaryDirectory(prefix="eaglebatch-host-") as tmp:
        # enough rows to keep the largest batch full: each row lasts ~output_tokens steps
        need = max(args.batch_sizes) * (args.steps // args.output_tokens + 2)
        prompts = write_prompts(Path(tmp) / "prompts.parquet", need, args.output_tokens)
        for k, overlap in _modes(args):
            for prep in args.prep:
                for b in args.batch_sizes:
                    out = Path(tmp) / f"out-{k}-{overlap}-{prep}-{b}"
                    r = measure(prompts, out, b, args.steps, k, prep, args.device_ms / 1e3,
                                overlap)
                    mode = "plain" if k == 0 else f"speculative K={k}"
                    r.update(mode=mode + (" overlap" if overlap else ""), prep=prep, batch=b)
                    results.append(r)
                    table.add_row(r["mode"], prep, str(b), f"{r['rows_per_step']:.0f}",
                                  *(f"{r[c]:.0f}" for c in ("plan_us", "prep_us", "commit_us",
                                                           "total_us", "writer_us",
                                                           "device_idle_us")))
    console.print(table)
    for r in results:
        if r["batch"] == 256:
            verdict = "met" if r["total_us"] < GOAL_US else "not met"
            console.print(f"{r['mode']}, prep {r['prep']}, batch 256: {r['total_us']:.0f} us "
                          f"(goal < {GOAL_US}: {verdict})", highlight=False)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)

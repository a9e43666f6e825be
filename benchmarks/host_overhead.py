"""Host time per step: the real scheduler and output writer, driven by a worker without model math.

    python benchmarks/host_overhead.py [--batch-sizes 1 8 64 256 512] [--steps 200]
        [--output-tokens 128] [--k 3] [--prep none worker] [--device-ms 5] [--json PATH]

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

Printed per batch size and mode, over the decode (or verify) steps: rows per step, and host
microseconds per step split into planning (`next_plan`), preparation, commit, and the writer
thread's time to build and write parts (spread over all steps; it runs beside the step loop).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from eaglebatch.config import load_job
from eaglebatch.engine import build_scheduler, prepare

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

    def __init__(self, num_blocks: int, max_model_len: int, prep: str, block_size: int,
                 device_s: float):
        self.num_blocks, self.max_model_len = num_blocks, max_model_len
        self.prep, self.block_size, self.device_s = prep, block_size, device_s
        self.prep_s = 0.0
        self.steps = 0
        if prep == "worker":
            import torch

            from eaglebatch.attention import get_backend
            from eaglebatch.logits_processing import LogitsControls
            from eaglebatch.worker import plan_metadata, sampling_tensors

            self.backend = get_backend("cpu")  # configured as the embedded model's layers
            self.backend.configure(9, 3, 64, torch.float32, torch.float32)
            self.end_ids = torch.tensor([0], dtype=torch.long)
            self.cpu = torch.device("cpu")
            self.host_steps = (torch.from_numpy, LogitsControls.from_plan, plan_metadata,
                               sampling_tensors)

    def step(self, plan) -> tuple:
        start = time.perf_counter()
        if self.prep == "worker":
            self._prepare(plan)
        self.prep_s += time.perf_counter() - start
        time.sleep(self.device_s)  # the device's step, during which the input is read ahead
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

    def _prepare(self, plan) -> None:
        """What Worker.step does on the host before its forward (worker.py)."""
        from_numpy, controls, plan_metadata, sampling_tensors = self.host_steps
        self.backend.prepare(plan_metadata(plan, self.block_size, self.cpu))
        from_numpy(plan.input_ids)
        from_numpy(plan.positions)
        controls(plan, self.end_ids, self.cpu)
        sampling_tensors(plan, self.cpu)


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each count c, concatenated."""
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(int(counts.sum())) - starts


def _pattern(generated: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Token ids from a fixed pattern in 1000..20999 (never an end token)."""
    return (1000 + (generated * 31 + rows * 17) % 20000).astype(np.int32)


def measure(prompts: Path, out: Path, batch: int, steps: int, k: int, prep: str,
            device_s: float) -> dict:
    """One run at max batch size `batch` until `steps` decode / verify steps are done."""
    overrides = [
        f"input.path={prompts}", "input.limit=null", f"output.path={out}",
        f"engine.max_batch_size={batch}",
        "input.sampling_columns={max_new_tokens: max_tokens}", "output.part_rows=256",
        "engine.max_num_batched_tokens=16384", "engine.prefix_caching=false",
    ]
    if k == 0:
        overrides.append("draft=null")
    else:
        overrides += [f"speculative.num_steps={k}", "speculative.prompt_lookup_min=0"]
    job = load_job(ROOT / "jobs" / "quickstart.yaml", overrides)
    prep_job = prepare(job)
    worker = FakeWorker(1 << 20, 8192, prep, job.engine.block_size, device_s)
    scheduler = build_scheduler(prep_job, worker, {})
    return _loop(scheduler, worker, steps)


def _loop(scheduler, worker: FakeWorker, steps: int) -> dict:
    """Steps until `steps` decode / verify steps are done (then the rest is aborted: the
    writer closes the finished rows); the mean host time per such step."""
    seconds = {"plan": 0.0, "prep": 0.0, "commit": 0.0}
    decode = rows = 0
    while decode < steps:
        start = time.perf_counter()
        plan = scheduler.next_plan()
        if plan is None:
            break
        planned, before = time.perf_counter(), worker.prep_s
        answer = worker.step(plan)
        stepped = time.perf_counter()  # (the device's sleep is not host time: left out)
        scheduler.commit(*answer)
        if plan.kind != "prefill":
            decode, rows = decode + 1, rows + plan.num_seqs
            seconds["plan"] += planned - start
            seconds["prep"] += worker.prep_s - before
            seconds["commit"] += time.perf_counter() - stepped
    stats = scheduler.abort() if decode >= steps else scheduler.finish()
    per = 1e6 / max(decode, 1)
    out = {f"{k}_us": v * per for k, v in seconds.items()}
    out.update(steps=decode, rows_per_step=rows / max(decode, 1),
               writer_us=float(stats["writer_seconds"] or 0.0) * per,
               total_us=sum(seconds.values()) * per)
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
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    console = Console(width=160)
    table = Table(title="host microseconds per decode / verify step")
    for col in ("mode", "prep", "batch", "rows/step", "plan", "prep", "commit", "on the step "
                "thread", "writer thread"):
        table.add_column(col, justify="right")
    results = []
    with tempfile.TemporaryDirectory(prefix="eaglebatch-host-") as tmp:
        # enough rows to keep the largest batch full: each row lasts ~output_tokens steps
        need = max(args.batch_sizes) * (args.steps // args.output_tokens + 2)
        prompts = write_prompts(Path(tmp) / "prompts.parquet", need, args.output_tokens)
        for k in (0, args.k) if args.k > 0 else (0,):
            for prep in args.prep:
                for b in args.batch_sizes:
                    out = Path(tmp) / f"out-{k}-{prep}-{b}"
                    r = measure(prompts, out, b, args.steps, k, prep, args.device_ms / 1e3)
                    r.update(mode="plain" if k == 0 else f"speculative K={k}", prep=prep, batch=b)
                    results.append(r)
                    table.add_row(r["mode"], prep, str(b), f"{r['rows_per_step']:.0f}",
                                  *(f"{r[c]:.0f}" for c in ("plan_us", "prep_us", "commit_us",
                                                           "total_us", "writer_us")))
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

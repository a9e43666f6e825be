"""`eaglebatch bench`: figures a user can trust, measured side by side in one process.

Runs the job's prompts through eaglebatch at one or more max batch sizes -- plain decoding and,
when the job names a draft head, speculative decoding over the same loaded target -- and,
optionally, through Hugging Face transformers' `generate` (same weights, same prompts, greedy,
same max_new_tokens) at the requested batch sizes. Output tokens are counted the same way for
all: generated tokens up to and including the first EOS. With greedy sampling, every speculative
run is also checked token for token against the plain run at the same batch size (a digest per
request, so the check costs 16 bytes a request whatever the output length).

With `repeat` > 1, plain and speculative runs alternate (plain, EAGLE, plain, EAGLE, ...): on a
shared machine whose speed drifts over minutes, each speculative run is compared with the plain
run just before it, and the speedup is the median of those pairs. The table shows, per engine,
the run with the median output tok/s.

At max batch size 1 a run already serves one request after another, so there the two engines
alternate request by request instead (plain then EAGLE on request 0, EAGLE then plain on request
1, ...; each a run of one request over the same loaded weights, the speculative worker kept
across requests as in one run): both see the machine in the same seconds, and one run's figures
are the sums over its requests (tok/s = all output tokens / the summed wall time; latency
percentiles over the requests). A "run" with `repeat` is then one such pass over all prompts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from eaglebatch.job.config import JobConfig, job_to_dict
from eaglebatch.job.gguf_model import gguf_reference_dir
from eaglebatch.prepare import prepare
from eaglebatch.progress import accept_length, generation_seconds, lookup_line
from eaglebatch.runner import open_output, run_prepared
from eaglebatch.speculative.worker import SpecWorker
from eaglebatch.worker import Worker


def _eaglebatch_row(
    job: JobConfig,
    batch_size: int,
    worker,
    tmp: Path,
    spec: bool,
    compare: bool,
    only_row: int | None = None,
) -> dict:
    """One measured run (of input row `only_row` alone when given); with `compare`, also the
    digests of its output tokens per request."""
    name = "eaglebatch+eagle" if spec else "eaglebatch"
    inp = job.input
    if only_row is not None:
        inp = inp.model_copy(update={"limit": only_row + 1})
    job_b = job.model_copy(
        update={
            "input": inp,
            "engine": job.engine.model_copy(update={"max_batch_size": batch_size}),
            "output": job.output.model_copy(
                update={
                    "path": str(tmp / f"{name}-{batch_size}"),
                    "include_token_ids": compare or job.output.include_token_ids,
                }
            ),
            "draft": job.draft if spec else None,
        }
    )
    prep = prepare(job_b)
    if only_row is None:
        res = run_prepared(prep, worker=worker, restart=True)
    else:  # the rows before it count as done: the scheduler reads past them
        resume = open_output(prep, restart=True)
        resume = dataclasses.replace(resume, done_rows=np.arange(only_row, dtype=np.int64))
        res = run_prepared(prep, worker=worker, resume=resume)
    s = res.stats
    return {
        "digests": _token_digests(Path(job_b.output.path)) if compare else None,
        "spec_steps": s.get("spec_steps") or 0,  # for summing runs (_merge_runs)
        "spec_tokens": s.get("spec_tokens") or 0,
        "engine": name,
        "batch_size": batch_size,
        "accept_length": accept_length(s),
        "drafts": s.get("drafts"),  # speculative runs: head and prompt-lookup counts
        "requests": s["requests"],
        "output_tokens": s["output_tokens"],
        "prefill_tokens": s.get("prefill_tokens"),
        "cached_tokens": s.get("cached_tokens"),
        "wall_s": res.wall_s,
        "output_tok_s": res.output_tok_s,
        **_generation(s["output_tokens"], generation_seconds(s.get("step_seconds"))),
        "latency_p50": s.get("latency_p50"),
        "latency_p99": s.get("latency_p99"),
        "ttft_p50": s.get("ttft_p50"),
        "ttft_p99": s.get("ttft_p99"),
        "tpot_p50": s.get("tpot_p50"),
        "tpot_p99": s.get("tpot_p99"),
    }


_PER_REQUEST = ("latency", "ttft", "tpot")


def _generation(tokens: int, seconds: float | None) -> dict:
    """generation_s (the seconds of the steps after prefills) and output tokens per such
    second: the figure that leaves prompt processing out."""
    rate = tokens / seconds if seconds else None
    return {"generation_s": seconds, "generation_tok_s": rate}


def _merge_runs(runs: list[dict]) -> dict:
    """One row from single-request runs of one engine (paired mode): summed tokens and wall
    time, percentiles over the requests (numpy's linear, as the run summary's), the drafting
    counts of the last run (the worker's, cumulative over the pass)."""
    tokens = sum(r["output_tokens"] for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    steps, spec_tokens = sum(r["spec_steps"] for r in runs), sum(r["spec_tokens"] for r in runs)
    row = {
        "digests": None if runs[0]["digests"] is None else {
            k: v for r in runs for k, v in r["digests"].items()
        },
        "spec_steps": steps,
        "spec_tokens": spec_tokens,
        "engine": runs[0]["engine"],
        "batch_size": runs[0]["batch_size"],
        "accept_length": accept_length({"spec_steps": steps, "spec_tokens": spec_tokens}),
        "drafts": runs[-1]["drafts"],
        "requests": sum(r["requests"] for r in runs),
        "output_tokens": tokens,
        "prefill_tokens": sum(r.get("prefill_tokens") or 0 for r in runs),
        "cached_tokens": sum(r.get("cached_tokens") or 0 for r in runs),
        "wall_s": wall,
        "output_tok_s": tokens / wall if wall > 0 else 0.0,
        **_generation(tokens, sum(r["generation_s"] or 0.0 for r in runs)),
    }
    for name in _PER_REQUEST:  # a one-request run's p50 is that request's figure
        values = [r[f"{name}_p50"] for r in runs if r[f"{name}_p50"] is not None]
        for q in (50, 99):
            row[f"{name}_p{q}"] = float(np.percentile(values, q)) if values else None
    return row


def _paired_rows(
    job: JobConfig, target, spec_worker, tmp: Path, compare: bool, num_rows: int
) -> tuple[dict, dict]:
    """(plain row, speculative row) at batch size 1, the engines alternating request by request
    (plain first on even rows, speculative first on odd ones, so that a steady drift in the
    machine's speed cancels within each pair)."""
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for i in range(num_rows):
        for spec in (False, True) if i % 2 == 0 else (True, False):
            worker = spec_worker if spec else target
            runs[spec].append(_eaglebatch_row(job, 1, worker, tmp, spec, compare, only_row=i))
    return _merge_runs(runs[False]), _merge_runs(runs[True])


def _token_digests(out_dir: Path) -> dict[int, bytes]:
    """row_index -> digest of its output token ids, read back from a run's part files."""
    digests: dict[int, bytes] = {}
    for f in sorted(out_dir.glob("*.parquet")):
        for batch in pq.ParquetFile(f).iter_batches(columns=["row_index", "output_token_ids"]):
            for row, ids in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
                digests[row] = hashlib.blake2b(repr(ids).encode(), digest_size=16).digest()
    return digests


def _same_tokens(a: dict[int, bytes], b: dict[int, bytes]) -> int:
    """How many requests produced exactly the same output tokens in both runs."""
    return sum(1 for row, d in a.items() if b.get(row) == d)


def read_prompts(job: JobConfig, files: list[Path], limit: int) -> list:
    """Prompt texts or message lists, in input order, at most `limit`."""
    col = job.input.messages_column or job.input.text_column
    out: list = []
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(columns=[col], batch_size=1024):
            out.extend(batch.column(0).to_pylist())
            if len(out) >= limit:
                return out[:limit]
    return out


def _hf_row(job: JobConfig, prep, batch_size: int) -> dict:
    # lazy: torch, only for the transformers baseline
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mf = prep.model
    # a GGUF model: transformers' own float32 conversion of the file (cached)
    folder = gguf_reference_dir(str(mf.gguf)) if mf.gguf is not None else mf.dir
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompts = read_prompts(job, prep.input_files, prep.total_rows)
    if job.input.messages_column or job.input.apply_chat_template:
        msgs = [p if job.input.messages_column else [{"role": "user", "content": p}]
                for p in prompts]
        texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                 for m in msgs]
        enc_kwargs = {"add_special_tokens": False}
    else:
        texts, enc_kwargs = prompts, {}
    eos = set(job.sampling.end_token_ids(mf.eos_token_ids))
    out_tokens, latencies = 0, []
    start = time.monotonic()
    with torch.inference_mode():
        for i in range(0, len(texts), batch_size):
            t0 = time.monotonic()
            enc = tok(texts[i : i + batch_size], return_tensors="pt", padding=True, **enc_kwargs)
            gen = model.generate(
                **enc,
                max_new_tokens=job.sampling.max_new_tokens,
                do_sample=False,
                eos_token_id=sorted(eos),
                pad_token_id=tok.pad_token_id,
            )
            new = gen[:, enc["input_ids"].shape[1] :].tolist()
            for row in new:
                n = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
                out_tokens += n
            latencies += [time.monotonic() - t0] * len(new)
    wall = time.monotonic() - start
    latencies.sort()
    return {
        "engine": "transformers",
        "batch_size": batch_size,
        "accept_length": None,
        "requests": len(texts),
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
        "latency_p50": latencies[len(latencies) // 2],
        "latency_p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "ttft_p50": None,
        "ttft_p99": None,
        "tpot_p50": None,
        "tpot_p99": None,
    }


def _report(console: Console, r: dict) -> None:
    """One line per finished measurement, so a long run's figures survive an interruption."""
    console.print(
        f"  {r['engine']} batch {r['batch_size']}: {r['output_tokens']} tokens in "
        f"{r['wall_s']:.1f}s = {r['output_tok_s']:.1f} tok/s"
        + (f", acceptance length {r['accept_length']:.2f}" if r["accept_length"] else "")
        + (f" (prompt lookup: {line})" if (line := lookup_line(r.get("drafts"))) else ""),
        highlight=False,
    )
    if "identical_requests" in r:
        same, total = r["identical_requests"], r["requests"]
        console.print(
            f"  output tokens identical to plain decoding: {same}/{total} requests"
            + ("" if same == total else f" ({total - same} differ)"),
            highlight=False,
        )


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _median_run(runs: list[dict]) -> dict:
    """The run with the median output tok/s (the lower middle one for an even count)."""
    ranked = sorted(runs, key=lambda r: r["output_tok_s"])
    return ranked[(len(ranked) - 1) // 2]


def run_bench(
    job: JobConfig,
    batch_sizes: list[int],
    hf_batch_sizes: list[int],
    json_path: str | None,
    repeat: int = 1,
) -> dict:
    """Measures the job at each max batch size (module doc) and at `hf_batch_sizes` through
    transformers; prints the table and returns (and writes to `json_path`) the figures."""
    if repeat < 1:
        raise ValueError("repeat must be >= 1")
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # logs and files: never truncate the figures
    batch_sizes = batch_sizes or [job.engine.max_batch_size]
    prep = prepare(job)
    rows, pair_speedups = _eaglebatch_rows(job, prep, batch_sizes, repeat, console)
    for b in hf_batch_sizes:
        console.print(f"transformers generate, batch size {b} ...")
        rows.append(_hf_row(job, prep, b))
        _report(console, rows[-1])
    _print_table(console, rows, f"{prep.total_rows} prompts, {job.sampling.max_new_tokens} new "
                 "tokens")
    _drop_internal(rows)
    result: dict = {"job": job_to_dict(job), "rows": rows}
    result["plain"] = next(r for r in rows if r["engine"] == "eaglebatch")
    if prep.draft_dir is not None:
        _spec_summary(console, result, pair_speedups, repeat)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _drop_internal(rows: list[dict]) -> None:
    """Removes what only the measuring needed (token digests, the counts for merging runs)."""
    for r in rows:
        for key in ("digests", "spec_steps", "spec_tokens"):
            r.pop(key, None)


def eaglebatch_rows(
    job: JobConfig, batch_sizes: list[int], repeat: int = 1, console: Console | None = None
) -> tuple[list[dict], dict[int, list[float]]]:
    """The job's eaglebatch rows at each max batch size (plain, then speculative when the job
    names a draft head; pairs alternated as in `run_bench`), without the table: for benchmarks
    that put eaglebatch beside another engine. Returns (rows, speedups per batch size)."""
    rows, speedups = _eaglebatch_rows(job, prepare(job), batch_sizes, repeat,
                                      console or Console(width=200))
    _drop_internal(rows)
    return rows, speedups


def _eaglebatch_rows(
    job: JobConfig, prep, batch_sizes: list[int], repeat: int, console: Console
) -> tuple[list[dict], dict[int, list[float]]]:
    """eaglebatch's rows at each max batch size over one loaded target (freed on return), and
    per batch size the speedups of the speculative runs over their plain runs."""

    biggest = job.model_copy(
        update={"engine": job.engine.model_copy(update={"max_batch_size": max(batch_sizes)})}
    )
    spec = prep.draft_dir is not None
    target = Worker.from_job(biggest, prep.model, prep.engine, extra_kv_layers=1 if spec else 0)
    compare = spec and job.sampling.temperature == 0  # greedy: the tokens must be identical
    rows = []
    pair_speedups: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="eaglebatch-bench-") as tmp:
        setup = _Setup(job, prep, target, max(batch_sizes), repeat, spec, compare, Path(tmp),
                       console)
        for b in batch_sizes:
            b_rows, speedups = _bench_batch(setup, b)
            rows += b_rows
            if spec:
                pair_speedups.setdefault(b, []).extend(speedups)
    return rows, pair_speedups


@dataclasses.dataclass
class _Setup:
    """What every measured run of one bench shares."""

    job: JobConfig
    prep: object  # prepare.prepare's
    target: object  # the plain Worker, loaded once and shared by the speculative workers
    max_batch: int  # the largest max batch size measured: the workers are sized for it
    repeat: int
    spec: bool  # the job names a draft head
    compare: bool  # greedy: speculative runs must produce the plain runs' tokens
    tmp: Path
    console: Console


def _bench_batch(setup: _Setup, b: int) -> tuple[list[dict], list[float]]:
    """At max batch size b: the median run of each engine (plain, then speculative), and the
    speedup of each speculative run over the plain run measured with it."""
    plain_runs, spec_runs, speedups = [], [], []
    for rep in range(setup.repeat):
        plain, row = _measure(setup, b, rep)
        plain_runs.append(plain)
        if row is not None:
            spec_runs.append(row)
            speedups.append(row["output_tok_s"] / plain["output_tok_s"])
    rows = []
    for runs in (plain_runs, spec_runs) if setup.spec else (plain_runs,):
        row = _median_run(runs)
        if setup.repeat > 1:
            row["runs_tok_s"] = [r["output_tok_s"] for r in runs]
        if runs is spec_runs and setup.compare:  # every run must match, not only the median
            row["identical_requests"] = min(r["identical_requests"] for r in runs)
        rows.append(row)
    return rows, speedups


def _measure(setup: _Setup, b: int, rep: int) -> tuple[dict, dict | None]:
    """Run `rep` at max batch size b: (the plain row, the speculative row or None), printed as
    they finish; at batch 1 the engines alternate request by request (module doc)."""
    job, target, tmp, console = setup.job, setup.target, setup.tmp, setup.console
    tag = f" (run {rep + 1}/{setup.repeat})" if setup.repeat > 1 else ""
    if not setup.spec:
        console.print(f"eaglebatch, plain decoding, max batch size {b}{tag} ...")
        plain = _eaglebatch_row(job, b, target, tmp, spec=False, compare=setup.compare)
        _report(console, plain)
        return plain, None

    # a fresh worker per run: the adaptive policy starts from nothing every time
    worker = SpecWorker.from_job(target, setup.prep.draft_dir, job.speculative, setup.max_batch,
                                 job.forced_draft_tokens)  # fmt: skip
    k = job.speculative.num_steps
    if b == 1 and setup.prep.total_rows > 1:
        console.print(f"eaglebatch, plain decoding and EAGLE (K={k}) alternating request by "
                      f"request, max batch size 1{tag} ...")
        plain, row = _paired_rows(job, target, worker, tmp, setup.compare, setup.prep.total_rows)
        _report(console, plain)
    else:
        console.print(f"eaglebatch, plain decoding, max batch size {b}{tag} ...")
        plain = _eaglebatch_row(job, b, target, tmp, spec=False, compare=setup.compare)
        _report(console, plain)
        console.print(f"eaglebatch, EAGLE (K={k}), max batch size {b}{tag} ...")
        row = _eaglebatch_row(job, b, worker, tmp, spec=True, compare=setup.compare)
    if setup.compare:
        row["identical_requests"] = _same_tokens(plain["digests"], row["digests"])
    _report(console, row)
    return plain, row


def _print_table(console: Console, rows: list[dict], title: str) -> None:
    """The figures side by side; sets each row's speedup_vs_ref (over transformers' first row
    when measured, else the first row)."""
    ref = next((r for r in rows if r["engine"] == "transformers"), None)
    ref = ref or rows[0]
    table = Table(title=title)
    for col in ("engine", "batch", "requests", "out tokens", "prefilled", "cached", "wall s",
                "out tok/s", "gen tok/s",
                f"vs {ref['engine']} b{ref['batch_size']}", "accept len", "latency p50",
                "latency p99", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"):
        table.add_column(col, justify="right")
    for r in rows:
        r["speedup_vs_ref"] = r["output_tok_s"] / ref["output_tok_s"]
        table.add_row(
            r["engine"], str(r["batch_size"]), str(r["requests"]), str(r["output_tokens"]),
            _fmt(r.get("prefill_tokens"), "d"), _fmt(r.get("cached_tokens"), "d"),
            f"{r['wall_s']:.1f}", f"{r['output_tok_s']:.1f}",
            _fmt(r.get("generation_tok_s"), ".1f"), _fmt(r["speedup_vs_ref"], ".2f"),
            _fmt(r["accept_length"], ".2f"),
            _fmt(r["latency_p50"], ".2f"), _fmt(r["latency_p99"], ".2f"),
            _fmt(r["ttft_p50"], ".3f"), _fmt(r["ttft_p99"], ".3f"),
            _fmt(r["tpot_p50"], ".4f"), _fmt(r["tpot_p99"], ".4f"),
        )
    console.print(table)


def _spec_summary(
    console: Console, result: dict, pair_speedups: dict[int, list[float]], repeat: int
) -> None:
    """The speculative row and the speedup at the plain row's batch size (the median of the
    pairs) into `result`, and the closing lines."""
    plain = result["plain"]
    sp = next(r for r in result["rows"] if r["engine"] == "eaglebatch+eagle")
    result["spec"] = sp
    pairs = pair_speedups[plain["batch_size"]]
    result["speedup"] = statistics.median(pairs)
    if repeat > 1:
        result["pair_speedups"] = pairs
        console.print(
            "speedup of each EAGLE run over the plain run before it: "
            + ", ".join(f"{x:.2f}x" for x in pairs),
            highlight=False,
        )
    console.print(
        f"speculative speedup at batch {plain['batch_size']}: {result['speedup']:.2f}x"
        + (" (median of the pairs)" if repeat > 1 else "")
        + f" (acceptance length {_fmt(sp['accept_length'], '.2f')})"
        + (f", identical output tokens in {sp['identical_requests']}/{sp['requests']} "
           "requests" if "identical_requests" in sp else "")
    )

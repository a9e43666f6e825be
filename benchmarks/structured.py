"""Structured output's cost and its speculative gains, in one run on one machine: a JSON
extraction job (the quickstart's model, ShareGPT first turns, one schema of a dozen keys)
unconstrained vs constrained at batch 1 and 64 (plain decoding), the mask time per step (p50 /
p99), and constrained EAGLE with forced drafts vs without them at batch 1, with the share of
output tokens that came from forced drafts.

    python benchmarks/structured.py [--rows 64] [--batch1-rows 8] [--max-new-tokens 128]
                                    [--repeat 1] [--whitespace bounded|flexible|compact] [--json F]

Each configuration's worker is loaded once; runs alternate configurations of the same worker.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from eaglebatch.job import builtin
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import build_worker, run_prepared

_ENUM = {"type": "string", "enum": None}
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "language": {**_ENUM, "enum": ["en", "zh", "es", "fr", "de", "other"]},
        "topic": {"type": "string", "maxLength": 30},
        "intent": {**_ENUM, "enum": ["question", "task", "chat", "code", "other"]},
        "sentiment": {**_ENUM, "enum": ["positive", "neutral", "negative"]},
        "has_code": {"type": "boolean"},
        "num_questions": {"type": "integer", "minimum": 0, "maximum": 20},
        "difficulty": {"type": "integer", "minimum": 1, "maximum": 5},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20},
                     "maxItems": 3},
        "summary": {"type": "string", "maxLength": 100},
        "needs_followup": {"type": "boolean"},
        "audience": {**_ENUM, "enum": ["general", "expert", "student", "business"]},
    },
    "additionalProperties": False,
}
SCHEMA["required"] = list(SCHEMA["properties"])
# the schema's x-guidance (llguidance's JSON options): compact = no whitespace between JSON
# tokens, so the grammar forces every key and separator; flexible = any whitespace; bounded =
# none, eaglebatch's default (at most one line break per gap)
WHITESPACE = {"bounded": {}, "flexible": {"x-guidance": {"whitespace_flexible": True}},
              "compact": {"x-guidance": {"whitespace_flexible": False}}}


def response_format(whitespace: str) -> dict:
    schema = {**SCHEMA, **WHITESPACE[whitespace]}
    return {"type": "json_schema", "json_schema": {"name": "extraction", "schema": schema}}
SYSTEM = ("Describe the user's message as one JSON object with the keys "
          + ", ".join(SCHEMA["properties"]) + ".")  # fmt: skip


def write_input(path: Path, rows: int) -> Path:
    """ShareGPT first turns (up to 600 characters) under the extraction instruction."""
    table = pq.ParquetFile(builtin.sharegpt_parquet()).read_row_group(0)
    msgs = []
    for r in table.to_pylist():
        if len(msgs) == rows:
            break
        user = r["prompt"][:600]
        msgs.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])
    pq.write_table(pa.table({"messages": msgs}), path)
    return path


def job_file(d: Path, inp: Path, batch: int, max_new: int, draft: bool, constrained: bool,
             forced: bool = True, whitespace: str = "bounded", overlap: bool = False,
             ) -> Path:  # fmt: skip
    job = {
        "model": "smollm2-135m-instruct",
        "input": {"path": str(inp), "messages_column": "messages"},
        "output": {"path": str(d / "out")},
        "sampling": {"max_new_tokens": max_new, "temperature": 0},
        "engine": {"max_batch_size": batch, "overlap": overlap},
    }
    if constrained:
        job["sampling"]["response_format"] = response_format(whitespace)
    if draft:
        job["draft"] = "smollm2-135m-instruct-eagle"
        job["speculative"] = {"forced_drafts": forced}
    path = d / f"job-{batch}-{draft}-{constrained}-{forced}-{overlap}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_once(path: Path, worker):
    """One run over `worker` (built for the first run): its stats, the drafts' counters of
    this run only (a worker's accumulate)."""
    prep = prepare(load_job(path, []))
    worker = worker or build_worker(prep)
    if prep.draft_dir is not None:  # a SpecWorker, built by the first config: this run's setting
        worker.grammar.forced_drafts = prep.job.speculative.forced_drafts
    before = worker.draft_stats() or {}
    t = time.monotonic()
    stats = run_prepared(prep, worker=worker, restart=True).stats
    stats["tok_s"] = stats["output_tokens"] / (time.monotonic() - t)
    if "drafts" in stats:
        stats["drafts"] = {k: v - before.get(k, 0) for k, v in stats["drafts"].items()}
    return stats, worker


def measure(d: Path, inp: Path, args, batch: int, draft: bool, configs: dict) -> dict:
    """Median tok/s (and the last run's stats) of each config over one worker."""
    worker, runs = None, {name: [] for name in configs}
    for _ in range(args.repeat):
        for name, (constrained, forced, *overlap) in configs.items():
            path = job_file(d, inp, batch, args.max_new_tokens, draft, constrained, forced,
                            args.whitespace, bool(overlap and overlap[0]))  # fmt: skip
            stats, worker = run_once(path, worker)
            runs[name].append(stats)
    return {name: {"tok_s": statistics.median(s["tok_s"] for s in v), "stats": v[-1]}
            for name, v in runs.items()}  # fmt: skip


def summary(res: dict) -> dict:
    s = res["stats"]
    drafts = s.get("drafts") or {}
    forced = drafts.get("forced_accepted", 0)
    return {"tok_s": round(res["tok_s"], 1), "output_tokens": s["output_tokens"],
            "mask_p50_ms": _ms(s.get("mask_seconds_p50")),
            "mask_p99_ms": _ms(s.get("mask_seconds_p99")),
            "forced_share": round(forced / s["output_tokens"], 3) if s["output_tokens"] else 0,
            "accepted_tokens": s.get("accepted_tokens"), "spec_steps": s.get("spec_steps")}


def _ms(v):
    return None if v is None else round(v * 1e3, 3)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--batch1-rows", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--whitespace", choices=list(WHITESPACE), default="bounded")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    pair = {"unconstrained": (False, True), "constrained": (True, True)}
    # engine.overlap: constrained rows are not planned ahead (their next mask needs the token
    # in flight), so a constrained run with overlap on steps one plan at a time
    big_pair = {**pair, "unconstrained, overlap": (False, True, True),
                "constrained, overlap": (True, True, True)}
    out = {}
    with tempfile.TemporaryDirectory(prefix="eaglebatch-structured-") as tmp:
        d = Path(tmp)
        big = write_input(d / "in64.parquet", args.rows)
        small = write_input(d / "in1.parquet", args.batch1_rows)
        for name, res in measure(d, big, args, 64, False, big_pair).items():
            out[f"plain b64 {name}"] = summary(res)
        for name, res in measure(d, small, args, 1, False, pair).items():
            out[f"plain b1 {name}"] = summary(res)
        eagle = {"constrained, forced drafts": (True, True),
                 "constrained, no forced drafts": (True, False),
                 "unconstrained": (False, True)}  # fmt: skip
        for name, res in measure(d, small, args, 1, True, eagle).items():
            out[f"eagle b1 {name}"] = summary(res)
    report(out, args)
    return out


def report(out: dict, args) -> None:
    print(f"structured output, {platform.processor() or platform.machine()}; rows {args.rows} "
          f"(batch 64) / {args.batch1_rows} (batch 1), max_new_tokens {args.max_new_tokens}, "
          f"{args.whitespace} JSON whitespace")
    print(f"{'config':<40} {'tok/s':>8} {'tokens':>7} {'mask p50 ms':>12} {'p99 ms':>8} "
          f"{'forced':>7}")
    for name, s in out.items():
        print(f"{name:<40} {s['tok_s']:8.1f} {s['output_tokens']:7d} "
              f"{_fmt(s['mask_p50_ms']):>12} {_fmt(s['mask_p99_ms']):>8} {s['forced_share']:7.3f}")
    for b, suffix in (("b64", ""), ("b64", ", overlap"), ("b1", "")):
        c, u = out[f"plain {b} constrained{suffix}"], out[f"plain {b} unconstrained{suffix}"]
        print(f"constrained / unconstrained, plain {b}{suffix}: {c['tok_s'] / u['tok_s']:.2f}x")
    f, n = out["eagle b1 constrained, forced drafts"], out["eagle b1 constrained, no forced drafts"]
    print(f"constrained EAGLE b1, forced drafts / none: {f['tok_s'] / n['tok_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


if __name__ == "__main__":
    main()

"""Prefix caching on and off, side by side in one sitting, on the embedded default model.

    python benchmarks/prefix_cache.py [--case preamble|quickstart|samples|chunked ...]
                                      [--json PATH] [--model DIR]

Cases (each run twice on one loaded worker, caching off then on, greedy, output token ids
compared row by row):
  preamble    64 ShareGPT first-turn prompts of 20-400 characters, each after the same ~500-token
              labelling instruction as the system message (a chat job), 32 new tokens, batch 64;
  quickstart  jobs/quickstart.yaml as shipped (64 prompts, the builtin EAGLE head, 128 tokens):
              only the chat template's system prompt is shared;
  samples     the quickstart's first 16 prompts with sampling.n = 8 (temperature 0.8, 32 new
              tokens, batch 64) against the same 16 prompts with n = 1: the tokens prefilled
              (the issue's bound: within 1.2x of the 16 prompts' own) and the wall time. Not a
              caching off / on pair: n samples share their prompt whether caching is on or not;
  chunked     the quickstart with chunked prefill off (whole prompts, 4096 tokens a step) and on
              with 512 tokens a step: TPOT p99 and throughput side by side.
The first three run with the job's chunked-prefill setting (the default, on).
--model DIR runs the preamble case on another checkpoint with the same tokenizer (a synthetic
hybrid: benchmarks/synthetic_hybrid.py), its rows generating all 32 tokens (EOS ignored: its
random weights would end rows at random).
Prints wall time (first step to last row), prompt tokens prefilled and served from the cache,
output tok/s, TPOT p99 and whether the outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from eaglebatch.job import builtin
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import build_worker, run_prepared

ROOT = Path(__file__).resolve().parent.parent
RULES = [
    "Read the user's message and decide which one of the categories below fits it best.",
    "Categories: question (asks for information), request (asks for something to be done or "
    "written), opinion (states a view), chat (greets or makes small talk), other.",
    "Answer with the category name first, then one short sentence that explains the choice.",
    "Do not repeat the user's message, do not add a greeting, and do not use lists.",
    "When a message both asks a question and asks for something to be written, choose request.",
    "When the message is in a language other than English, label it all the same and explain "
    "the choice in English.",
    "Messages that contain code count as requests unless they only ask what the code does, which "
    "makes them questions.",
    "If the message is empty, offensive or cannot be understood, answer other and say why in a few "
    "words, without quoting it.",
]


def preamble() -> str:
    """A ~500-token instruction (SmolLM2's tokenizer): the rules, then worked examples."""
    examples = [("What is the capital of France?", "question"), ("Write a haiku about rain.",
                "request"), ("I think tabs are better than spaces.", "opinion"),
                ("hey, how are you doing today?", "chat")]  # fmt: skip
    lines = ["You are a careful annotator for a message classification project.", *RULES,
             "Examples:"]  # fmt: skip
    for text, label in examples * 3:
        lines.append(f"Message: {text}\nLabel: {label}, because it is a typical {label}.")
    return "\n".join(lines)


def preamble_job(tmp: Path, model: str = "smollm2-135m-instruct") -> Path:
    table = pq.ParquetFile(builtin.sharegpt_parquet()).read_row_group(0)
    rows = [r for r in table.to_pylist() if 20 <= len(r["prompt"]) <= 400][:64]
    system = preamble()
    msgs = [[{"role": "system", "content": system}, {"role": "user", "content": r["prompt"]}]
            for r in rows]  # fmt: skip
    pq.write_table(pa.table({"id": [r["id"] for r in rows], "messages": msgs}), tmp / "in.parquet")
    job = tmp / "preamble.yaml"
    eos = "  ignore_eos: true\n" if model != "smollm2-135m-instruct" else ""
    job.write_text(f"model: {model}\ninput:\n  path: {tmp / 'in.parquet'}\n"
                   "  messages_column: messages\n  id_column: id\noutput:\n  path: out\n"
                   f"sampling:\n  max_new_tokens: 32\n{eos}"
                   "engine:\n  max_batch_size: 64\n")  # fmt: skip
    return job


def run(job_file: Path, out: Path, caching: bool, worker=None, extra=()) -> tuple[dict, object]:
    sets = [f"output.path={out}", "output.include_token_ids=true",
            f"engine.prefix_caching={str(caching).lower()}", *extra]  # fmt: skip
    prep = prepare(load_job(job_file, sets))
    worker = worker or build_worker(prep)
    res = run_prepared(prep, worker=worker, restart=True)
    t = pq.read_table(out, columns=["row_index", "output_token_ids", "cached_tokens"])
    s = res.stats
    row = {"caching": caching, "wall_s": res.wall_s, "output_tok_s": res.output_tok_s,
           "prompt_tokens": s["prompt_tokens"], "prefill_tokens": s["prefill_tokens"],
           "cached_tokens": s["cached_tokens"], "prefix_hit_rate": s["prefix_hit_rate"],
           "tpot_p99": s["tpot_p99"], "ttft_p99": s["ttft_p99"],
           "tokens": dict(zip(t.column("row_index").to_pylist(),
                              t.column("output_token_ids").to_pylist(), strict=True)),
           "min_cached": min(t.column("cached_tokens").to_pylist())}  # fmt: skip
    return row, worker


def case(name: str, job_file: Path, tmp: Path, console: Console) -> dict:
    if name == "chunked":  # caching on in both: chunked prefill off, then on
        off, worker = run(job_file, tmp / f"{name}-off", True,
                          extra=["engine.chunked_prefill=false"])  # fmt: skip
        on, _ = run(job_file, tmp / f"{name}-on", True, worker,
                    extra=["engine.chunked_prefill=true", "engine.max_num_batched_tokens=512"])
        what, labels = "chunked prefill off / on (512 tokens a step)", ("off", "on")
    else:  # one worker, built for caching (a hybrid model's state checkpoints), for both
        worker = build_worker(prepare(load_job(job_file, ["engine.prefix_caching=true"])))
        off, _ = run(job_file, tmp / f"{name}-off", False, worker)
        on, _ = run(job_file, tmp / f"{name}-on", True, worker)
        what, labels = "prefix caching off / on", ("off", "on")
    same = sum(off["tokens"][r] == on["tokens"].get(r) for r in off["tokens"])
    table = Table(title=f"{name}: {what} (identical outputs {same}/{len(off['tokens'])})")
    for col in ("setting", "wall s", "prefilled", "cached", "hit rate", "out tok/s",
                "TTFT p99", "TPOT p99", "min cached/row"):
        table.add_column(col, justify="right")
    for label, r in zip(labels, (off, on), strict=True):
        table.add_row(label, f"{r['wall_s']:.1f}",
                      str(r["prefill_tokens"]), str(r["cached_tokens"]),
                      f"{r['prefix_hit_rate'] or 0:.1%}", f"{r['output_tok_s']:.1f}",
                      f"{r['ttft_p99']:.2f}", f"{r['tpot_p99']:.3f}", str(r["min_cached"]))
    console.print(table)
    speedup = off["wall_s"] / on["wall_s"]
    console.print(f"{name}: {speedup:.2f}x end to end ({what})")
    for r in (off, on):
        del r["tokens"]
    return {"off": off, "on": on, "speedup": speedup, "identical": same}


def samples_case(tmp: Path, console: Console) -> dict:
    job = ROOT / "jobs/quickstart.yaml"
    base = ["input.limit=16", "draft=null", "sampling.temperature=0.8",
            "sampling.max_new_tokens=32"]  # fmt: skip
    runs, worker = {}, None
    for n in (1, 8):
        sets = [*base, f"sampling.n={n}", f"output.path={tmp / f'n{n}'}"]
        prep = prepare(load_job(job, sets))
        worker = worker or build_worker(prep)
        res = run_prepared(prep, worker=worker, restart=True)
        runs[n] = {"wall_s": res.wall_s, "requests": res.stats["requests"],
                   "prompt_tokens": res.stats["prompt_tokens"],
                   "prefill_tokens": res.stats["prefill_tokens"],
                   "output_tok_s": res.output_tok_s}  # fmt: skip
    ratio = runs[8]["prefill_tokens"] / runs[1]["prefill_tokens"]
    one, eight = runs[1], runs[8]
    console.print(f"samples: 16 prompts, n = 1: {one['prefill_tokens']} tokens prefilled in "
                  f"{one['wall_s']:.1f} s; n = 8: {eight['requests']} rows, "
                  f"{eight['prefill_tokens']} tokens prefilled ({ratio:.3f}x) in "
                  f"{eight['wall_s']:.1f} s, {eight['output_tok_s']:.1f} out tok/s")  # fmt: skip
    return {"n1": runs[1], "n8": runs[8], "prefill_ratio": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append",
                    choices=["preamble", "quickstart", "samples", "chunked"])  # fmt: skip
    ap.add_argument("--json")
    ap.add_argument("--model", help="the preamble case on this checkpoint folder")
    args = ap.parse_args()
    console = Console(width=150)
    result = {"machine": platform.processor() or platform.machine(), "cases": {},
              "model": args.model or "smollm2-135m-instruct"}  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name in args.case or ["preamble", "quickstart", "samples", "chunked"]:
            if name == "samples":
                result["cases"][name] = samples_case(tmp, console)
            else:
                job = ROOT / "jobs/quickstart.yaml"
                if name == "preamble":
                    job = preamble_job(tmp, *([args.model] if args.model else []))
                result["cases"][name] = case(name, job, tmp, console)
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""eaglebatch against llama.cpp on a Qwen3-30B-A3B-shaped MoE GGUF, on the CPU, in one sitting.

    python benchmarks/cpu_moe_vs_llamacpp.py [--gguf PATH] [--batch1-prompts 4] [--prompts 32]
        [--max-tokens 64] [--batched 32] [--threads 2] [--int8] [--json PATH]

The model is a synthetic GGUF of random weights shaped like Qwen3-30B-A3B (48 layers, 128
experts of 768, 8 per token, hidden 2048; `benchmarks/synthetic_moe_gguf.py`), written to
`--gguf` once (~17 GB) and reused. The prompts are the first ShareGPT prompts of 20-400
characters in the quickstart's input, rendered with the file's chat template by eaglebatch's
tokenizer; llama.cpp receives those token ids, so both engines see the same input. Greedy,
EOS ignored: every request generates `--max-tokens` tokens.

Batch 1 is the first `--batch1-prompts` prompts one at a time (llama-server with one slot,
`eaglebatch run` with engine.max_batch_size 1); batched is `--prompts` prompts at `--batched`
at once (llama-server with that many slots under continuous batching, eaglebatch with that max
batch size). eaglebatch runs `engine.weights: quantized` (the steps read the file's blocks,
the float32 model's function), and with `--int8` also `engine.activations: int8` (x quantized
to 8 bits in block products, as llama.cpp does).

Each engine is a fresh process per row: its start-up time (eaglebatch: the process's wall time
less its run's, i.e. start to the first step plus exit; llama-server: start to a healthy
server), its peak resident memory (mapped file pages it touched included: eaglebatch's
`peak_resident_mib`, the server's VmHWM) and generation throughput (output tokens over the
time after prompt processing; for llama.cpp with slots an estimate, benchmarks/llamacpp.py)
are printed side by side, with eaglebatch's
tokens per active expert per step (how many of a step's tokens one pass over an expert's
weights serves) and its peak memory against the file + KV cache + 15% bound.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_vs_llamacpp import (  # noqa: E402
    PROMPTS,
    ROOT,
    cpu_line,
    prompt_token_ids,
    quickstart_job,
    short_prompts,
)
from llamacpp import find_llama_server, run_llama_server  # noqa: E402
from synthetic_moe_gguf import write_moe_gguf  # noqa: E402

DEFAULT_GGUF = Path.home() / ".cache" / "eaglebatch" / "bench" / "qwen3moe-30b-a3b-q4_0.gguf"
GOAL_BATCH1, GOAL_BATCHED = 1.0, 1.5  # eaglebatch over llama.cpp (issue 60)
# eaglebatch's KV cache per row (engine.kv_cache_tokens = rows x this, and max_model_len): a
# prompt of up to 400 characters plus its template and the output fit; llama.cpp gets 1024
KV_TOKENS_PER_ROW = 512


def eaglebatch_run(gguf: Path, prompts: Path, n: int, batch: int, args, tmp: Path,
                   int8: bool) -> dict:  # fmt: skip
    """One `eaglebatch run` process over the first n prompts at max batch size `batch`; its
    summary JSON."""
    out, summary = tmp / f"out-{batch}-{int(int8)}", tmp / f"summary-{batch}-{int(int8)}.json"
    sets = [f"model={gguf}", "draft=null", f"input.path={prompts}", f"input.limit={n}",
            f"output.path={out}", f"sampling.max_new_tokens={args.max_tokens}",
            "sampling.ignore_eos=true", f"engine.max_batch_size={batch}",
            "engine.weights=quantized", f"engine.num_threads={args.threads}",
            f"engine.kv_cache_tokens={KV_TOKENS_PER_ROW * batch}",
            f"engine.max_model_len={KV_TOKENS_PER_ROW}"]  # fmt: skip
    if int8:
        sets.append("engine.activations=int8")
    cmd = [sys.executable, "-c", "from eaglebatch.cli import main; main()", "run",
           str(ROOT / "jobs" / "quickstart.yaml"),
           "--summary-json", str(summary)]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, EAGLEBATCH_PROGRESS_INTERVAL_S="60")
    started = time.monotonic()
    subprocess.run(cmd, check=True, env=env)
    wall = time.monotonic() - started
    got = json.loads(summary.read_text())
    got["generation_tok_s"] = got["output_tokens"] / got["generation_s"]
    got["startup_s"] = wall - got["wall_s"]  # process start to the first step (and its exit)
    return got


def llama_run(gguf: Path, ids: list[list[int]], parallel: int, args, console: Console) -> dict:
    binary = find_llama_server()
    r = run_llama_server(gguf, ids, args.max_tokens, parallel, threads=args.threads,
                         binary=binary, ignore_eos=True)  # fmt: skip
    r.pop("per_request")
    console.print(f"llama.cpp, {parallel} slot(s), {len(ids)} prompts: "
                  f"{r['output_tok_s_gen']:.2f} gen tok/s, start-up {r['startup_s']:.1f} s, "
                  f"peak {r['peak_resident_mib']:.0f} MiB")  # fmt: skip
    return r


def table(rows: list[tuple[str, str, dict]], file_mib: float) -> Table:
    t = Table(title="Qwen3-30B-A3B-shaped Q4_0 GGUF, generation tok/s, start-up, peak memory")
    for col in ("engine", "batch", "gen tok/s", "start-up s", "peak MiB", "peak / (file+KV)",
                "tokens per active expert"):
        t.add_column(col, justify="right")
    for engine, batch, r in rows:
        tok_s = r.get("generation_tok_s", r.get("output_tok_s_gen"))
        kv = r.get("kv_cache_mib") or 0.0
        peak = r.get("peak_resident_mib")
        ratio = f"{peak / (file_mib + kv):.2f}" if peak else "-"
        per_expert = r.get("expert_rows_per_active")
        t.add_row(engine, batch, f"{tok_s:.2f}", f"{r['startup_s']:.1f}",
                  f"{peak:.0f}" if peak else "-", ratio,
                  f"{per_expert:.2f}" if per_expert else "-")  # fmt: skip
    return t


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF,
                    help="the synthetic file (written there first when missing)")
    ap.add_argument("--batch1-prompts", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batched", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8", action="store_true", help="also engine.activations: int8")
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=200)
    console.print(f"CPU: {cpu_line()}")
    if not args.gguf.exists():
        args.gguf.parent.mkdir(parents=True, exist_ok=True)
        console.print(f"writing {args.gguf} (once) ...")
        write_moe_gguf(args.gguf)
    file_mib = args.gguf.stat().st_size / 2**20
    console.print(f"model: {args.gguf} ({file_mib:.0f} MiB)")
    rows: list[tuple[str, str, dict]] = []
    n1, n = args.batch1_prompts, args.prompts
    with tempfile.TemporaryDirectory(prefix="eaglebatch-moe-vs-llamacpp-") as tmp_name:
        tmp = Path(tmp_name)
        prompts = short_prompts(tmp / PROMPTS, n)
        ids = prompt_token_ids(quickstart_job(tmp / "ids", prompts, n, args.max_tokens,
                                              [f"model={args.gguf}", "draft=null"]))  # fmt: skip
        for batch, count in ((1, n1), (args.batched, n)):
            rows.append(("llama.cpp", str(batch), llama_run(args.gguf, ids[:count], batch, args,
                                                            console)))  # fmt: skip
            for int8 in (False, True) if args.int8 else (False,):
                r = eaglebatch_run(args.gguf, prompts, count, batch, args, tmp, int8)
                rows.append(("eaglebatch" + (" int8" if int8 else ""), str(batch), r))
    console.print(table(rows, file_mib))
    for engine, batch, r in rows:
        if engine.startswith("eaglebatch"):
            ref = next(x for e, b, x in rows if e == "llama.cpp" and b == batch)
            goal = GOAL_BATCH1 if batch == "1" else GOAL_BATCHED
            speed = r["generation_tok_s"] / ref["output_tok_s_gen"]
            console.print(f"batch {batch}, {engine}: {speed:.2f}x llama.cpp (goal {goal}x: "
                          f"{'met' if speed >= goal else 'not met'})")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_line(), "args": {k: str(v) for k, v in
                                         vars(args).items()}, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""eaglebatch against llama.cpp on the CPU: the same GGUF, the same prompts, greedy, one sitting.

    python benchmarks/cpu_vs_llamacpp.py [--batch1-prompts 24] [--prompts 64]
        [--max-tokens 128] [--batch-sizes 1 8 16 32 64] [--dequantized-batch-sizes 1 64]
        [--int8-batch-sizes 1 64] [--llama-parallel 16 32 64] [--threads 2] [--repeat 1]
        [--json PATH] [--model-shape 1b|3b]

The prompts are the first ShareGPT first-turn prompts of 20-400 characters in the quickstart's
input (the embedded dataset), rendered with the model's chat template by its tokenizer;
llama.cpp receives those token ids, so both engines see exactly the same input. The model is
the embedded SmolLM2-135M-Instruct Q4_1 GGUF: llama.cpp's `llama-server` serves the file itself
(`benchmarks/llamacpp.py` finds or builds it and says how); eaglebatch runs it with
`engine.weights: quantized` (steps read the GGUF's blocks), the same with `engine.activations:
int8` (x quantized to 8 bits in the block products, as llama.cpp does: another function than
the float32 model's) and `dequantized` (float32 copies), plain and with the builtin EAGLE head.

Batch 1 is the first `--batch1-prompts` prompts one at a time (llama.cpp with one slot;
eaglebatch with plain and EAGLE alternating request by request); "batched" is all `--prompts`
prompts, llama.cpp with parallel slots under continuous batching (the best of `--llama-parallel`)
against eaglebatch at max batch size 64. At every batch size plain and EAGLE run back to back
over one loaded model, and greedy EAGLE output is checked token for token against plain; with
`--repeat N` N such pairs alternate and EAGLE / plain is the median of the pairs (the tok/s
columns: each engine's median run).

Figures are generation throughput: output tokens over the time after prompt processing.
eaglebatch: the seconds of its decode and verify steps (a run's `step_seconds`: prefills and
decode steps that also carried prompt chunks left out). llama.cpp: at one slot the server's
summed `predicted_ms`; with slots, the wall time less the summed `prompt_ms` divided by the
slots (prompts processed that many at a time; an estimate, as prompt and generation batches
overlap). Wall-time throughput is printed beside each, and
EAGLE over plain is by wall time (a speculative prefill also prefills the head).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from eaglebatch.commands.bench import eaglebatch_rows
from eaglebatch.job import builtin
from eaglebatch.job.config import JobConfig, load_job
from eaglebatch.prepare import prepare

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp import find_llama_server, run_llama_server  # noqa: E402
from synthetic_gguf import write_llama_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GOAL_BATCH1, GOAL_BATCHED = 1.5, 2.0  # EAGLE over llama.cpp (issue 31)
PROMPTS = "prompts.parquet"
# eaglebatch's variants: (label, job overrides); a row's "weights" is its variant's key
VARIANTS = {
    "quantized": ("weights quantized", ["engine.weights=quantized"]),
    "int8": ("weights quantized, int8 activations",
             ["engine.weights=quantized", "engine.activations=int8"]),
    "dequantized": ("weights dequantized", ["engine.weights=dequantized"]),
}


def cpu_line() -> str:
    """The CPU model and its AVX-512 features (figures differ between AVX-512 and AVX2 hosts)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"model name\s*:\s*(.*)", text)
    flags = sorted(set(re.findall(r"\bavx512[a-z_0-9]*", text)))
    isa = ", ".join(flags) if flags else "no AVX-512 (AVX2 + FMA)"
    return f"{model.group(1) if model else platform.processor()}; {isa}"


def short_prompts(out: Path, n: int, lo: int = 20, hi: int = 400) -> Path:
    """The first n rows of the quickstart's ShareGPT input whose first turn has lo..hi
    characters, written to `out` (read in pages: the dataset is never loaded whole)."""
    job = load_job(ROOT / "jobs" / "quickstart.yaml", [f"output.path={out.parent / 'unused'}"])
    source = prepare(job).input_files
    keep = []
    for f in source:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
            lengths = [len(m[0]["content"]) for m in batch.column("messages").to_pylist()]
            mask = pa.array([lo <= x <= hi for x in lengths])
            keep.append(batch.filter(mask))
            if sum(b.num_rows for b in keep) >= n:
                break
    table = pa.Table.from_batches(keep).slice(0, n)
    if table.num_rows < n:
        raise SystemExit(f"only {table.num_rows} prompts of {lo}-{hi} characters in {source}")
    pq.write_table(table, out)
    return out


def quickstart_job(out: Path, prompts: Path, n: int, max_tokens: int,
                   overrides: list[str]) -> JobConfig:
    """The quickstart job (the embedded model, its EAGLE head) over the first n `prompts`."""
    return load_job(ROOT / "jobs" / "quickstart.yaml", [
        f"input.path={prompts}", f"input.limit={n}", f"sampling.max_new_tokens={max_tokens}",
        f"output.path={out}", *overrides,
    ])


def prompt_token_ids(job: JobConfig) -> list[list[int]]:
    """The job's prompts as the token ids eaglebatch feeds its model (chat template applied)."""
    from transformers import AutoTokenizer

    from eaglebatch.commands.bench import read_prompts

    prep = prepare(job)
    tok = AutoTokenizer.from_pretrained(str(prep.model.dir))
    rows = read_prompts(job, prep.input_files, prep.total_rows)
    texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
             for m in rows]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def llama_rows(gguf: Path, ids: list[list[int]], n1: int, args, console: Console) -> dict:
    """llama.cpp at one slot on the first n1 prompts, and at each slot count on all of them."""
    binary = find_llama_server()
    console.print(f"llama-server: {binary[1]}")
    out = {"binary": binary[1], "batch1": None, "batched": []}
    runs = [(1, ids[:n1])] + [(p, ids) for p in args.llama_parallel]
    for parallel, prompts in runs:
        r = run_llama_server(gguf, prompts, args.max_tokens, parallel, threads=args.threads,
                             binary=binary, ignore_eos=bool(args.model_shape))
        r.pop("per_request")
        console.print(f"llama.cpp, {parallel} slot(s), {len(prompts)} prompts: "
                      f"{r['output_tok_s_gen']:.1f} gen tok/s ({r['output_tok_s_wall']:.1f} wall)")
        if parallel == 1:
            out["batch1"] = r
        else:
            out["batched"].append(r)
    return out


def eagle_rows(weights: str, batch_sizes: list[int], n1: int, args, tmp: Path,
               console: Console, model: list[str]) -> list[dict]:  # fmt: skip
    """eaglebatch plain and EAGLE rows at each batch size for the variant `weights` (a key of
    VARIANTS; `model`: overrides naming another model than the quickstart's)."""
    rows = []
    label, overrides = VARIANTS[weights]
    for b in batch_sizes:
        n = n1 if b == 1 else args.prompts
        job = quickstart_job(tmp / f"{weights}-{b}", tmp / PROMPTS, n, args.max_tokens,
                             [*overrides, *model])
        console.print(f"eaglebatch, {label}, batch {b}, {n} prompts ...")
        got, pairs = eaglebatch_rows(job, [b], repeat=args.repeat, console=console)
        for r in got:
            r["weights"] = weights
            if r["engine"] == "eaglebatch+eagle":  # EAGLE over the plain run before it, wall
                r["pair_speedups"] = pairs.get(b, [])
            console.print(f"  {r['engine']}: {_f(r['generation_tok_s'])} gen tok/s "
                          f"({r['output_tok_s']:.1f} wall), acceptance "
                          f"{_f(r['accept_length'], '.2f')}")
        rows += got
    return rows


def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _find(rows: list[dict], weights: str, engine: str, b: int) -> dict | None:
    return next((r for r in rows if r["weights"] == weights and r["engine"] == engine
                 and r["batch_size"] == b), None)


def side_by_side(llama: dict, rows: list[dict], n1: int, n: int, batched: int) -> Table:
    """The issue's table: generation tok/s at batch 1 and batched, per engine."""
    best = max(llama["batched"], key=lambda r: r["output_tok_s_gen"])
    t = Table(title=f"generation tok/s (wall tok/s): batch 1 on {n1} prompts, batched on {n}")
    for col in ("engine", "batch 1", "batched", "accept len b1 / batched"):
        t.add_column(col, justify="right")
    one = llama["batch1"]
    t.add_row("llama.cpp llama-server",
              f"{one['output_tok_s_gen']:.1f} ({one['output_tok_s_wall']:.1f})",
              f"{best['output_tok_s_gen']:.1f} ({best['output_tok_s_wall']:.1f}), "
              f"{best['parallel']} slots", "-")
    for weights, (variant, _) in VARIANTS.items():
        for engine, label in (("eaglebatch", "plain"), ("eaglebatch+eagle", "EAGLE")):
            a, b = _find(rows, weights, engine, 1), _find(rows, weights, engine, batched)
            if a is None and b is None:
                continue
            cells = [f"{_f(r['generation_tok_s'])} ({r['output_tok_s']:.1f})" if r else "-"
                     for r in (a, b)]
            acc = " / ".join(_f(r and r["accept_length"], ".2f") for r in (a, b))
            t.add_row(f"eaglebatch {label}, {variant}", *cells, acc)
    return t


def spec_table(rows: list[dict], weights: str, batch_sizes: list[int]) -> Table:
    """EAGLE over plain at each batch size (the pair measured back to back), by wall time:
    the speculative run's prefills also prefill its head, so generation time alone would
    leave a cost of speculation out."""
    t = Table(title=f"EAGLE / plain, {VARIANTS[weights][0]} (output tok/s, wall time)")
    for col in ("batch", "plain", "EAGLE", "EAGLE / plain", "generation only", "accept len",
                "identical"):
        t.add_column(col, justify="right")
    for b in batch_sizes:
        p, e = _find(rows, weights, "eaglebatch", b), _find(rows, weights, "eaglebatch+eagle", b)
        if p is None or e is None:
            continue
        pairs = e.get("pair_speedups") or [e["output_tok_s"] / p["output_tok_s"]]
        e["speedup"] = statistics.median(pairs)
        e["gen_speedup"] = e["generation_tok_s"] / p["generation_tok_s"]
        shown = f"{e['speedup']:.2f}x" + (
            f" ({', '.join(f'{x:.2f}' for x in pairs)})" if len(pairs) > 1 else "")
        t.add_row(str(b), f"{p['output_tok_s']:.1f}", f"{e['output_tok_s']:.1f}",
                  shown, f"{e['gen_speedup']:.2f}x",
                  _f(e["accept_length"], ".2f"),
                  f"{e.get('identical_requests', '-')}/{e['requests']}")
    return t


def goal_lines(llama: dict, rows: list[dict], batched: int,
               goals: tuple[float, float] = (GOAL_BATCH1, GOAL_BATCHED)) -> list[str]:  # fmt: skip
    best = max(r["output_tok_s_gen"] for r in llama["batched"])
    out = []
    for label, b, ref, goal in (("batch 1", 1, llama["batch1"]["output_tok_s_gen"], goals[0]),
                                ("batched", batched, best, goals[1])):
        for weights, (variant, _) in VARIANTS.items():
            e = _find(rows, weights, "eaglebatch+eagle", b)
            p = _find(rows, weights, "eaglebatch", b)
            if p is None:
                continue
            fastest = max(r["generation_tok_s"] for r in (e, p) if r is not None)
            eagle = f"EAGLE {e['generation_tok_s'] / ref:.2f}x, " if e is not None else ""
            out.append(f"{label}, {variant}: {eagle}"
                       f"plain {p['generation_tok_s'] / ref:.2f}x llama.cpp "
                       f"(goal {goal}x: {'met' if fastest / ref >= goal else 'not met'})")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--batch1-prompts", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    ap.add_argument("--dequantized-batch-sizes", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--int8-batch-sizes", type=int, nargs="*",
                    help="batch sizes of the engine.activations: int8 runs (default: "
                    "--batch-sizes)")
    ap.add_argument("--llama-parallel", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1,
                    help="eaglebatch plain / EAGLE pairs per batch size (the median is shown)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--model-shape", choices=["1b", "3b"],
                    help="a synthetic Llama GGUF of this size (benchmarks/synthetic_gguf.py, "
                    "random weights, plain decoding with EOS ignored) instead of the embedded "
                    "model")
    args = ap.parse_args(argv)
    if args.model_shape and "--dequantized-batch-sizes" not in (argv or sys.argv):
        args.dequantized_batch_sizes = []  # float32 copies of 1-3B weights: not the point
    if args.int8_batch_sizes is None:
        args.int8_batch_sizes = args.batch_sizes
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=200)
    console.print(f"CPU: {cpu_line()}")
    n1, batched = args.batch1_prompts, max(args.batch_sizes)
    with tempfile.TemporaryDirectory(prefix="eaglebatch-vs-llamacpp-") as tmp:
        gguf, model = builtin.builtin_gguf(), []
        if args.model_shape:
            gguf = write_llama_gguf(Path(tmp) / f"{args.model_shape}.gguf", args.model_shape)
            model = [f"model={gguf}", "draft=null", "sampling.ignore_eos=true"]
            console.print(f"synthetic {args.model_shape} GGUF: {gguf.stat().st_size / 1e9:.2f} GB")
        short_prompts(Path(tmp) / PROMPTS, args.prompts)
        ids = prompt_token_ids(quickstart_job(Path(tmp) / "ids", Path(tmp) / PROMPTS,
                                              args.prompts, args.max_tokens, model))
        llama = llama_rows(gguf, ids, n1, args, console)
        rows = eagle_rows("quantized", args.batch_sizes, n1, args, Path(tmp), console, model)
        rows += eagle_rows("int8", args.int8_batch_sizes, n1, args, Path(tmp), console, model)
        rows += eagle_rows("dequantized", args.dequantized_batch_sizes, n1, args, Path(tmp),
                           console, model)
    console.print(side_by_side(llama, rows, n1, args.prompts, batched))
    for weights in VARIANTS:
        if any(r["weights"] == weights for r in rows):
            console.print(spec_table(rows, weights, args.batch_sizes))
    goals = (1.0, 1.5) if args.model_shape else (GOAL_BATCH1, GOAL_BATCHED)
    for line in goal_lines(llama, rows, batched, goals):
        console.print(line, highlight=False)
    if args.json:
        result = {"cpu": cpu_line(), "args": {k: str(v) for k, v in vars(args).items()},
                  "llama_cpp": llama, "eaglebatch": rows}
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

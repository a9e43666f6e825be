"""lm-evaluation-harness requests on eaglebatch vs lm-eval's own `hf` model, in one run on one
machine, on the quickstart's model (eaglebatch: its GGUF blocks; hf: the same weights
dequantized, float32):

- multiple choice: a 4-choice task built from ShareGPT (context: a first-turn prompt and
  "Answer:", choices: four snippets of responses), `loglikelihood` requests per second, hf at
  each `--hf-batch-size` (its best reported), with the largest difference between the two
  engines' log-likelihoods and whether their answers agree; the contexts are ShareGPT prompts
  of 200-1200 characters (`--context-chars`), about a few-shot prompt's length;
- generation: ShareGPT first turns as `generate_until` requests (greedy, stop at a blank line),
  requests per second, eaglebatch with its builtin EAGLE head, and whether the outputs are
  equal.

    python benchmarks/scoring.py [--docs 100] [--gen 16] [--max-gen-toks 64]
                                 [--hf-batch-size 8 --hf-batch-size 32] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import pyarrow.parquet as pq

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

MODEL = "builtin:smollm2-135m-instruct"
DRAFT = "builtin:smollm2-135m-instruct-eagle"


def sharegpt(n: int, chars: tuple[int, int] = (20, 400)) -> list[dict]:
    from eaglebatch.job import builtin

    rows = pq.ParquetFile(builtin.sharegpt_parquet()).read_row_group(0).to_pylist()
    lo, hi = chars
    rows = [r for r in rows if lo <= len(r["prompt"]) <= hi and len(r["response"] or "") > 200]
    return rows[:n]


def mc_requests(docs: int, chars: tuple[int, int]) -> list[tuple[str, str]]:
    """4 choices per doc: the doc's own response start and three others'."""
    rows = sharegpt(docs + 3, chars)
    snippet = [" " + " ".join(r["response"].split()[:8]) for r in rows]
    reqs = []
    for i, r in enumerate(rows[:docs]):
        context = f"Question: {r['prompt']}\nAnswer:"
        reqs += [(context, snippet[(i + k) % len(rows)]) for k in range(4)]
    return reqs


def instances(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def hf_model(folder: str, batch_size: int):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=folder, batch_size=batch_size, device="cpu", dtype="float32")


def run_mc(args, ours, result: dict) -> None:
    reqs = mc_requests(args.docs, tuple(args.context_chars))
    tok = ours.engine.tokenizer
    ctx = sum(len(tok.encode(c).ids) for c, _ in reqs[::4]) / args.docs
    cont = sum(len(tok.encode(c + x).ids) for c, x in reqs) / len(reqs) - ctx
    got, wall = timed(ours.loglikelihood, instances("loglikelihood", reqs))
    result["mc"] = {"requests": len(reqs), "eaglebatch_req_s": len(reqs) / wall, "hf": {},
                    "context_tokens": ctx, "continuation_tokens": cont}  # fmt: skip
    print(f"multiple choice: {len(reqs)} loglikelihood requests ({args.docs} docs x 4), "
          f"contexts {ctx:.0f} tokens, continuations {cont:.0f} tokens on average")
    print(f"  eaglebatch              {len(reqs) / wall:8.1f} req/s  ({wall:.1f} s)")
    for bs in args.hf_batch_size:
        hf = hf_model(str(ours.engine.model_dir), bs)
        want, hf_wall = timed(hf.loglikelihood, instances("loglikelihood", reqs))
        diff = max(abs(a[0] - b[0]) for a, b in zip(got, want, strict=True))
        agree = sum(_answer(got, d) == _answer(want, d) for d in range(args.docs))
        result["mc"]["hf"][bs] = {"req_s": len(reqs) / hf_wall, "max_abs_diff": diff,
                                  "answers_agree": agree}  # fmt: skip
        print(f"  hf batch {bs:<3}            {len(reqs) / hf_wall:8.1f} req/s  ({hf_wall:.1f} s)"
              f"  speedup {hf_wall / wall:.2f}x  max |dlogprob| {diff:.2e}  "
              f"answers agree {agree}/{args.docs}")  # fmt: skip
    best = max(v["req_s"] for v in result["mc"]["hf"].values())
    result["mc"]["speedup_vs_best_hf"] = result["mc"]["eaglebatch_req_s"] / best
    print(f"  eaglebatch / best hf: {result['mc']['speedup_vs_best_hf']:.2f}x")


def _answer(results: list, doc: int) -> int:
    scores = [results[doc * 4 + k][0] for k in range(4)]
    return scores.index(max(scores))


def run_gen(args, ours, result: dict) -> None:
    kwargs = {"until": ["\n\n"], "max_gen_toks": args.max_gen_toks, "do_sample": False}
    reqs = [(r["prompt"], kwargs) for r in sharegpt(args.gen)]
    got, wall = timed(ours.generate_until, instances("generate_until", reqs))
    print(f"generate_until: {len(reqs)} requests, greedy, <= {args.max_gen_toks} tokens")
    print(f"  eaglebatch + EAGLE head {len(reqs) / wall:8.2f} req/s  ({wall:.1f} s)")
    result["gen"] = {"requests": len(reqs), "eaglebatch_req_s": len(reqs) / wall, "hf": {}}
    for bs in args.hf_batch_size:
        hf = hf_model(str(ours.engine.model_dir), bs)
        want, hf_wall = timed(hf.generate_until, instances("generate_until", reqs))
        same = sum(a == b for a, b in zip(got, want, strict=True))
        result["gen"]["hf"][bs] = {"req_s": len(reqs) / hf_wall, "equal_outputs": same}
        print(f"  hf batch {bs:<3}            {len(reqs) / hf_wall:8.2f} req/s  ({hf_wall:.1f} s)"
              f"  speedup {hf_wall / wall:.2f}x  equal outputs {same}/{len(reqs)}")  # fmt: skip


def cpu_flags() -> str:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown"
    return "AVX-512" if "avx512f" in flags else ("AVX2+FMA" if "avx2" in flags else "other")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=100)
    p.add_argument("--context-chars", type=int, nargs=2, default=[200, 1200],
                   metavar=("MIN", "MAX"), help="the prompts' length in characters")
    p.add_argument("--gen", type=int, default=16)
    p.add_argument("--max-gen-toks", type=int, default=64)
    p.add_argument("--hf-batch-size", type=int, action="append")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.hf_batch_size = args.hf_batch_size or [8, 32]
    from eaglebatch.integrations.lm_eval import EaglebatchLM

    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} "
                         f"cores, {cpu_flags()}", "model": MODEL}  # fmt: skip
    print(f"machine: {result['machine']}")
    # scoring needs no draft head (its requests generate nothing); generation speculates
    plain = EaglebatchLM(model=MODEL, engine={"max_batch_size": 64})
    run_mc(args, plain, result)
    plain.engine.close()
    run_gen(args, EaglebatchLM(model=MODEL, draft=DRAFT, engine={"max_batch_size": 64}), result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

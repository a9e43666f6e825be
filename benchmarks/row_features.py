"""What the per-row features cost: the same job with them off, with `output.logprobs: 5`, and
with the three penalties on, over one loaded model, alternating runs (off, logprobs,
penalties, off, ...) so each is measured in the same minutes; the median of each.

    python benchmarks/row_features.py [--job jobs/quickstart.yaml] [--rows 32] [--repeat 3]
                                      [--max-new-tokens 64] [--no-draft] [--only off --json]

`--only off --json` runs just the features-off job and prints one JSON line: run it under two
builds alternately to compare a change's throughput without the features (before / after).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import build_worker, run_prepared

CONFIGS = {
    "off": [],
    "logprobs=5": ["output.logprobs=5"],
    "penalties": ["sampling.repetition_penalty=1.1", "sampling.frequency_penalty=0.3",
                  "sampling.presence_penalty=0.3"],  # fmt: skip
}


def run_once(job_path: str, base: list[str], extra: list[str], out: Path, worker):
    over = [*base, *extra, f"output.path={out}"]
    prep = prepare(load_job(job_path, over))
    if worker is None:
        worker = build_worker(prep)
    t = time.monotonic()
    res = run_prepared(prep, worker=worker, restart=True)
    wall = time.monotonic() - t
    return res.stats["output_tokens"] / wall, worker


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="jobs/quickstart.yaml")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-draft", action="store_true")
    ap.add_argument("--only", choices=sorted(CONFIGS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    base = [f"input.limit={args.rows}", f"sampling.max_new_tokens={args.max_new_tokens}"]
    if args.no_draft:
        base.append("draft=null")
    names = [args.only] if args.only else list(CONFIGS)
    tok_s: dict[str, list[float]] = {n: [] for n in names}
    worker = None
    with tempfile.TemporaryDirectory(prefix="eaglebatch-features-") as d:
        for r in range(args.repeat):
            for name in names:
                out = Path(d) / f"{name}-{r}"
                t, worker = run_once(args.job, base, CONFIGS[name], out, worker)
                tok_s[name].append(t)
    medians = {n: statistics.median(v) for n, v in tok_s.items()}
    if args.json:
        print(json.dumps({"tok_s": medians, "runs": tok_s}))
        return medians
    off = medians.get("off")
    print(f"{'config':<12} {'output tok/s (median)':>22} {'vs off':>8}   runs")
    for n, m in medians.items():
        rel = f"{m / off:8.2f}" if off else ""
        print(f"{n:<12} {m:22.1f} {rel}   {', '.join(f'{x:.1f}' for x in tok_s[n])}")
    return medians


if __name__ == "__main__":
    main()

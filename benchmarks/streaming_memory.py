"""Peak RSS of a whole job as a function of input rows: streaming keeps it flat.

    python benchmarks/streaming_memory.py --rows 20000 200000 [--format openai-batch]

Each size runs in a fresh subprocess (ru_maxrss is a per-process high-water mark) on a tiny
random model with max_new_tokens=1, so the figure measures the pipeline (read, tokenize,
schedule, write), not the model. `--format openai-batch` reads OpenAI Batch JSONL requests and
writes the results file too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared
t = time.monotonic()
res = run_prepared(prepare(load_job(sys.argv[2])))
print(json.dumps({"rows": res.stats["requests"], "wall_s": time.monotonic() - t,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def make_input(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pq.ParquetWriter(path, pa.schema([("id", pa.int64()), ("prompt", pa.string())])) as w:
        for start in range(0, rows, 50_000):
            n = min(50_000, rows - start)
            ids = list(range(start, start + n))
            w.write_table(
                pa.table({"id": ids, "prompt": [f"prompt number {i} " * 3 for i in ids]}),
                row_group_size=10_000,
            )


def make_batch_input(path: Path, rows: int) -> None:
    """OpenAI Batch completion requests, one per line."""
    with open(path, "w") as f:
        for i in range(rows):
            body = {"model": "tiny", "prompt": f"prompt number {i} " * 3, "max_tokens": 1}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                "url": "/v1/completions", "body": body}) + "\n")  # fmt: skip


def measure(rows: int, model_dir: Path, tmp: Path, fmt: str = "parquet") -> dict:
    batch = fmt == "openai-batch"
    inp = tmp / f"in-{rows}.{'jsonl' if batch else 'parquet'}"
    (make_batch_input if batch else make_input)(inp, rows)
    job = tmp / f"job-{rows}.yaml"
    job.write_text(
        f"model: {model_dir}\ninput:\n  path: {inp}\n" + ("" if batch else "  id_column: id\n")
        + f"output:\n  path: {tmp / f'out-{rows}'}\n  part_rows: 8192\n"
        + ("  format: openai-batch\n" if batch else "")
        + "sampling:\n  max_new_tokens: 1\n"
        "engine:\n  device: cpu\n  max_batch_size: 256\n  kv_cache_tokens: 65536\n"
    )
    tests_dir = Path(__file__).resolve().parent.parent / "tests"
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tests_dir), str(job)],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[20_000, 200_000])
    ap.add_argument("--format", choices=["parquet", "openai-batch"], default="parquet")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support.tiny import make_tiny_model

    results = []
    with tempfile.TemporaryDirectory(prefix="eaglebatch-mem-") as d:
        tmp = Path(d)
        model = make_tiny_model(tmp / "model", hidden_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1)
        for rows in args.rows:
            t = time.monotonic()
            r = measure(rows, model, tmp, args.format)
            r["total_s"] = time.monotonic() - t
            results.append(r)
            print(f"rows={r['rows']:>8}  peak RSS={r['peak_rss_mb']:8.1f} MiB  "
                  f"job wall={r['wall_s']:6.1f}s", flush=True)
    return results


if __name__ == "__main__":
    main()

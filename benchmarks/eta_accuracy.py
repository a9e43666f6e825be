"""How right the progress line's ETA is: runs a job with `eaglebatch run` (stderr not a terminal,
so it logs a line every EAGLEBATCH_PROGRESS_INTERVAL_S seconds), records each printed ETA with
the time it was printed, and prints per line: elapsed, ETA, the time the run actually still took,
and their ratio (the larger over the smaller); then the largest ratio from a fifth of the run on.

    python benchmarks/eta_accuracy.py jobs/quickstart.yaml --set output.path=/tmp/eta-qs
    python benchmarks/eta_accuracy.py --uniform 64        # 64 prompts of one length, ignore_eos

Times count from the command's start (the model load included), as the user waits, to the
summary table."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ETA = re.compile(r"ETA (\d+)s")


def uniform_job(rows: int, words: int, max_new_tokens: int, where: Path) -> Path:
    """A job over `rows` identical-length prompts (distinct words, so no prefix is shared)
    that always generates `max_new_tokens` tokens (ignore_eos)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    vocab = ["river", "stone", "cloud", "amber", "lemon", "orbit", "piano", "tiger"]
    prompts = [" ".join(f"{vocab[(i * 7 + j) % 8]}{i}" for j in range(words)) for i in range(rows)]
    pq.write_table(pa.table({"prompt": prompts}), where / "uniform.parquet")
    job = where / "uniform.yaml"
    job.write_text(
        "model: smollm2-135m-instruct\ndraft: smollm2-135m-instruct-eagle\n"
        "input: {path: uniform.parquet}\noutput: {path: out}\n"
        f"sampling: {{max_new_tokens: {max_new_tokens}, temperature: 0, ignore_eos: true}}\n"
        f"engine: {{max_batch_size: {rows}}}\n"
    )
    return job


def run(job: Path, sets: list[str], interval: float) -> tuple[list[tuple[float, str]], float]:
    """Runs the job to the end; returns (seconds since start, line) for each line it wrote and
    the seconds until the run finished: its summary table printed (the interpreter's exit
    after it is no part of the run)."""
    cmd = ["eaglebatch", "run", str(job), "--restart"] + [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "EAGLEBATCH_PROGRESS_INTERVAL_S": str(interval)}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env)  # fmt: skip
    lines = []
    for line in proc.stderr:
        lines.append((time.monotonic() - start, line.rstrip()))
    end = time.monotonic() - start
    if proc.wait() != 0:
        sys.exit("\n".join(text for _, text in lines[-20:]))
    return lines, next((at for at, text in lines if "eaglebatch summary" in text), end)


def report(lines: list[tuple[float, str]], total: float) -> float:
    """Prints the table; returns the largest ratio from a fifth of the run on."""
    print(f"{'elapsed':>8} {'ETA':>7} {'actual':>7} {'ratio':>6}  line")
    worst = 1.0
    for at, text in lines:
        if not text.startswith("[eaglebatch]"):
            continue
        m = ETA.search(text)
        left = total - at
        if m is None:
            print(f"{at:8.1f} {'-':>7} {left:7.1f} {'-':>6}  {text}")
            continue
        eta = float(m.group(1))
        ratio = max(eta, 1.0) / max(left, 1.0)
        ratio = max(ratio, 1 / ratio)
        if at >= total / 5:
            worst = max(worst, ratio)
        print(f"{at:8.1f} {eta:7.0f} {left:7.1f} {ratio:6.2f}  {text}")
    print(f"run took {total:.1f}s; largest ratio from {total / 5:.1f}s on: {worst:.2f}")
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", nargs="?", type=Path)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between log lines")
    ap.add_argument("--uniform", type=int, metavar="ROWS", help="generate a uniform job")
    ap.add_argument("--prompt-words", type=int, default=100)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        job = args.job
        if args.uniform:
            job = uniform_job(args.uniform, args.prompt_words, args.max_new_tokens, Path(tmp))
        elif job is None:
            ap.error("name a job file or --uniform ROWS")
        lines, total = run(job, args.sets, args.interval)
        report(lines, total)


if __name__ == "__main__":
    main()

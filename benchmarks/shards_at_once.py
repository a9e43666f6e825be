"""Shards of one job started at once on one machine against the same shards one after the
other (the CPU threads each process takes, cpu/threads.py, and how its idle threads wait).

    python benchmarks/shards_at_once.py [--job jobs/quickstart.yaml] [--shards 2]
        [--set KEY=VALUE ...] [--no-share]

Each shard is `eaglebatch run JOB --shard i/N` in its own process, into its own output
directory per sitting (sequential first, then all at once). --no-share gives every process its
own worker registry, so each takes every usable CPU (the behaviour before processes shared
them). Prints both wall times, their ratio and each concurrent shard's thread line.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _command(job: Path, shard: int, n: int, out: Path, sets: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "eaglebatch.cli", "run", str(job), "--shard", f"{shard}/{n}",
           "--set", f"output.path={out}"]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    return cmd


def _env(tmp: Path, shard: int, sitting: str, share: bool) -> dict:
    env = dict(os.environ)
    if not share:
        env["EAGLEBATCH_WORKERS_DIR"] = str(tmp / f"workers-{sitting}-{shard}")
    return env


def sitting(job: Path, n: int, tmp: Path, name: str, sets: list[str], share: bool,
            at_once: bool) -> tuple[float, list[str]]:  # fmt: skip
    """Runs the N shards (at once or in turn); wall seconds and their logs."""
    out = tmp / name
    start = time.perf_counter()
    procs, logs = [], []
    for i in range(n):
        log = open(tmp / f"{name}-{i}.log", "w")  # noqa: SIM115 (closed below)
        p = subprocess.Popen(_command(job, i, n, out, sets), env=_env(tmp, i, name, share),
                             stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        procs.append((p, log))
        if not at_once:
            p.wait()
    for p, log in procs:
        if p.wait() != 0:
            raise SystemExit(f"a shard failed: {(tmp / f'{name}-0.log').read_text()[-2000:]}")
        log.close()
    wall = time.perf_counter() - start
    for i in range(n):
        text = (tmp / f"{name}-{i}.log").read_text()
        logs += [ln.strip("│ ") for ln in text.splitlines() if "CPU threads" in ln]
    return wall, logs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", type=Path, default=ROOT / "jobs" / "quickstart.yaml")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--no-share", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="eaglebatch-shards-") as d:
        tmp = Path(d)
        share = not args.no_share
        seq, _ = sitting(args.job, args.shards, tmp, "sequential", args.sets, share, False)
        par, threads = sitting(args.job, args.shards, tmp, "at-once", args.sets, share, True)
    print(f"{args.shards} shards of {args.job.name}: one after the other {seq:.1f} s, at once "
          f"{par:.1f} s, ratio {par / seq:.2f}")
    for line in threads:
        print(f"  at once: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One process with every core against a Ray run of N actors, on the same job, in one sitting.

    python benchmarks/ray_scaling.py jobs/quickstart.yaml --actors 2 [--set key=value ...]

Each is timed from the first step to the last row written; model loading (and Ray's start) is
reported separately. Prints both, the ratio and whether the outputs agree (greedy jobs: the
same tokens row by row), and writes the figures as JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
from rich.console import Console

from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.ray_executor import run_on_ray
from eaglebatch.runner import build_worker, run_prepared


def one_process(job_file: str, overrides: list[str], out: Path) -> dict:
    prep = prepare(load_job(job_file, [*overrides, f"output.path={out}"]))
    t0 = time.monotonic()
    worker = build_worker(prep)
    load = time.monotonic() - t0
    res = run_prepared(prep, worker=worker, restart=True)
    tokens = res.stats["output_tokens"]
    return {"load_s": load, "wall_s": res.wall_s, "output_tokens": tokens,
            "tok_s": tokens / res.wall_s}  # fmt: skip


def on_ray(job_file: str, overrides: list[str], out: Path, actors: int, cpus: int) -> dict:
    extra = [f"ray.actors={actors}", f"ray.cpus_per_actor={cpus}", f"output.path={out}"]
    prep = prepare(load_job(job_file, [*overrides, *extra]))
    t0 = time.monotonic()
    stats, wall = run_on_ray(prep, None, True, Console(stderr=True))
    total = time.monotonic() - t0
    tokens = stats["output_tokens"]
    return {"startup_s": stats["startup_s"], "wall_s": wall, "total_s": total,
            "output_tokens": tokens, "tok_s": tokens / wall, "units": stats["units"]}  # fmt: skip


def outputs(out: Path) -> dict:
    t = pq.read_table(out, columns=["row_index", "output_text"])
    return dict(zip(t.column("row_index").to_pylist(), t.column("output_text").to_pylist(),
                    strict=True))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--cpus-per-actor", type=int, default=1)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        local = one_process(a.job, a.overrides, Path(tmp) / "local")
        ray = on_ray(a.job, a.overrides, Path(tmp) / "ray", a.actors, a.cpus_per_actor)
        same = outputs(Path(tmp) / "local") == outputs(Path(tmp) / "ray")
    ratio = ray["tok_s"] / local["tok_s"]
    print(f"machine: {os.cpu_count()} CPUs")
    print(f"one process ({os.cpu_count()} threads): {local['output_tokens']} tokens in "
          f"{local['wall_s']:.1f}s = {local['tok_s']:.1f} tok/s "
          f"(model load {local['load_s']:.1f}s)")
    print(f"Ray, {a.actors} actors x {a.cpus_per_actor} CPU: {ray['output_tokens']} tokens in "
          f"{ray['wall_s']:.1f}s = {ray['tok_s']:.1f} tok/s ({ray['units']} units; Ray start and "
          f"model loads {ray['startup_s']:.1f}s, {ray['total_s']:.1f}s in all)")
    print(f"Ray / one process: {ratio:.2f}x; identical outputs: {same}")
    if a.json:
        Path(a.json).write_text(json.dumps({"local": local, "ray": ray, "ratio": ratio,
                                            "identical": same}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()

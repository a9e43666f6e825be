"""Runs racing for one output.path never write a row twice: 50 random interleavings of two
shards of different shard counts started together, and of a Ray driver rerun while an engine
actor of the dead driver before it still runs its unit. Each side runs in a long-lived process
(support/race_worker.py) so an interleaving costs no interpreter start."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import eaglebatch
from eaglebatch.ray_executor import cut_units
from support.tiny import make_tiny_model, write_prompts

pytest.importorskip("eaglebatch._native")
ROWS = 24
INTERLEAVINGS = 50


class Worker:
    def __init__(self):
        here = Path(__file__).parent
        path = f"{Path(eaglebatch.__file__).resolve().parent.parent}:{here}"
        self.proc = subprocess.Popen(
            [sys.executable, str(here / "support" / "race_worker.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "PYTHONPATH": path},
        )  # fmt: skip

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, "the race worker died"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def workers():
    pair = [Worker(), Worker()]
    yield pair
    for w in pair:
        w.close()


@pytest.fixture(scope="module")
def race_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("race")
    model = make_tiny_model(tmp / "model", hidden_size=32, num_layers=1, num_heads=2,
                            num_kv_heads=1)  # fmt: skip
    words = ["the", "cat", "sat", "on", "a", "mat", "42", "code"]
    write_prompts(tmp / "in.parquet", [" ".join(words[: 1 + i % 8]) for i in range(ROWS)],
                  ids=[f"r{i}" for i in range(ROWS)])  # fmt: skip
    job = tmp / "job.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {tmp / 'in.parquet'}\n  id_column: id\n"
        f"output:\n  path: {tmp / 'out'}\n  part_rows: 3\n  flush_interval_s: 0.05\n"
        "sampling:\n  max_new_tokens: 6\n"
        "engine:\n  device: cpu\n  kv_cache_tokens: 1024\n  max_batch_size: 2\n"
        "  num_threads: 1\nray:\n  actors: 1\n  cpus_per_actor: 1\n"
    )
    return job, tmp / "out"


def row_counts(out: Path) -> Counter:
    if not out.exists():
        return Counter()
    table = pq.read_table(out, columns=["row_index"]) if any(out.rglob("part-*")) else None
    return Counter(table.column("row_index").to_pylist()) if table is not None else Counter()


def check_at_most_once(out: Path, workers, job: Path, case: str) -> Counter:
    """No row twice, and `status` reads the output (0: complete, 1: rows to go; a duplicate
    row is exit 2)."""
    counts = row_counts(out)
    twice = sorted(r for r, c in counts.items() if c > 1)
    assert not twice, f"{case}: rows written twice: {twice}"
    workers[0].send(argv=["status", str(job)])
    want = 0 if len(counts) == ROWS else 1
    assert workers[0].answer()["rc"] == want, f"{case}: status refused the output"
    return counts


def test_shards_of_different_counts_started_together(workers, race_job):
    job, out = race_job
    rng = random.Random(42)
    for k in range(INTERLEAVINGS):
        shutil.rmtree(out, ignore_errors=True)
        a, b = f"{rng.randrange(3)}/3", f"{rng.randrange(2)}/2"
        spread = 0.4 if k % 3 == 0 else 0.01  # most start within the check's few milliseconds
        delays = [rng.uniform(0, spread), rng.uniform(0, spread)]
        workers[0].send(argv=["run", str(job), "--shard", a], sleep=delays[0])
        workers[1].send(argv=["run", str(job), "--shard", b], sleep=delays[1])
        rcs = sorted([workers[0].answer()["rc"], workers[1].answer()["rc"]])
        case = f"interleaving {k}: --shard {a} after {delays[0]:.2f}s, {b} after {delays[1]:.2f}s"
        assert rcs == [0, 2], f"{case}: exit statuses {rcs}"  # one N per output.path
        check_at_most_once(out, workers, job, case)


def test_a_rerun_driver_with_an_orphaned_actor_still_running(workers, race_job):
    job, out = race_job
    rng = random.Random(7)
    for k in range(INTERLEAVINGS):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        first_cut = cut_units(ROWS, np.empty(0, np.int64), rng.choice([5, 8, 12]))
        for u in first_cut:  # the dead driver made its units' directories, then dispatched
            (out / u.name).mkdir()
        orphan = rng.choice(first_cut)
        delays = [rng.uniform(0, 0.4), rng.uniform(0, 0.4)]
        rerun_rows = rng.choice([3, 7, 10])
        workers[0].send(unit=[orphan.start, orphan.end], job=str(job), sleep=delays[0])
        workers[1].send(argv=["run", str(job), "--ray", "--set", f"ray.unit_rows={rerun_rows}"],
                        fake_ray=True, sleep=delays[1])  # fmt: skip
        result, rc = workers[0].answer()["result"], workers[1].answer()["rc"]
        case = (f"interleaving {k}: orphan {orphan.name} after {delays[0]:.2f}s, rerun with "
                f"unit_rows {rerun_rows} after {delays[1]:.2f}s")  # fmt: skip
        assert rc == 0, f"{case}: the rerun driver failed"
        assert "failed" not in result, f"{case}: the orphan {result}"
        counts = check_at_most_once(out, workers, job, case)
        assert sorted(counts) == list(range(ROWS)), f"{case}: rows missing"

"""`eaglebatch run --ray`: engine actors on a local Ray instance or a two-node test cluster give
the rows of one process, exactly once, through a killed actor, a killed driver and a lost node.
Skipped only where Ray is not installed (CI installs it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import eaglebatch
from support.cli import cli, rows
from support.cli import finish as cli_finish
from support.tiny import make_tiny_model, write_prompts

pytest.importorskip("eaglebatch._native")
ray = pytest.importorskip("ray")

RAY = ["--set", "ray.actors=2", "--set", "ray.cpus_per_actor=1"]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("ray-llama"), hidden_size=32, num_layers=1, num_heads=2,
        num_kv_heads=1,
    )


def write_job(tmp: Path, model: Path, num_rows: int, unit_rows: int) -> Path:
    words = ["the", "cat", "sat", "on", "a", "mat", "42", "code", "über"]
    prompts = [" ".join(words[(i * 7 + j) % 9] for j in range(1 + i % 6)) for i in range(num_rows)]
    ids = [f"r{i}" for i in range(num_rows)]
    ids[num_rows - 3] = ids[5]  # a duplicate id far from its first row: an error row
    write_prompts(tmp / "in.parquet", prompts, ids=ids)
    job = tmp / "job.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {tmp / 'in.parquet'}\n  id_column: id\n"
        f"output:\n  path: {tmp / 'out'}\n  part_rows: 10\n  flush_interval_s: 0.2\n"
        "  include_token_ids: true\n"
        "sampling:\n  max_new_tokens: 6\n"
        "engine:\n  device: cpu\n  kv_cache_tokens: 2048\n  max_batch_size: 4\n"
        f"ray:\n  unit_rows: {unit_rows}\n"
    )
    return job


def finish(proc, status: int = 0) -> str:
    return cli_finish(proc, status, timeout=600)  # Ray's start and the models' loads


def unit_parts(out: Path) -> list[Path]:
    return sorted(out.glob("unit-*/part-*.parquet"))


def wait_for_parts(proc: subprocess.Popen, out: Path, n: int = 1, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while len(unit_parts(out)) < n:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() - t0 < timeout, "no progress"
        time.sleep(0.05)


def actor_pids() -> list[int]:
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in ps.splitlines() if "ray::EngineActor" in line]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_model):
    tmp = tmp_path_factory.mktemp("ray-ref")
    job = write_job(tmp, small_model, 240, 30)
    finish(cli("run", str(job)))
    return rows(tmp / "out")


def check_exactly_once(out: Path, reference: list[dict]) -> None:
    assert rows(out) == reference  # every row once, with one process's greedy outputs
    assert not list(out.glob("**/.part-*.tmp"))


def test_two_actors_give_the_rows_of_one_process(tmp_path, small_model, reference):
    job = write_job(tmp_path, small_model, 240, 30)
    finish(cli("run", str(job), "--shard", "0/3"))  # a third done before: Ray does the rest
    log = finish(cli("run", str(job), "--ray", *RAY))
    assert "240 rows (160 to generate) in 6 units" in log and "2 actors" in log, log
    check_exactly_once(tmp_path / "out", reference)
    assert "240/240 rows done, 1 error rows" in finish(cli("status", str(job)))
    # a rerun of a finished job starts no Ray at all
    assert "all 240 rows are done" in finish(cli("run", str(job), "--ray", *RAY))
    check_exactly_once(tmp_path / "out", reference)


def test_a_killed_actor_only_loses_its_unfinished_rows(tmp_path, small_model, reference):
    job = write_job(tmp_path, small_model, 240, 60)
    proc = cli("run", str(job), "--ray", *RAY)
    wait_for_parts(proc, tmp_path / "out")
    os.kill(actor_pids()[0], signal.SIGKILL)  # mid-unit: it writes a part every 10 rows
    log = finish(proc)
    assert "retried" in log and " 0 retried" not in log, log
    check_exactly_once(tmp_path / "out", reference)


def test_a_killed_driver_then_rerun_writes_each_row_once(tmp_path, small_model, reference):
    job = write_job(tmp_path, small_model, 240, 30)
    proc = cli("run", str(job), "--ray", *RAY)
    wait_for_parts(proc, tmp_path / "out", 2)
    proc.kill()
    proc.communicate()
    t0 = time.monotonic()
    while actor_pids():  # a dead driver's actors end with it (else they would keep writing)
        assert time.monotonic() - t0 < 60, "actors outlived their driver"
        time.sleep(0.2)
    log = finish(cli("run", str(job), "--ray", *RAY))
    assert "to generate" in log and "(240 to generate)" not in log, log  # it resumed
    check_exactly_once(tmp_path / "out", reference)


def test_a_lost_node_mid_job(tmp_path, small_model, reference):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        worker = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        job = write_job(tmp_path, small_model, 240, 30)
        proc = cli("run", str(job), "--ray", cluster.address, *RAY)
        wait_for_parts(proc, tmp_path / "out", 2)
        cluster.remove_node(worker)  # its actor dies; a new one starts on the head node
        log = finish(proc)
        assert "retried" in log and " 0 retried" not in log, log  # the lost node's unit
        check_exactly_once(tmp_path / "out", reference)
    finally:
        cluster.shutdown()


def test_bad_ray_runs_are_refused_before_any_model_is_loaded(tmp_path, small_model):
    job = write_job(tmp_path, small_model, 20, 10)
    for args, message in [
        (["--ray", "127.0.0.1:1"], "cannot reach a Ray cluster at '127.0.0.1:1'"),
        (["--ray", "--shard", "0/2"], "--shard and --ray"),
        (["--ray", "--set", "ray.actors=0"], "ray.actors"),
    ]:
        text = finish(cli("run", str(job), *args), 2)
        assert message in text and "Traceback" not in text, text
    assert not (tmp_path / "out").exists()


def test_a_unit_locked_by_another_process_waits_for_it(tmp_path, small_model, reference):
    """The actor of a lost node may still hold its unit's lock: the unit waits, then runs."""
    job = write_job(tmp_path, small_model, 240, 30)
    unit = tmp_path / "out" / "unit-000000000000-000000000030"
    unit.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; "
         f"fd = os.open({str(unit)!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
         "print('locked', flush=True); time.sleep(8)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        released = time.time() + 8
        finish(cli("run", str(job), "--ray", *RAY))
        first_part = min(p.stat().st_mtime for p in unit.glob("part-*.parquet"))
        assert first_part > released - 0.5  # the unit waited for the lock, then ran
    finally:
        holder.kill()
        holder.wait()
    check_exactly_once(tmp_path / "out", reference)


def test_a_rerun_driver_fences_an_actor_that_outlived_its_driver(tmp_path, small_model, reference):
    """The dead driver cut units of 40 rows and made their directories; one of its actors still
    runs its unit. The rerun cuts units of 30: it keeps the 40-row units (names and ranges), so
    its own actor waits for that unit's lock, then resumes after what the late actor wrote."""
    import json

    from eaglebatch.ray_executor import cut_units

    job = write_job(tmp_path, small_model, 240, 30)
    out = tmp_path / "out"
    out.mkdir()
    for u in cut_units(240, np.empty(0, np.int64), 40):
        (out / u.name).mkdir()
    here = Path(__file__).parent
    path = f"{Path(eaglebatch.__file__).resolve().parent.parent}:{here}"
    orphan = subprocess.Popen([sys.executable, str(here / "support" / "race_worker.py")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": path})  # fmt: skip
    orphan.stdin.write(json.dumps({"unit": [40, 80], "job": str(job)}) + "\n")
    orphan.stdin.close()
    try:
        t0 = time.monotonic()
        while not list((out / "unit-000000000040-000000000080").glob("part-*.parquet")):
            assert orphan.poll() is None and time.monotonic() - t0 < 120, "the orphan never ran"
            time.sleep(0.02)
        log = finish(cli("run", str(job), "--ray", *RAY))
        assert "units of about 30 rows" in log, log
        assert json.loads(orphan.stdout.readline())["result"].get("failed") is None
    finally:
        orphan.kill()
        orphan.wait()
    check_exactly_once(out, reference)
    assert sorted(d.name for d in out.iterdir() if d.name.startswith("unit-"))[:3] == [
        "unit-000000000000-000000000040", "unit-000000000040-000000000080",
        "unit-000000000080-000000000120"]  # fmt: skip

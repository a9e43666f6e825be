"""Jobs that survive: SIGKILL at random moments then resume, clean SIGINT / SIGTERM, job
identity checks. `eaglebatch run` runs as a subprocess, like a user's job."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import eaglebatch
from eaglebatch.errors import JobError
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared
from support.tiny import make_tiny_model, write_prompts

pytest.importorskip("eaglebatch._native")

ROWS = 2000


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """hidden 32, one layer: a step costs well under a millisecond."""
    return make_tiny_model(
        tmp_path_factory.mktemp("small-llama"), hidden_size=32, num_layers=1, num_heads=2,
        num_kv_heads=1,
    )


def write_job(tmp: Path, model: Path, rows: int, *, batch: int = 1, part_rows: int = 20) -> Path:
    rng = random.Random(rows)
    words = ["the", "cat", "sat", "on", "a", "mat", "42", "code", "über"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) for _ in range(rows)]
    inp = write_prompts(tmp / "in.parquet", prompts, ids=[f"r{i}" for i in range(rows)])
    job = tmp / "job.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {inp}\n  id_column: id\n"
        f"output:\n  path: {tmp / 'out'}\n  part_rows: {part_rows}\n  flush_interval_s: 0.2\n"
        "  include_token_ids: true\n"
        "sampling:\n  max_new_tokens: 6\n"
        f"engine:\n  device: cpu\n  kv_cache_tokens: 2048\n  max_batch_size: {batch}\n"
        "  num_threads: 1\n"
    )
    return job


def start_run(job: Path, *args: str) -> subprocess.Popen:
    # the same eaglebatch this test imported: the checkout's py/ in development, site-packages
    # after `pip install .` (CI), where py/ has no compiled extension
    env = {**os.environ, "PYTHONPATH": str(Path(eaglebatch.__file__).resolve().parent.parent)}
    return subprocess.Popen(
        [sys.executable, "-m", "eaglebatch.cli", "run", str(job), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def parts(out: Path) -> list[Path]:
    return sorted(out.glob("part-*.parquet"))


def wait_for_new_part(proc: subprocess.Popen, out: Path, before: int, timeout: float = 120):
    """Until a part beyond the first `before` appears (generation is under way) or exit."""
    t0 = time.monotonic()
    while proc.poll() is None and len(parts(out)) <= before:
        assert time.monotonic() - t0 < timeout, "no progress"
        time.sleep(0.01)


def check_readable(out: Path) -> int:
    """Every visible file is a complete Parquet file; returns the rows in them."""
    rows = 0
    for f in out.iterdir():
        if f.name.startswith("."):
            assert f.name.endswith(".tmp"), f  # a killed writer's temporary file
            continue
        rows += pq.read_metadata(f).num_rows
    return rows


def temporary_files(out: Path) -> list[Path]:
    return [f for f in out.iterdir() if f.name.startswith(".")]


def outputs(out: Path) -> dict:
    t = pq.read_table(out, columns=["id", "output_token_ids", "output_text", "finish_reason"])
    return {r["id"]: r for r in t.to_pylist()}


def test_sigkill_at_random_moments_then_resume(tmp_path, small_model):
    job = write_job(tmp_path, small_model, ROWS)
    out = tmp_path / "out"
    rng = random.Random(1234)
    # One kill at a random moment, likely before generation started: nothing may break.
    proc = start_run(job)
    time.sleep(rng.uniform(0.0, 2.0))
    proc.kill()
    proc.wait()
    mid_job_kills = 0
    for _ in range(12):
        before = len(parts(out))
        proc = start_run(job)
        wait_for_new_part(proc, out, before)
        time.sleep(rng.uniform(0.0, 0.3))
        proc.kill()
        _, err = proc.communicate()
        if proc.returncode == 0:
            break  # finished before the kill: nothing left to resume
        assert proc.returncode == -signal.SIGKILL, err
        mid_job_kills += 1
        assert check_readable(out) < ROWS
        if mid_job_kills == 5:
            break
    assert mid_job_kills >= 5
    proc = start_run(job)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "rows already done" in err

    # Every input id exactly once, every file readable, no temporary file left.
    assert check_readable(out) == ROWS
    assert temporary_files(out) == []
    ids = pq.read_table(out, columns=["id"]).column("id").to_pylist()
    assert sorted(ids) == sorted(f"r{i}" for i in range(ROWS))
    # Greedy outputs equal an uninterrupted run's.
    ref = tmp_path / "ref"
    run_prepared(prepare(load_job(job, [f"output.path={ref}"])))
    assert outputs(out) == outputs(ref)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_cleanly_and_resume_completes(tmp_path, small_model, sig):
    job = write_job(tmp_path, small_model, 600)
    out = tmp_path / "out"
    proc = start_run(job)
    wait_for_new_part(proc, out, 0)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert "run the same command again to resume" in err
    assert "Traceback" not in err
    written = check_readable(out)
    assert 0 < written < 600
    # A clean stop leaves only complete part files.
    assert temporary_files(out) == []
    run_prepared(prepare(load_job(job)))
    ids = pq.read_table(out, columns=["id"]).column("id").to_pylist()
    assert sorted(ids) == sorted(f"r{i}" for i in range(600))


def test_second_sigint_exits_at_once(tmp_path, small_model):
    job = write_job(tmp_path, small_model, 600)
    out = tmp_path / "out"
    proc = start_run(job)
    wait_for_new_part(proc, out, 0)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    # Either the first stop completed already (130) or the second signal killed the process.
    assert proc.returncode in (130, -signal.SIGINT)
    check_readable(out)
    run_prepared(prepare(load_job(job)))
    assert pq.read_table(out).num_rows == 600


def test_resume_refuses_another_jobs_output_and_unreadable_parts(tmp_path, small_model):
    job = write_job(tmp_path, small_model, 30, batch=8, part_rows=7)
    run_prepared(prepare(load_job(job)))
    # Output-affecting changes are refused, naming the key; speed settings are not.
    for override, key in [
        ("sampling.temperature=0.5", "sampling.temperature"),
        ("output.include_token_ids=false", "output.include_token_ids"),
        ("engine.max_model_len=100", "engine.max_model_len"),
        ("input.limit=10", "input.limit"),
    ]:
        with pytest.raises(JobError, match=rf"different job .*{key}.*--restart"):
            run_prepared(prepare(load_job(job, [override])))
    res = run_prepared(prepare(load_job(job, ["engine.max_batch_size=3", "output.part_rows=2"])))
    assert res.stats["requests"] == 0 and res.stats["skipped"] == 30
    assert pq.read_table(tmp_path / "out").num_rows == 30
    # A part file that is not readable (not one of ours) is reported, not overwritten.
    (tmp_path / "out" / "part-00099.parquet").write_bytes(b"garbage")
    with pytest.raises(JobError, match="part-00099.parquet is not a readable"):
        run_prepared(prepare(load_job(job)))
    # --restart cannot tell whether eaglebatch wrote it either: it refuses, and deletes nothing.
    with pytest.raises(JobError, match="part-00099.parquet is not a readable"):
        run_prepared(prepare(load_job(job)), restart=True)
    assert len(parts(tmp_path / "out")) > 1
    (tmp_path / "out" / "part-00099.parquet").unlink()
    # --restart starts over.
    res = run_prepared(prepare(load_job(job, ["sampling.max_new_tokens=2"])), restart=True)
    assert res.stats["requests"] == 30
    assert pq.read_table(tmp_path / "out").num_rows == 30


def test_a_second_concurrent_run_is_refused(tmp_path, small_model):
    job = write_job(tmp_path, small_model, 10, batch=4)
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; "
         f"fd = os.open({str(out)!r}, os.O_RDONLY); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        (out / ".part-00000.parquet.tmp").write_bytes(b"being written by the other run")
        with pytest.raises(JobError, match="in use by another running eaglebatch job"):
            run_prepared(prepare(load_job(job)))
        # The other run's temporary file was left alone.
        assert (out / ".part-00000.parquet.tmp").exists()
    finally:
        holder.kill()
        holder.wait()
    run_prepared(prepare(load_job(job)))  # the lock died with its process
    assert pq.read_table(out).num_rows == 10
    assert temporary_files(out) == []


def test_the_lock_survives_deleting_files_in_the_directory(tmp_path, small_model):
    """A cleanup script deleting every hidden file cannot let a second run write beside a
    running one (the lock is on the directory itself, not on a file in it)."""
    job = write_job(tmp_path, small_model, ROWS)
    out = tmp_path / "out"
    first = start_run(job)
    try:
        wait_for_new_part(first, out, 0)
        assert first.poll() is None, "the first run ended before the test could race it"
        for f in out.iterdir():
            if f.name.startswith(".") and not f.name.endswith(".tmp"):
                f.unlink()
        second = start_run(job)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err
        assert "in use by another running eaglebatch job" in err
    finally:
        first.wait(timeout=600)
    assert first.returncode == 0
    ids = pq.read_table(out, columns=["row_index"]).column(0).to_pylist()
    assert sorted(ids) == list(range(ROWS))

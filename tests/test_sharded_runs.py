"""Sharded runs (`eaglebatch run --shard i/N`) as separate processes, like array-job tasks:
the same rows, ids, error rows and greedy outputs as one unsharded run; a shard killed at random
moments and rerun still writes every row once; `eaglebatch status`; bad shards refused."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from support.cli import cli, finish, rows
from support.tiny import make_tiny_model, write_prompts

pytest.importorskip("eaglebatch._native")



@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("shard-llama"), hidden_size=32, num_layers=1, num_heads=2,
        num_kv_heads=1,
    )


def write_job(tmp: Path, model: Path, ids: list[str], *, limit: int | None = None) -> Path:
    rng = random.Random(len(ids))
    words = ["the", "cat", "sat", "on", "a", "mat", "42", "code", "über"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) for _ in ids]
    half = len(ids) // 2  # two input files, so shards straddle a file boundary
    write_prompts(tmp / "in" / "a.parquet", prompts[:half], ids=ids[:half])
    write_prompts(tmp / "in" / "b.parquet", prompts[half:], ids=ids[half:])
    job = tmp / "job.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {tmp / 'in'}\n  id_column: id\n"
        + (f"  limit: {limit}\n" if limit is not None else "")
        + f"output:\n  path: {tmp / 'out'}\n  part_rows: 7\n  flush_interval_s: 0.2\n"
        "  include_token_ids: true\n"
        "sampling:\n  max_new_tokens: 5\n"
        "engine:\n  device: cpu\n  kv_cache_tokens: 2048\n  max_batch_size: 4\n"
        "  num_threads: 1\n"
    )
    return job


def test_shards_as_separate_processes_equal_one_unsharded_run(tmp_path, small_model):
    # ids repeat across files and shard boundaries: row 40 repeats row 3's id, 45 repeats 30's
    ids = [f"r{i}" for i in range(50)]
    ids[40], ids[45] = ids[3], ids[30]
    job = write_job(tmp_path, small_model, ids, limit=47)
    ref = tmp_path / "ref"
    finish(cli("run", str(job), "--set", f"output.path={ref}"))
    out = tmp_path / "out"
    n = 4
    procs = [cli("run", str(job), "--shard", f"{i}/{n}") for i in range(n)]  # all at once
    logs = [finish(p) for p in procs]
    assert "shard-00001-of-00004: rows [11, 23) of 47" in logs[1]
    got, want = rows(out), rows(ref)
    assert [r["row_index"] for r in got] == list(range(47))
    assert got == want  # ids, greedy tokens and text, error rows: all as unsharded
    assert "duplicate id" in got[40]["error"] and "duplicate id" in got[45]["error"]
    names = sorted(p.name for p in out.iterdir() if p.name[0] != ".")  # .eaglebatch.lock
    assert names == [f"shard-0000{i}-of-00004" for i in range(n)]
    # one table however it is read
    assert pq.read_table(out).num_rows == 47
    status = cli("status", str(job))
    text = finish(status, 0)
    assert "shard 2/4: rows [23, 35): 12/12 done" in text
    assert "47/47 rows done, 2 error rows" in text
    # Rerunning a shard does nothing; an unsharded run over the shards finds the job done.
    assert "rows already done" in finish(cli("run", str(job), "--shard", "2/4"))
    assert "47 of 47 rows already done" in finish(cli("run", str(job)))
    assert pq.read_table(out).num_rows == 47


def test_a_shard_killed_at_random_moments_then_rerun_writes_each_row_once(tmp_path, small_model):
    total = 1500
    job = write_job(tmp_path, small_model, [f"r{i}" for i in range(total)])
    out = tmp_path / "out"
    shard_dir = out / "shard-00001-of-00002"
    rng = random.Random(7)
    finish(cli("run", str(job), "--shard", "0/2"))
    text = finish(cli("status", str(job)), 1)
    assert "750/1500 rows done" in text and "incomplete: 750 rows to go" in text
    kills = 0
    for _ in range(10):
        before = len(list(shard_dir.glob("part-*.parquet")))
        proc = cli("run", str(job), "--shard", "1/2")
        t0 = time.monotonic()
        while proc.poll() is None and len(list(shard_dir.glob("part-*.parquet"))) <= before:
            assert time.monotonic() - t0 < 120, "no progress"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
        proc.kill()
        _, err = proc.communicate()
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, err
        kills += 1
        if kills == 4:
            break
    assert kills >= 3
    # (the last kill may come after the shard's last part: status tells which)
    status = cli("status", str(job))
    text = status.communicate(timeout=300)[0]
    complete = pq.read_table(out).num_rows == total
    assert status.returncode == (0 if complete else 1), text
    assert ("incomplete" in text) != complete
    finish(cli("run", str(job), "--shard", "1/2"))
    assert "1500/1500 rows done, 0 error rows" in finish(cli("status", str(job)), 0)
    got = rows(out)
    assert [r["row_index"] for r in got] == list(range(total))
    assert [r["id"] for r in got] == [f"r{i}" for i in range(total)]


def test_bad_shards_are_refused_before_any_model_is_loaded(tmp_path, small_model):
    job = write_job(tmp_path, small_model, [f"r{i}" for i in range(10)])
    for args, message in [
        (["--shard", "4/4"], "shard index 4 is outside 0..3"),
        (["--shard", "0/0"], "number of shards must be >= 1"),
        (["--shard", "auto"], "neither SLURM_ARRAY_TASK_ID"),
    ]:
        text = finish(cli("run", str(job), *args), 2)
        assert message in text and "Traceback" not in text, text
    finish(cli("run", str(job), "--shard", "0/2"))
    text = finish(cli("run", str(job), "--shard", "1/3"), 2)
    assert "shard-00000-of-00002" in text and "shard 1/3" in text and "Traceback" not in text
    assert not (tmp_path / "out" / "shard-00001-of-00003").exists()
    # SLURM's variables name the shard
    env = {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"}
    assert "rows [5, 10) of 10" in finish(cli("run", str(job), "--shard", "auto", env=env))
    assert finish(cli("status", str(job)), 0).endswith("complete\n")


def slurm(task: int, array: list[int]) -> dict:
    """The array variables SLURM sets for task `task` of `sbatch --array=<array>`."""
    return {"SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_MIN": str(min(array)),
            "SLURM_ARRAY_TASK_MAX": str(max(array)), "SLURM_ARRAY_TASK_COUNT": str(len(array)),
            "SLURM_ARRAY_TASK_STEP": "1", "SLURM_ARRAY_JOB_ID": "77"}  # fmt: skip


def test_slurm_retries_of_any_subset_run_exactly_those_shards(tmp_path, small_model):
    """`--array=0-3`, tasks 1-3 killed, then `--array=1` and `--array=2,3` resubmitted: each
    task runs the shard of its own array id; every shard complete, each row once."""
    ids = [f"r{i}" for i in range(40)]
    job = write_job(tmp_path, small_model, ids)
    first = [cli("run", str(job), "--shard", "auto", env=slurm(t, [0, 1, 2, 3])) for t in range(4)]
    finish(first[0])
    for proc in first[1:]:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    for array in ([1], [2, 3]):
        logs = [finish(cli("run", str(job), "--shard", "auto", env=slurm(t, array)))
                for t in array]  # fmt: skip
        for t, log in zip(array, logs, strict=True):
            assert f"shard-0000{t}-of-00004" in log, log
    text = finish(cli("status", str(job)))
    assert "40/40 rows done" in text and "complete" in text, text
    assert [r["row_index"] for r in rows(tmp_path / "out")] == list(range(40))
    for env, message in [
        (slurm(4, [4]), "shard index 4 is outside 0..3"),  # an id past the shards written
        ({**slurm(1, [1]), "SLURM_ARRAY_TASK_ID": "1"}, None),  # fine: shard 1 of 4, done
    ]:
        proc = cli("run", str(job), "--shard", "auto", env=env)
        if message is None:
            finish(proc)
        else:
            assert message in finish(proc, 2)
    assert "--shards 3, but output.path holds shards of N = 4" in finish(
        cli("run", str(job), "--shard", "auto", "--shards", "3", env=slurm(1, [1])), 2)
    other = tmp_path / "fresh"
    assert "pass --shards N" in finish(cli("run", str(job), "--shard", "auto", "--set",
                                           f"output.path={other}", env=slurm(1, [1])), 2)

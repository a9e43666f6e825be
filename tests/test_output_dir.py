"""The output directory: eaglebatch deletes only what it wrote, never writes a row twice, and
refuses an output that would mix with an input (output/directory.py, output/resume.py,
job/inputs.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from eaglebatch.cli import main
from support.tiny import write_prompts

pytest.importorskip("eaglebatch._native")


def write_job(tmp_path: Path, model: Path, inp, out, extra: str = "") -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(
        f"model: {model}\ninput:\n  path: '{inp}'\noutput:\n  path: {out}\n  part_rows: 2\n"
        f"sampling:\n  max_new_tokens: 3\nengine:\n  device: cpu\n  kv_cache_tokens: 1024\n"
        + extra
    )
    return p


def run(job: Path, *args: str):
    return CliRunner().invoke(main, ["run", str(job), *args])


def foreign_part(path: Path) -> Path:
    """A part file another program wrote (Spark-style name or ours, no eaglebatch metadata)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"x": [1, 2, 3]}), path)
    return path


@pytest.mark.parametrize("name", ["part-00000.parquet", "part-00000-3f2a.snappy.parquet",
                                  "results.parquet", "notes.txt"])
def test_restart_never_deletes_files_eaglebatch_did_not_write(tmp_path, tiny_model_dir, name):
    inp = write_prompts(tmp_path / "in" / "in.parquet", ["a", "b", "c"])
    out = tmp_path / "out"
    theirs = foreign_part(out / name) if name.endswith(".parquet") else out / name
    if not theirs.exists():
        out.mkdir()
        theirs.write_text("a user's file")
    before = theirs.read_bytes()
    job = write_job(tmp_path, tiny_model_dir, inp, out)
    for args in ((), ("--restart",)):
        r = run(job, *args)
        assert r.exit_code == 2, r.output
        assert "did not write" in r.output and name in r.output
        assert theirs.read_bytes() == before
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [name]


def test_restart_deletes_only_eaglebatch_parts(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in" / "in.parquet", ["a", "b", "c"])
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_dir, inp, out)
    assert run(job).exit_code == 0
    (out / "_SUCCESS").write_text("")  # hidden from readers (pyarrow, Spark): left alone
    (out / ".keep").write_text("")
    r = run(job, "--restart", "--set", "sampling.max_new_tokens=2")
    assert r.exit_code == 0, r.output
    assert (out / "_SUCCESS").exists() and (out / ".keep").exists()
    assert pq.read_table(out).num_rows == 3


def test_output_that_is_inside_or_contains_the_input_is_refused(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    inp = write_prompts(data / "in.parquet", ["a", "b"])
    cases = [
        (data, data),  # the input directory itself: --restart would delete the input
        (data, data / "out"),  # inside: the next run reads its own output
        (inp, data),  # the input file lies inside the output directory
        (tmp_path / "data" / "**" / "*.parquet", data / "out"),  # the glob matches our parts
        (data / "in.parquet", tmp_path),
    ]
    for input_path, out in cases:
        job = write_job(tmp_path, tiny_model_dir, input_path, out)
        for args in ((), ("--restart",)):
            r = run(job, *args)
            assert r.exit_code == 2, (input_path, out, r.output)
            assert "must not be, contain or lie inside input.path" in r.output
        assert inp.exists() and pq.read_table(inp).num_rows == 2
    # A glob that cannot match the parts, and a sibling directory, are fine.
    for input_path, out in [(data / "*.parquet", data / "out"), (data, tmp_path / "out")]:
        job = write_job(tmp_path, tiny_model_dir, input_path, out)
        r = run(job)
        assert r.exit_code == 0, r.output
        shutil.rmtree(out)


def test_directory_input_skips_hidden_and_underscore_paths(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    write_prompts(data / "a.parquet", ["a", "b"])
    write_prompts(data / "sub" / "b.parquet", ["c"])
    write_prompts(data / "_temporary" / "0" / "c.parquet", ["spark's half-written task"])
    write_prompts(data / ".hidden" / "d.parquet", ["a hidden copy"])
    write_prompts(data / "_e.parquet", ["skipped"])
    job = write_job(tmp_path, tiny_model_dir, data, tmp_path / "out")
    r = run(job)
    assert r.exit_code == 0, r.output
    assert pq.read_table(tmp_path / "out").num_rows == 3 == pq.read_table(data).num_rows


def test_resume_refuses_a_row_written_twice_and_a_damaged_part(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in" / "in.parquet", [f"prompt {i}" for i in range(6)])
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_dir, inp, out)
    assert run(job).exit_code == 0
    parts = sorted(out.glob("part-*.parquet"))
    shutil.copy(parts[0], out / "part-00099.parquet")  # as two runs at once would leave it
    r = run(job)
    assert r.exit_code == 2 and "written more than once" in r.output, r.output
    assert "part-00099.parquet" in r.output
    (out / "part-00099.parquet").unlink()
    # Damage the data pages (not the footer) of one part: the footer still reads.
    data = bytearray(parts[1].read_bytes())
    for i in range(8, min(len(data) // 2, 200)):
        data[i] ^= 0x5A
    parts[1].write_bytes(bytes(data))
    pq.read_metadata(parts[1])
    r = run(job)
    assert r.exit_code == 2 and "is damaged" in r.output and parts[1].name in r.output, r.output
    assert run(job, "--restart").exit_code == 0
    t = pq.read_table(out)
    assert sorted(t.column("row_index").to_pylist()) == list(range(6))


def test_identity_uses_resolved_values_and_content(tmp_path, tiny_model_dir):
    """An explicit max_model_len equal to the model's, a moved input directory and a path
    spelled differently are the same job; the 'differs' message shows whole values."""
    data = tmp_path / "data"
    write_prompts(data / "in.parquet", ["a", "b", "c"])
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_dir, data, out)
    assert run(job).exit_code == 0
    r = run(job, "--set", "engine.max_model_len=512")  # the tiny model's own length
    assert r.exit_code == 0 and "3 of 3 rows already done" in r.output, r.output
    moved = tmp_path / "moved"
    data.rename(moved)
    job = write_job(tmp_path, tiny_model_dir, "moved/../moved", out)
    r = run(job)
    assert r.exit_code == 0 and "3 of 3 rows already done" in r.output, r.output
    r = run(job, "--set", "sampling.stop=['a very long stop string that goes on and on']")
    assert r.exit_code == 2
    assert "a very long stop string that goes on and on" in r.output, r.output


def test_shard_directories_are_ours_and_restart_scopes(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in" / "in.parquet", [f"w{i}" for i in range(6)])
    out = tmp_path / "out"
    job = write_job(tmp_path, tiny_model_dir, inp, out)
    for i in range(2):
        assert run(job, "--shard", f"{i}/2").exit_code == 0
    shard1 = out / "shard-00001-of-00002"
    before = {p: p.read_bytes() for p in shard1.glob("part-*.parquet")}
    # --restart of shard 0 deletes shard 0's parts only, and regenerates them
    r = run(job, "--restart", "--shard", "0/2")
    assert r.exit_code == 0 and "rows [0, 3) of 6" in r.output, r.output
    assert {p: p.read_bytes() for p in shard1.glob("part-*.parquet")} == before
    assert pq.read_table(out).num_rows == 6
    # another program's directory beside the shards is refused, with or without --restart
    (out / "spark-output").mkdir()
    for args in (("--shard", "1/2"), ("--restart",)):
        r = run(job, *args)
        assert r.exit_code == 2 and "spark-output/" in r.output, r.output
    (out / "spark-output").rmdir()
    # a shard directory holding another program's part is refused too
    theirs = foreign_part(shard1 / "part-00099.parquet")
    r = run(job)
    assert r.exit_code == 2 and "part-00099.parquet" in r.output, r.output
    theirs.unlink()
    # --restart without --shard deletes every shard's parts and the emptied directories
    r = run(job, "--restart")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        p.name for p in sorted(out.glob("part-*.parquet"))
    ]
    assert pq.read_table(out).num_rows == 6


def test_a_shard_and_a_whole_run_never_write_at_once(tmp_path):
    import subprocess
    import sys

    from eaglebatch.output.directory import prepare_output_dir, release_output_dir

    out = tmp_path / "out"
    # another process (locks are per open file, like another run's) tries while a shard runs
    probe = (
        "import sys; from pathlib import Path; from eaglebatch.output.directory import "
        "prepare_output_dir as p; from eaglebatch.errors import JobError\n"
        "try:\n    p(Path(sys.argv[1]), False, sys.argv[2] or None)\nexcept JobError as e:\n"
        "    print(e); sys.exit(2)"
    )

    def attempt(subdir: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", probe, str(out), subdir],
                              capture_output=True, text=True)  # fmt: skip

    prepare_output_dir(out, restart=False, subdir="shard-00000-of-00002")
    try:
        assert attempt("shard-00001-of-00002").returncode == 0  # other shards may run
        for subdir in ("", "shard-00000-of-00002"):  # a whole run, the same shard: refused
            r = attempt(subdir)
            assert r.returncode == 2 and "in use by another running" in r.stdout, r
    finally:
        release_output_dir(out, "shard-00000-of-00002")
    prepare_output_dir(out, restart=False)  # a whole run holds it all: no shard starts
    try:
        r = attempt("shard-00001-of-00002")
        assert r.returncode == 2 and "in use by another running" in r.stdout, r
    finally:
        release_output_dir(out)


def test_a_unit_directory_another_process_holds_fences_every_other_run(tmp_path):
    """An engine actor that outlived its driver holds its unit directory: a whole run, a shard
    and a restart refuse; a Ray driver leaves it to its unit (which waits for the lock); a unit
    whose directory its driver never made is refused."""
    import subprocess
    import sys

    from eaglebatch.errors import JobError
    from eaglebatch.output.directory import DirectoryInUse, prepare_output_dir, release_output_dir

    out = tmp_path / "out"
    unit = out / "unit-000000000000-000000000010"
    unit.mkdir(parents=True)
    (unit / ".part-00000.parquet.tmp").write_bytes(b"the actor is writing this")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; "
         f"fd = os.open({str(unit)!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
         "print('locked', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        for kwargs in ({}, {"subdir": "shard-00000-of-00002"}, {"busy_ok": True, "restart": True}):
            with pytest.raises(DirectoryInUse, match="a Ray engine actor may still be writing"):
                prepare_output_dir(out, **{"restart": False, **kwargs})
        busy = prepare_output_dir(out, restart=False, busy_ok=True)  # a Ray driver
        assert busy == [unit] and (unit / ".part-00000.parquet.tmp").exists()
        release_output_dir(out)
        with pytest.raises(JobError, match="does not exist: a Ray unit runs only in a directory"):
            prepare_output_dir(out, False, "unit-000000000010-000000000020", unit=True)
        assert not (out / "unit-000000000010-000000000020").exists()
    finally:
        holder.kill()
        holder.wait()
    prepare_output_dir(out, restart=True)  # the holder is gone: a restart may clean it
    release_output_dir(out)
    assert not (unit / ".part-00000.parquet.tmp").exists()


def test_validate_refuses_an_output_path_that_is_a_file_as_run_does(tmp_path, tiny_model_dir,
                                                                    kind_checks):  # fmt: skip
    write_prompts(tmp_path / "in.parquet", ["a", "b"])
    (tmp_path / "out").write_text("a file")
    job = write_job(tmp_path, tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out")
    for command in ("validate", "run"):
        kind_checks.clear()
        r = CliRunner().invoke(main, [command, str(job)])
        assert r.exit_code == 2 and "output.path:" in r.output, r.output
        assert "exists and is not a directory" in r.output
        assert len(kind_checks) == 1, (command, kind_checks)
    assert (tmp_path / "out").read_text() == "a file"


@pytest.fixture
def kind_checks(monkeypatch):
    """Counts check_output_kind calls under every name a caller may hold it by."""
    import eaglebatch.output.directory as directory
    import eaglebatch.prepare as prepare

    calls = []
    real = directory.check_output_kind

    def spy(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(directory, "check_output_kind", spy)
    monkeypatch.setattr(prepare, "check_output_kind", spy)
    return calls


def test_a_start_checks_the_output_kind_once(tmp_path, tiny_model_dir, kind_checks):
    """validate, run and the Python API each check output.path's kind exactly once."""
    from eaglebatch.api.run import run as api_run

    write_prompts(tmp_path / "in.parquet", ["a", "b"])
    job = write_job(tmp_path, tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out")
    for command in ("validate", "run"):
        kind_checks.clear()
        r = CliRunner().invoke(main, [command, str(job)])
        assert r.exit_code == 0, r.output
        assert len(kind_checks) == 1, (command, kind_checks)
    kind_checks.clear()
    api_run(str(job), restart=True, progress=False)
    assert len(kind_checks) == 1, kind_checks

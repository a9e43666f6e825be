"""output.results_path (results_file.py): resolved like every job path, never replaces a file
eaglebatch did not write (the job file, a user's file, a file changed since), never lands where
the input reads, refused before any work when it cannot be written, and built from exactly the
parts resume reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from eaglebatch.cli import main
from test_openai_batch import COMPLETIONS, request

pytest.importorskip("eaglebatch._native")


def invoke(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def batch_dir_job(tmp: Path, model: Path, inp: str, out: str = "out", results: str | None = None,
                  name: str = "job") -> Path:  # fmt: skip
    """A batch job in tmp/jobs/ reading `inp` (relative to the job file)."""
    (tmp / "jobs").mkdir(exist_ok=True)
    (tmp / "data").mkdir(exist_ok=True)
    lines = [request(f"c{i}", COMPLETIONS, {"prompt": f"hello {i}"}) for i in range(3)]
    (tmp / "data" / "a.jsonl").write_text("\n".join(lines) + "\n")
    job = tmp / "jobs" / f"{name}.yaml"
    res = f"  results_path: {results}\n" if results else ""
    job.write_text(
        f"model: {model}\ninput:\n  path: {inp}\n  format: openai-batch\noutput:\n"
        f"  path: {out}\n  format: openai-batch\n"
        f"{res}sampling:\n  max_new_tokens: 4\nengine:\n  device: cpu\n  kv_cache_tokens: 2048\n"
    )
    return job


def custom_ids(path: Path) -> list[str]:
    return [json.loads(t)["custom_id"] for t in path.read_text().splitlines()]


def test_an_input_glob_beside_the_output_never_reads_the_default_results(tmp_path, tiny_model_dir):
    job = batch_dir_job(tmp_path, tiny_model_dir, "../data/*.jsonl", out="../data/out")
    for _ in range(2):  # the rerun reads the same single input file
        r = invoke("run", job)
        assert r.exit_code == 0, r.output
    assert invoke("status", job).exit_code == 0
    results = tmp_path / "data" / "out" / "_results.jsonl"
    assert custom_ids(results) == ["c0", "c1", "c2"]
    job2 = batch_dir_job(tmp_path, tiny_model_dir, "../data", out="../out2", name="dir")
    assert invoke("run", job2).exit_code == 0
    assert invoke("run", job2, "--restart").exit_code == 0
    # a recursive glob reaches into output.path, whose `_results.jsonl` it does not read
    job3 = batch_dir_job(tmp_path, tiny_model_dir, "../data/**/*.jsonl", out="../data/out3",
                         name="deep")  # fmt: skip
    for _ in range(2):
        r = invoke("run", job3)
        assert r.exit_code == 0, r.output
    assert custom_ids(tmp_path / "data" / "out3" / "_results.jsonl") == ["c0", "c1", "c2"]


def test_validate_checks_the_results_path_of_a_builtin_model_too(tmp_path, tiny_model_dir):
    """validate does not convert a builtin model, yet refuses what run would refuse."""
    job = batch_dir_job(tmp_path, "builtin:smollm2-135m-instruct", "../data/a.jsonl",
                        results="mine.jsonl")  # fmt: skip
    (tmp_path / "jobs" / "mine.jsonl").write_text("my own data\n")
    r = invoke("validate", job)
    assert r.exit_code == 2 and "output.results_path" in r.output, r.output
    assert (tmp_path / "jobs" / "mine.jsonl").read_text() == "my own data\n"


def test_a_relative_results_path_is_relative_to_the_job_file(tmp_path, tiny_model_dir, monkeypatch):
    job = batch_dir_job(tmp_path, tiny_model_dir, "../data/a.jsonl", results="res/r.jsonl")
    monkeypatch.chdir(tmp_path)  # not the job's directory
    assert invoke("run", job).exit_code == 0
    assert custom_ids(tmp_path / "jobs" / "res" / "r.jsonl") == ["c0", "c1", "c2"]
    home = tmp_path / "home"
    home.mkdir()
    job = batch_dir_job(tmp_path, tiny_model_dir, "../data/a.jsonl", out="o2", results="~/r.jsonl",
                        name="home")  # fmt: skip
    monkeypatch.setenv("HOME", str(home))
    assert invoke("run", job).exit_code == 0
    assert custom_ids(home / "r.jsonl") == ["c0", "c1", "c2"]
    assert not (tmp_path / "jobs" / "~").exists()


@pytest.mark.parametrize("target", ["user", "job", "input", "in-input-dir", "in-output", "glob"])
def test_files_eaglebatch_did_not_write_are_never_replaced(tmp_path, tiny_model_dir, target):
    inp = "../data/*.jsonl" if target == "glob" else "../data" if target == "in-input-dir" else (
        "../data/a.jsonl")  # fmt: skip
    results = {"user": "mine.jsonl", "job": "job.yaml", "input": "../data/a.jsonl",
               "in-input-dir": "../data/r.jsonl", "in-output": "out/r.jsonl",
               "glob": "../data/r.jsonl"}[target]  # fmt: skip
    job = batch_dir_job(tmp_path, tiny_model_dir, inp, results=results)
    (tmp_path / "jobs" / "mine.jsonl").write_text("my own data\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    r = invoke("run", job)
    assert r.exit_code == 2 and "output.results_path" in r.output, r.output
    assert "Traceback" not in r.output
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # nothing written, nothing replaced
    assert not (tmp_path / "jobs" / "out").exists()  # refused before any work


def test_only_its_own_unchanged_results_file_is_replaced(tmp_path, tiny_model_dir):
    job = batch_dir_job(tmp_path, tiny_model_dir, "../data/a.jsonl", results="r.jsonl")
    results = tmp_path / "jobs" / "r.jsonl"
    assert invoke("run", job).exit_code == 0
    assert invoke("run", job).exit_code == 0  # ours: rewritten
    assert invoke("run", job, "--restart", "--set", "sampling.max_new_tokens=3").exit_code == 0
    assert custom_ids(results) == ["c0", "c1", "c2"]
    results.write_text("edited by the user\n")  # not the file eaglebatch wrote any more
    r = invoke("run", job)
    assert r.exit_code == 2 and "did not write it" in r.output, r.output
    assert results.read_text() == "edited by the user\n"
    other = batch_dir_job(tmp_path, tiny_model_dir, "../data/a.jsonl", out="other",
                          results="r2.jsonl", name="other")  # fmt: skip
    assert invoke("run", other).exit_code == 0
    shutil.copy(tmp_path / "jobs" / "r2.jsonl", results)  # a copy: another inode, no sidecar
    assert invoke("run", job).exit_code == 2


def test_an_unwritable_results_location_fails_before_any_work(tmp_path, tiny_model_dir):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "afile").write_text("x")
    job = batch_dir_job(tmp_path, tiny_model_dir, "../data/a.jsonl", results="afile/r.jsonl")
    r = invoke("run", job)
    assert r.exit_code == 2 and "is not a directory" in r.output, r.output
    assert not (tmp_path / "jobs" / "out").exists()
    job = batch_dir_job(tmp_path, tiny_model_dir, "../data/a.jsonl", results="sub", name="sub")
    (tmp_path / "jobs" / "sub").mkdir()
    assert invoke("run", job).exit_code == 2


def test_copies_in_hidden_directories_are_not_read(tmp_path, tiny_model_dir):
    job = batch_dir_job(tmp_path, tiny_model_dir, "../data/a.jsonl")
    assert invoke("run", job).exit_code == 0
    out = tmp_path / "jobs" / "out"
    for hidden in ("_copy", ".copy"):
        (out / hidden).mkdir()
        for p in out.glob("part-*.parquet"):
            shutil.copy(p, out / hidden / p.name)
    assert invoke("run", job).exit_code == 0  # every row done: only the results are rewritten
    assert custom_ids(out / "_results.jsonl") == ["c0", "c1", "c2"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_the_results_file_and_its_sidecar_get_the_parts_mode(tmp_path, tiny_model_dir, umask):
    """Created as any new file of the process (0666 less the umask), as the Parquet parts are,
    not mkstemp's owner-only 0600."""
    import os
    import stat

    job = batch_dir_job(tmp_path, tiny_model_dir, "../data/a.jsonl", out="../out")
    old = os.umask(umask)
    try:
        r = invoke("run", job)
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    results = tmp_path / "out" / "_results.jsonl"
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    part = next((tmp_path / "out").glob("part-*.parquet"))
    assert mode(part) == 0o666 & ~umask
    assert mode(results) == mode(part) == mode(tmp_path / "out" / "._results.jsonl.eaglebatch.json")

"""The command line: exit codes and messages a user sees."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from eaglebatch.cli import main
from support.tiny import write_prompts


def job(tmp_path, model, inp, extra=""):
    p = tmp_path / "job.yaml"
    p.write_text(
        f"model: {model}\ninput:\n  path: {inp}\noutput:\n  path: {tmp_path / 'out'}\n"
        f"sampling:\n  max_new_tokens: 4\nengine:\n  device: cpu\n  kv_cache_tokens: 1024\n"
        + extra
    )
    return p


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def test_validate_ok(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", ["a", "b"])
    r = invoke("validate", str(job(tmp_path, tiny_model_dir, inp)))
    assert r.exit_code == 0, r.output
    assert "2 rows" in r.output


def test_validate_misspelled_key(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", ["a"])
    p = job(tmp_path, tiny_model_dir, inp)
    p.write_text(p.read_text().replace("sampling:\n", "sampling:\n  temprature: 1\n"))
    r = invoke("validate", str(p))
    assert r.exit_code == 2
    assert "sampling.temprature" in r.output
    assert "Traceback" not in r.output


def test_validate_missing_column(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", ["a"], column="text")
    r = invoke("validate", str(job(tmp_path, tiny_model_dir, inp)))
    assert r.exit_code == 2
    assert "input.prompt_column" in r.output and "'prompt'" in r.output


def test_validate_missing_input(tmp_path, tiny_model_dir):
    r = invoke("validate", str(job(tmp_path, tiny_model_dir, tmp_path / "nope.parquet")))
    assert r.exit_code == 2 and "input.path" in r.output


def test_validate_not_parquet(tmp_path, tiny_model_dir):
    bad = tmp_path / "in.parquet"
    bad.write_text("id,prompt\n1,hi\n")
    r = invoke("validate", str(job(tmp_path, tiny_model_dir, bad)))
    assert r.exit_code == 2 and "not a readable Parquet file" in r.output


def test_validate_missing_model_files(tmp_path):
    inp = write_prompts(tmp_path / "in.parquet", ["a"])
    (tmp_path / "m").mkdir()
    r = invoke("validate", str(job(tmp_path, tmp_path / "m", inp)))
    assert r.exit_code == 2 and "config.json" in r.output


def test_set_override_error(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", ["a"])
    r = invoke("validate", str(job(tmp_path, tiny_model_dir, inp)), "--set", "engine.bogus=1")
    assert r.exit_code == 2 and "engine.bogus" in r.output


def test_run_writes_rows_resumes_and_restarts(tmp_path, tiny_model_dir):
    pytest.importorskip("eaglebatch._native")
    inp = write_prompts(tmp_path / "in.parquet", ["hello", "world", "again"])
    j = str(job(tmp_path, tiny_model_dir, inp))
    r = invoke("run", j)
    assert r.exit_code == 0, r.output
    assert "output tok/s" in r.output
    assert pq.read_table(tmp_path / "out").num_rows == 3
    parts = sorted((tmp_path / "out").iterdir())
    # A second run resumes: nothing left to do, nothing written twice.
    r = invoke("run", j)
    assert r.exit_code == 0, r.output
    assert "3 of 3 rows already done" in r.output
    assert sorted((tmp_path / "out").iterdir()) == parts
    # A changed output-affecting setting is refused, naming the key and the ways out.
    r = invoke("run", j, "--set", "sampling.max_new_tokens=5")
    assert r.exit_code == 2, r.output
    assert "sampling.max_new_tokens: 4 -> 5" in r.output
    assert "--restart" in r.output and "output.path" in r.output
    # Speed-only settings do not change the job.
    r = invoke("run", j, "--set", "engine.max_batch_size=2", "--set", "output.part_rows=1")
    assert r.exit_code == 0, r.output
    r = invoke("run", j, "--restart", "--set", "sampling.max_new_tokens=5")
    assert r.exit_code == 0, r.output
    assert pq.read_table(tmp_path / "out").num_rows == 3


def test_validate_reports_resume_state_and_other_jobs_output(tmp_path, tiny_model_dir):
    pytest.importorskip("eaglebatch._native")
    inp = write_prompts(tmp_path / "in.parquet", ["hello", "world"])
    j = str(job(tmp_path, tiny_model_dir, inp))
    assert invoke("run", j).exit_code == 0
    r = invoke("validate", j)
    assert r.exit_code == 0 and "2 rows already done" in r.output, r.output
    r = invoke("validate", j, "--set", "sampling.temperature=0.5")
    assert r.exit_code == 2 and "different job" in r.output and "sampling.temperature" in r.output


def test_summary_json_and_status_json_for_pipelines(tmp_path, tiny_model_dir):
    import json

    inp = write_prompts(tmp_path / "in.parquet", ["a", "b", "c"])
    p = job(tmp_path, tiny_model_dir, inp)
    r = invoke("status", str(p), "--json")
    st = json.loads(r.output)
    assert r.exit_code == 1 and st["complete"] is False and st["rows"] == 3 and st["rows_done"] == 0
    r = invoke("run", str(p), "--summary-json", str(tmp_path / "s" / "summary.json"))
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert s["exit_reason"] == "complete" and s["exit_status"] == 0 and s["error"] is None
    assert s["requests"] == 3 and s["errors"] == 0 and s["output_tokens"] > 0
    assert s["output_path"] == str(tmp_path / "out") and s["results_file"] is None
    assert s["output_tok_s"] > 0 and s["latency_p50"] is not None
    r = invoke("status", str(p), "--json")
    st = json.loads(r.output)
    assert r.exit_code == 0 and st["complete"] and st["rows_done"] == 3 and st["part_files"] >= 1
    # refused before any work: still one object, naming why
    r = invoke("run", str(p), "--set", "sampling.temperature=-1", "--summary-json",
               str(tmp_path / "bad.json"))  # fmt: skip
    bad = json.loads((tmp_path / "bad.json").read_text())
    assert r.exit_code == 2 and bad["exit_reason"] == "refused" and bad["exit_status"] == 2
    assert "sampling.temperature" in bad["error"]


def test_summary_json_never_replaces_what_eaglebatch_did_not_write(tmp_path, tiny_model_dir):
    """An input, a foreign file, a path inside output.path or an unwritable place: exit 2
    before any work, the file untouched; an earlier summary is replaced."""
    import json

    inp = write_prompts(tmp_path / "in.parquet", ["a", "b"])
    p = job(tmp_path, tiny_model_dir, inp)
    before = inp.read_bytes()
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    for target, why in ((inp, "is not a summary"), (tmp_path / "notes.json", "is not a summary"),
                        (tmp_path / "out" / "s.json", "inside output.path"),
                        (tmp_path / "in.parquet.d" / ".." / "in.parquet", "is not a summary"),
                        (tmp_path / "job.yaml", "is not a summary"),
                        (tmp_path / "notes.json" / "s.json", "cannot write")):  # fmt: skip
        r = invoke("run", str(p), "--summary-json", str(target))
        assert r.exit_code == 2 and why in r.output and "Traceback" not in r.output, r.output
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("part-*"))
    assert inp.read_bytes() == before and (tmp_path / "notes.json").read_text() == '{"mine": 1}'
    ok = tmp_path / "summary.json"
    for _ in range(2):  # the second run replaces the first run's summary
        r = invoke("run", str(p), "--summary-json", str(ok))
        assert r.exit_code == 0, r.output
        assert json.loads(ok.read_text())["exit_reason"] == "complete"
    assert sorted(f.name for f in tmp_path.iterdir() if f.name.startswith(".")) == []


def test_dash_h_is_help():
    for args in (["-h"], ["run", "-h"], ["status", "-h"]):
        r = invoke(*args)
        assert r.exit_code == 0 and "Usage:" in r.output, (args, r.output)


@pytest.mark.parametrize("target", ["-", "/dev/stdout"])
def test_summary_json_on_stdout_is_a_pure_json_stream(tmp_path, tiny_model_dir, target):
    """stdout a pipe (as `| jq`): one JSON object there and nothing else; the progress and the
    summary table go to stderr."""
    import json

    from support.cli import cli

    inp = write_prompts(tmp_path / "in.parquet", ["a", "b"])
    proc = cli("run", str(job(tmp_path, tiny_model_dir, inp)), "--summary-json", target)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    s = json.loads(out)
    assert s["exit_reason"] == "complete" and s["requests"] == 2
    assert "output tok/s" in err
    proc = cli("run", str(job(tmp_path, tiny_model_dir, inp)), "--set", "sampling.top_k=-5",
               "--summary-json", target)  # fmt: skip
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and json.loads(out)["exit_reason"] == "refused", err


def test_summary_json_naming_a_fifo_is_refused_unread(tmp_path, tiny_model_dir):
    import os
    import subprocess

    from support.cli import cli

    inp = write_prompts(tmp_path / "in.parquet", ["a"])
    os.mkfifo(tmp_path / "fifo")
    proc = cli("run", str(job(tmp_path, tiny_model_dir, inp)), "--summary-json",
               str(tmp_path / "fifo"))  # fmt: skip
    try:
        out, err = proc.communicate(timeout=60)  # the old pre-check blocked reading the FIFO
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 2 and "not a regular file" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("part-*"))


def test_summary_json_is_written_when_a_run_dies_of_a_bug(tmp_path, tiny_model_dir, monkeypatch):
    import json

    import eaglebatch.runner

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(eaglebatch.runner, "run_prepared", broken)
    inp = write_prompts(tmp_path / "in.parquet", ["a"])
    r = invoke("run", str(job(tmp_path, tiny_model_dir, inp)), "--summary-json",
               str(tmp_path / "s.json"))  # fmt: skip
    assert r.exit_code == 1 and isinstance(r.exception, RuntimeError)
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["exit_reason"] == "failed" and s["exit_status"] == 1
    assert s["error"] == "RuntimeError: boom"


@pytest.mark.parametrize(("columns", "keys", "key"), [
    (["prompt", "prompt"], "", "input.prompt_column"),
    (["prompt", "cont", "cont"], "task: score\n", "input.continuation_column"),
    (["prompt", "id", "id"], "", "input.id_column"),
    (["prompt", "s", "s"], "", "input.sampling_columns.stop"),
    (["prompt", "k", "k"], "", "output.keep_columns"),
])  # fmt: skip
def test_a_column_the_job_reads_twice_is_refused_by_name(tmp_path, tiny_model_dir, columns, keys,
                                                          key):  # fmt: skip
    """pyarrow writes a file with two columns of one name; which one the job means is
    unknowable, so `validate` and `run` refuse it naming the column and the file."""
    import pyarrow as pa

    dup = columns[-1]
    table = pa.Table.from_arrays([pa.array(["a b"]) for _ in columns], names=columns)
    pq.write_table(table, tmp_path / "in.parquet")
    extra = {"input.continuation_column": "  continuation_column: cont\n",
             "input.id_column": "  id_column: id\n",
             "input.sampling_columns.stop": "  sampling_columns: {stop: s}\n"}.get(key, "")
    p = job(tmp_path, tiny_model_dir, tmp_path / "in.parquet")
    text = keys + p.read_text().replace("output:\n", extra + "output:\n")
    if key == "output.keep_columns":
        text = text.replace("output:\n", "output:\n  keep_columns: [k]\n")
    p.write_text(text)
    for cmd in ("validate", "run"):
        r = invoke(cmd, str(p))
        assert r.exit_code == 2, (cmd, r.output)
        assert f"{key}: column '{dup}' appears twice in {tmp_path / 'in.parquet'}" in r.output
        assert "Traceback" not in r.output

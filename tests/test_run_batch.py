"""`eaglebatch run-batch -i IN -o OUT --model M` (run_batch.py): vLLM's form writes the job a
user would write and runs it: the results equal `run` of that job written by hand, a rerun
resumes, and a file run-batch did not write is never replaced."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from eaglebatch.cli import main
from test_openai_batch import COMPLETIONS, batch_job, request, results

pytest.importorskip("eaglebatch._native")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_run_batch_is_the_job_a_user_would_write(tmp_path, tiny_model_dir, monkeypatch):
    lines = [request(f"c{i}", COMPLETIONS, {"prompt": f"say {i}", "max_tokens": 5})
             for i in range(4)]  # fmt: skip
    job = batch_job(tmp_path, tiny_model_dir, lines)  # reads tmp/batch-requests.jsonl
    assert invoke("run", job).exit_code == 0
    want = results(tmp_path)
    monkeypatch.chdir(tmp_path)  # relative -i / -o, as a shell passes them
    args = ["run-batch", "-i", "batch-requests.jsonl", "-o", "res/out.jsonl", "--model",
            tiny_model_dir, "--set", "engine.device=cpu", "--set", "engine.kv_cache_tokens=4096",
            "--set", "sampling.max_new_tokens=16"]  # fmt: skip
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    got = {json.loads(t)["custom_id"]: json.loads(t)
           for t in (tmp_path / "res" / "out.jsonl").read_text().splitlines()}  # fmt: skip
    assert sorted(got) == sorted(want) == [f"c{i}" for i in range(4)]
    for cid in got:
        a, b = got[cid]["response"]["body"], want[cid]["response"]["body"]
        assert a["choices"] == b["choices"] and a["usage"] == b["usage"]
    assert (tmp_path / "res" / "out.jsonl.parts").is_dir()
    r = invoke(*args)  # a rerun: every request is done, the same results
    assert r.exit_code == 0 and "4 of 4 rows already done" in r.output, r.output
    assert invoke("status", tmp_path / "res" / "out.jsonl.job.yaml").exit_code == 0
    (tmp_path / "mine.job.yaml").write_text("model: x\n")  # not run-batch's
    r = invoke("run-batch", "-i", "batch-requests.jsonl", "-o", "mine", "--model",
               tiny_model_dir)  # fmt: skip
    assert r.exit_code == 2 and "run-batch did not write it" in r.output, r.output
    assert (tmp_path / "mine.job.yaml").read_text() == "model: x\n"
    assert invoke("run-batch", "-h").exit_code == 0


def test_run_batch_checks_its_job_once(tmp_path, tiny_model_dir, monkeypatch):
    """The checks that need no model (input, output.path's kind) run once: before the job file
    is written, and `run` of that file takes what they found."""
    import eaglebatch.output.directory as directory
    import eaglebatch.prepare as prepare

    calls: dict[str, int] = {}

    def counted(module, name):
        real = getattr(module, name)

        def spy(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)

    counted(prepare, "check_job_input")
    counted(prepare, "check_output_kind")
    monkeypatch.setattr(directory, "check_output_kind", prepare.check_output_kind)
    (tmp_path / "in.jsonl").write_text(request("c0", COMPLETIONS, {"prompt": "x"}) + "\n")
    r = invoke("run-batch", "-i", tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl",
               "--model", tiny_model_dir, "--set", "engine.device=cpu", "--set",
               "engine.kv_cache_tokens=1024", "--set", "sampling.max_new_tokens=2")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert calls == {"check_job_input": 1, "check_output_kind": 1}, calls


def test_run_batch_refuses_credentials_it_would_write_into_the_job_file(
    tmp_path, tiny_model_dir,
):  # fmt: skip
    (tmp_path / "in.jsonl").write_text(request("c0", COMPLETIONS, {"prompt": "x"}) + "\n")
    for key, value in [("storage.endpoint", "http://AKIDUSER:s3cretvalue@minio:9000"),
                       ("storage.options.aws_secret_access_key", "s3cretvalue")]:  # fmt: skip
        r = invoke("run-batch", "-i", tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl",
                   "--model", tiny_model_dir, "--set", f"{key}={value}")  # fmt: skip
        assert r.exit_code == 2 and f"--set {key}" in r.output, r.output
        assert "s3cretvalue" not in r.output
        assert not (tmp_path / "out.jsonl.job.yaml").exists()


def test_a_refused_run_batch_writes_no_job_file(tmp_path, tiny_model_dir):
    """-o under a regular file, or onto a file eaglebatch did not write (a model's config.json):
    exit 2 in words, before any file is written (no OUT.job.yaml beside the model's files)."""
    (tmp_path / "batch.jsonl").write_text(request("c0", COMPLETIONS, {"prompt": "hi"}) + "\n")
    (tmp_path / "somefile.txt").write_text("x")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for out, why in ((tmp_path / "somefile.txt" / "out.jsonl", "is not a directory"),
                     (model / "config.json", "eaglebatch did not write it")):  # fmt: skip
        r = invoke("run-batch", "-i", tmp_path / "batch.jsonl", "-o", out, "--model",
                   tiny_model_dir)  # fmt: skip
        assert r.exit_code == 2 and why in r.output and "Traceback" not in r.output, r.output
        assert r.exception is None or isinstance(r.exception, SystemExit)
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]
    assert (model / "config.json").read_text() == "{}"


def test_run_batch_keeps_an_object_store_model_url(tmp_path):
    """--model s3://... is written into the job file as the URL (a remote model is copied into
    the cache by `run`), not resolved as a local path under the shell's directory."""
    from eaglebatch.commands.run_batch import _model_ref

    for url in ("s3://bucket/models/tiny/", "gs://b/m.gguf", "az://c/m"):
        assert _model_ref(url) == url
    assert _model_ref("builtin:smollm2-135m-instruct") == "builtin:smollm2-135m-instruct"
    assert _model_ref(str(tmp_path / "m" / ".." / "m")) == str((tmp_path / "m").resolve())

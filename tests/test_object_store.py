"""Object storage (docs/scale-out.md "Object storage") against real protocol servers on
127.0.0.1: moto's S3 server and the GCS emulator. A job from and to each equals the local run
row for row (OpenAI Batch lines too); shards equal one run; SIGKILL at random points and a
rerun write every row once; a live lease keeps a second run out and a killed or expired one's
is taken over; transient faults are retried without duplicates; a 403 is exit 1 naming the URL
and no credential, and no credential reaches the parts' metadata."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import socket
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from support.cli import cli, finish
from support.object_servers import (
    KEY_ID,
    SECRET,
    FaultProxy,
    GcsServer,
    S3Server,
    eaglebatch_env,
    gcs_xml_shim,
)
from support.tiny import make_tiny_model, write_prompts

pytest.importorskip("eaglebatch._native")
pytest.importorskip("moto.server")

COLS = ["row_index", "id", "output_token_ids", "output_text", "finish_reason", "error"]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("os-llama"), hidden_size=32, num_layers=1,
                           num_heads=2, num_kv_heads=1)  # fmt: skip


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    yield server
    server.stop()


def _prompts(n: int) -> list[str]:
    rng = random.Random(n)
    words = ["the", "cat", "sat", "on", "a", "mat", "42", "code", "über"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) for _ in range(n)]


def _inputs(tmp: Path, n: int) -> Path:
    """Two input files (shards straddle them) and a hidden one that is not input."""
    prompts, ids = _prompts(n), [f"r{i}" for i in range(n)]
    d = tmp / "in"
    write_prompts(d / "a.parquet", prompts[: n // 2], ids=ids[: n // 2])
    write_prompts(d / "b.parquet", prompts[n // 2:], ids=ids[n // 2:])
    write_prompts(d / "_skip" / "c.parquet", ["not input"], ids=["x"])
    return d


def _job(tmp: Path, model: Path, inp: str, out: str, endpoint: str, extra: str = "",
         rows_per_part: int = 7, max_new: int = 5) -> Path:  # fmt: skip
    job = tmp / f"job-{random.randrange(1 << 30)}.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {inp}\n  id_column: id\n"
        f"output:\n  path: {out}\n  part_rows: {rows_per_part}\n  flush_interval_s: 0.2\n"
        f"  include_token_ids: true\nsampling:\n  max_new_tokens: {max_new}\n"
        "engine:\n  device: cpu\n  kv_cache_tokens: 2048\n  max_batch_size: 4\n"
        f"  num_threads: 1\nstorage:\n  endpoint: {endpoint}\n  lease_ttl_s: 6\n{extra}"
    )
    return job


def _upload(server, d: Path, bucket: str) -> None:
    for f in sorted(d.rglob("*.parquet")):
        server.upload(f, bucket, f"in/{f.relative_to(d).as_posix()}")
    return "in"


def _on_s3(s3, bucket: str, local_ref, n: int, max_new: int = 5) -> tuple[list[dict], str]:
    """The local run's rows of `n` prompts, and a new bucket holding the same inputs."""
    want, d = local_ref(n, max_new=max_new)
    b = s3.bucket(bucket)
    _upload(s3, d, b)
    return want, b


def _rows(table) -> list[dict]:
    return sorted(table.select(COLS).to_pylist(), key=lambda r: r["row_index"])


def run(job: Path, *args: str, status: int = 0, env: dict | None = None) -> str:
    return finish(cli("run", str(job), *args, env=eaglebatch_env(env)), status)


@pytest.fixture
def local_ref(tmp_path, small_model):
    def make(n: int, max_new: int = 5) -> list[dict]:
        d = _inputs(tmp_path, n)
        job = _job(tmp_path, small_model, str(d), str(tmp_path / "ref"), "http://unused",
                   max_new=max_new)  # fmt: skip
        finish(cli("run", str(job)))
        return _rows(pq.read_table(tmp_path / "ref")), d
    return make


def test_s3_job_equals_the_local_run_resumes_and_restarts(tmp_path, small_model, s3, local_ref):
    want, b = _on_s3(s3, "plain", local_ref, 40)
    secret = f"  options:\n    aws_secret_access_key: {SECRET}\n"  # as well as the env's
    job = _job(tmp_path, small_model, f"s3://{b}/in", f"s3://{b}/out", s3.endpoint, secret)
    log = run(job)
    assert "40 (0 errors)" in log and SECRET not in log
    assert _rows(s3.table(b, "out/")) == want
    footer = pq.read_metadata(io.BytesIO(s3.get(b, "out/part-00000.parquet"))).metadata
    assert b"aws_secret_access_key" in footer[b"eaglebatch.job"]  # the job's record ...
    assert SECRET.encode() not in b"".join(footer.values())  # ... without the credential
    keys = s3.keys(b, "out/")
    assert ".eaglebatch.lease" in {k.rsplit("/", 1)[-1] for k in keys}
    assert not [k for k in keys if k.endswith(".tmp")]  # no temporary objects
    assert "40 of 40 rows already done" in run(job)
    assert "40/40 rows done, 0 error rows" in finish(cli("status", str(job), env=eaglebatch_env()))
    run(job, "--restart")
    assert _rows(s3.table(b, "out/")) == want  # restart deleted the old parts first
    # a glob over the bucket reads the same rows; the `_skip/` object is not input
    glob_job = _job(tmp_path, small_model, f"s3://{b}/in/*.parquet", f"s3://{b}/glob",
                    s3.endpoint)  # fmt: skip
    run(glob_job)
    assert _rows(s3.table(b, "glob/")) == want


def test_shards_on_s3_equal_one_run(tmp_path, small_model, s3, local_ref):
    want, b = _on_s3(s3, "shards", local_ref, 30)
    job = _job(tmp_path, small_model, f"s3://{b}/in", f"s3://{b}/out", s3.endpoint)
    procs = [cli("run", str(job), "--shard", f"{i}/3", env=eaglebatch_env()) for i in range(3)]
    for p in procs:
        finish(p)
    assert _rows(s3.table(b, "out/")) == want
    dirs = {k.split("/")[1] for k in s3.keys(b, "out/")}
    assert dirs == {f"shard-0000{i}-of-00003" for i in range(3)}
    # a run over every row finds the job done; a shard of another count is refused
    assert "30 of 30 rows already done" in run(job)
    assert "another number of shards" in run(job, "--shard", "0/2", status=2)


def test_gcs_without_conditional_writes_is_refused_unless_unsafe(tmp_path, small_model,
                                                                 local_ref):  # fmt: skip
    pytest.importorskip("gcp_storage_emulator")
    want, d = local_ref(20)
    gcs = GcsServer(tmp_path)
    shim = FaultProxy(gcs.endpoint, translate=gcs_xml_shim(gcs.endpoint))
    gcs.endpoint = shim.endpoint  # the crate's XML requests; uploads go through it too
    try:
        b = gcs.bucket("gbkt")
        for f in sorted(d.glob("*.parquet")):
            gcs.upload(f, b, f"in/{f.name}")
        opts = "  options:\n    google_bearer_token: emulator-token\n"
        job = _job(tmp_path, small_model, f"gs://{b}/in", f"gs://{b}/out", gcs.endpoint, opts)
        assert "storage.unsafe_no_conditional_writes" in run(job, status=2)
        unsafe = _job(tmp_path, small_model, f"gs://{b}/in", f"gs://{b}/out", gcs.endpoint,
                      opts + "  unsafe_no_conditional_writes: true\n")  # fmt: skip
        assert "20 (0 errors)" in run(unsafe)
        from eaglebatch import _native
        from eaglebatch.storage import RemotePath

        store = _native.ObjectStore(gcs.endpoint, {"google_bearer_token": "x"}, True)
        out = RemotePath(f"gs://{b}/out", store)
        parts = [p for p in out.iterdir() if p.name.startswith("part-")]
        got = [r for p in parts for r in pq.read_table(p.open()).select(COLS).to_pylist()]
        assert sorted(got, key=lambda r: r["row_index"]) == want
        assert "20 of 20 rows already done" in run(unsafe)
    finally:
        shim.stop()
        gcs.stop()


def test_s3_without_create_only_writes_is_refused_unless_unsafe(tmp_path, small_model, s3):
    b = s3.bucket("nocond")
    _upload(s3, _inputs(tmp_path, 6), b)
    off = "  options:\n    aws_conditional_put: disabled\n"  # the crate then cannot create-only
    job = _job(tmp_path, small_model, f"s3://{b}/in", f"s3://{b}/out", s3.endpoint, off)
    assert "storage.unsafe_no_conditional_writes: true" in run(job, status=2)
    unsafe = _job(tmp_path, small_model, f"s3://{b}/in", f"s3://{b}/out", s3.endpoint,
                  off + "  unsafe_no_conditional_writes: true\n")  # fmt: skip
    assert "6 (0 errors)" in run(unsafe)
    assert len(_rows(s3.table(b, "out/"))) == 6


def test_kills_at_random_moments_then_rerun_write_each_row_once(tmp_path, small_model, s3,
                                                                local_ref):  # fmt: skip
    want, b = _on_s3(s3, "kills", local_ref, 300, max_new=12)
    slow = FaultProxy(s3.endpoint, delay_s=0.1)  # 60 parts: about 6 s of uploads
    job = _job(tmp_path, small_model, f"s3://{b}/in", f"s3://{b}/out", slow.endpoint,
               rows_per_part=5, max_new=12)  # fmt: skip
    rng = random.Random(7)
    try:
        for _ in range(3):
            p = cli("run", str(job), env=eaglebatch_env())
            time.sleep(rng.uniform(2.0, 5.0))
            p.send_signal(signal.SIGKILL)
            p.wait()
        run(job)  # a killed run's lease: this host, its process gone -> taken over at once
    finally:
        slow.stop()
    got = _rows(s3.table(b, "out/"))  # every part readable
    assert [r["row_index"] for r in got] == list(range(300))  # each row once
    assert got == want


def test_a_second_run_is_refused_while_the_first_holds_the_lease(tmp_path, small_model, s3,
                                                                 local_ref):  # fmt: skip
    want, b = _on_s3(s3, "lease", local_ref, 300, max_new=12)
    slow = FaultProxy(s3.endpoint, delay_s=0.5)  # 60 parts: about 30 s of uploads
    job = _job(tmp_path, small_model, f"s3://{b}/in", f"s3://{b}/out", slow.endpoint,
               rows_per_part=5, max_new=12)  # fmt: skip
    try:
        first = cli("run", str(job), env=eaglebatch_env())
        for _ in range(600):
            if "out/.eaglebatch.lease" in s3.keys(b, "out/"):
                break
            time.sleep(0.05)
        second = run(job, status=2)
        assert f"held by process {first.pid} on {socket.gethostname()}" in second
        assert "in use by a run over every row" in run(job, "--shard", "0/2", status=2)
        assert first.poll() is None  # still running: the refusals were no accident
        first.send_signal(signal.SIGKILL)
        first.wait()
        run(job)  # takes the dead process's lease over and finishes
    finally:
        slow.stop()
    assert _rows(s3.table(b, "out/")) == want


def test_an_expired_lease_is_taken_over_a_live_one_is_not(tmp_path, small_model, s3, local_ref):
    want, b = _on_s3(s3, "expiry", local_ref, 20)
    job = _job(tmp_path, small_model, f"s3://{b}/in", f"s3://{b}/out", s3.endpoint)

    def lease(expires_in: float) -> None:
        s3.put(b, "out/.eaglebatch.lease", json.dumps({
            "holder": "x", "host": "another-host", "pid": 1, "ttl_s": 6,
            "expires_at": time.time() + expires_in, "released": False}).encode())  # fmt: skip

    lease(300)
    assert "held by process 1 on another-host" in run(job, status=2)
    lease(-1)
    assert "20 (0 errors)" in run(job)
    assert _rows(s3.table(b, "out/")) == want
    held = json.loads(s3.get(b, "out/.eaglebatch.lease"))
    assert held["released"] and held["host"] == socket.gethostname()


def test_transient_faults_are_retried_without_duplicates(tmp_path, small_model, s3, local_ref):
    want, b = _on_s3(s3, "faults", local_ref, 60)
    proxy = FaultProxy(s3.endpoint, fail_every=4)
    try:
        job = _job(tmp_path, small_model, f"s3://{b}/in", f"s3://{b}/out", proxy.endpoint,
                   rows_per_part=4)  # fmt: skip
        run(job)
        assert proxy.injected >= 5
    finally:
        proxy.stop()
    assert _rows(s3.table(b, "out/")) == want


def test_access_denied_is_exit_1_naming_the_url_without_credentials(tmp_path, small_model, s3):
    proxy = FaultProxy(s3.endpoint, deny=True)
    try:
        job = _job(tmp_path, small_model, "s3://denied/in", "s3://denied/out", proxy.endpoint)
        text = run(job, status=1)
    finally:
        proxy.stop()
    assert "s3://denied/" in text and "403 Forbidden" in text and "Traceback" not in text
    assert SECRET not in text and KEY_ID not in text


def test_openai_batch_lines_read_from_s3_equal_the_local_file(tmp_path, small_model, s3):
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "m", "prompt": p, "max_tokens": 4}})
             for i, p in enumerate(_prompts(12))]  # fmt: skip
    local = tmp_path / "batch" / "requests.jsonl"
    local.parent.mkdir()
    local.write_text("\n".join(lines) + "\n")
    b = s3.bucket("batch")
    s3.upload(local, b, "in/requests.jsonl")
    outs = []
    for inp, out in [(str(local), tmp_path / "a"), (f"s3://{b}/in/requests.jsonl", tmp_path / "b")]:
        job = tmp_path / f"{out.name}.yaml"
        job.write_text(f"model: {small_model}\ninput:\n  path: {inp}\noutput:\n  path: {out}\n"
                       "  include_token_ids: true\nengine:\n  device: cpu\n"
                       "  kv_cache_tokens: 2048\n"
                       f"  num_threads: 1\nstorage:\n  endpoint: {s3.endpoint}\n")  # fmt: skip
        run(job)
        outs.append(_rows(pq.read_table(out)))
    assert outs[0] == outs[1] and len(outs[0]) == 12


def test_a_model_folder_on_s3_is_copied_once_and_gives_the_local_models_rows(
    tmp_path, small_model, s3, local_ref,
):  # fmt: skip
    want, d = local_ref(10)
    b = s3.bucket("models")
    for f in sorted(small_model.rglob("*")):
        if f.is_file():
            s3.upload(f, b, f"tiny/{f.relative_to(small_model).as_posix()}")
    cache = tmp_path / "cache"
    env = {"EAGLEBATCH_CACHE": str(cache)}
    job = _job(tmp_path, f"s3://{b}/tiny", str(d), str(tmp_path / "out"), s3.endpoint)
    run(job, env=env)
    assert _rows(pq.read_table(tmp_path / "out")) == want
    copies = [p for p in (cache / "remote-models").rglob("*") if p.is_file()]
    stamps = {p: p.stat().st_mtime_ns for p in copies}
    assert any(p.name == "config.json" for p in copies)
    run(job, "--restart", env=env)  # the copy is reused: nothing rewritten
    assert {p: p.stat().st_mtime_ns for p in copies} == stamps


def test_a_ray_run_on_s3_equals_the_local_run(tmp_path, small_model, s3, local_ref):
    pytest.importorskip("ray")
    want, b = _on_s3(s3, "ray", local_ref, 40)
    job = _job(tmp_path, small_model, f"s3://{b}/in", f"s3://{b}/out", s3.endpoint,
               "ray:\n  unit_rows: 10\n")  # fmt: skip
    ray = ["--ray", "--set", "ray.actors=1", "--set", "ray.cpus_per_actor=1"]
    run(job, *ray)
    assert _rows(s3.table(b, "out/")) == want
    units = {k.split("/")[1] for k in s3.keys(b, "out/") if k.split("/")[1].startswith("unit-")}
    assert len(units) == 4  # each unit in its own directory, created by the driver
    assert "all 40 rows are done" in run(job, *ray)
    assert "40/40 rows done" in finish(cli("status", str(job), env=eaglebatch_env()))


def test_pyarrow_reads_remote_bytes_from_its_own_memory():
    """A remote part's or footer's bytes reach pyarrow copied into Arrow's memory: a buffer
    Python owns would be freed by an Arrow I/O thread taking the GIL, which aborts the process
    when that happens during interpreter shutdown (seen: `status` exiting with SIGABRT)."""
    from eaglebatch.storage import arrow_reader

    table = pa.table({"row_index": list(range(50)), "ids": [[1, 2]] * 50})
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=10)
    data = sink.getvalue()
    reader = arrow_reader(data)
    assert reader.read_buffer(4).address != pa.py_buffer(data).address  # a copy
    reader.seek(0)
    assert pq.ParquetFile(reader).read().equals(table)


def _upload_model(s3, model: Path, bucket: str, prefix: str) -> None:
    for f in sorted(model.rglob("*")):
        if f.is_file():
            s3.upload(f, bucket, f"{prefix}/{f.relative_to(model).as_posix()}")


def _prompt_tokens(out: Path) -> list[int]:
    rows = pq.read_table(out, columns=["row_index", "prompt_tokens"]).to_pylist()
    return [r["prompt_tokens"] for r in sorted(rows, key=lambda r: r["row_index"])]


def test_a_cached_remote_model_follows_the_remote_folder_and_its_identity(
    tmp_path, small_model, s3,
):  # fmt: skip
    """A file deleted remotely leaves the copy; a changed one is copied again; the run renders
    the template the remote folder now holds, and an output of the old folder is another
    job's."""
    from support.tiny import CHAT_TEMPLATE

    b = s3.bucket("modelsync")
    _upload_model(s3, small_model, b, "tiny")
    s3.put(b, "tiny/extra/notes.txt", b"to be deleted")
    d = _inputs(tmp_path, 6)
    env = {"EAGLEBATCH_CACHE": str(tmp_path / "cache")}
    chat = ("--set", "input.apply_chat_template=true")
    job = _job(tmp_path, f"s3://{b}/tiny", str(d), str(tmp_path / "first"), s3.endpoint)
    run(job, *chat, env=env)
    before = _prompt_tokens(tmp_path / "first")
    # the folder drops chat_template.jinja (which took precedence) and notes.txt; the template
    # is now tokenizer_config.json's, with a 20-byte preamble (the tokenizer: a token a byte)
    preamble = "SYSTEM PREAMBLE 20B\n"
    assert len(preamble.encode()) == 20
    s3.client.delete_object(Bucket=b, Key="tiny/chat_template.jinja")
    s3.client.delete_object(Bucket=b, Key="tiny/extra/notes.txt")
    s3.put(b, "tiny/tokenizer_config.json", json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "chat_template": preamble + CHAT_TEMPLATE}).encode())  # fmt: skip
    second = _job(tmp_path, f"s3://{b}/tiny", str(d), str(tmp_path / "second"), s3.endpoint)
    run(second, *chat, env=env)
    assert _prompt_tokens(tmp_path / "second") == [n + 20 for n in before]
    [copy] = [p for p in (tmp_path / "cache" / "remote-models").iterdir() if p.is_dir()]
    local = sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file())
    assert local == sorted([".eaglebatch-source.json", *(
        p.relative_to(small_model).as_posix() for p in small_model.rglob("*")
        if p.is_file() and p.name != "chat_template.jinja")])  # fmt: skip
    # the first output was made from another model folder: resuming it is refused by name
    text = run(job, *chat, status=2, env=env)
    assert "chat_template.jinja" in text and "tokenizer_config.json" in text


def test_processes_racing_the_first_copy_of_a_remote_model_all_get_it_whole(
    tmp_path, small_model, s3, monkeypatch,
):  # fmt: skip
    """Two shards starting on one node copy the same remote model at once: every caller gets
    the complete copy (one copies, the others wait for it), none fails on another's files."""
    import threading

    from eaglebatch.job.config import StorageConfig
    from eaglebatch.storage import download, location
    from support.object_servers import s3_env

    b = s3.bucket("modelrace")
    _upload_model(s3, small_model, b, "tiny")
    opts = {k.lower(): v for k, v in s3_env().items()}
    storage = StorageConfig(endpoint=s3.endpoint, options=opts)
    monkeypatch.setattr(download, "CHUNK", 1024)  # many reads per file: the copies overlap
    cache, start, errors, got = tmp_path / "cache", threading.Barrier(4), [], []

    def first_use() -> None:
        start.wait()
        try:
            got.append(download.cached_copy(location(f"s3://{b}/tiny", storage), cache))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(got)) == 1
    for f in small_model.rglob("*"):
        if f.is_file():
            assert (got[0] / f.relative_to(small_model)).read_bytes() == f.read_bytes()
    assert not [p for p in got[0].rglob(".*") if p.name != ".eaglebatch-source.json"]


def test_a_remote_models_identity_is_the_same_in_every_copy(tmp_path, small_model, s3):
    """Shards on several machines each copy the model at their own time: the identity names the
    weights by the objects' size and e_tag, not the copies' mtimes, and changes with them."""
    from eaglebatch.job.config import StorageConfig
    from eaglebatch.job.fingerprint import folder_fingerprint
    from eaglebatch.storage import download, location
    from support.object_servers import s3_env

    b = s3.bucket("modelident")
    _upload_model(s3, small_model, b, "tiny")
    storage = StorageConfig(endpoint=s3.endpoint,
                            options={k.lower(): v for k, v in s3_env().items()})  # fmt: skip
    remote = location(f"s3://{b}/tiny", storage)
    one = download.cached_copy(remote, tmp_path / "node-a")
    weights = next(one.glob("*.safetensors"))
    os.utime(weights, (1_000_000, 1_000_000))  # copied long ago
    two = download.cached_copy(remote, tmp_path / "node-b")
    assert folder_fingerprint(one) == folder_fingerprint(two)
    s3.put(b, f"tiny/{weights.name}", weights.read_bytes()[:-1] + b" ")  # rewritten remotely
    three = download.cached_copy(location(f"s3://{b}/tiny", storage), tmp_path / "node-a")
    assert folder_fingerprint(three) != folder_fingerprint(two)


def test_validate_refuses_an_output_path_that_is_an_object_as_run_does(tmp_path, small_model,
                                                                        s3):  # fmt: skip
    b = s3.bucket("outobject")
    s3.put(b, "results", b"an object, not a prefix")
    d = _inputs(tmp_path, 4)
    job = _job(tmp_path, small_model, str(d), f"s3://{b}/results", s3.endpoint)
    for command in ("validate", "run"):
        text = finish(cli(command, str(job), env=eaglebatch_env()), 2)
        assert f"output.path: s3://{b}/results is an object" in text and "Traceback" not in text
    assert s3.keys(b, "") == {"results": 23}  # nothing written beside it


def test_credentials_in_the_endpoint_reach_no_part_summary_or_message(tmp_path, small_model, s3,
                                                                      local_ref):  # fmt: skip
    """`http://KEY:SECRET@host` works as an endpoint; its user information is in no part's
    footer, summary, log or message, and a rerun with it resumes."""
    user, password = "EPUSERKEY7", "EPpass-w0rd-value"
    want, b = _on_s3(s3, "endpointcreds", local_ref, 12)
    endpoint = s3.endpoint.replace("http://", f"http://{user}:{password}@")
    job = _job(tmp_path, small_model, f"s3://{b}/in", f"s3://{b}/out", endpoint,
               rows_per_part=4)  # fmt: skip
    summary = tmp_path / "summary.json"
    logs = run(job, "--summary-json", str(summary))
    assert _rows(s3.table(b, "out/")) == want
    parts = [k for k in s3.keys(b, "out/") if k.rsplit("/", 1)[-1].startswith("part-")]
    assert len(parts) >= 3
    for key in parts:
        meta = pq.read_metadata(io.BytesIO(s3.get(b, key))).metadata
        record = b"".join(k + v for k, v in meta.items())
        assert user.encode() not in record and password.encode() not in record, key
        recorded = json.loads(meta[b"eaglebatch.job"])["storage"]["endpoint"]
        assert recorded == s3.endpoint.replace("http://", "http://***@")
    logs += summary.read_text() + run(job, "--summary-json", str(summary))
    assert "12 of 12 rows already done" in logs  # the rerun resumed
    denied = FaultProxy(s3.endpoint, deny=True)  # a failing request's message
    try:
        bad = _job(tmp_path, small_model, f"s3://{b}/in", f"s3://{b}/other",
                   denied.endpoint.replace("http://", f"http://{user}:{password}@"))  # fmt: skip
        logs += run(bad, "--summary-json", str(summary), status=1) + summary.read_text()
    finally:
        denied.stop()
    assert "403 Forbidden" in logs and "***@" in logs
    assert user not in logs and password not in logs

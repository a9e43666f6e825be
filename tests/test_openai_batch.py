"""OpenAI Batch JSONL in and out: chat and completion request lines generate what the same
messages / prompts generate from Parquet, each line's sampling keys are honoured, a malformed
line is an error line naming its line number, the results file parses as OpenAI Batch output
with each custom_id once, and a job killed with SIGKILL and rerun writes each custom_id once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglebatch.errors import JobError
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared
from test_runner import random_prompts

pytest.importorskip("eaglebatch._native")

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def request(cid, url, body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def batch_job(tmp, model, lines: list[str], name="batch", extra="") -> Path:
    inp = tmp / f"{name}-requests.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    job = tmp / f"{name}.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {inp}\noutput:\n  path: {tmp / name}\n"
        f"  format: openai-batch\n  include_token_ids: true\n{extra}"
        "sampling:\n  max_new_tokens: 16\nengine:\n  device: cpu\n  kv_cache_tokens: 4096\n"
    )
    return job


def results(tmp, name="batch") -> dict[str, dict]:
    """The results file by custom_id, checking the OpenAI Batch output shape of every line."""
    out = {}
    for text in (tmp / name / "_results.jsonl").read_text().splitlines():
        line = json.loads(text)
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert line["custom_id"] not in out, "a custom_id written twice"
        resp = line["response"]
        assert set(resp) == {"status_code", "request_id", "body"}
        if resp["status_code"] == 200:
            body = resp["body"]
            assert {"id", "object", "created", "model", "choices", "usage"} <= set(body)
            usage = body["usage"]
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        else:
            assert resp["status_code"] == 400 and resp["body"]["error"]["message"]
        out[line["custom_id"]] = line
    return out


def parquet_job(tmp, model, table: pa.Table, name: str, extra: str = "") -> list[dict]:
    inp = tmp / f"{name}-in.parquet"
    pq.write_table(table, inp)
    job = tmp / f"{name}.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {inp}\n  id_column: id\n{extra}output:\n"
        f"  path: {tmp / name}\n  include_token_ids: true\n"
        "sampling:\n  max_new_tokens: 16\nengine:\n  device: cpu\n  kv_cache_tokens: 4096\n"
    )
    run_prepared(prepare(load_job(job)))
    return pq.read_table(tmp / name).sort_by("row_index").to_pylist()


def test_chat_lines_equal_a_messages_column_job(tmp_path, tiny_model_dir):
    prompts = random_prompts(5, seed=3)
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    lines = [request(f"c{i}", CHAT, {"model": "x", "messages": m}) for i, m in enumerate(msgs)]
    lines.insert(2, "")  # a blank line is not a request
    run_prepared(prepare(load_job(batch_job(tmp_path, tiny_model_dir, lines))))
    ref = parquet_job(tmp_path, tiny_model_dir, pa.table({"id": [f"c{i}" for i in range(5)],
                      "messages": msgs}), "ref", "  messages_column: messages\n")  # fmt: skip
    got = results(tmp_path)
    assert sorted(got) == [f"c{i}" for i in range(5)]
    for r in ref:
        body = got[r["id"]]["response"]["body"]
        assert body["object"] == "chat.completion"
        choice = body["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": r["output_text"]}
        assert choice["finish_reason"] == r["finish_reason"]
        assert body["usage"]["completion_tokens"] == r["output_tokens"]


def test_a_bom_and_crlf_lines_are_read(tmp_path, tiny_model_dir):
    """A file opening with a UTF-8 byte order mark, its lines ending in CRLF (as Windows
    editors save it): every request generates under its custom_id, as the plain file does."""
    from support.cli import cli, finish

    prompts = random_prompts(3, seed=6)
    lines = [request(f"b{i}", COMPLETIONS, {"model": "x", "prompt": p})
             for i, p in enumerate(prompts)]  # fmt: skip
    plain = batch_job(tmp_path, tiny_model_dir, lines, name="plain")
    bom = batch_job(tmp_path, tiny_model_dir, lines, name="bom")
    (tmp_path / "bom-requests.jsonl").write_bytes(
        b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n"
    )
    out = finish(cli("validate", str(bom)))
    assert "3 rows" in out, out
    for job in (plain, bom):
        finish(cli("run", str(job)))
    want, got = results(tmp_path, "plain"), results(tmp_path, "bom")
    assert sorted(got) == ["b0", "b1", "b2"], got
    for cid, line in got.items():
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        assert line["response"]["body"]["choices"] == want[cid]["response"]["body"]["choices"]


def test_completion_lines_their_sampling_and_logprobs(tmp_path, tiny_model_dir):
    prompts = random_prompts(4, seed=4)
    bodies = [{"prompt": prompts[0], "max_tokens": 3},
              {"prompt": prompts[1], "temperature": 0.8, "seed": 5},
              {"prompt": prompts[2], "logprobs": 2},
              {"prompt": prompts[3], "frequency_penalty": 1.0, "min_tokens": 10}]  # fmt: skip
    lines = [request(f"p{i}", COMPLETIONS, b) for i, b in enumerate(bodies)]
    run_prepared(prepare(load_job(batch_job(tmp_path, tiny_model_dir, lines))))
    got = {k: v["response"]["body"]["choices"][0] for k, v in results(tmp_path).items()}
    cols = {"id": [f"p{i}" for i in range(4)], "prompt": prompts,
            "mt": pa.array([3, None, None, None], pa.int64()), "t": [None, 0.8, None, None],
            "sd": pa.array([None, 5, None, None], pa.int64()),
            "lp": pa.array([None, None, 2, None], pa.int64()),
            "fp": [None, None, None, 1.0], "mn": pa.array([None, None, None, 10], pa.int64())}
    mapping = ("  sampling_columns: {max_new_tokens: mt, temperature: t, seed: sd, logprobs: lp, "
               "frequency_penalty: fp, min_new_tokens: mn}\n")  # fmt: skip
    ref = parquet_job(tmp_path, tiny_model_dir, pa.table(cols), "ref", mapping)
    for r in ref:
        assert got[r["id"]]["text"] == r["output_text"], r["id"]
    assert ref[0]["output_tokens"] <= 3 and ref[3]["output_tokens"] >= 10
    assert max(r["output_tokens"] for r in ref[1:3]) > 3  # max_tokens 3 was the line's own
    lp = got["p2"]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == ref[2]["output_tokens"]
    assert all(len(top) <= 2 for top in lp["top_logprobs"])
    assert got["p0"]["logprobs"] is None


def test_bad_lines_are_error_lines_naming_the_line(tmp_path, tiny_model_dir):
    lines = [
        request("ok", COMPLETIONS, {"prompt": "hello"}),
        "{this is not json",
        request("neg", COMPLETIONS, {"prompt": "hi", "max_tokens": -2}),
        request("ok", COMPLETIONS, {"prompt": "dup"}),
        json.dumps({"method": "POST", "url": COMPLETIONS, "body": {"prompt": "x"}}),
        request("emb", "/v1/embeddings", {"input": "x"}),
    ]
    job = batch_job(tmp_path, tiny_model_dir, lines)
    with open(tmp_path / "batch-requests.jsonl", "ab") as f:
        f.write(b'{"custom_id": "\xff\xfe"}\n')  # not UTF-8
    run_prepared(prepare(load_job(job)))
    text = (tmp_path / "batch" / "_results.jsonl").read_text().splitlines()
    assert len(text) == 7  # one line per request, the bad ones included
    by_line = {}
    for t in text:
        line = json.loads(t)
        by_line[line["id"]] = line
    status = {k: v["response"]["status_code"] for k, v in by_line.items()}
    assert status["batch_req_0"] == 200 and status["batch_req_3"] == 400
    for row, want in [(1, "line 2: not valid JSON"), (2, "line 3:"), (3, "line 4: duplicate"),
                      (4, "line 5: custom_id"), (5, "line 6: url /v1/embeddings needs task: embed"),
                      (6, "line 7: not valid UTF-8")]:  # fmt: skip
        msg = by_line[f"batch_req_{row}"]["response"]["body"]["error"]["message"]
        assert msg.startswith(want), msg
    assert by_line["batch_req_1"]["custom_id"] is None


def test_an_input_without_a_request_line_is_a_job_error(tmp_path, tiny_model_dir):
    job = batch_job(tmp_path, tiny_model_dir, ["{}", json.dumps({"url": "/v1/embeddings"})])
    with pytest.raises(JobError, match="no line of .* is a request"):
        prepare(load_job(job))


KILL_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared
run_prepared(prepare(load_job(sys.argv[2])))
"""


def test_killed_and_rerun_writes_each_custom_id_once(tmp_path, tiny_model_dir):
    lines = [request(f"k{i}", COMPLETIONS, {"prompt": p, "max_tokens": 24})
             for i, p in enumerate(random_prompts(200, seed=6))]  # fmt: skip
    path = batch_job(tmp_path, tiny_model_dir, lines,
                     extra="  part_rows: 8\n  flush_interval_s: 0.2\n")  # fmt: skip
    tests = str(Path(__file__).parent)
    proc = subprocess.Popen([sys.executable, "-c", KILL_CHILD, tests, str(path)])
    out = tmp_path / "batch"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(out.glob("part-*.parquet"))) < 2:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    parts = list(out.glob("part-*.parquet"))
    assert parts and not (tmp_path / "batch" / "_results.jsonl").exists()
    done = pq.read_table(out).num_rows
    assert 0 < done < 200, "the kill must land mid-run"
    run_prepared(prepare(load_job(path)))
    got = results(tmp_path)
    assert sorted(got) == sorted(f"k{i}" for i in range(200))
    assert pq.read_table(out).num_rows == 200


def test_samples_are_a_lines_choices_and_parquet_input_gets_a_results_file(tmp_path,
                                                                           tiny_model_dir):
    lines = [request(f"s{i}", COMPLETIONS, {"prompt": p, "n": 3})
             for i, p in enumerate(random_prompts(4, seed=9))]  # fmt: skip
    path = batch_job(tmp_path, tiny_model_dir, lines)
    job = path.read_text()
    path.write_text(job.replace("sampling:\n", "sampling:\n  n: 3\n  temperature: 0.9\n"))
    run_prepared(prepare(load_job(path)))
    parts = pq.read_table(tmp_path / "batch").to_pylist()
    for cid, line in results(tmp_path).items():
        body = line["response"]["body"]
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        mine = sorted((r for r in parts if r["id"] == cid), key=lambda r: r["sample_index"])
        assert [c["text"] for c in body["choices"]] == [r["output_text"] for r in mine]
        assert body["usage"]["completion_tokens"] == sum(r["output_tokens"] for r in mine)
    # a Parquet job with output.format openai-batch: chat bodies for a messages column
    msgs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
    ref = parquet_job(tmp_path, tiny_model_dir, pa.table({"id": [7, 8], "messages": msgs}),
                      "pq", "  messages_column: messages\n")  # fmt: skip
    job = (tmp_path / "pq.yaml").read_text().replace("output:\n", "output:\n  format: "
                                                     "openai-batch\n")  # fmt: skip
    (tmp_path / "pq.yaml").write_text(job)
    run_prepared(prepare(load_job(tmp_path / "pq.yaml")))  # every row done: writes the file
    got = results(tmp_path, "pq")
    assert sorted(got) == ["7", "8"]
    for r in ref:
        choice = got[str(r["id"])]["response"]["body"]["choices"][0]
        assert choice["message"]["content"] == r["output_text"]


def test_validate_counts_batch_requests(tmp_path, tiny_model_dir):
    from click.testing import CliRunner

    from eaglebatch.cli import main

    lines = [request(f"v{i}", CHAT, {"messages": [{"role": "user", "content": "x"}]})
             for i in range(3)]  # fmt: skip
    r = CliRunner().invoke(main, ["validate", str(batch_job(tmp_path, tiny_model_dir,
                                                             ["", *lines, ""]))])  # fmt: skip
    assert r.exit_code == 0 and "3 rows" in r.output, r.output


def test_a_batch_jobs_identity_covers_the_logprobs_mode(tmp_path, tiny_model_dir):
    """A line may ask for logprobs, so their distribution decides what its row holds."""
    lines = [request("a", COMPLETIONS, {"prompt": "hi", "logprobs": 1})]
    job = batch_job(tmp_path, tiny_model_dir, lines)
    raw = prepare(load_job(job)).identity["output"]
    processed = prepare(load_job(job, ["output.logprobs_mode=processed"])).identity["output"]
    assert raw["logprobs_mode"] == "raw" and processed["logprobs_mode"] == "processed"


def test_response_format_lines_are_structured_like_a_column_job(tmp_path, tiny_model_dir):
    """Chat and completion lines with a response_format generate what the same format from a
    sampling column generates; their content is the structured text; {"type": "text"} is free
    text and a format that does not compile is the line's error."""
    prompts = random_prompts(3, seed=4)
    rf = {"type": "regex", "pattern": "[a-c]{3}-[0-9]{2}"}
    lines = [request("chat", CHAT, {"messages": [{"role": "user", "content": prompts[0]}],
                                    "response_format": rf}),
             request("comp", COMPLETIONS, {"prompt": prompts[1], "response_format": rf}),
             request("text", COMPLETIONS, {"prompt": prompts[2],
                                           "response_format": {"type": "text"}}),
             request("bad", COMPLETIONS, {"prompt": prompts[2], "response_format":
                                          {"type": "regex", "pattern": "("}})]  # fmt: skip
    run_prepared(prepare(load_job(batch_job(tmp_path, tiny_model_dir, lines))))
    got = results(tmp_path)
    ref = parquet_job(tmp_path, tiny_model_dir, pa.table({"id": ["comp"], "prompt": [prompts[1]],
                      "rf": [json.dumps(rf)]}), "ref",
                      "  prompt_column: prompt\n  sampling_columns:\n    response_format: rf\n")
    comp = got["comp"]["response"]["body"]["choices"][0]
    assert comp["text"] == ref[0]["output_text"] and ref[0]["structured"] == "complete"
    chat = got["chat"]["response"]["body"]["choices"][0]["message"]["content"]
    for text in (comp["text"], chat):
        assert len(text) == 6 and text[3] == "-" and set(text[:3]) <= set("abc")
    assert got["text"]["response"]["status_code"] == 200
    assert "does not compile" in got["bad"]["response"]["body"]["error"]["message"]

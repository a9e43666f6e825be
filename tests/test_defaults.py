"""Embedded defaults: ShareGPT streaming over a truncated JSON array, and the cached Parquet."""

import json

import pyarrow.parquet as pq

from eaglebatch import defaults


def test_iter_sharegpt_survives_truncation_and_chunk_boundaries(tmp_path):
    records = [
        {"id": f"r{i}", "conversations": [{"from": "human", "value": "x" * (i * 7) + "}]"}]}
        for i in range(50)
    ]
    text = json.dumps(records, indent=2)
    cut = text[: len(text) - 40]  # truncated inside the last record
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    got = list(defaults.iter_sharegpt(path, chunk_chars=97))
    assert [r["id"] for r in got] == [f"r{i}" for i in range(49)]
    assert got == records[:49]


def test_iter_sharegpt_complete_file(tmp_path):
    records = [{"id": "a", "conversations": []}, {"id": "b", "conversations": []}]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(records))
    assert list(defaults.iter_sharegpt(path, chunk_chars=5)) == records


def test_sharegpt_parquet_first_turns(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEBATCH_CACHE", str(tmp_path))
    path = defaults.sharegpt_parquet()
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

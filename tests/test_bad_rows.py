"""Bad rows never fail a job: each becomes an error row with a specific message, every other
row is generated normally (compared with a run over the good rows only)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared

pytest.importorskip("eaglebatch._native")

# Like the tiny model's template, but roles other than user / assistant / system are refused.
STRICT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('Roles must be user, assistant or system, got ' + m['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


@pytest.fixture(scope="module")
def strict_model(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("strict-model")
    for f in Path(tiny_model_dir).iterdir():
        shutil.copy(f, d / f.name)
    (d / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    return d


def run(tmp: Path, model: Path, table: pa.Table, source: str, name: str, extra: str = ""):
    inp = tmp / f"{name}.parquet"
    pq.write_table(table, inp)
    job = tmp / f"{name}.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {inp}\n  {source}\n  id_column: id\n"
        f"output:\n  path: {tmp / name}\n  part_rows: 3\n  include_token_ids: true\n"
        f"sampling:\n  max_new_tokens: 5\nengine:\n  device: cpu\n  max_batch_size: 4\n"
        f"  kv_cache_tokens: 256\n  block_size: 16\n{extra}"
    )
    res = run_prepared(prepare(load_job(job)))
    return pq.read_table(tmp / name).sort_by("row_index").to_pylist(), res


def user(text):
    return [{"role": "user", "content": text}]


def test_bad_messages_rows(tmp_path, strict_model):
    cases = [
        (user("hello"), None),
        (None, "messages column 'messages' is null"),
        ([], "malformed messages: empty list"),
        ([{"role": None, "content": "x"}], "malformed messages: message 0 has no role"),
        ([{"role": "user", "content": None}], "malformed messages: message 0 has null content"),
        ([{"role": "tool", "content": "x"}], "Roles must be user, assistant or system"),
        (user("the cat"), None),
        (user("y" * 300), "needs 20 KV blocks"),  # longer than the whole 256-token KV budget
        (user("the cat"), "duplicate id"),  # same id as the row before the last
        (user("a mat"), "id column 'id' is null"),
    ]
    ids = [f"m{i}" for i in range(len(cases))]
    ids[8], ids[9] = ids[6], None
    table = pa.table({
        "id": pa.array(ids, pa.string()),
        "messages": pa.array([c[0] for c in cases], MESSAGES_TYPE),
    })
    rows, res = run(tmp_path, strict_model, table, "messages_column: messages", "bad")
    assert len(rows) == len(cases)
    for row, (_, want) in zip(rows, cases, strict=True):
        if want is None:
            assert row["finish_reason"] in ("stop", "length"), row
            assert row["error"] is None
        else:
            assert row["finish_reason"] == "error", row
            assert want in row["error"], row["error"]
            assert row["output_tokens"] == 0 and row["output_text"] == ""
    assert res.stats["errors"] == 8
    # The good rows are generated exactly as in a job without the bad ones.
    good = pa.table({
        "id": ["m0", "m6"],
        "messages": pa.array([user("hello"), user("the cat")], MESSAGES_TYPE),
    })
    ref, _ = run(tmp_path, strict_model, good, "messages_column: messages", "good")
    got = {r["id"]: r["output_token_ids"] for r in rows if r["error"] is None}
    assert got == {r["id"]: r["output_token_ids"] for r in ref}


def test_bad_prompt_rows(tmp_path, tiny_model_dir):
    prompts = ["hello", None, "", "x" * 600, "y" * 300, "the cat"]
    table = pa.table({"id": pa.array([1, 2, 3, 4, 5, 1], pa.int64()), "prompt": prompts})
    rows, _ = run(tmp_path, tiny_model_dir, table, "prompt_column: prompt", "p")
    errors = [r["error"] for r in rows]
    assert errors[0] is None
    assert "prompt column 'prompt' is null" in errors[1]
    assert "prompt column 'prompt' is empty" in errors[2]
    assert "shorter than max_model_len" in errors[3]
    assert "KV blocks" in errors[4]
    assert "duplicate id" in errors[5]

"""`output.keep_columns`: input columns copied into each output row with their types, so a
pipeline needs no join. Checked against the input file itself (pyarrow reads both): every
kept value equals its input row's, of every Arrow type a Parquet writer produces; error rows
and every sample carry theirs; generation is the same with and without kept columns; bad
settings are exit 2 before any work, from `validate` and `run` alike."""

from __future__ import annotations

import datetime as dt
import decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from eaglebatch.cli import main

pytest.importorskip("eaglebatch._native")

ROWS = 7


def columns() -> dict:
    """One column per kind of type, with nulls; row 3's prompt is null (an error row)."""
    r = range(ROWS)
    return {
        "prompt": [None if i == 3 else f"the cat sat {i}" for i in r],
        "id": [f"r{i}" for i in r],
        "i8": pa.array([i - 3 for i in r], pa.int8()),
        "u64": pa.array([2**64 - 1 - i for i in r], pa.uint64()),
        "f16": pa.array([None if i == 2 else i / 4 for i in r], pa.float16()),
        "f64": [i * 1.5 for i in r],
        "flag": [i % 2 == 0 for i in r],
        "text": pa.array([f"t{i}" * i for i in r], pa.large_string()),
        "cat": pa.array(["a", "b", "a", None, "c", "b", "a"]).dictionary_encode(),
        "blob": pa.array([bytes([i]) * i for i in r], pa.binary()),
        "when": pa.array([dt.datetime(2026, 1, 1 + i) for i in r], pa.timestamp("us", "UTC")),
        "day": pa.array([dt.date(2026, 2, 1 + i) for i in r], pa.date32()),
        "price": pa.array([decimal.Decimal(f"{i}.25") for i in r], pa.decimal128(9, 2)),
        "tags": [[f"x{j}" for j in range(i % 3)] for i in r],
        "nums": pa.array([[i] * i for i in r], pa.large_list(pa.int32())),
        "meta": [{"score": i / 2, "src": f"s{i}", "inner": {"k": i}} for i in r],
        "attrs": pa.array([[("a", i)] for i in r], pa.map_(pa.string(), pa.int64())),
    }


def write_job(tmp: Path, model: Path, inp: Path, name: str, extra: str = "") -> Path:
    job = tmp / f"{name}.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {inp}\n  id_column: id\n"
        f"output:\n  path: {tmp / name}\n  include_token_ids: true\n  part_rows: 3\n{extra}"
        "sampling:\n  max_new_tokens: 5\nengine:\n  device: cpu\n  kv_cache_tokens: 2048\n"
    )
    return job


def run(job: Path) -> pa.Table:
    for cmd in ("validate", "run"):
        res = CliRunner().invoke(main, [cmd, str(job)])
        assert res.exit_code == 0, res.output
    return pq.read_table(job.parent / job.stem).sort_by([("row_index", "ascending"),
                                                         ("sample_index", "ascending")])


def test_every_type_round_trips_with_its_row(tmp_path, tiny_model_dir):
    cols = columns()
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table(cols), inp, row_group_size=4)
    plain = run(write_job(tmp_path, tiny_model_dir, inp, "plain"))
    kept = run(write_job(tmp_path, tiny_model_dir, inp, "kept", '  keep_columns: "*"\n'))
    want = pq.read_table(inp)
    names = [c for c in want.column_names if c != "id"]  # "*": the id column named id is `id`
    assert kept.column_names[-len(names):] == names
    for c in names:
        t = want.schema.field(c).type
        value_type = t.value_type if pa.types.is_dictionary(t) else t
        assert kept.schema.field(c).type == value_type, c
        got = kept.column(c).to_pylist()
        assert got == [want.column(c)[r].as_py() for r in kept.column("row_index").to_pylist()], c
    errors = kept.column("error").to_pylist()
    assert [e is not None for e in errors] == [i == 3 for i in range(ROWS)]
    assert kept.column("output_token_ids") == plain.column("output_token_ids")
    assert kept.column_names[: len(plain.column_names)] == plain.column_names


def test_named_columns_on_every_sample_and_across_file_spellings(tmp_path, tiny_model_dir):
    d = tmp_path / "in"
    d.mkdir()
    base = {"prompt": ["a b", "c d", "e f"], "id": ["x", "y", "z"]}
    pq.write_table(pa.table({**base, "note": pa.array(["n0", "n1", "n2"], pa.string())}),
                   d / "a.parquet")
    pq.write_table(pa.table({**base, "id": ["u", "v", "w"],
                             "note": pa.array(["n3", "n4", "n5"], pa.large_string())}),
                   d / "b.parquet")
    extra = "  keep_columns: [note]\n"
    job = write_job(tmp_path, tiny_model_dir, d, "samples", extra)
    job.write_text(job.read_text().replace("max_new_tokens: 5", "max_new_tokens: 4\n  n: 2\n"
                                           "  temperature: 1.0"))
    out = run(job)
    assert out.schema.field("note").type == pa.large_string()  # string + large_string
    notes = out.column("note").to_pylist()
    assert notes == [f"n{r}" for r in out.column("row_index").to_pylist()]
    assert out.num_rows == 12 and out.column_names[-1] == "note"


@pytest.mark.parametrize(
    "keep, message",
    [
        ("[output_text]", "column 'output_text' clashes with the output column"),
        ("[nope]", "column 'nope' not found in"),
        ("[id]", "column 'id' clashes"),
        ("[f64, f64]", "column 'f64' is named twice"),
    ],
)
def test_bad_settings_exit_2_before_any_work(tmp_path, tiny_model_dir, keep, message):
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table(columns()), inp)
    job = write_job(tmp_path, tiny_model_dir, inp, "bad", f"  keep_columns: {keep}\n")
    for cmd in ("validate", "run"):
        res = CliRunner().invoke(main, [cmd, str(job)])
        assert res.exit_code == 2, res.output
        assert "output.keep_columns" in res.output and message in res.output, res.output
        assert "Traceback" not in res.output
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").glob("part-*"))


def test_a_column_clashes_only_with_what_this_job_writes(tmp_path, tiny_model_dir):
    """`n`, `logprob`, `endpoint`, `logprobs` are output columns of other jobs (OpenAI Batch
    input, scoring, logprobs): a generation job without them keeps input columns so named."""
    inp = tmp_path / "in.parquet"
    names = ["n", "logprob", "endpoint", "logprobs", "is_greedy", "reasoning_text"]
    pq.write_table(pa.table({"prompt": ["a", "b"], "id": ["x", "y"],
                             **{c: [f"{c}0", f"{c}1"] for c in names}}), inp)  # fmt: skip
    keep = f"  keep_columns: [{', '.join(names)}]\n"
    job = write_job(tmp_path, tiny_model_dir, inp, "free", keep)
    out = run(job)
    assert out.column_names[-len(names):] == names
    assert out.column("logprob").to_pylist() == ["logprob0", "logprob1"]
    for extra, clash in (("  logprobs: 2\n", "logprobs"), ("", "logprob")):
        text = job.read_text().replace("  part_rows: 3\n", "  part_rows: 3\n" + extra)
        if clash == "logprob":  # a scoring job writes logprob
            text = text.replace("input:\n", "task: perplexity\ninput:\n").replace(
                "  include_token_ids: true\n", "").replace("  max_new_tokens: 5\n",
                                                          "  max_new_tokens: 1\n")  # fmt: skip
        job.write_text(text)
        for cmd in ("validate", "run"):
            res = CliRunner().invoke(main, [cmd, str(job)])
            assert res.exit_code == 2, res.output
            assert f"column '{clash}' clashes" in res.output and "Traceback" not in res.output


def test_star_names_a_clash_and_a_batch_input_has_no_columns(tmp_path, tiny_model_dir):
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "error": ["mine"]}), inp)
    job = write_job(tmp_path, tiny_model_dir, inp, "star", '  keep_columns: "*"\n')
    job.write_text(job.read_text().replace("  id_column: id\n", ""))
    res = CliRunner().invoke(main, ["validate", str(job)])
    assert res.exit_code == 2 and "column 'error' clashes" in res.output, res.output
    assert 'instead of "*"' in res.output
    batch = tmp_path / "in.jsonl"
    batch.write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "a"}}\n')
    job.write_text(job.read_text().replace(str(inp), str(batch)))
    res = CliRunner().invoke(main, ["validate", str(job)])
    assert res.exit_code == 2 and "openai-batch input has no columns" in res.output, res.output


def test_columns_a_polars_frame_wrote_come_back_as_polars_reads_them(tmp_path, tiny_model_dir):
    pl = pytest.importorskip("polars")
    frame = pl.DataFrame({
        "prompt": ["a b", "c d", "e f"],
        "label": pl.Series(["x", "y", "x"], dtype=pl.Categorical),
        "scores": [[0.5, 1.5], [], [2.0]],
        "doc": [{"title": "t0", "pages": 3}, {"title": "t1", "pages": 1}, {"title": None,
                                                                           "pages": 2}],
    })  # fmt: skip
    inp = tmp_path / "polars.parquet"
    frame.write_parquet(inp)
    job = write_job(tmp_path, tiny_model_dir, inp, "pl", "  keep_columns: [label, scores, doc]\n")
    job.write_text(job.read_text().replace("  id_column: id\n", ""))
    run(job)
    out = pl.read_parquet(tmp_path / "pl").sort("row_index")
    for c in ("scores", "doc"):
        assert out[c].to_list() == frame[c].to_list(), c
    assert out["label"].cast(pl.String).to_list() == ["x", "y", "x"]

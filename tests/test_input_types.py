"""Inputs as other tools write them: dictionary-encoded strings (pandas `category`, polars
`Categorical`, `dictionary_encode()`) read as strings, and the string spellings of different
writers (polars' large_string, duckdb's and pyarrow's string, string_view) mixed in one input
directory. `validate` and `run` accept exactly the same inputs (one rule, reader/validate.rs,
which `validate` calls through the extension); a kind that truly differs between files is
refused naming both."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from eaglebatch.cli import main

pytest.importorskip("eaglebatch._native")

PROMPTS = ["the cat sat", "on a mat", "the cat sat", "42 code", "über naïve", "on a mat"]
MESSAGES = [[{"role": "user", "content": p}] for p in PROMPTS]
IDS = [f"r{i}" for i in range(len(PROMPTS))]


def write_job(tmp: Path, model: Path, inp: Path, input_keys: str, name: str) -> Path:
    job = tmp / f"{name}.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {inp}\n{input_keys}"
        f"output:\n  path: {tmp / name}\n  include_token_ids: true\n  part_rows: 4\n"
        "sampling:\n  max_new_tokens: 6\nengine:\n  device: cpu\n  kv_cache_tokens: 2048\n"
    )
    return job


def validate_and_run(tmp: Path, model: Path, inp: Path, input_keys: str, name: str):
    """(validate's result, run's result, the output sorted by row_index or None)."""
    job = write_job(tmp, model, inp, input_keys, name)
    checked = CliRunner().invoke(main, ["validate", str(job)])
    ran = CliRunner().invoke(main, ["run", str(job)])
    out = tmp / name
    table = pq.read_table(out).sort_by("row_index") if ran.exit_code == 0 else None
    return checked, ran, table


def run_ok(tmp: Path, model: Path, inp: Path, input_keys: str, name: str) -> pa.Table:
    checked, ran, table = validate_and_run(tmp, model, inp, input_keys, name)
    assert checked.exit_code == 0, checked.output
    assert ran.exit_code == 0, ran.output
    return table


def tokens(table: pa.Table) -> list:
    return table.column("output_token_ids").to_pylist()


def reference(tmp: Path, model: Path, cols: dict, input_keys: str, name: str) -> pa.Table:
    inp = tmp / f"{name}-in.parquet"
    pq.write_table(pa.table(cols), inp)
    return run_ok(tmp, model, inp, input_keys, name)


def dictionary_messages() -> pa.Array:
    """The messages with role and content dictionary-encoded strings (as a pandas category or
    polars Categorical inside the structs)."""
    item = pa.struct([("role", pa.dictionary(pa.int32(), pa.string())),
                      ("content", pa.dictionary(pa.int8(), pa.large_string()))])
    return pa.array(MESSAGES, pa.list_(item))


@pytest.mark.parametrize("encoded", ["prompt", "id", "st", "all"])
def test_dictionary_prompt_id_and_stop_columns_read_as_strings(tmp_path, tiny_model_dir, encoded):
    keys = "  id_column: id\n  sampling_columns: {stop: st, max_new_tokens: mt}\n"
    plain = {"prompt": PROMPTS, "id": pa.array(IDS, pa.large_string()),
             "st": [None, "zz", None, None, "zz", None],
             "mt": pa.array([6, 6, 3, 6, 6, 3], pa.int64())}
    ref = reference(tmp_path, tiny_model_dir, plain, keys, "plain")
    cols = {k: pa.array(v).dictionary_encode() if encoded in (k, "all") else v
            for k, v in plain.items()}
    inp = tmp_path / "dict-in.parquet"
    pq.write_table(pa.table(cols), inp)
    column = "prompt" if encoded == "all" else encoded
    assert pa.types.is_dictionary(pq.read_schema(inp).field(column).type)
    out = run_ok(tmp_path, tiny_model_dir, inp, keys, "dict")
    assert tokens(out) == tokens(ref)
    assert out.column("id").to_pylist() == IDS
    assert out.schema.field("id").type == pa.large_string()  # the dictionary's value type
    assert out.column("error").null_count == len(PROMPTS)


def test_a_list_of_dictionary_strings_is_a_stop_column(tmp_path, tiny_model_dir):
    stops = [None, ["zz", "yy"], None, [], ["zz"], None]
    keys = "  sampling_columns: {stop: st}\n"
    ref = reference(tmp_path, tiny_model_dir, {"prompt": PROMPTS, "st": stops}, keys, "plain")
    listed = pa.array(stops, pa.list_(pa.dictionary(pa.int16(), pa.string())))
    inp = tmp_path / "ldict-in.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS, "st": listed}), inp)
    assert tokens(run_ok(tmp_path, tiny_model_dir, inp, keys, "ldict")) == tokens(ref)


def test_dictionary_messages_read_as_strings(tmp_path, tiny_model_dir):
    keys = "  messages_column: messages\n"
    ref = reference(tmp_path, tiny_model_dir, {"messages": MESSAGES}, keys, "plain")
    inp = tmp_path / "mdict-in.parquet"
    pq.write_table(pa.table({"messages": dictionary_messages()}), inp)
    out = run_ok(tmp_path, tiny_model_dir, inp, keys, "mdict")
    assert tokens(out) == tokens(ref)
    assert out.column("error").null_count == len(PROMPTS)


def test_polars_categorical_columns_run(tmp_path, tiny_model_dir):
    pl = pytest.importorskip("polars")
    keys = "  id_column: id\n"
    ref = reference(tmp_path, tiny_model_dir, {"prompt": PROMPTS, "id": IDS}, keys, "plain")
    inp = tmp_path / "pl-in.parquet"
    pl.DataFrame({"prompt": pl.Series(PROMPTS, dtype=pl.Categorical),
                  "id": pl.Series(IDS, dtype=pl.Categorical)}).write_parquet(inp)
    out = run_ok(tmp_path, tiny_model_dir, inp, keys, "pl")
    assert tokens(out) == tokens(ref)
    assert out.column("id").to_pylist() == IDS


def test_a_dictionary_of_numbers_is_still_no_prompt(tmp_path, tiny_model_dir):
    """Looking through dictionaries does not widen the rule: a dictionary of integers is no
    string column, and validate and run both say so naming the column."""
    inp = tmp_path / "bad-in.parquet"
    pq.write_table(pa.table({"prompt": pa.array([1, 2]).dictionary_encode()}), inp)
    checked, ran, _ = validate_and_run(tmp_path, tiny_model_dir, inp, "", "bad")
    for r in (checked, ran):
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert "'prompt'" in r.output and "dictionary" in r.output, r.output


def split_writers(tmp: Path, cols: dict) -> Path:
    """The rows in two files of one directory: the first half written by polars (large_string,
    large_list), the second by duckdb (string, list)."""
    pl = pytest.importorskip("polars")
    duckdb = pytest.importorskip("duckdb")
    d = tmp / "mixed"
    d.mkdir()
    half = len(PROMPTS) // 2
    pl.DataFrame({k: v[:half] for k, v in cols.items()}).write_parquet(d / "a.parquet")
    rest = pa.table({k: v[half:] for k, v in cols.items()})  # noqa: F841 (read by duckdb)
    duckdb.sql(f"COPY rest TO '{d / 'b.parquet'}' (FORMAT parquet)")
    a, b = pq.read_schema(d / "a.parquet"), pq.read_schema(d / "b.parquet")
    assert a.field(next(iter(cols))).type != b.field(next(iter(cols))).type
    return d


def test_polars_and_duckdb_files_with_prompts_and_ids_run_together(tmp_path, tiny_model_dir):
    keys = "  id_column: id\n"
    ref = reference(tmp_path, tiny_model_dir, {"prompt": PROMPTS, "id": IDS}, keys, "plain")
    d = split_writers(tmp_path, {"prompt": PROMPTS, "id": IDS})
    assert pq.read_schema(d / "a.parquet").field("id").type == pa.large_string()
    assert pq.read_schema(d / "b.parquet").field("id").type == pa.string()
    out = run_ok(tmp_path, tiny_model_dir, d, keys, "mixed-out")
    assert tokens(out) == tokens(ref)
    assert out.column("id").to_pylist() == IDS
    assert out.schema.field("id").type == pa.large_string()  # string spellings differ: large


def test_polars_and_duckdb_files_with_messages_run_together(tmp_path, tiny_model_dir):
    keys = "  messages_column: messages\n"
    ref = reference(tmp_path, tiny_model_dir, {"messages": MESSAGES}, keys, "plain")
    d = split_writers(tmp_path, {"messages": MESSAGES})
    out = run_ok(tmp_path, tiny_model_dir, d, keys, "mixed-out")
    assert tokens(out) == tokens(ref)


def test_string_view_and_dictionary_ids_mix_with_strings(tmp_path, tiny_model_dir):
    d = tmp_path / "views"
    d.mkdir()
    pq.write_table(pa.table({"prompt": pa.array(PROMPTS[:2], pa.string_view()),
                             "id": pa.array(IDS[:2], pa.string_view())}), d / "a.parquet")
    pq.write_table(pa.table({"prompt": PROMPTS[2:4],
                             "id": pa.array(IDS[2:4]).dictionary_encode()}), d / "b.parquet")
    pq.write_table(pa.table({"prompt": PROMPTS[4:], "id": IDS[4:]}), d / "c.parquet")
    out = run_ok(tmp_path, tiny_model_dir, d, "  id_column: id\n", "views-out")
    assert out.column("id").to_pylist() == IDS


def test_integer_widths_mix_and_keep_one_id_type(tmp_path, tiny_model_dir):
    d = tmp_path / "ints"
    d.mkdir()
    pq.write_table(pa.table({"prompt": PROMPTS[:3], "id": pa.array([1, 2, 3], pa.int32())}),
                   d / "a.parquet")
    pq.write_table(pa.table({"prompt": PROMPTS[3:], "id": pa.array([4, 5, 6], pa.uint8())}),
                   d / "b.parquet")
    out = run_ok(tmp_path, tiny_model_dir, d, "  id_column: id\n", "ints-out")
    assert out.column("id").to_pylist() == [1, 2, 3, 4, 5, 6]
    assert out.schema.field("id").type == pa.int64()


@pytest.mark.parametrize("second, kind", [
    (pa.array([4, 5, 6], pa.int64()), "an integer"),
    (pa.array([4, 5, 6], pa.uint64()), "uint64"),
])  # fmt: skip
def test_ids_of_different_kinds_are_refused_naming_both_files(tmp_path, tiny_model_dir, second,
                                                              kind):
    d = tmp_path / "clash"
    d.mkdir()
    first = pa.array(IDS[:3]) if kind == "an integer" else pa.array([1, 2, 3], pa.int32())
    pq.write_table(pa.table({"prompt": PROMPTS[:3], "id": first}), d / "a.parquet")
    pq.write_table(pa.table({"prompt": PROMPTS[3:], "id": second}), d / "b.parquet")
    checked, ran, _ = validate_and_run(tmp_path, tiny_model_dir, d, "  id_column: id\n", "out")
    for r in (checked, ran):
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        msg = " ".join(r.output.split())
        assert "input.id_column" in msg and "a.parquet" in msg and "b.parquet" in msg, msg


def test_the_identity_of_a_single_type_input_is_unchanged(tmp_path, tiny_model_dir):
    """The identity's input and output sections hold the keys they held before: a job
    written before these changes still resumes its output."""
    from eaglebatch.job.config import load_job
    from eaglebatch.prepare import prepare

    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS, "id": IDS}), inp)
    identity = prepare(load_job(write_job(tmp_path, tiny_model_dir, inp, "  id_column: id\n",
                                          "out"))).identity
    assert sorted(identity["input"]) == ["apply_chat_template", "files", "id_column", "limit",
                                         "messages_column", "prompt_column"]
    assert identity["output"] == {"include_token_ids": True}

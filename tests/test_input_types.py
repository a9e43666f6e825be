"""Inputs as other tools write them: dictionary-encoded strings (pandas `category`, polars
`Categorical`, `dictionary_encode()`) read as strings. `validate` and `run` accept exactly the
same inputs (inputs.py and reader.rs share one rule)."""

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


def test_the_identity_of_a_single_type_input_is_unchanged(tmp_path, tiny_model_dir):
    """The identity's input and output sections hold the keys they held before: a job
    written before these changes still resumes its output."""
    from eaglebatch.config import load_job
    from eaglebatch.engine import prepare

    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS, "id": IDS}), inp)
    identity = prepare(load_job(write_job(tmp_path, tiny_model_dir, inp, "  id_column: id\n",
                                          "out"))).identity
    assert sorted(identity["input"]) == ["apply_chat_template", "files", "id_column", "limit",
                                         "messages_column", "prompt_column"]
    assert identity["output"] == {"include_token_ids": True}

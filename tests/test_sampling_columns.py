"""input.sampling_columns: a row's non-null values override the job's sampling keys, nulls fall
back to them, a bad value makes that row an error row naming the column while the others are
generated, the mapping is checked against the schema before any work, and resume's identity
covers it. References: runs of the same model with the values set for the whole job."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from eaglebatch.cli import main
from eaglebatch.errors import JobError
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared
from test_runner import random_prompts, run_job

pytest.importorskip("eaglebatch._native")


def job_file(tmp, model, cols: dict, mapping: str, name: str = "cols"):
    inp = tmp / f"{name}-in.parquet"
    pq.write_table(pa.table(cols), inp)
    path = tmp / f"{name}.yaml"
    path.write_text(
        f"model: {model}\ninput:\n  path: {inp}\n  sampling_columns: {mapping}\n"
        f"output:\n  path: {tmp / name}\n  include_token_ids: true\n"
        "sampling:\n  max_new_tokens: 24\nengine:\n  device: cpu\n  kv_cache_tokens: 4096\n"
    )
    return path


def run_cols(tmp, model, cols, mapping, name="cols"):
    run_prepared(prepare(load_job(job_file(tmp, model, cols, mapping, name))))
    return pq.read_table(tmp / name).sort_by("row_index").to_pylist()


def reference(tmp, model, prompts, name, overrides=()):
    table, _ = run_job(tmp, model, prompts, overrides=list(overrides), name=name)
    return table.to_pylist()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, seed=8)


def test_row_values_override_and_nulls_fall_back(tmp_path, tiny_model_dir, prompts):
    greedy = reference(tmp_path, tiny_model_dir, prompts, "greedy")
    hot = reference(tmp_path, tiny_model_dir, prompts, "hot", ["sampling.temperature=0.9"])
    short = reference(tmp_path, tiny_model_dir, prompts, "short", ["sampling.max_new_tokens=3"])
    stop = greedy[2]["output_text"][4:6]
    stopped = reference(tmp_path, tiny_model_dir, prompts, "stopped", [f"sampling.stop=[{stop!r}]"])
    cols = {
        "prompt": prompts,
        "mt": pa.array([3, None, None, 3, None, None], pa.int32()),
        "temp": [None, 0.9, None, None, 0.9, None],
        "st": pa.array([None, None, [stop], None, None, None], pa.list_(pa.string())),
    }
    rows = run_cols(tmp_path, tiny_model_dir, cols, "{max_new_tokens: mt, temperature: temp, "
                    "stop: st}")  # fmt: skip
    want = [short[0], hot[1], stopped[2], short[3], hot[4], greedy[5]]
    for r, w in zip(rows, want, strict=True):
        assert (r["output_token_ids"], r["output_text"]) == (w["output_token_ids"],
                                                            w["output_text"])
    assert rows[1]["output_token_ids"] != greedy[1]["output_token_ids"]  # sampled, not greedy
    assert rows[2]["finish_reason"] == "stop" and len(rows[2]["output_text"]) == 4


def test_a_rows_seed_is_its_own(tmp_path, tiny_model_dir):
    """The same prompt and seed give the same sample at any row index; another seed another."""
    p = "the cat sat on the mat"
    cols = {"prompt": [p] * 4, "temp": [1.0] * 4, "sd": pa.array([7, 9, 7, None], pa.int64())}
    rows = run_cols(tmp_path, tiny_model_dir, cols, "{temperature: temp, seed: sd}")
    ids = [r["output_token_ids"] for r in rows]
    assert ids[0] == ids[2] and ids[0] != ids[1] and ids[3] not in (ids[0], ids[1])


def test_bad_values_are_error_rows_naming_the_column(tmp_path, tiny_model_dir, prompts):
    greedy = reference(tmp_path, tiny_model_dir, prompts, "greedy")
    cols = {
        "prompt": prompts,
        "mt": pa.array([-1, None, 0, None, None, 40], pa.int64()),
        "temp": [None, -0.5, None, None, None, None],
        "tk": pa.array([None, None, None, -3, None, None], pa.int32()),
        "mn": pa.array([None, None, None, None, None, 30], pa.int32()),
    }
    mapping = "{max_new_tokens: mt, temperature: temp, top_k: tk, min_new_tokens: mn}"
    rows = run_cols(tmp_path, tiny_model_dir, cols, mapping)
    errors = {0: "'mt'", 1: "'temp'", 2: "'mt'", 3: "'tk'"}
    for i, r in enumerate(rows):
        if i in errors:
            assert r["finish_reason"] == "error" and errors[i] in r["error"], r["error"]
        else:
            assert r["error"] is None
    assert rows[4]["output_token_ids"] == greedy[4]["output_token_ids"]
    assert rows[5]["output_tokens"] >= 30  # min 30 of at most 40: EOS masked until then


@pytest.mark.parametrize("cols, mapping, message", [
    ({"prompt": ["a"]}, "{temperature: temp}", "input.sampling_columns.temperature: column "
     "'temp' not found"),
    ({"prompt": ["a"], "temp": ["hot"]}, "{temperature: temp}",
     "input.sampling_columns.temperature: column 'temp' in .* has type string, expected a "
     "number"),
    ({"prompt": ["a"], "mt": [1.5]}, "{max_new_tokens: mt}", "expected an integer"),
    ({"prompt": ["a"]}, "{temprature: temp}", "unknown key.*temprature"),
])  # fmt: skip
def test_the_mapping_is_checked_before_any_work(tmp_path, tiny_model_dir, cols, mapping,
                                                message):
    path = job_file(tmp_path, tiny_model_dir, cols, mapping)
    with pytest.raises(JobError, match=message):
        prepare(load_job(path))
    r = CliRunner().invoke(main, ["run", str(path)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert not (tmp_path / "cols").exists() or not any((tmp_path / "cols").glob("part-*"))


def test_the_mapping_is_part_of_the_jobs_identity(tmp_path, tiny_model_dir):
    cols = {"prompt": ["a"], "t1": [0.5], "t2": [0.5]}
    ids = [prepare(load_job(job_file(tmp_path, tiny_model_dir, cols, m))).identity
           for m in ("{}", "{temperature: t1}", "{temperature: t2}")]  # fmt: skip
    assert "sampling_columns" not in ids[0]["input"]
    assert ids[1]["input"]["sampling_columns"] == {"temperature": "t1"}
    assert ids[1] != ids[2]


def test_per_row_logprobs(tmp_path, tiny_model_dir, prompts):
    cols = {"prompt": prompts[:3], "lp": pa.array([2, None, 4], pa.int32())}
    rows = run_cols(tmp_path, tiny_model_dir, cols, "{logprobs: lp}")
    assert rows[1]["logprobs"] is None
    for r, k in ((rows[0], 2), (rows[2], 4)):
        assert len(r["logprobs"]) == r["output_tokens"]
        assert all(len(e["top_logprobs"]) == k for e in r["logprobs"])


def test_tiny_sampling_values_are_refused_not_a_crash(tmp_path, tiny_model_dir, prompts):
    """A job key under the documented minimum (or lost as an f32) is exit 2 naming the key; a
    row's 1e-40 temperature is that row's error while the other rows generate."""
    from support.cli import cli, finish, rows

    path = job_file(tmp_path, tiny_model_dir, {"prompt": prompts[:3]}, "{}", name="job")
    for key, value in [("sampling.temperature", "1e-38"), ("sampling.temperature", "1e-40"),
                       ("sampling.temperature", "5e-6"), ("sampling.repetition_penalty", "1e-45"),
                       ("sampling.top_p", "1e-300")]:  # fmt: skip
        out = finish(cli("validate", str(path), "--set", f"{key}={value}"), status=2)
        assert key in out and "Traceback" not in out, out
    out = finish(cli("run", str(path), "--set", "sampling.temperature=1e-38"), status=2)
    assert "sampling.temperature" in out and "1e-5" in out and "Traceback" not in out, out
    greedy = reference(tmp_path, tiny_model_dir, prompts[:3], "greedy")
    cols = {"prompt": prompts[:3], "temp": [None, 1e-40, 1e-38], "rp": [1e-45, None, None]}
    path = job_file(tmp_path, tiny_model_dir, cols, "{temperature: temp, "
                    "repetition_penalty: rp}", name="rows")  # fmt: skip
    finish(cli("run", str(path)))
    got = rows(tmp_path / "rows")
    assert [r["finish_reason"] for r in got] == ["error", "error", "error"], got
    assert "'rp'" in got[0]["error"] and "'temp'" in got[1]["error"], got
    cols = {"prompt": prompts[:3], "temp": [None, 1e-40, 0.0]}
    path = job_file(tmp_path, tiny_model_dir, cols, "{temperature: temp}", name="rows2")
    finish(cli("run", str(path)))
    got = rows(tmp_path / "rows2")
    assert got[1]["finish_reason"] == "error" and "1e-5" in got[1]["error"], got[1]
    assert "'temp'" in got[1]["error"]
    for i in (0, 2):
        assert got[i]["error"] is None
        assert got[i]["output_token_ids"] == greedy[i]["output_token_ids"]


def test_a_rows_overrides_are_checked_together(tmp_path, tiny_model_dir, prompts):
    """Job min_new_tokens 2 and a row's max_new_tokens 1 with min_new_tokens 0: valid
    together, so the row generates one token; max_new_tokens 1 alone is the row's error."""
    cols = {"prompt": prompts[:2], "mt": pa.array([1, 1], pa.int32()),
            "mn": pa.array([0, None], pa.int32())}  # fmt: skip
    path = job_file(tmp_path, tiny_model_dir, cols, "{max_new_tokens: mt, min_new_tokens: mn}")
    run_prepared(prepare(load_job(path, ["sampling.min_new_tokens=2"])))
    got = pq.read_table(tmp_path / "cols").sort_by("row_index").to_pylist()
    assert got[0]["error"] is None and len(got[0]["output_token_ids"]) == 1, got[0]
    assert got[1]["finish_reason"] == "error" and "'mt'" in got[1]["error"], got[1]
    assert "min_new_tokens (2)" in got[1]["error"]


INT_TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(),
             pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()]  # fmt: skip
FLOAT_TYPES = [pa.float16(), pa.float32(), pa.float64()]


def test_every_numeric_column_type_is_read(tmp_path, tiny_model_dir, prompts):
    """A max_new_tokens column of each integer width (and dictionary-encoded) limits the
    output; a temperature column of each float width (and dictionary-encoded) at 0 gives the
    job's greedy output, at 0.5 its sampled one: no type is read as null."""
    greedy = reference(tmp_path, tiny_model_dir, prompts[:2], "greedy")
    hot = reference(tmp_path, tiny_model_dir, prompts[:2], "hot", ["sampling.temperature=0.5"])
    cols: dict = {"prompt": prompts[:2]}
    mapping = []
    for i, t in enumerate(INT_TYPES):
        cols[f"i{i}"] = pa.array([2 + i, 2 + i], t)
    cols["idict"] = pa.array([3, 3], pa.int64()).dictionary_encode()
    for i, t in enumerate(FLOAT_TYPES):
        cols[f"f{i}"] = pa.array([0.0, 0.5], t)
    cols["fdict"] = pa.array([0.0, 0.5]).dictionary_encode()
    for col in [f"f{i}" for i in range(len(FLOAT_TYPES))] + ["fdict"]:  # float16 first
        mapping.append((f"float-{col}", f"{{temperature: {col}}}", col))
    for col in [f"i{i}" for i in range(len(INT_TYPES))] + ["idict"]:
        mapping.append((f"int-{col}", f"{{max_new_tokens: {col}}}", col))
    for name, m, col in mapping:
        path = job_file(tmp_path, tiny_model_dir, cols, m, name=name)
        checked = CliRunner().invoke(main, ["validate", str(path)])
        assert checked.exit_code == 0, checked.output
        run_prepared(prepare(load_job(path)))
        got = pq.read_table(tmp_path / name).sort_by("row_index").to_pylist()
        assert all(r["error"] is None for r in got), (col, got)
        if name.startswith("int-"):
            want = cols[col].to_pylist()[0] if col != "idict" else 3
            assert [len(r["output_token_ids"]) for r in got] == [want, want], col
        else:
            assert got[0]["output_token_ids"] == greedy[0]["output_token_ids"], col
            assert got[1]["output_token_ids"] == hot[1]["output_token_ids"], col


def test_stop_token_id_lists_of_any_integer_spelling_stop_alike(tmp_path, tiny_model_dir, prompts):
    """A stop_token_ids column whose items are int8 or dictionary-encoded stops rows where the
    int64 list does (the Python check and the Rust reader read the items by one rule)."""
    ref = reference(tmp_path, tiny_model_dir, prompts[:3], "ids-ref", ["sampling.ignore_eos=true"])
    first = [r["output_token_ids"][1] for r in ref]  # each row's second token ends it
    spellings = {
        "plain": pa.array([[t] for t in first], pa.list_(pa.int64())),
        "narrow": pa.array([[t] for t in first], pa.large_list(pa.int16())),
        "dict": pa.array([[t] for t in first], pa.list_(pa.dictionary(pa.int8(), pa.int32()))),
    }
    for name, col in spellings.items():
        cols = {"prompt": prompts[:3], "st": col}
        path = job_file(tmp_path, tiny_model_dir, cols, "{stop_token_ids: st}", name=name)
        path.write_text(path.read_text().replace("max_new_tokens: 24\n",
                                                 "max_new_tokens: 24\n  ignore_eos: true\n"))
        checked = CliRunner().invoke(main, ["validate", str(path)])
        assert checked.exit_code == 0, checked.output
        run_prepared(prepare(load_job(path)))
        got = pq.read_table(tmp_path / name).sort_by("row_index").to_pylist()
        want = [r["output_token_ids"][: r["output_token_ids"].index(t) + 1]
                for r, t in zip(ref, first)]  # fmt: skip
        assert [g["output_token_ids"] for g in got] == want, name
        assert [g["stop_token_id"] for g in got] == first, name

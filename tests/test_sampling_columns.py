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
from eaglebatch.config import JobError, load_job
from eaglebatch.engine import prepare, run_prepared
from test_engine import random_prompts, run_job

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

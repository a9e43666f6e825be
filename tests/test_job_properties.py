"""Property: whatever the input table and job file, `eaglebatch run` either fails fast (exit 2,
one clear message, nothing generated) or writes exactly one row per input row."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from eaglebatch.cli import main
from support.tiny import make_tiny_model

pytest.importorskip("eaglebatch._native")


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("prop-llama"), hidden_size=32, num_layers=1, num_heads=2,
        num_kv_heads=1,
    )


prompt = st.one_of(
    st.none(),
    st.just(""),
    st.text(max_size=20),
    st.integers(300, 700).map(lambda n: "x" * n),  # longer than the KV budget or the context
)
ids = st.one_of(
    st.none(),  # no id column
    st.lists(st.one_of(st.none(), st.integers(0, 6))).map(lambda v: pa.array(v, pa.int64())),
    st.lists(st.sampled_from(["a", "b", "c", "d", "e"])).map(lambda v: pa.array(v, pa.string())),
    st.lists(st.floats(0, 1)).map(lambda v: pa.array(v, pa.float64())),  # mistyped
)


@st.composite
def input_tables(draw, broken: bool):
    """(table, has_id_column). `broken` also draws mistyped / misnamed columns."""
    prompts = draw(st.lists(prompt, max_size=10))
    name = draw(st.sampled_from(["prompt", "prompt", "text"])) if broken else "prompt"
    cols = {name: pa.array(prompts, pa.string())}
    id_col = draw(ids if broken else ids.filter(lambda a: a is None or a.type != pa.float64()))
    if id_col is not None:
        values, n = id_col.to_pylist(), len(prompts)
        cycled = (values * n)[:n] if values else [None] * n
        cols["id"] = pa.array(cycled, id_col.type)
    if broken and draw(st.integers(0, 9)) == 0:
        cols["prompt"] = pa.array(range(len(prompts)), pa.int64())  # mistyped prompt column
    return pa.table(cols), id_col is not None


valid_keys = {
    "sampling.max_new_tokens": st.integers(1, 4),
    "sampling.temperature": st.sampled_from([0, 0.7]),
    "sampling.top_p": st.sampled_from([1.0, 0.5]),
    "sampling.top_k": st.integers(0, 3),
    "sampling.stop": st.sampled_from([[], ["a"], ["\n", "b"]]),
    "engine.max_batch_size": st.integers(1, 5),
    "engine.kv_cache_tokens": st.sampled_from([8, 64, 512]),
    "engine.block_size": st.sampled_from([1, 4, 16]),
    "engine.max_model_len": st.sampled_from([2, 32, 512]),
    "output.part_rows": st.integers(1, 4),
    "input.limit": st.sampled_from([0, 3, 100]),
}
invalid_keys = {
    "sampling.max_new_tokens": st.sampled_from([-1, 0, "many"]),
    "sampling.temperature": st.sampled_from([-0.5, "hot", ".inf"]),
    "sampling.top_p": st.sampled_from([0, 1.5]),
    "sampling.top_k": st.just(-1),
    "sampling.stop": st.sampled_from([[""], "a"]),
    "engine.max_batch_size": st.just(0),
    "engine.kv_cache_tokens": st.just(0),
    "engine.block_size": st.just(0),
    "engine.max_model_len": st.sampled_from([1, 1000]),
    "engine.attention_backend": st.sampled_from(["bogus", "flashinfer"]),
    "output.part_rows": st.just(0),
    "input.limit": st.just(-1),
    "engine.colour": st.just("blue"),  # unknown key
}


@st.composite
def job_settings(draw, broken: bool):
    """--set overrides: valid values, plus (when `broken`) one or two invalid ones."""
    keys = draw(st.fixed_dictionaries({}, optional=valid_keys))
    if broken:
        bad = draw(st.lists(st.sampled_from(sorted(invalid_keys)), max_size=2, unique=True))
        keys.update({k: draw(invalid_keys[k]) for k in bad})
    return keys


def run_cli(model: Path, table: pa.Table, has_ids: bool, keys: dict, tmp: Path,
            not_parquet: bool = False):
    inp = tmp / "in.parquet"
    if not_parquet:
        inp.write_text("id,prompt\n1,hi\n")
    else:
        pq.write_table(table, inp)
    job = tmp / "job.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {inp}\n"
        + ("  id_column: id\n" if has_ids else "")
        + f"output:\n  path: {tmp / 'out'}\nsampling:\n  max_new_tokens: 3\n"
        "engine:\n  device: cpu\n  kv_cache_tokens: 256\n"
    )
    sets = [a for k, v in keys.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    r = CliRunner().invoke(main, ["run", str(job), *sets])
    event(f"exit {r.exit_code}")
    assert "Traceback" not in r.output, r.output
    return r


def check_one_row_per_input_row(out: Path, table: pa.Table, keys: dict) -> None:
    limit = keys.get("input.limit")
    n = table.num_rows if limit is None else min(limit, table.num_rows)
    rows = pq.read_table(out).to_pylist()
    assert sorted(r["row_index"] for r in rows) == list(range(n))
    for row in rows:
        if row["finish_reason"] == "error":
            assert row["error"] and row["output_tokens"] == 0
        else:
            assert row["error"] is None and row["output_tokens"] >= 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=input_tables(broken=False), keys=job_settings(broken=False))
def test_valid_job_writes_one_row_per_input_row(small_model, data, keys):
    table, has_ids = data
    tmp = Path(tempfile.mkdtemp(prefix="eb-prop-"))
    try:
        r = run_cli(small_model, table, has_ids, keys, tmp)
        assert r.exit_code == 0, (r.output, r.exc_info)
        check_one_row_per_input_row(tmp / "out", table, keys)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=input_tables(broken=True), keys=job_settings(broken=True),
       missing_model=st.integers(0, 9).map(lambda i: i == 0),
       not_parquet=st.integers(0, 9).map(lambda i: i == 0))
def test_any_job_fails_fast_or_writes_one_row_per_input_row(small_model, data, keys,
                                                             missing_model, not_parquet):
    table, has_ids = data
    tmp = Path(tempfile.mkdtemp(prefix="eb-prop-"))
    try:
        model = tmp / "no-model" if missing_model else small_model
        r = run_cli(model, table, has_ids, keys, tmp, not_parquet)
        if r.exit_code == 2:
            assert r.output.startswith("error: ") and len(r.output.strip()) > 10, r.output
            assert not list((tmp / "out").glob("part-*")), "failed after writing rows"
            return
        assert r.exit_code == 0, (r.output, r.exc_info)
        check_one_row_per_input_row(tmp / "out", table, keys)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

"""Generated junk (job files, tokenizer files, config files, Parquet inputs with corrupted bytes):
every `eaglebatch run` ends with exit 0 or 2, never a traceback, never a partial visible part."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from eaglebatch.cli import main
from support.tiny import write_prompts

pytest.importorskip("eaglebatch._native")

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=6,
)


def job_text(model: Path, inp: Path, out: Path) -> str:
    return (
        f"model: {model}\ninput:\n  path: {inp}\noutput:\n  path: {out}\n  part_rows: 2\n"
        "sampling:\n  max_new_tokens: 3\nengine:\n  device: cpu\n  kv_cache_tokens: 1024\n"
    )


def run_and_check(job: Path, out: Path) -> None:
    r = CliRunner().invoke(main, ["run", str(job)])
    assert r.exit_code in (0, 2), (r.exit_code, r.output, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exc_info
    assert "Traceback" not in r.output
    for part in out.glob("part-*.parquet"):  # every visible part is complete
        pq.read_table(part)


def flip(data: bytes, positions: list[int], values: list[int]) -> bytes:
    b = bytearray(data)
    for p, v in zip(positions, values):
        b[p % len(b)] = v
    return bytes(b)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("junk-inputs")
    return write_prompts(d / "in.parquet", ["hello", "a longer prompt", "x"])


@SETTINGS
@given(st.lists(st.integers(0, 1 << 20), min_size=1, max_size=6),
       st.lists(st.integers(0, 255), min_size=6, max_size=6), st.booleans())
def test_corrupted_parquet_input(tiny_model_dir, positions, values, truncate):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        inp = tmp / "in.parquet"
        pq.write_table(pa.table({"prompt": [f"prompt {i}" for i in range(40)]}), inp,
                       row_group_size=10)
        data = flip(inp.read_bytes(), positions, values)
        inp.write_bytes(data[: positions[0] % len(data)] if truncate else data)
        job = tmp / "job.yaml"
        job.write_text(job_text(tiny_model_dir, inp, tmp / "out"))
        run_and_check(job, tmp / "out")


@SETTINGS
@given(st.sampled_from(["flip", "truncate", "value"]), st.integers(0, 1 << 20),
       st.integers(0, 255), JSON_VALUES)
def test_junk_tokenizer_file(tiny_model_dir, inputs, how, pos, byte, value):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        shutil.copytree(tiny_model_dir, model)
        f = model / "tokenizer.json"
        data = f.read_bytes()
        if how == "flip":
            f.write_bytes(flip(data, [pos], [byte]))
        elif how == "truncate":
            f.write_bytes(data[: pos % len(data)])
        else:
            tok = json.loads(data)
            keys = sorted(tok)
            tok[keys[pos % len(keys)]] = value
            f.write_text(json.dumps(tok))
        job = tmp / "job.yaml"
        job.write_text(job_text(model, inputs, tmp / "out"))
        run_and_check(job, tmp / "out")


@SETTINGS
@given(st.sampled_from(["hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "vocab_size", "intermediate_size",
                        "max_position_embeddings", "rms_norm_eps", "rope_theta",
                        "rope_scaling", "tie_word_embeddings", "eos_token_id", "bos_token_id",
                        "head_dim", "model_type", "architectures", "torch_dtype"]), JSON_VALUES)
def test_junk_config_value(tiny_model_dir, inputs, key, value):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        shutil.copytree(tiny_model_dir, model)
        cfg = json.loads((model / "config.json").read_text())
        cfg[key] = value
        (model / "config.json").write_text(json.dumps(cfg))
        job = tmp / "job.yaml"
        job.write_text(job_text(model, inputs, tmp / "out"))
        run_and_check(job, tmp / "out")


@SETTINGS
@given(st.integers(0, 10_000), st.binary(max_size=40), st.booleans())
def test_junk_job_file(tiny_model_dir, inputs, pos, junk, replace):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = job_text(tiny_model_dir, inputs, tmp / "out").encode()
        pos %= len(text)
        end = pos + len(junk) if replace else pos
        job = tmp / "job.yaml"
        job.write_bytes(text[:pos] + junk + text[end:])
        run_and_check(job, tmp / "out")


RESULTS_PATHS = st.one_of(
    st.sampled_from(["job.yaml", "in.jsonl", "data/in.jsonl", "data/r.jsonl", "out/r.jsonl",
                     "out/_r.jsonl", "afile/r.jsonl", "afile", "mine.jsonl", "r.jsonl", "out",
                     "new/dir/r.jsonl", "~/r.jsonl", "data", ".", "../r.jsonl", "./job.yaml"]),
    st.text(st.sampled_from("ab./_~-"), min_size=1, max_size=8),
)  # fmt: skip


@SETTINGS
@given(results=st.one_of(st.none(), RESULTS_PATHS), inp=st.sampled_from(
    ["in.jsonl", "data", "data/*.jsonl", "*.jsonl", "**/*.jsonl"]), twice=st.booleans())
@example(results=None, inp="**/*.jsonl", twice=True)  # the glob reaches out/_results.jsonl
def test_junk_results_path(tiny_model_dir, results, inp, twice):
    """Whatever output.results_path says: exit 0 or 2, no traceback, no file eaglebatch did not
    write is changed, and a finished run's results file has one line per request."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "data").mkdir()
        line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": "hi", "max_tokens": 2}})  # fmt: skip
        for f in ("in.jsonl", "data/in.jsonl"):
            (tmp / f).write_text(line + "\n")
        (tmp / "afile").write_text("a file")
        (tmp / "mine.jsonl").write_text("the user's\n")
        res = "" if results is None else f"  results_path: {json.dumps(results)}\n"
        job = tmp / "job.yaml"
        job.write_text(f"model: {tiny_model_dir}\ninput:\n  path: '{inp}'\n  format: openai-batch\n"
                       f"output:\n  path: out\n  format: openai-batch\n{res}"
                       "engine:\n  device: cpu\n  kv_cache_tokens: 1024\n")  # fmt: skip
        before = {p: p.read_bytes() for p in tmp.rglob("*") if p.is_file()}
        for _ in range(2 if twice else 1):
            r = CliRunner().invoke(main, ["run", str(job)], env={"HOME": str(tmp / "home")})
            assert r.exit_code in (0, 2), (r.exit_code, r.output, r.exc_info)
            assert "Traceback" not in r.output
        for p, data in before.items():
            assert p.read_bytes() == data, f"{p} was changed"
        if r.exit_code == 0 and results is None:  # the input's lines (mine.jsonl: an error line)
            got = (tmp / "out" / "_results.jsonl").read_text().splitlines()
            # in.jsonl, data/in.jsonl, mine.jsonl: one line each, as the pattern reads them
            # (never out/_results.jsonl itself, which `**/*.jsonl` would reach)
            files = {"in.jsonl": 1, "data": 1, "data/*.jsonl": 1, "*.jsonl": 2, "**/*.jsonl": 3}
            assert len(got) == files[inp] and all("custom_id" in json.loads(t) for t in got)


NUMERIC_TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(),
                 pa.uint32(), pa.uint64(), pa.float16(), pa.float32(), pa.float64()]  # fmt: skip
FLOAT_KEYS = ["temperature", "top_p", "repetition_penalty", "frequency_penalty",
              "presence_penalty"]  # fmt: skip
INT_KEYS = ["max_new_tokens", "min_new_tokens", "top_k", "seed", "logprobs"]
EXTREME = st.one_of(
    st.none(), st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-40, 1e-38, 5e-6, 1e-5, 1.0, 1e6, 1e7, 2.0, -2.0,
                     65504.0, 2**63, -(2**63), 2**64]),
)  # fmt: skip


def _column(values: list, t: pa.DataType) -> pa.Array:
    """`values` as type `t` where they fit (out-of-range / non-finite ones become null for an
    integer type, as a producer with that type could not write them)."""
    if pa.types.is_integer(t):
        lo, hi = (0, 2 ** t.bit_width - 1) if pa.types.is_unsigned_integer(t) else (
            -(2 ** (t.bit_width - 1)), 2 ** (t.bit_width - 1) - 1)  # fmt: skip
        ok = [None if v is None or v != v or v in (float("inf"), float("-inf"))
              or not lo <= int(v) <= hi else int(v) for v in values]  # fmt: skip
        return pa.array(ok, t)
    if pa.types.is_float16(t):
        import numpy as np

        arr = np.array([np.nan if v is None else v for v in values], np.float64)
        with np.errstate(over="ignore"):
            return pa.array(arr.astype(np.float16), mask=np.array([v is None for v in values]))
    return pa.array(values, t)


@SETTINGS
@given(key=st.sampled_from(FLOAT_KEYS + INT_KEYS), t=st.sampled_from(NUMERIC_TYPES),
       values=st.lists(EXTREME, min_size=1, max_size=4), dictionary=st.booleans())
def test_junk_sampling_column(tiny_model_dir, key, t, values, dictionary):
    """A sampling column of any numeric type holding extreme values: exit 0 or 2 (a type the key
    cannot take, refused by name), never a traceback; a run writes one row per input row, a
    value the sampler cannot compute being that row's error."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        col = _column(values, t)
        if dictionary:
            col = col.dictionary_encode()
        table = pa.table({"prompt": [f"p{i}" for i in range(len(values))], "v": col})
        pq.write_table(table, tmp / "in.parquet")
        job = tmp / "job.yaml"
        text = job_text(tiny_model_dir, tmp / "in.parquet", tmp / "out")
        job.write_text(text.replace("output:", f"  sampling_columns: {{{key}: v}}\noutput:")
                       .replace("sampling:\n", "sampling:\n  temperature: 0.5\n"))  # fmt: skip
        r = CliRunner().invoke(main, ["run", str(job)])
        assert r.exit_code in (0, 2), (r.exit_code, r.output, r.exc_info)
        assert "Traceback" not in r.output
        if key in INT_KEYS and pa.types.is_floating(t):
            assert r.exit_code == 2 and "sampling_columns" in r.output, r.output
            return
        assert r.exit_code == 0, r.output
        stored = pq.read_table(tmp / "in.parquet").column("v").to_pylist()
        got = pq.read_table(tmp / "out").sort_by("row_index").column("finish_reason").to_pylist()
        assert [f == "error" for f in got] == [not valid(key, v) for v in stored], (stored, got)


def valid(key: str, v) -> bool:
    """The documented rule for one row's value of `key` (job max_new_tokens 3): a float key's
    nonzero value must also be a normal float32 (the sampler's type)."""
    if v is None:
        return True
    if key in FLOAT_KEYS:
        f32 = v == 0 or 1.1754943508222875e-38 <= abs(v) <= 3.4028234663852886e38
        rng = {"temperature": v == 0 or 1e-5 <= v <= 1e6, "top_p": 0 < v <= 1,
               "repetition_penalty": 1e-5 <= v <= 1e6}.get(key, -2 <= v <= 2)  # fmt: skip
        return f32 and rng
    i32, i64 = 2**31 - 1, 2**63 - 1
    lo, hi = {"max_new_tokens": (1, i32), "min_new_tokens": (0, 3), "top_k": (0, i32),
              "seed": (0, i64), "logprobs": (0, 20)}[key]  # fmt: skip
    return lo <= v <= hi


@SETTINGS
@given(bom=st.booleans(), crlf=st.booleans(), blank=st.booleans(), n=st.integers(1, 4))
def test_junk_batch_line_endings(tiny_model_dir, bom, crlf, blank, n):
    """An OpenAI Batch file with a UTF-8 BOM, CRLF line endings or blank lines: every request is
    generated under its custom_id."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                             "body": {"prompt": f"hi {i}", "max_tokens": 2}}) for i in range(n)]
        sep = "\r\n" if crlf else "\n"
        text = (sep * 2 if blank else sep).join(lines) + sep
        (tmp / "in.jsonl").write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
        job = tmp / "job.yaml"
        job.write_text(f"model: {tiny_model_dir}\ninput:\n  path: {tmp / 'in.jsonl'}\n"
                       f"output:\n  path: {tmp / 'out'}\n  format: openai-batch\n"
                       "engine:\n  device: cpu\n  kv_cache_tokens: 1024\n")  # fmt: skip
        r = CliRunner().invoke(main, ["run", str(job)])
        assert r.exit_code == 0, r.output
        got = [json.loads(t) for t in (tmp / "out" / "_results.jsonl").read_text().splitlines()]
        assert sorted(g["custom_id"] for g in got) == [f"c{i}" for i in range(n)]
        assert all(g["response"]["status_code"] == 200 for g in got), got

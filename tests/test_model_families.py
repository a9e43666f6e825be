"""Qwen3 (per-head q/k norms, head_dim apart from hidden / heads), Gemma 3 (its sliding
layers see the last 8 positions; prompts and outputs run far past that) and Gemma 4 (full
layers with their own head dim and KV heads, K = V and proportional RoPE; and an E2B-like
shape with per-layer embeddings and layers sharing earlier layers' KV caches) end to end
against transformers' greedy `generate` on tiny random models: the CPU fast path (native
GEMMs, and for Qwen3 native decoder layers) and torch's layers, several batch sizes,
speculative decoding with a random EAGLE-3 head in the published format, the uniform
(CUDA-graph) steps run eagerly on the CPU, prefix caching with chunked prefill and
preemptions, and prompt logprobs."""

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
    "gemma4": dict(
        model_type="gemma4_text", sliding_window=8, hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=0, final_logit_softcapping=30.0, tie_word_embeddings=False,
    ),
    "gemma4_e2b": dict(
        model_type="gemma4_text", sliding_window=8, hidden_activation="gelu_pytorch_tanh",
        num_layers=4, global_head_dim=32, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=320, num_kv_shared_layers=2, use_double_wide_mlp=True,
        layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=True,
    ),
}  # fmt: skip
HF_CLASSES = {"qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
              "gemma4": "Gemma4ForCausalLM", "gemma4_e2b": "Gemma4ForCausalLM"}  # fmt: skip


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(model folder, transformers' greedy tokens of PROMPTS on it, of SHARED on it, the
    transformers model)."""
    import torch
    import transformers

    path = make_tiny_model(tmp_path_factory.mktemp(request.param),
                           **{**SHAPE, **FAMILIES[request.param]})  # fmt: skip
    hf_cls = getattr(transformers, HF_CLASSES[request.param])
    hf = hf_cls.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, [hf_greedy(hf, p) for p in PROMPTS], [hf_greedy(hf, p) for p in SHARED], hf


PROMPTS = random_prompts(9, seed=11)
SHARED = ["the cat sat on the mat " * 2 + p for p in random_prompts(6, seed=12)]


def tokens(tmp, model_dir, overrides=()) -> list[list[int]]:
    table, _ = run_job(tmp, model_dir, PROMPTS, overrides=overrides)
    return table.column("output_token_ids").to_pylist()


@pytest.mark.parametrize("gemm", ["native", "torch"])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_equals_transformers(tmp_path, family, gemm, batch):
    model_dir, reference, _, _ = family
    got = tokens(tmp_path, model_dir, [f"engine.cpu_gemm={gemm}", f"engine.max_batch_size={batch}"])
    assert got == reference


def test_speculative_with_an_eagle3_head_equals_transformers(tmp_path, family):
    model_dir, reference, _, _ = family
    head = init_random_draft(tmp_path / "head", model_dir, kind="eagle3", seed=3,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    for k in (1, 3):
        got = tokens(tmp_path / f"k{k}", model_dir,
                     [f"draft={head}", f"speculative.num_steps={k}", "speculative.adaptive=false",
                      "engine.max_batch_size=4"])  # fmt: skip
        assert got == reference


def test_graph_steps_equal_transformers(tmp_path, family):
    """The uniform (CUDA-graph) steps, run eagerly on the CPU (Gemma: their window masks)."""
    model_dir, reference, _, _ = family
    head = init_random_draft(tmp_path / "head", model_dir, kind="eagle3", seed=4,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    for name, extra in (("plain", []), ("spec", [f"draft={head}", "speculative.adaptive=false"])):
        prep = _job(tmp_path, model_dir, PROMPTS, name, ["engine.max_batch_size=4", *extra])
        got, res = _outputs(prep, build_worker(prep, graph_mode="eager"))
        assert res.stats["cuda_graphs"]["replays"] > 0
        assert got == [r[:GRAPH_MAX_NEW] for r in reference]  # greedy: a prefix of the longer


def test_prefix_cache_chunked_prefill_and_preemption_equal_transformers(tmp_path, family):
    """Prompts sharing a prefix (served from the cache), prefilled in chunks of 16 tokens, in
    a KV cache so small that rows are preempted and recomputed."""
    model_dir, _, reference, _ = family
    table, res = run_job(tmp_path, model_dir, SHARED, wrap=ReaderWaitSpy,
                         overrides=["engine.max_num_batched_tokens=16",
                                    "engine.kv_cache_tokens=192", "engine.max_batch_size=8"])
    assert res.stats["preemptions"] > 0
    assert sum(table.column("cached_tokens").to_pylist()) > 0
    assert table.column("output_token_ids").to_pylist() == reference


def test_prompt_logprobs_equal_transformers(tmp_path, family):
    """Every prompt token's logprob within 1e-4 of log_softmax of transformers' logits."""
    import torch

    model_dir, _, _, hf = family
    table, _ = run_job(tmp_path, model_dir, SHARED[:3],
                       overrides=["output.prompt_logprobs=1", "engine.max_num_batched_tokens=16"])
    for row, prompt in zip(table.to_pylist(), SHARED[:3], strict=True):
        ids = byte_tokenizer().encode(prompt).ids
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        got = [e["logprob"] for e in row["prompt_logprobs"]]
        want = [ref[j, ids[j + 1]].item() for j in range(len(ids) - 1)]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


def test_auto_backend_avoids_flashinfer_for_layers_of_several_head_shapes(family, request):
    """Gemma 4's full layers have their own head dim: flashinfer cannot serve it."""
    from eaglebatch.job.engine_settings import _uniform_heads

    name = request.node.callspec.params["family"]
    assert _uniform_heads(family[0]) == ("global_head_dim" not in FAMILIES[name])


def test_gemma4_multimodal_checkpoint_runs_its_text_tower(tmp_path):
    """A `gemma4` checkpoint (Gemma4ForConditionalGeneration, tensors under
    model.language_model.*) generates as transformers does on text prompts."""
    import shutil

    import torch
    import transformers

    text_dir = make_tiny_model(tmp_path / "text", **{**SHAPE, **FAMILIES["gemma4_e2b"]})
    text = transformers.Gemma4ForCausalLM.from_pretrained(str(text_dir), dtype=torch.float32)
    config = transformers.Gemma4Config(text_config=text.config.to_dict(), vision_config=None,
                                       audio_config=None)  # fmt: skip
    mm = transformers.Gemma4ForConditionalGeneration(config).eval()
    mm.model.language_model.load_state_dict(text.model.state_dict())
    mm_dir = tmp_path / "mm"
    mm.save_pretrained(str(mm_dir))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(text_dir / name, mm_dir / name)
    got = tokens(tmp_path, mm_dir)
    assert got == [hf_greedy(mm, p) for p in PROMPTS]


@pytest.mark.parametrize("key, value", [("enable_moe_block", True),
                                        ("use_bidirectional_attention", "all")])  # fmt: skip
def test_gemma4_refusals_exit_2_naming_the_key(tmp_path, key, value):
    import json

    from click.testing import CliRunner

    from eaglebatch.cli import main
    from support.tiny import write_prompts

    model = make_tiny_model(tmp_path / "m", **{**SHAPE, **FAMILIES["gemma4"]})
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, key: value}))
    inp = write_prompts(tmp_path / "in.parquet", ["hello"])
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {model}\ninput:\n  path: {inp}\noutput:\n  path: {tmp_path / 'o'}\n")
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 2 and key in r.output and "Traceback" not in r.output

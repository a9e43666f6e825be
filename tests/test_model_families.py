"""Every family but the Llama-like ones of tests/test_llama.py (Qwen3: per-head q/k norms,
head_dim apart from hidden / heads; Gemma 3 and OLMo 3: sliding layers that see the last 8
positions, prompts and outputs running far past that; OLMo 2: post-norm) end to end against
transformers' greedy `generate` on tiny random models written by transformers here: the CPU
fast path (native GEMMs, and native decoder layers where they fit) and torch's layers, several
batch sizes, speculative decoding with random EAGLE-3 heads in every published layout, the
uniform (CUDA-graph) steps run eagerly on the CPU, prefix caching with chunked prefill and
preemption, prompt logprobs, train-draft, and in one test overlapped steps, n samples,
output logprobs (raw and processed), JSON-schema output and scoring."""

from __future__ import annotations

import json

import pytest

from eaglebatch.runner import build_worker
from eaglebatch.speculative import init_random_draft
from eaglebatch.train.trainer import train_draft
from support.draft_layouts import FLAGS, set_flags, to_layout
from support.spies import ReaderWaitSpy
from support.tiny import byte_tokenizer, make_tiny_model
from test_graphs import MAX_NEW as GRAPH_MAX_NEW
from test_graphs import _job, _outputs
from test_runner import hf_greedy, random_prompts, run_job

pytest.importorskip("eaglebatch._native")

MINISTRAL3_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.5,
                   "original_max_position_embeddings": 8}  # fmt: skip
# YaRN, and queries scaled by 1 + 0.5 log(1 + floor(pos / 8)): the scale changes every 8
# positions
MINISTRAL3_ROPE = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                   "llama_4_scaling_beta": 0.5, "original_max_position_embeddings": 8}  # fmt: skip
SHAPE = dict(num_layers=3, head_dim=24, hidden_size=64, num_heads=4, num_kv_heads=2)
FAMILIES = {
    "qwen3": dict(model_type="qwen3"),
    # 4 experts of 32, 2 per token, renormalised; layer 1 dense (mlp_only_layers)
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    # not renormalised; every other layer routed (decoder_sparse_step 2: layer 1)
    "qwen3_moe_unnormed": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, decoder_sparse_step=2),
    # 4 experts of 32, 2 per token, not renormalised, a shared expert of 48 behind its sigmoid
    # gate; q/k/v biases; layer 2 dense
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      mlp_only_layers=[2]),
    # 4 experts of intermediate_size, 2 per token, weights applied in float32; tied
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                    tie_word_embeddings=True),
    # sinks; sliding (last 8 positions) and full layers; YaRN x4 over 32 positions,
    # untruncated; 4 biased experts of 128, 2 per token, behind a biased top-k router; a
    # SwiGLU limit low enough to clamp
    "gpt_oss": dict(
        model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 32,
                         "rope_theta": 150000.0},
    ),
    "gemma3": dict(
        model_type="gemma3_text", sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        hidden_activation="gelu_pytorch_tanh",
    ),
    # post-norm layers, q/k norms over the whole projection; linearly scaled RoPE
    "olmo2": dict(model_type="olmo2",
                  rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    # OLMo 2's layers, sliding (last 8 positions, their own RoPE base) and full (YaRN);
    # tied embeddings
    "olmo3": dict(
        model_type="olmo3", sliding_window=8, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                               "original_max_position_embeddings": 32},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    ),
    # layer 1 goes without RoPE and sees the last 8 positions (transformers derives its
    # layer_types from use_sliding_window and the no-RoPE layers)
    "smollm3": dict(
        model_type="smollm3", no_rope_layers=[1, 0, 1], use_sliding_window=True, sliding_window=8,
        tie_word_embeddings=True, pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    ),
    "granite": dict(
        model_type="granite", embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.015625, logits_scaling=8.0, attention_bias=True,
    ),
    "ministral3": dict(model_type="ministral3", rope_parameters=MINISTRAL3_ROPE),
    # its sliding layers see the last 8 positions
    "ministral": dict(model_type="ministral", sliding_window=8,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # fused qkv_proj and gate_up_proj checkpoint tensors; RoPE over the first half of each head
    "phi3": dict(model_type="phi3", partial_rotary_factor=0.5, pad_token_id=None),
    # Phi-4-mini's published layout: 3/4 of each head of 16 rotated, longrope (the short
    # factors, its attention factor: 2048 / 512 extends the length 4x) capped at 512 positions;
    # tied
    "phi4_mini": dict(
        model_type="phi3", head_dim=16, partial_rotary_factor=0.75, tie_word_embeddings=True,
        pad_token_id=None, max_position_embeddings=2048, original_max_position_embeddings=512,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.6, 3.4, 5.0],
                      "long_factor": [2.0, 3.0, 4.5, 6.0, 9.0, 12.0]},
    ),
    # full layers with their own head dim and one KV head, K = V, proportional RoPE
    "gemma4": dict(
        model_type="gemma4_text", sliding_window=8, hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=0, final_logit_softcapping=30.0, tie_word_embeddings=False,
    ),
    # E2B-like: per-layer embeddings, the last two layers reading earlier layers' KV caches
    "gemma4_e2b": dict(
        model_type="gemma4_text", sliding_window=8, hidden_activation="gelu_pytorch_tanh",
        num_layers=4, global_head_dim=32, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=320, num_kv_shared_layers=2, use_double_wide_mlp=True,
        layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=True,
    ),
    # 26B-A4B-like: 4 experts of 32 beside each dense MLP, 2 per token (scaled router, scale
    # per expert); sliding and full layers
    "gemma4_moe": dict(
        model_type="gemma4_text", sliding_window=8, hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        global_head_dim=32, hidden_size_per_layer_input=0, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=32, tie_word_embeddings=True,
    ),
}  # fmt: skip
# the families whose experts run as grouped GEMMs on CUDA (gpt-oss's have biases: the
# per-expert loop)
MOE_FAMILIES = [n for n, f in FAMILIES.items() if "num_experts" in f or "num_local_experts" in f]
GROUPED_GEMM_FAMILIES = [n for n in MOE_FAMILIES if FAMILIES[n]["model_type"] != "gpt_oss"]
HF_MODELS = {}  # model folder -> its transformers model (float32, eval)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(model folder, transformers' greedy tokens of `prompts` on it, transformers' model)."""
    import torch
    import transformers

    path = make_tiny_model(tmp_path_factory.mktemp(request.param),
                           **{**SHAPE, **FAMILIES[request.param]})  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    HF_MODELS[path] = hf.eval()
    return path, [hf_greedy(hf, p) for p in PROMPTS]


PROMPTS = random_prompts(9, seed=11)
# prompts whose first blocks are the same tokens: the prefix cache serves them
SHARED = ["the cat sat on the mat " * 3 + p for p in PROMPTS[:6]]


@pytest.fixture(scope="module")
def family_hf(family):
    """transformers' model of the family's checkpoint."""
    return HF_MODELS[family[0]]


def tokens(tmp, model_dir, overrides=()) -> list[list[int]]:
    table, _ = run_job(tmp, model_dir, PROMPTS, overrides=overrides)
    return table.column("output_token_ids").to_pylist()


@pytest.mark.parametrize("gemm", ["native", "torch"])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_equals_transformers(tmp_path, family, gemm, batch):
    model_dir, reference = family
    got = tokens(tmp_path, model_dir, [f"engine.cpu_gemm={gemm}", f"engine.max_batch_size={batch}"])
    assert got == reference


def test_speculative_with_an_eagle3_head_equals_transformers(tmp_path, family):
    model_dir, reference = family
    head = init_random_draft(tmp_path / "head", model_dir, kind="eagle3", seed=3,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    for k in (1, 3):
        got = tokens(tmp_path / f"k{k}", model_dir,
                     [f"draft={head}", f"speculative.num_steps={k}", "speculative.adaptive=false",
                      "engine.max_batch_size=4"])  # fmt: skip
        assert got == reference


@pytest.mark.parametrize("layout", ["speculators", "modelopt"])
def test_speculative_with_a_foreign_layout_head_equals_transformers(tmp_path, family, layout):
    """A head in the speculators / ModelOpt layout, every EAGLE-3 flag on."""
    model_dir, reference = family
    ours = init_random_draft(tmp_path / "ours", model_dir, kind="eagle3", seed=5,
                             draft_vocab_size=200, aux_layer_ids=(0, 1, 2))  # fmt: skip
    set_flags(ours, **dict.fromkeys(FLAGS, True))
    head = to_layout(ours, tmp_path / layout, layout, SHAPE["num_layers"])
    got = tokens(tmp_path / "k3", model_dir,
                 [f"draft={head}", "speculative.num_steps=3", "speculative.adaptive=false",
                  "engine.max_batch_size=4"])  # fmt: skip
    assert got == reference


def test_graph_steps_equal_transformers(tmp_path, family):
    """The uniform (CUDA-graph) steps, run eagerly on the CPU (Gemma: their window masks)."""
    model_dir, reference = family
    head = init_random_draft(tmp_path / "head", model_dir, kind="eagle3", seed=4,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    for name, extra in (("plain", []), ("spec", [f"draft={head}", "speculative.adaptive=false"])):
        prep = _job(tmp_path, model_dir, PROMPTS, name, ["engine.max_batch_size=4", *extra])
        got, res = _outputs(prep, build_worker(prep, graph_mode="eager"))
        assert res.stats["cuda_graphs"]["replays"] > 0
        assert got == [r[:GRAPH_MAX_NEW] for r in reference]  # greedy: a prefix of the longer


@pytest.mark.parametrize("family", GROUPED_GEMM_FAMILIES, indirect=True)
def test_grouped_gemm_experts_equal_transformers(tmp_path, family, monkeypatch):
    """The routed experts on CUDA's path (two grouped GEMMs over stacked weights,
    model/moe_grouped.py) forced onto the CPU, the per-expert loop unused: greedy at batch 4
    and the uniform (CUDA-graph) steps equal transformers'."""
    from eaglebatch.model import moe_grouped
    from eaglebatch.model.moe import SparseMoeBlock

    model_dir, reference = family
    monkeypatch.setattr(moe_grouped, "ON_CPU", True)
    monkeypatch.setattr(SparseMoeBlock, "_grouped", None)  # calling it would raise
    got = tokens(tmp_path, model_dir, ["engine.cpu_gemm=torch", "engine.max_batch_size=4"])
    assert got == reference
    prep = _job(tmp_path, model_dir, PROMPTS, "graphs", ["engine.max_batch_size=4"])
    got, res = _outputs(prep, build_worker(prep, graph_mode="eager"))
    assert res.stats["cuda_graphs"]["replays"] > 0
    assert got == [r[:GRAPH_MAX_NEW] for r in reference]


def test_train_draft_trains_a_head_for_the_family(tmp_path, family):
    """`eaglebatch train-draft` on the family's target: the head starts from the target's
    final norm as it acts (Gemma's (1 + w)), and the trained head's speculative output equals
    transformers' greedy output."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from rich.console import Console

    from eaglebatch.model import CausalLM
    from eaglebatch.train.job import load_train_job
    from eaglebatch.train.trainer import init_head

    model_dir, reference = family
    inp = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": random_prompts(24, seed=5)}), inp)
    job_file = tmp_path / "train.yaml"
    job_file.write_text(
        f"model: {model_dir}\ninput:\n  path: {inp}\noutput:\n  path: {tmp_path / 'head'}\n"
        "data:\n  holdout_rows: 4\n  num_prompts: 12\n  max_new_tokens: 8\n  max_batch_size: 8\n"
        "head:\n  draft_vocab_size: 64\n  aux_layer_ids: [0, 1, 2]\n"
        "train:\n  epochs: 1\n  batch_tokens: 256\n  unroll: 2\n  warmup_steps: 1\n"
        "  val_sequences: 2\n"
    )
    job = load_train_job(job_file)
    target = CausalLM.from_pretrained(model_dir)
    probe = load_train_job(job_file, [f"output.path={tmp_path / 'probe'}"])
    head = init_head(probe, target, model_dir, list(range(64)), (0, 1, 2))
    x = torch.randn(3, target.config.hidden_size)
    torch.testing.assert_close(head.norm(x), target.model.norm(x), rtol=1e-5, atol=1e-5)
    out = train_draft(job, Console(stderr=True))
    got = tokens(tmp_path / "spec", model_dir, [f"draft={out}", "speculative.num_steps=3",
                                                "speculative.adaptive=false"])  # fmt: skip
    assert got == reference


@pytest.mark.parametrize("gemm", ["native", "torch"])
def test_prefix_cache_chunks_and_preemption_equal_transformers(tmp_path, family, family_hf, gemm):
    """Prompts sharing their first blocks (served from the prefix cache), computed in chunks
    of 16 tokens, with a KV cache so short that rows are preempted and recomputed: greedy
    output still equals transformers'."""
    model_dir, _ = family
    reference = [hf_greedy(family_hf, p) for p in SHARED]
    over = [f"engine.cpu_gemm={gemm}", "engine.max_num_batched_tokens=16",
            "engine.kv_cache_tokens=256", "engine.max_batch_size=6"]  # fmt: skip
    table, res = run_job(tmp_path, model_dir, SHARED, overrides=over, wrap=ReaderWaitSpy)
    assert res.stats["preemptions"] > 0
    assert sum(table.column("cached_tokens").to_pylist()) > 0
    assert table.column("output_token_ids").to_pylist() == reference


@pytest.mark.parametrize("family", MOE_FAMILIES, indirect=True)
@pytest.mark.parametrize("batch", [1, 8])
def test_moe_32_tokens_on_8_prompts_with_caching_chunks_and_preemption(tmp_path, family,
                                                                       family_hf, batch):
    """Issue 60's statement for each mixture-of-experts family: greedy 32 new tokens on 8
    prompts (sharing their first blocks) equal transformers' at batch 1 and 8, on the native
    CPU path with prefix caching, 16-token prefill chunks and, at batch 8, a KV cache so
    short that rows are preempted and recomputed."""
    model_dir, _ = family
    prompts = ["the cat sat on the mat " * 3 + p for p in PROMPTS[:8]]
    reference = [hf_greedy(family_hf, p, max_new=32) for p in prompts]
    over = ["engine.cpu_gemm=native", "engine.max_num_batched_tokens=16",
            "engine.kv_cache_tokens=256", f"engine.max_batch_size={batch}",
            "sampling.max_new_tokens=32"]  # fmt: skip
    table, res = run_job(tmp_path, model_dir, prompts, overrides=over, wrap=ReaderWaitSpy)
    assert sum(table.column("cached_tokens").to_pylist()) > 0
    assert batch == 1 or res.stats["preemptions"] > 0
    assert table.column("output_token_ids").to_pylist() == reference


def test_prompt_logprobs_equal_transformers(tmp_path, family, family_hf):
    """Every prompt token's logprob within 1e-4 of log_softmax of transformers' logits."""
    import torch

    model_dir, _ = family
    over = ["output.prompt_logprobs=3", "engine.max_num_batched_tokens=16"]  # in chunks
    table, _ = run_job(tmp_path, model_dir, PROMPTS[:4], overrides=over)
    for row, prompt in zip(table.to_pylist(), PROMPTS[:4], strict=True):
        ids = byte_tokenizer().encode(prompt).ids
        with torch.inference_mode():
            ref = torch.log_softmax(family_hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        entries = row["prompt_logprobs"]
        assert [e["token_id"] for e in entries] == ids[1:]
        for j, e in enumerate(entries):
            assert abs(e["logprob"] - ref[j, ids[j + 1]].item()) < 1e-4
            assert [t["token_id"] for t in e["top_logprobs"]] == ref[j].topk(3).indices.tolist()


def test_granite_multipliers_on_native_layers_equal_transformers(tmp_path):
    """Granite with residual_multiplier 1 fits the native decoder layers (its attention scale is
    the layer's, the embedding and logits multipliers sit outside the layers): still exact."""
    import torch
    import transformers

    from eaglebatch.cpu.decoder import native_layers_fit
    from eaglebatch.model.config import ModelConfig

    granite = {**FAMILIES["granite"], "residual_multiplier": 1.0}
    path = make_tiny_model(tmp_path / "m", **SHAPE, **granite)
    assert native_layers_fit(ModelConfig.from_dir(path))
    hf = transformers.GraniteForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    reference = [hf_greedy(hf, p) for p in PROMPTS]
    got = tokens(tmp_path, path, ["engine.cpu_gemm=native", "engine.max_batch_size=4"])
    assert got == reference


def test_auto_backend_avoids_flashinfer_for_layers_of_several_head_shapes(family, request):
    """Gemma 4's full layers have their own head dim: flashinfer cannot serve it."""
    from eaglebatch.job.engine_settings import uniform_heads
    from eaglebatch.model.config import ModelConfig

    name = request.node.callspec.params["family"]
    cfg = ModelConfig.from_dir(family[0])
    assert uniform_heads(cfg) == ("global_head_dim" not in FAMILIES[name])


@pytest.mark.parametrize("name", ["gemma4_e2b", "gemma4_moe"])
def test_gemma4_multimodal_checkpoint_runs_its_text_tower(tmp_path, name):
    """A `gemma4` checkpoint (Gemma4ForConditionalGeneration, tensors under
    model.language_model.*; 26B-A4B ships so, its experts too) generates as transformers
    does on text prompts."""
    import shutil

    import torch
    import transformers

    text_dir = make_tiny_model(tmp_path / "text", **{**SHAPE, **FAMILIES[name]})
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


@pytest.mark.parametrize("name, key, value", [("gemma4_moe", "top_k_experts", 8),
                                              ("gemma4", "use_bidirectional_attention", "all")])
def test_gemma4_refusals_exit_2_naming_the_key(tmp_path, name, key, value):
    import json

    from click.testing import CliRunner

    from eaglebatch.cli import main
    from support.tiny import write_prompts

    model = make_tiny_model(tmp_path / "m", **{**SHAPE, **FAMILIES[name]})
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, key: value}))
    inp = write_prompts(tmp_path / "in.parquet", ["hello"])
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {model}\ninput:\n  path: {inp}\noutput:\n  path: {tmp_path / 'o'}\n")
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 2 and key in r.output and "Traceback" not in r.output


def test_rows_past_a_longrope_cap_are_refused_or_stopped(tmp_path, family):
    """A model whose RoPE serves fewer positions than max_position_embeddings (longrope: its
    short factors, up to original_max_position_embeddings) has max_model_len capped there: a
    longer prompt is an error row, a row reaching the cap stops there ("length"), and the rows
    within it still equal transformers'."""
    import json

    model_dir, reference = family
    raw = json.loads((model_dir / "config.json").read_text())
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) not in ("longrope", "su"):
        pytest.skip("no longrope")
    cap = raw["original_max_position_embeddings"]
    assert cap < raw["max_position_embeddings"]
    near = "x" * (cap - 4)  # 4 positions left: its output stops at the cap
    table, _ = run_job(tmp_path, model_dir, [PROMPTS[0], "y" * (cap + 8), near])
    rows = table.to_pylist()
    assert rows[0]["error"] is None and rows[0]["output_token_ids"] == reference[0]
    assert rows[1]["finish_reason"] == "error"
    assert f"shorter than max_model_len ({cap})" in rows[1]["error"]
    assert rows[2]["error"] is None and rows[2]["finish_reason"] == "length"
    assert rows[2]["prompt_tokens"] + rows[2]["output_tokens"] == cap


# an object of an integer and an enum string, no JSON whitespace: `{"n":99,"c":"blue"}` at most
# 19 tokens, within MAX_NEW
SMALL_SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "c": {"enum": ["red", "blue"]}},
    "required": ["n", "c"], "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}  # fmt: skip
SMALL_FORMAT = {"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL_SCHEMA}}


def run_columns(tmp, model_dir, columns: dict, overrides, name, wrap=None):
    """run_job over the input `columns` (a "prompt" column and others), 4 rows at once -> its
    rows by (row_index, sample_index)."""
    extra = {k: v for k, v in columns.items() if k != "prompt"}
    table, _ = run_job(tmp, model_dir, columns["prompt"], name=name, wrap=wrap, columns=extra,
                       overrides=[*overrides, "engine.max_batch_size=4"])  # fmt: skip
    order = [(c, "ascending") for c in ("row_index", "sample_index")]
    return table.sort_by(order).to_pylist()


def hf_scores(hf, prompt: str, output: list[int]):
    """transformers' logits predicting each of `output` after `prompt`: [len(output), V]."""
    import torch

    ids = byte_tokenizer().encode(prompt).ids
    with torch.inference_mode():
        logits = hf(torch.tensor([ids + output])).logits[0].float()
    return logits[len(ids) - 1 : len(ids) - 1 + len(output)]


def assert_logprobs(row: dict, scores, temperature: float = 1.0) -> None:
    """Each output token's logprob is log_softmax(scores / temperature) at it, within 1e-4."""
    import torch

    ref = torch.log_softmax(scores / temperature, dim=-1)
    assert [e["token_id"] for e in row["logprobs"]] == row["output_token_ids"]
    for j, e in enumerate(row["logprobs"]):
        assert abs(e["logprob"] - ref[j, e["token_id"]].item()) < 1e-4, (j, e, ref[j].max())


def check_greedy_json_rows(rows, reference, hf) -> None:
    """Rows 0, 1 free: transformers' greedy tokens; rows 2, 3 with SMALL_FORMAT: complete,
    valid JSON ended by the grammar; every row's raw logprobs are transformers'."""
    import json

    import jsonschema

    for i, row in enumerate(rows):
        assert_logprobs(row, hf_scores(hf, PROMPTS[i], row["output_token_ids"]))
        if i < 2:
            assert row["output_token_ids"] == reference[i] and row["structured"] is None
        else:
            assert (row["finish_reason"], row["structured"]) == ("stop", "complete"), row
            jsonschema.validate(json.loads(row["output_text"]), SMALL_SCHEMA)


def check_scores(rows, contexts, continuations, hf) -> None:
    """Each pair's logprob is the sum of transformers' log_softmax over the continuation's
    tokens after the context's (a byte tokenizer: the pair's bytes split at the context's
    end), within 1e-4; is_greedy says whether each is transformers' argmax."""
    import torch

    tok = byte_tokenizer()
    for row, ctx, cont in zip(rows, contexts, continuations, strict=True):
        cont_ids = tok.encode(cont).ids
        ref = torch.log_softmax(hf_scores(hf, ctx, cont_ids), dim=-1)
        want = ref[torch.arange(len(cont_ids)), cont_ids]
        assert row["error"] is None and row["num_tokens"] == len(cont_ids)
        assert abs(row["logprob"] - want.sum().item()) < 1e-4, (row, want.sum())
        assert row["is_greedy"] == bool((ref.argmax(-1) == torch.tensor(cont_ids)).all())


def test_overlap_samples_logprobs_scores_and_json_on_the_family(tmp_path, family, family_hf):
    """Overlapped steps with logprobs and a JSON schema on some rows (greedy: transformers'
    tokens and logprobs); n = 2 sampled rows, the same with overlap off, whose processed
    logprobs are transformers' at the temperature; scores of (context, continuation) pairs."""
    from test_overlap import LaunchSpy

    model_dir, reference = family
    prompts = PROMPTS[:4]
    spies = []

    def spy(worker):
        spies.append(LaunchSpy(worker))
        return spies[-1]

    rf = [None, None, *[json.dumps(SMALL_FORMAT)] * 2]
    over = ["engine.overlap=true", "output.logprobs=2",
            "input.sampling_columns={response_format: rf}"]  # fmt: skip
    rows = run_columns(tmp_path, model_dir, {"prompt": prompts, "rf": rf}, over, "greedy", spy)
    assert spies[0].ahead > 0  # steps really were launched ahead of their commit
    check_greedy_json_rows(rows, reference, family_hf)

    sampled = ["sampling.n=2", "sampling.temperature=0.8", "sampling.seed=7",
               "output.logprobs=1", "output.logprobs_mode=processed"]  # fmt: skip
    on = run_columns(tmp_path, model_dir, {"prompt": prompts},
                     [*sampled, "engine.overlap=true"], "on")  # fmt: skip
    off = run_columns(tmp_path, model_dir, {"prompt": prompts},
                      [*sampled, "engine.overlap=false"], "off")  # fmt: skip
    assert [r["output_token_ids"] for r in on] == [r["output_token_ids"] for r in off]
    pairs = [(i, s) for i in range(len(prompts)) for s in (0, 1)]
    assert [(r["row_index"], r["sample_index"]) for r in on] == pairs
    for r in on:
        assert_logprobs(r, hf_scores(family_hf, prompts[r["row_index"]], r["output_token_ids"]),
                        temperature=0.8)  # fmt: skip

    conts = [" the mat", " 42 code", " naïve", "\n— cat"]
    scored = run_columns(tmp_path, model_dir, {"prompt": prompts, "cont": conts},
                         ["task=score", "input.continuation_column=cont"], "score")  # fmt: skip
    check_scores(scored, prompts, conts, family_hf)


# a turn format in gpt-oss's style (its role names and markers, the date, a developer turn
# from a system message), as a checkpoint's chat_template.jinja
HARMONY_STYLE = (
    "{%- if messages[0]['role'] not in ('system', 'user') %}"
    "{{ raise_exception('the first message must be a system or user one') }}{% endif -%}"
    "<|start|>system<|message|>Current date: {{ strftime_now('%Y-%m-%d') }}<|end|>"
    "{%- for m in messages %}<|start|>{{ 'developer' if m['role'] == 'system' else m['role'] }}"
    "<|message|>{{ m['content'] }}<|end|>{% endfor -%}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def test_gpt_oss_chat_jobs_render_the_checkpoints_template(tmp_path):
    """A gpt-oss folder's chat_template.jinja renders chat jobs as transformers'
    apply_chat_template renders it, and the outputs are transformers' greedy tokens."""
    import torch
    import transformers

    path = make_tiny_model(tmp_path / "m", **{**SHAPE, **FAMILIES["gpt_oss"]})
    (path / "chat_template.jinja").write_text(HARMONY_STYLE)
    hf = transformers.GptOssForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in PROMPTS[:3]]  # fmt: skip
    assert all(t.startswith("<|start|>system") and t.endswith("<|start|>assistant")
               for t in texts)  # fmt: skip
    table, _ = run_job(tmp_path, path, PROMPTS[:3], overrides=["input.apply_chat_template=true"])
    assert table.column("output_token_ids").to_pylist() == [hf_greedy(hf, t) for t in texts]

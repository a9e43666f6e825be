"""bf16 and fp16 safetensors checkpoints on the CPU straight from their 16-bit weights
(cpu/half_weights.py, cpu/stored.py) against references that do not share that code: the same
checkpoint loaded into float32 parameters (`engine.weights: dequantized`), and the widening
done by torch."""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglebatch.cpu.gemm import SMALL_GEMM_AVAILABLE
from eaglebatch.cpu.half_weights import half_bytes, half_weights, kept_names
from eaglebatch.cpu.stored import has_stored_weights
from eaglebatch.job.config import load_job
from eaglebatch.model.config import ModelConfig
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared
from support.tiny import make_tiny_model, write_prompts

pytest.importorskip("eaglebatch._native")
native = pytest.mark.skipif(not SMALL_GEMM_AVAILABLE, reason="CPU without AVX-512F / AVX2+FMA")

PROMPTS = ["Hello there", "What is 2+2?", "Name three colours.", "Why is the sky blue?",
           "Count to five", "a", "Write a haiku about rain."]  # fmt: skip


def _sixteen_bit(src, out, dtype: torch.dtype, keep_float32: tuple[str, ...] = ()):
    """A copy of checkpoint folder `src` with every tensor cast to `dtype` (those whose name
    contains one of `keep_float32` left float32), split over two files with an index."""
    shutil.copytree(src, out)
    tensors = load_file(src / "model.safetensors")
    cast = {n: t if any(s in n for s in keep_float32) else t.to(dtype) for n, t in tensors.items()}
    (out / "model.safetensors").unlink()
    names = sorted(cast)
    halves = {"model-1.safetensors": names[::2], "model-2.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: cast[n].contiguous() for n in part}, out / file)
    index = {"weight_map": {n: f for f, part in halves.items() for n in part}}
    (out / "model.safetensors.index.json").write_text(__import__("json").dumps(index))
    return out


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True, seed=3)


def _job(d, model, weights: str, extra: str = ""):
    d.mkdir(parents=True, exist_ok=True)
    job = d / "job.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {write_prompts(d / 'in.parquet', PROMPTS)}\n"
        f"output:\n  path: {d / 'out'}\n  include_token_ids: true\n"
        "sampling:\n  max_new_tokens: 20\nengine:\n  device: cpu\n  dtype: float32\n"
        f"  max_batch_size: 4\n  kv_cache_tokens: 2048\n  weights: {weights}\n{extra}"
    )
    return load_job(job)


def _run(d, model, weights: str, extra: str = ""):
    summary = run_prepared(prepare(_job(d, model, weights, extra)))
    ids = pq.read_table(d / "out").sort_by("row_index").column("output_token_ids").to_pylist()
    return ids, summary.stats["weights"]


def test_kept_names_are_the_2d_sixteen_bit_tensors(tiny_model_dir, tied_model, tmp_path):
    model = _sixteen_bit(tiny_model_dir, tmp_path / "bf16", torch.bfloat16, ("mlp.up_proj",))
    cfg = ModelConfig.from_dir(model)
    names = kept_names(model, cfg)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("norm" in n or "up_proj" in n for n in names)  # 1-D, float32
    sizes = half_bytes(model, cfg)
    assert sizes["lm_head.weight"] == cfg.vocab_size * cfg.hidden_size * 2
    assert has_stored_weights(model, None) and not has_stored_weights(tiny_model_dir, None)
    assert not kept_names(tiny_model_dir, ModelConfig.from_dir(tiny_model_dir))
    # a float32 tied checkpoint with a bf16 lm_head.weight the model does not have
    extra = shutil.copytree(tied_model, tmp_path / "extra")
    t = load_file(extra / "model.safetensors")
    t["lm_head.weight"] = t["model.embed_tokens.weight"].to(torch.bfloat16)
    save_file(t, extra / "model.safetensors")
    assert not has_stored_weights(extra, None)


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_views_widen_to_the_checkpoint_values(tiny_model_dir, tmp_path, dtype):
    """Every weight, read through the kernels' loaders, is torch's float32 widening of the
    stored tensor bit for bit (fp16 subnormals included)."""
    model = _sixteen_bit(tiny_model_dir, tmp_path / "m", dtype)
    stored = {n: t for f in model.glob("*.safetensors") for n, t in load_file(f).items()}
    stored["model.layers.0.mlp.up_proj.weight"][0, :4] = torch.tensor([6e-8, -3e-5, 0.0, -0.0])
    save_file({n: t for n, t in stored.items()}, model / "model-extra.safetensors")
    for f in ("model-1.safetensors", "model-2.safetensors", "model.safetensors.index.json"):
        (model / f).unlink()
    for name, qw in half_weights(model, ModelConfig.from_dir(model)).items():
        want = stored[name].to(torch.float32)
        got = qw.rows(torch.arange(qw.shape[0]))
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name


@native
@pytest.mark.parametrize(("dtype", "tied"), [(torch.bfloat16, False), (torch.float16, True)])
def test_greedy_from_sixteen_bits_equals_the_float32_model(
    tiny_model_dir, tied_model, tmp_path, dtype, tied
):
    """The same tokens as the checkpoint loaded into float32 parameters, from the 16-bit
    weights (a tied LM head reads the embedding's), with the memory estimate counting them at
    2 bytes."""
    src = tied_model if tied else tiny_model_dir
    if tied:  # a tied checkpoint that also stores lm_head.weight (the model ignores it)
        src = shutil.copytree(tied_model, tmp_path / "tied")
        t = load_file(src / "model.safetensors")
        save_file({**t, "lm_head.weight": t["model.embed_tokens.weight"].clone()},
                  src / "model.safetensors")  # fmt: skip
    model = _sixteen_bit(src, tmp_path / "model", dtype)
    want, float32_line = _run(tmp_path / "f32", model, "dequantized")
    got, line = _run(tmp_path / "auto", model, "auto")
    assert got == want
    assert float32_line.startswith("float32") and line.startswith("safetensors 16-bit (")
    assert ("x BF16" if dtype == torch.bfloat16 else "x F16") in line
    weights = ("quantized", "dequantized")
    plans = [prepare(_job(tmp_path / w, model, w)).memory_plan for w in weights]
    cfg = ModelConfig.from_dir(model)
    matrices = sum(half_bytes(model, cfg).values())
    assert plans[1].model_bytes - plans[0].model_bytes == matrices  # 4 bytes -> 2 bytes each


@native
def test_gemma3_and_an_eagle3_head_over_sixteen_bits_equal_the_float32_model(tmp_path):
    """Gemma 3 (scaled embeddings, (1 + w) norms, sliding layers) stored in bf16, plain and with
    a random EAGLE-3 head that reads the target's 16-bit embedding: the float32 load's tokens."""
    from eaglebatch.speculative import init_random_draft

    src = make_tiny_model(
        tmp_path / "gemma", num_layers=3, head_dim=24, hidden_size=64, num_heads=4,
        num_kv_heads=2, model_type="gemma3_text", sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        hidden_activation="gelu_pytorch_tanh",
    )  # fmt: skip
    model = _sixteen_bit(src, tmp_path / "bf16", torch.bfloat16)
    head = init_random_draft(tmp_path / "e3", model, kind="eagle3", draft_vocab_size=200, seed=2,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    want, _ = _run(tmp_path / "f32", model, "dequantized")
    got, line = _run(tmp_path / "auto", model, "auto")
    assert got == want and line.startswith("safetensors 16-bit (")
    spec = f"draft: {head}\nspeculative:\n  num_steps: 3\n"
    got, _ = _run(tmp_path / "spec", model, "auto", spec)
    assert got == want


def _hf_bf16(tmp_path, variant: str):
    """A random transformers checkpoint of test_llama's VARIANTS (or a multimodal Gemma 3)
    saved in bfloat16."""
    import transformers

    from test_llama import VARIANTS

    torch.manual_seed(7)
    if variant == "gemma3_multimodal":
        vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32,
                                                 num_hidden_layers=1, num_attention_heads=2,
                                                 image_size=28, patch_size=14)  # fmt: skip
        cfg = transformers.Gemma3Config(text_config=VARIANTS["gemma3"](), vision_config=vision,
                                        mm_tokens_per_image=4, image_token_index=255,
                                        boi_token_index=253, eoi_token_index=254)  # fmt: skip
        hf = transformers.Gemma3ForConditionalGeneration(cfg)
    else:
        hf = transformers.AutoModelForCausalLM.from_config(VARIANTS[variant]())
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    return tmp_path


@native
@pytest.mark.parametrize("variant", ["llama_tied_3layers", "llama3_rope_bias", "qwen2", "mistral",
                                     "qwen3", "qwen3_bias", "gemma3", "gemma3_multimodal"])
def test_every_family_from_sixteen_bits_equals_its_float32_load(tmp_path, variant):
    """Biases, tied heads, q/k norms, Gemma's norms and a multimodal checkpoint's text tower
    (vision tensors left out): greedy tokens and logits from the 16-bit weights are the
    float32 load's, bit for bit."""
    from eaglebatch.cpu import accelerate
    from eaglebatch.cpu.quantized import use_quantized_weights
    from eaglebatch.model import CausalLM
    from test_llama import Runner, greedy_generate

    path = _hf_bf16(tmp_path, variant)
    cfg = ModelConfig.from_dir(path)
    ref = CausalLM.from_pretrained(path)
    kept = kept_names(path, cfg)
    assert kept and not any("vision" in n or "norm" in n for n in kept)
    ours = CausalLM.from_pretrained(path, skip=kept)
    accelerate(ref, 2)
    accelerate(ours, 2)
    assert set(use_quantized_weights(ours, half_weights(path, cfg), 2)) == kept
    prompts = [list(range(100, 130)), [7, 8, 9], list(range(40, 45))]
    first = [Runner(m, num_blocks=64).step(list(enumerate(prompts))) for m in (ours, ref)]
    assert all(torch.equal(a, b) for a, b in zip(*first, strict=True))
    assert greedy_generate(ours, prompts, 10) == greedy_generate(ref, prompts, 10)

"""Our Llama-family models (Llama, Qwen2, Mistral, Qwen3) against Hugging Face transformers on
tiny random checkpoints."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from eaglebatch.attention import allocate_kv_cache
from eaglebatch.model import CausalLM
from paged_kv import PagedSequences

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
MINISTRAL3_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.5,
                   "original_max_position_embeddings": 8}  # fmt: skip
VARIANTS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "llama_tied_3layers": lambda: transformers.LlamaConfig(
        **{**SMALL, "num_hidden_layers": 3}, tie_word_embeddings=True
    ),
    "llama3_rope_bias": lambda: transformers.LlamaConfig(
        **SMALL, rope_scaling=LLAMA3_ROPE, attention_bias=True, mlp_bias=True, rope_theta=50000.0
    ),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=256, head_dim=32),
    # head_dim independent of hidden / heads (64 / 4 = 16), per-head q/k norms
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=24, tie_word_embeddings=True),
    "qwen3_bias": lambda: transformers.Qwen3Config(**SMALL, head_dim=32, attention_bias=True),
    # YaRN: blended frequencies and cos/sin scaled by its attention factor (Qwen3's long context)
    "qwen3_yarn": lambda: transformers.Qwen3Config(**SMALL, head_dim=32, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "rope_theta": 10000.0}),
    # sliding layers see the last 8 positions (prompts run to 40 tokens), the full one all
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**SMALL, "num_hidden_layers": 3}, head_dim=24, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=20, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
    ),
    # queries scaled by 1 + 0.5 log(1 + floor(pos / 8)) after RoPE (prompts run to 40 tokens)
    "ministral3": lambda: transformers.Ministral3Config(
        **SMALL, head_dim=24, tie_word_embeddings=True, rope_parameters=MINISTRAL3_ROPE),
    "ministral": lambda: transformers.MinistralConfig(
        **{**SMALL, "num_hidden_layers": 3}, head_dim=16, sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
}
BLOCK_SIZE = 4


def make_checkpoint(variant: str, path, **save_kwargs):
    torch.manual_seed(hash(variant) % 1000)
    config = VARIANTS[variant]()
    hf_cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "gemma3_text": transformers.Gemma3ForCausalLM,
        "ministral3": transformers.Ministral3ForCausalLM,
        "ministral": transformers.MinistralForCausalLM,
    }[config.model_type]
    hf = hf_cls(config).eval()
    # HF's init (std 0.02, zero biases, unit norms) gives near-uniform logits whose top two
    # differ by less than float32 noise; unit-scale activations make greedy decoding well posed.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
            elif "norm" in name:
                p.normal_(mean=1.0, std=0.1)
            elif "embed_tokens" in name:
                p.normal_(std=1.0)
            else:  # [out, in] projections
                p.normal_(std=1.5 / p.shape[1] ** 0.5)
    hf.save_pretrained(path, **save_kwargs)
    return hf


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(request.param, path)
    return hf, CausalLM.from_pretrained(path)


class Runner:
    """Drives our model step by step over a paged cache, keeping each sequence's tokens."""

    def __init__(self, model: CausalLM, num_blocks: int = 128) -> None:
        self.model = model
        self.seqs = PagedSequences(num_blocks, BLOCK_SIZE, seed=7)
        self.kv = allocate_kv_cache(model.config, num_blocks, BLOCK_SIZE, model.dtype, "cpu")
        self.tokens: dict[int, list[int]] = {}

    @torch.inference_mode()
    def step(self, batch: list[tuple[int, list[int]]], capture=()):
        """Appends tokens and returns the logits of every new token, per sequence."""
        for s, toks in batch:
            self.tokens.setdefault(s, []).extend(toks)
        ids, pos, meta = self.seqs.step(batch)
        self.model.backend.prepare(meta)
        out = self.model(ids, pos, meta, self.kv, capture_layers=capture)
        hidden, captured = out if capture else (out, None)
        logits = self.model.compute_logits(hidden)
        cu = meta.cu_seqlens_q.tolist()
        per_seq = [logits[cu[i] : cu[i + 1]] for i in range(len(batch))]
        return (per_seq, captured) if capture else per_seq

    def rollback(self, seq: int, length: int) -> None:
        self.seqs.truncate(seq, length)
        del self.tokens[seq][length:]


@torch.inference_mode()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()  # [len, V]


PROMPTS = [[3, 17, 99, 5, 200], [42], list(range(100, 130)), [7, 7, 7, 8, 9, 10, 11, 250, 1]]


def test_prefill_decode_verify_logits(pair) -> None:
    hf, ours = pair
    run = Runner(ours)
    got = run.step(list(enumerate(PROMPTS)))
    for i, p in enumerate(PROMPTS):
        torch.testing.assert_close(got[i], hf_logits(hf, p), atol=1e-4, rtol=1e-4)

    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # decode, including a step with a subset of sequences in another order
        for batch_ids in ([0, 1, 2, 3], [2, 0]):
            batch = [(s, [int(torch.randint(256, (1,), generator=gen))]) for s in batch_ids]
            got = run.step(batch)
            for (s, _), logits in zip(batch, got, strict=True):
                ref = hf_logits(hf, run.tokens[s])[-1:]
                torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)

    # verify-like: 3 new tokens per sequence on top of its prefix, then reject 2 of them and
    # recompute over the rejected positions
    for _ in range(2):
        batch = [(s, torch.randint(256, (3,), generator=gen).tolist()) for s in range(4)]
        got = run.step(batch)
        for (s, _), logits in zip(batch, got, strict=True):
            ref = hf_logits(hf, run.tokens[s])[-3:]
            torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        for s in range(4):
            run.rollback(s, len(run.tokens[s]) - 2)


def test_captured_hidden_states_match_hf(pair) -> None:
    hf, ours = pair
    layers = hf.config.num_hidden_layers
    capture = (0, 1, layers)
    run = Runner(ours)
    _, captured = run.step(list(enumerate(PROMPTS[:2])), capture=capture)
    with torch.inference_mode():
        ref = [hf(torch.tensor([p]), output_hidden_states=True).hidden_states for p in PROMPTS[:2]]
    for layer in capture:
        expected = torch.cat([r[layer][0] for r in ref])
        torch.testing.assert_close(captured[layer], expected, atol=1e-4, rtol=1e-4)


def greedy_generate(
    ours: CausalLM, prompts: list[list[int]], steps: int
) -> list[list[int]]:
    run = Runner(ours, num_blocks=256)
    out: list[list[int]] = [[] for _ in prompts]
    logits = run.step(list(enumerate(prompts)))
    for _ in range(steps):
        nxt = [int(x[-1].argmax()) for x in logits]
        for i, t in enumerate(nxt):
            out[i].append(t)
        if len(out[0]) == steps:
            break
        logits = run.step([(i, [t]) for i, t in enumerate(nxt)])
    return out


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_generation_matches_hf(pair, batch_size: int) -> None:
    hf, ours = pair
    gen = torch.Generator().manual_seed(batch_size)
    lengths = torch.randint(1, 40, (batch_size,), generator=gen).tolist()
    prompts = [torch.randint(256, (n,), generator=gen).tolist() for n in lengths]
    steps = 20
    got = greedy_generate(ours, prompts, steps)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    for p, tokens in zip(prompts, got, strict=True):
        ids = torch.tensor([p])
        # explicit mask: otherwise HF treats prompt tokens equal to pad_token_id as padding
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=steps
        )[0, len(p) :].tolist()
        assert tokens == ref


def test_sharded_checkpoint_loads(tmp_path) -> None:
    hf = make_checkpoint("llama", tmp_path, max_shard_size="100KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    ours = CausalLM.from_pretrained(tmp_path)
    run = Runner(ours)
    got = run.step([(0, PROMPTS[0])])
    torch.testing.assert_close(got[0], hf_logits(hf, PROMPTS[0]), atol=1e-4, rtol=1e-4)


def test_missing_and_unexpected_tensors_are_named(tmp_path) -> None:
    make_checkpoint("llama", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        CausalLM.from_pretrained(tmp_path)
    assert "missing tensors: model.layers.1.self_attn.k_proj.weight" in str(err.value)
    assert "unexpected tensors: model.layers.0.mlp.extra.weight" in str(err.value)


def test_shape_mismatch_and_no_checkpoint(tmp_path) -> None:
    make_checkpoint("llama", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight"):
        CausalLM.from_pretrained(tmp_path)
    os.remove(file)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        CausalLM.from_pretrained(tmp_path)


def test_bfloat16_load_casts(tmp_path) -> None:
    make_checkpoint("qwen2", tmp_path)
    ours = CausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    run = Runner(ours)
    got = run.step([(0, PROMPTS[0]), (1, PROMPTS[1])])
    assert got[0].dtype == torch.float32 and torch.isfinite(got[0]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_hf_formula(dtype) -> None:
    from eaglebatch.model.decoder_layer import RMSNorm

    norm = RMSNorm(576, 1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(7, 576) * 3).to(dtype)
    x32 = x.float()
    want = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    torch.testing.assert_close(norm(x), want, atol=1e-6, rtol=1e-6)
    # rows are independent: one row alone gives the bits it gets in a batch
    assert torch.equal(norm(x[3:4])[0], norm(x)[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cast_last_rms_norm_scales_before_the_cast(dtype) -> None:
    """norm_kind "rms_cast_last" (OLMo 2): the weight multiplies in float32, one cast at the
    end; in float32 the same values as RMSNorm, in bfloat16 not (rounded once, not twice)."""
    from types import SimpleNamespace

    from eaglebatch.model.decoder_layer import RMSNorm, make_norm

    norm = make_norm(SimpleNamespace(norm_kind="rms_cast_last", rms_norm_eps=1e-5), 576,
                     dtype=dtype)  # fmt: skip
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(7, 576) * 3).to(dtype)
    x32 = x.float()
    want = norm.weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(norm(x), want.to(dtype), atol=0, rtol=0)
    llama = RMSNorm(576, 1e-5, dtype=dtype)
    llama.load_state_dict(norm.state_dict())
    if dtype == torch.float32:
        torch.testing.assert_close(norm(x), llama(x), atol=1e-6, rtol=1e-6)
    else:
        assert not torch.equal(norm(x), llama(x))


@pytest.mark.parametrize("rows,size", [(1, 576), (4, 576), (130, 64), (3, 37)])
def test_native_rms_norm_matches_torch(rows, size) -> None:
    """The draft heads' native RMSNorm (cpu/norm.py): torch's values to float32 rounding,
    rows independent, and torch's path wherever autograd needs it."""
    from eaglebatch.cpu.norm import use_native_norms
    from eaglebatch.model.decoder_layer import RMSNorm

    norm = RMSNorm(size, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(rows, size) * 3
    with torch.no_grad():
        want = norm(x)
        use_native_norms(norm)
        got = norm(x)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
        assert not torch.equal(got, torch.zeros_like(got))
        assert torch.equal(norm(x[rows - 1 :])[0], got[rows - 1])
        assert torch.equal(norm(x.t().contiguous().t()), got)  # non-contiguous input
    y = x.clone().requires_grad_()
    norm(y).sum().backward()  # torch's path: gradients flow
    assert y.grad is not None and norm.weight.grad is not None
    from eaglebatch import _native

    with pytest.raises(ValueError, match="rms_norm"):
        _native.rms_norm(x.data_ptr(), norm.weight.data_ptr(), x.data_ptr(), 0, size, 1e-5)


def assert_greedy_equals_multimodal(ours: CausalLM, hf) -> None:
    """Our text model's greedy tokens equal the multimodal transformers model's on text."""
    prompts = [list(range(100, 130)), [7, 8, 9]]
    got = greedy_generate(ours, prompts, 12)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    for p, tokens in zip(prompts, got, strict=True):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=12)[0, len(p):].tolist()  # fmt: skip
        assert tokens == ref


def test_the_text_tower_of_a_multimodal_gemma3_checkpoint(tmp_path) -> None:
    """A Gemma3ForConditionalGeneration checkpoint (text tower under language_model.*, a vision
    tower beside it) runs as its text model: greedy tokens equal transformers' on text."""
    torch.manual_seed(5)
    text = VARIANTS["gemma3"]()
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)  # fmt: skip
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=255, boi_token_index=253,
                                    eoi_token_index=254)  # fmt: skip
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and "norm" not in name:
                p.normal_(std=1.0 if "embed_tokens" in name else 1.5 / p.shape[-1] ** 0.5)
    hf.save_pretrained(tmp_path)
    ours = CausalLM.from_pretrained(tmp_path)
    assert ours.config.text_tower and ours.config.model_type == "gemma3_text"
    assert_greedy_equals_multimodal(ours, hf)


def test_the_text_tower_of_a_multimodal_mistral3_checkpoint(tmp_path) -> None:
    """A Mistral3ForConditionalGeneration checkpoint (the text model under language_model.*, a
    Pixtral tower and projector beside it, both skipped) runs as its ministral3 text model: greedy
    tokens equal transformers' on text, the per-position query scale included."""
    torch.manual_seed(6)
    text = transformers.Ministral3Config(**SMALL, head_dim=24, rope_parameters=MINISTRAL3_ROPE)
    vision = transformers.PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        head_dim=16, image_size=28, patch_size=14)  # fmt: skip
    cfg = transformers.Mistral3Config(text_config=text, vision_config=vision,
                                      tie_word_embeddings=False)  # fmt: skip
    hf = transformers.Mistral3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ("language_model" in name or "lm_head" in name) and "norm" not in name:
                p.normal_(std=1.0 if "embed_tokens" in name else 1.5 / p.shape[-1] ** 0.5)
    hf.save_pretrained(tmp_path)
    names = load_file(tmp_path / "model.safetensors").keys()
    # transformers writes the released layout: language_model.model.*, vision_tower.*, ...
    assert any(n.startswith(("vision_tower.", "model.vision_tower.")) for n in names)
    ours = CausalLM.from_pretrained(tmp_path)
    assert ours.config.text_tower and ours.config.model_type == "ministral3"
    assert ours.config.query_position_scale == (0.5, 8)
    assert_greedy_equals_multimodal(ours, hf)

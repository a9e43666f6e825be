"""The gated full attention of Qwen3.5 / Qwen3-Next (decoder_layer.Attention with
`attention_output_gate`, (1 + w) per-head QK norms, partial rotary) against transformers'
Qwen3_5Attention / Qwen3NextAttention, weights copied from them, float32, over paged KV in two
steps (a prefill, then a verify-sized step)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5Attention,
    Qwen3_5TextRotaryEmbedding,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextRotaryEmbedding,
)

from eaglebatch.attention import get_backend
from eaglebatch.model.config import ModelConfig, parse_rope, rotary_dim_of
from eaglebatch.model.decoder_layer import Attention
from eaglebatch.model.rotary import RotaryEmbedding
from paged_kv import PagedSequences

SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
             vocab_size=64, intermediate_size=64, max_position_embeddings=256)  # fmt: skip


# (config, attention, rotary) of each family; Qwen3.5's rotary is multimodal (mrope), which for
# text positions (every section the same position) is plain RoPE
FAMILIES = {"qwen3_5_text": (Qwen3_5TextConfig, Qwen3_5Attention, Qwen3_5TextRotaryEmbedding),
            "qwen3_next": (Qwen3NextConfig, Qwen3NextAttention, Qwen3NextRotaryEmbedding)}


def _configs(head_dim: int, family: str = "qwen3_5_text") -> tuple[object, ModelConfig]:
    hf = FAMILIES[family][0](**SIZES, head_dim=head_dim)
    hf._attn_implementation = "sdpa"
    raw = hf.to_dict()
    theta, scaling = parse_rope(raw, raw["max_position_embeddings"])
    rotary = rotary_dim_of(raw, head_dim)
    assert rotary == head_dim // 4  # partial_rotary_factor 0.25, from rope_parameters
    ours = ModelConfig(
        model_type=family, architecture="", hidden_size=64,
        intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, vocab_size=64, rms_norm_eps=hf.rms_norm_eps, rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=(), bos_token_id=None, torch_dtype=None, norm_kind="rms_plus_one",
        qk_norm="head", rotary_dim=rotary, attention_output_gate=True,
    )  # fmt: skip
    return hf, ours


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head_dim", [32, 256])
def test_gated_attention_equals_transformers(head_dim: int, family: str) -> None:
    torch.manual_seed(0)
    hf_cfg, cfg = _configs(head_dim, family)
    _, attention, rotary = FAMILIES[family]
    ref = attention(hf_cfg, 3).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # the (1 + w) norms too, away from w = 0
    ours = Attention(cfg, 0).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(16, 64)
    want = _reference(ref, rotary(hf_cfg), x)
    got = _paged(ours, cfg, x, split=11)  # a prefill of 11, then 5 tokens (a verify's shape)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _reference(ref: torch.nn.Module, rotary: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(x.shape[0])[None]  # [1, T] text positions
    cos, sin = rotary(x[None], positions)
    with torch.no_grad():
        return ref(x[None], (cos, sin), attention_mask=None)[0][0]


def _paged(ours: Attention, cfg: ModelConfig, x: torch.Tensor, split: int) -> torch.Tensor:
    backend = get_backend("torch")
    _, hkv, d = cfg.heads_of(0)
    backend.configure(cfg.num_attention_heads, hkv, d, torch.float32, torch.float32)
    seqs = PagedSequences(num_blocks=8, block_size=4, seed=1)
    cache = torch.zeros(2, 8, 4, hkv, d)
    rotary = RotaryEmbedding(cfg)
    outs = []
    for part in (slice(0, split), slice(split, x.shape[0])):
        _, positions, meta = seqs.step([(0, [0] * (part.stop - part.start))])
        backend.prepare(meta)
        cos, sin = rotary(positions, torch.float32)
        with torch.no_grad():
            outs.append(ours(x[part], cos, sin, meta, cache, backend))
    return torch.cat(outs)


def test_output_gate_doubles_q_proj_only_where_configured() -> None:
    _, cfg = _configs(32)
    gated = Attention(cfg, 0)
    assert gated.q_proj.out_features == 2 * 4 * 32
    plain = Attention(ModelConfig(**{**cfg.__dict__, "attention_output_gate": False}), 0)
    assert plain.q_proj.out_features == 4 * 32

"""Gemma 3 text models (`gemma3_text`) over packed tokens and a paged KV cache.

What differs from the Llama family (model/llama.py, whose loading, capture and LM head this
reuses): embeddings scaled by sqrt(hidden); RMSNorm computed in float32 and scaled by
(1 + weight); per-head q/k norms; four norms per layer (before and after attention and the MLP);
GeGLU with tanh-approximated GELU; attention scale query_pre_attn_scalar ** -0.5; and layers
of two kinds (`ModelConfig.layer_types`): sliding layers attend to the last `attention_window`
positions (the attention backend masks the rest) with RoPE base `rope_local_theta`, full layers
to every position with `rope_theta` and its scaling. Parameter names are transformers'.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from eaglebatch.attention.base import AttentionBackend, AttentionMetadata
from eaglebatch.model.config import ModelConfig
from eaglebatch.model.llama import Attention, LlamaForCausalLM, _embedding
from eaglebatch.model.rotary import RotaryEmbedding


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, cast back (transformers' Gemma3RMSNorm)."""

    def __init__(self, size: int, eps: float, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class Gemma3Attention(Attention):
    """Llama's attention with Gemma norms on the q/k heads and the layer's window."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, **factory) -> None:
        super().__init__(cfg, layer_idx, **factory)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, **factory)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, **factory)


class GeGLU(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, **factory) -> None:
        super().__init__()
        hidden, inner = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False, **factory)
        self.up_proj = nn.Linear(hidden, inner, bias=False, **factory)
        self.down_proj = nn.Linear(inner, hidden, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, **factory) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, **factory)
        self.self_attn = Gemma3Attention(cfg, layer_idx, **factory)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, **factory)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, **factory)
        self.mlp = GeGLU(cfg, **factory)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, **factory)

    def forward(
        self,
        x: torch.Tensor,  # [T, H] residual stream
        cos: torch.Tensor,  # [T, 1, D] of this layer's kind
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, H]
        a = self.self_attn(self.input_layernorm(x), cos, sin, attn, kv_cache, backend)
        h = x + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None, **factory) -> None:
        super().__init__()
        self.embed_tokens = _embedding(cfg.vocab_size, cfg.hidden_size, **factory)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, **factory) for i in range(cfg.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        device = factory.get("device")
        self.rotary_emb = RotaryEmbedding(cfg, max_positions, device=device)  # full layers
        local = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)
        self.rotary_local = RotaryEmbedding(local, max_positions, device=device)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The Gemma 3 decoder + tied LM head (optionally soft-capped logits); see the module doc."""

    def _build_model(self, cfg: ModelConfig, max_positions: int | None, **factory) -> nn.Module:
        return Gemma3Model(cfg, max_positions, **factory)

    def rotaries(self) -> list[RotaryEmbedding]:
        return [self.model.rotary_emb, self.model.rotary_local]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        h = self.model.embed_tokens(input_ids)
        return h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype)

    def run_layers(self, h, positions, attn, kv_caches, first: int, last: int) -> torch.Tensor:
        """Decoder layers first..last-1 over h [T, H], each with its kind's RoPE."""
        full = self.model.rotary_emb(positions, h.dtype)  # ([T, 1, D], [T, 1, D])
        local = self.model.rotary_local(positions, h.dtype)
        for i in range(first, last):
            cos, sin = local if self.config.window_of(i) is not None else full
            h = self.model.layers[i](h, cos, sin, attn, kv_caches[i], self.backend)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> float32 [N, V]
        logits = self.lm_head_forward(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

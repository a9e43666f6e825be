"""The decoder layer every family shares, over packed tokens and a paged KV cache: its norms,
attention and gated MLP, each shaped by ModelConfig's features (never a family's name).

Parameter names equal those of Hugging Face checkpoints (self_attn.q_proj, mlp.gate_proj,
input_layernorm, ...), so weights load by name. Activations are packed: T tokens of B
sequences in one [T, H] tensor, no padding; where each sequence starts and what it attends to
is in `AttentionMetadata`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eaglebatch.attention.base import AttentionBackend, AttentionMetadata
from eaglebatch.model.config import ModelConfig
from eaglebatch.model.rotary import apply_rotary


class RMSNorm(nn.Module):
    """w * (x / rms(x)): normalised in float32, cast back, then scaled (the HF order)."""

    def __init__(self, size: int, eps: float, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # nothing to cast: one fused op instead of ~8 (a CPU decode step runs 61 norms),
            # the same value as the lines below up to float32 rounding (tests/test_llama.py)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def scale(self) -> torch.Tensor:  # [H]
        """What x / rms(x) is multiplied by (a Llama-style norm initialised from this one)."""
        return self.weight


class PlusOneRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w), in float32, cast back (Gemma's)."""

    def __init__(self, size: int, eps: float, **factory) -> None:
        super().__init__(size, eps, **factory)
        nn.init.zeros_(self.weight)  # (1 + 0): the identity, as transformers initialises it

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)

    def scale(self) -> torch.Tensor:  # [H]
        return 1.0 + self.weight


class CastLastRMSNorm(RMSNorm):
    """(w * (x / rms(x))).to(x.dtype): normalised and scaled in float32, cast back last (OLMo 2's
    order). In float32 it equals RMSNorm; in bfloat16 it rounds once where RMSNorm rounds twice."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * out).to(x.dtype)


_NORMS = {"rms": RMSNorm, "rms_plus_one": PlusOneRMSNorm, "rms_cast_last": CastLastRMSNorm}


def make_norm(cfg: ModelConfig, size: int, **factory) -> nn.Module:
    return _NORMS[cfg.norm_kind](size, cfg.rms_norm_eps, **factory)


def query_position_scale(
    cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:  # int64 [T] -> [T, 1, 1] in `dtype`, None where cfg has none
    """The per-token query factor of `cfg.query_position_scale`: computed in float32 from the
    positions, cast to the activations' dtype (the reference's order)."""
    if cfg.query_position_scale is None:
        return None
    beta, original_max = cfg.query_position_scale
    steps = torch.floor(positions.to(torch.float32) / original_max)  # [T]
    return (1.0 + beta * torch.log(1.0 + steps)).to(dtype).view(-1, 1, 1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, **factory) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.attention_scale
        self.window = cfg.window_of(layer_idx)  # attends to the last `window` positions; None: all
        hidden, q_size = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(hidden, q_size, bias=bias, **factory)
        self.k_proj = nn.Linear(hidden, kv_size, bias=bias, **factory)
        self.v_proj = nn.Linear(hidden, kv_size, bias=bias, **factory)
        self.o_proj = nn.Linear(q_size, hidden, bias=cfg.o_proj_bias, **factory)
        self.qk_norm = cfg.qk_norm  # "head": over each head's D values; "projection": all of q / k
        self.q_norm = self.k_norm = None
        if cfg.qk_norm != "none":
            per_head = cfg.qk_norm == "head"
            self.q_norm = make_norm(cfg, cfg.head_dim if per_head else q_size, **factory)
            self.k_norm = make_norm(cfg, cfg.head_dim if per_head else kv_size, **factory)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor | None,  # [T, 1, D] (None: a layer without RoPE)
        sin: torch.Tensor | None,  # [T, 1, D]
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        backend: AttentionBackend,
        q_scale: torch.Tensor | None = None,  # [T, 1, 1]: query_position_scale's factor
    ) -> torch.Tensor:  # [T, H]
        num_tokens = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [T, Hq*D], [T, Hkv*D] x2
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if q_scale is not None:
            q = q * q_scale  # [T, Hq, D]
        out = backend.forward(
            self.layer_idx, q, k, v, kv_cache, attn, self.scale, window=self.window
        )  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu,
                "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}  # fmt: skip


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)) (SwiGLU with silu, GeGLU with gelu)."""

    def __init__(self, cfg: ModelConfig, **factory) -> None:
        super().__init__()
        hidden, inner, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias, **factory)
        self.up_proj = nn.Linear(hidden, inner, bias=bias, **factory)
        self.down_proj = nn.Linear(inner, hidden, bias=bias, **factory)
        self.act = _ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Attention then the MLP, each a residual block whose norms sit where
    `cfg.norm_layout` says (ModelConfig), its output scaled by `cfg.residual_multiplier`."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, **factory) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.layout = cfg.norm_layout
        self.residual_multiplier = cfg.residual_multiplier
        if self.layout != "post":
            self.input_layernorm = make_norm(cfg, h, **factory)
        self.self_attn = Attention(cfg, layer_idx, **factory)
        self.post_attention_layernorm = make_norm(cfg, h, **factory)
        if self.layout == "sandwich":
            self.pre_feedforward_layernorm = make_norm(cfg, h, **factory)
        self.mlp = MLP(cfg, **factory)
        if self.layout != "pre":
            self.post_feedforward_layernorm = make_norm(cfg, h, **factory)

    def forward(
        self,
        x: torch.Tensor,  # [T, H] residual stream
        cos: torch.Tensor | None,  # [T, 1, D] of this layer's kind; None: no RoPE
        sin: torch.Tensor | None,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        q_scale: torch.Tensor | None = None,  # [T, 1, 1] (Attention.forward)
    ) -> torch.Tensor:  # [T, H]
        if self.layout == "pre":
            a = self.self_attn(self.input_layernorm(x), cos, sin, attn, kv_cache, backend, q_scale)
            h = x + self._scaled(a)
            return h + self._scaled(self.mlp(self.post_attention_layernorm(h)))
        attn_in = x if self.layout == "post" else self.input_layernorm(x)
        a = self.self_attn(attn_in, cos, sin, attn, kv_cache, backend, q_scale)
        h = x + self._scaled(self.post_attention_layernorm(a))
        mlp_in = h if self.layout == "post" else self.pre_feedforward_layernorm(h)
        return h + self._scaled(self.post_feedforward_layernorm(self.mlp(mlp_in)))

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier

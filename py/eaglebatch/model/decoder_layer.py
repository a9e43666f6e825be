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
from eaglebatch.model.gated_deltanet import GatedDeltaNet
from eaglebatch.model.moe import SparseMoeBlock
from eaglebatch.model.recurrent_state import run_linear
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
        if not torch.is_grad_enabled() and self.weight.dtype == x.dtype:
            # one fused op normalises in float32 and rounds once to x's dtype, as the lines
            # below do (up to float32 rounding), without their five [..., H] float32 buffers
            return F.rms_norm(x, self.weight.shape, None, self.eps).mul_(self.weight)
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


class Float32RMSNorm(RMSNorm):
    """x / rms(x) * w, all in float32, cast back (Gemma 4's); without a weight when
    `weighted` is False (its V norm)."""

    def __init__(self, size: int, eps: float, weighted: bool = True, **factory) -> None:
        super().__init__(size, eps, **factory)
        if not weighted:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        x32 = x.float()
        out = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (out if self.weight is None else out * self.weight.float()).type_as(x)


_NORMS = {"rms": RMSNorm, "rms_plus_one": PlusOneRMSNorm, "rms_cast_last": CastLastRMSNorm,
          "rms_float32": Float32RMSNorm}  # fmt: skip


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
    """q, k, v projections, their norms and RoPE, paged attention and o_proj, with the layer's
    own (Hq, Hkv, D) (cfg.heads_of). A layer sharing an earlier layer's KV cache
    (cfg.kv_source) has no k/v projections: it reads this step's K/V from that cache, where
    that layer wrote them, and passes them on (the backend writes the same values again)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, **factory) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.heads_of(layer_idx)
        self.scale = cfg.attention_scale_of(layer_idx)
        self.window = cfg.window_of(layer_idx)  # attends to the last `window` positions; None: all
        hidden, q_size = cfg.hidden_size, self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        bias = cfg.attention_bias
        self.shares_kv = cfg.kv_source(layer_idx) != layer_idx
        self.k_is_v = bool(cfg.k_eq_v_layers and cfg.k_eq_v_layers[layer_idx])
        self.output_gate = cfg.attention_output_gate  # q_proj: per head D query, D gate rows
        q_rows = 2 * q_size if self.output_gate else q_size
        self.q_proj = nn.Linear(hidden, q_rows, bias=bias, **factory)
        if not self.shares_kv:
            self.k_proj = nn.Linear(hidden, kv_size, bias=bias, **factory)
        if not (self.shares_kv or self.k_is_v):
            self.v_proj = nn.Linear(hidden, kv_size, bias=bias, **factory)
        self.o_proj = nn.Linear(q_size, hidden, bias=cfg.o_proj_bias, **factory)
        self.qk_norm = cfg.qk_norm  # "head": over each head's D values; "projection": all of q / k
        self.q_norm = self.k_norm = self.v_norm = None
        if cfg.qk_norm != "none":
            per_head = cfg.qk_norm == "head"
            self.q_norm = make_norm(cfg, self.head_dim if per_head else q_size, **factory)
            if not self.shares_kv:
                self.k_norm = make_norm(cfg, self.head_dim if per_head else kv_size, **factory)
        if cfg.v_norm and not self.shares_kv:
            self.v_norm = Float32RMSNorm(self.head_dim, cfg.rms_norm_eps, weighted=False)
        # [Hq]: each head's sink logit (cfg.attention_sinks), passed to the backend
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, **factory)) if cfg.attention_sinks \
            else None

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
        q, gate = self._query_and_gate(x)  # [T, Hq*D], [T, Hq*D] or None
        if self.qk_norm == "projection":
            q = self.q_norm(q)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        if self.qk_norm == "head":
            q = self.q_norm(q)
        if cos is not None:
            q = self.rotate(q, cos, sin)
        if q_scale is not None:
            q = q * q_scale  # [T, Hq, D]
        if self.shares_kv:  # this step's K/V, as the source layer wrote them: [T, Hkv, D] x2
            k, v = kv_cache.flatten(1, 2).index_select(1, attn.slot_mapping).to(q.dtype).unbind(0)
        else:
            k, v = self._key_value(x, cos, sin)
        out = backend.forward(
            self.layer_idx, q, k, v, kv_cache, attn, self.scale, window=self.window,
            sinks=self.sinks,
        )  # [T, Hq, D]
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))

    def _query_and_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q [T, Hq*D] and, with an output gate, the gate [T, Hq*D] (each head's second half of
        its 2D q_proj rows)."""
        q = self.q_proj(x)  # [T, Hq*D] or [T, Hq*2D]
        if not self.output_gate:
            return q, None
        q, gate = q.view(x.shape[0], self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        return q.reshape(x.shape[0], -1), gate.reshape(x.shape[0], -1)

    def _key_value(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hkv, D] x2
        num_tokens = x.shape[0]
        k = self.k_proj(x)  # [T, Hkv*D]
        v = k if self.k_is_v else self.v_proj(x)  # V is K before its norm and RoPE
        if self.qk_norm == "projection":
            k = self.k_norm(k)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.qk_norm == "head":
            k = self.k_norm(k)
        if self.v_norm is not None:
            v = self.v_norm(v)
        if cos is not None:
            k = self.rotate(k, cos, sin)
        return k, v

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE of q or k [T, H, D] by cos, sin [T, 1, R] (a CPU fast path swaps in here)."""
        return apply_rotary(x, cos, sin)


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu,
                "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}  # fmt: skip


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)) (SwiGLU with silu, GeGLU with gelu)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, **factory) -> None:
        super().__init__()
        hidden, inner, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        if cfg.layer_intermediate_sizes is not None:
            inner = cfg.layer_intermediate_sizes[layer_idx]
        self.gate_proj = nn.Linear(hidden, inner, bias=bias, **factory)
        self.up_proj = nn.Linear(hidden, inner, bias=bias, **factory)
        self.down_proj = nn.Linear(inner, hidden, bias=bias, **factory)
        self.act = _ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate, up = self.gate_proj(x), self.up_proj(x)  # [T, I] each
        if self.act is F.silu and not torch.is_grad_enabled():
            # in place: the same values without two fresh [T, I] buffers (a prefill step's
            # are megabytes each, and on the CPU their page faults cost as much as the maths)
            return self.down_proj(F.silu(gate, inplace=True).mul_(up))
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Attention then the MLP, each a residual block whose norms sit where
    `cfg.norm_layout` says (ModelConfig), its output scaled by `cfg.residual_multiplier`.
    A linear-attention layer (cfg.is_linear) holds a Gated DeltaNet `linear_attn` instead of
    `self_attn`; its `kv_cache` argument is then its LayerStates (model/recurrent_state.py)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, **factory) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.layer_idx = layer_idx
        self.layout = cfg.norm_layout
        self.residual_multiplier = cfg.residual_multiplier
        if self.layout != "post":
            self.input_layernorm = make_norm(cfg, h, **factory)
        self.linear = cfg.is_linear(layer_idx)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg.deltanet, **factory)
        else:
            self.self_attn = Attention(cfg, layer_idx, **factory)
        self.post_attention_layernorm = make_norm(cfg, h, **factory)
        if self.layout == "sandwich":
            self.pre_feedforward_layernorm = make_norm(cfg, h, **factory)
        self.moe = None
        if cfg.is_sparse(layer_idx) and not cfg.moe_beside_dense:
            self.mlp = SparseMoeBlock(cfg, _ACTIVATIONS[cfg.activation], **factory)
        else:
            self.mlp = MLP(cfg, layer_idx, **factory)
        if cfg.is_sparse(layer_idx) and cfg.moe_beside_dense:
            self._add_moe_beside_dense(cfg, **factory)
        if self.layout != "pre":
            self.post_feedforward_layernorm = make_norm(cfg, h, **factory)
        if cfg.per_layer_input_size:  # per-layer embeddings: a third residual block
            p = cfg.per_layer_input_size
            self.per_layer_input_gate = nn.Linear(h, p, bias=False, **factory)
            self.per_layer_projection = nn.Linear(p, h, bias=False, **factory)
            self.post_per_layer_input_norm = make_norm(cfg, h, **factory)
        self.layer_scalar = nn.Parameter(torch.ones(1, **factory)) if cfg.layer_scalar else None

    def _add_moe_beside_dense(self, cfg: ModelConfig, **factory) -> None:
        """The routed experts beside the dense MLP, with the norms of both branches."""
        if self.layout != "sandwich":
            raise ValueError("model config: experts beside the dense MLP need sandwich norms")
        h = cfg.hidden_size
        self.moe = SparseMoeBlock(cfg, _ACTIVATIONS[cfg.activation], **factory)
        self.pre_feedforward_layernorm_2 = make_norm(cfg, h, **factory)
        self.post_feedforward_layernorm_1 = make_norm(cfg, h, **factory)
        self.post_feedforward_layernorm_2 = make_norm(cfg, h, **factory)

    def forward(
        self,
        x: torch.Tensor,  # [T, H] residual stream
        cos: torch.Tensor | None,  # [T, 1, D] of this layer's kind; None: no RoPE
        sin: torch.Tensor | None,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        q_scale: torch.Tensor | None = None,  # [T, 1, 1] (Attention.forward)
        per_layer_input: torch.Tensor | None = None,  # [T, P]: cfg.per_layer_input_size
    ) -> torch.Tensor:  # [T, H]
        h = self._attention_and_mlp(x, cos, sin, attn, kv_cache, backend, q_scale)
        if per_layer_input is not None:  # h + norm(proj(act(gate(h)) * per-layer input))
            gated = self.mlp.act(self.per_layer_input_gate(h)) * per_layer_input  # [T, P]
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h if self.layer_scalar is None else h * self.layer_scalar

    def _mix(self, x, cos, sin, attn, kv_cache, backend, q_scale) -> torch.Tensor:  # [T, H]
        """The token mixer: attention over the KV cache, or the Gated DeltaNet over its states."""
        if self.linear:
            return run_linear(self.linear_attn, x, kv_cache, self.layer_idx)
        return self.self_attn(x, cos, sin, attn, kv_cache, backend, q_scale)

    def _attention_and_mlp(self, x, cos, sin, attn, kv_cache, backend, q_scale) -> torch.Tensor:
        if self.layout == "pre":
            a = self._mix(self.input_layernorm(x), cos, sin, attn, kv_cache, backend, q_scale)
            h = x + self._scaled(a)
            return h + self._scaled(self.mlp(self.post_attention_layernorm(h)))
        attn_in = x if self.layout == "post" else self.input_layernorm(x)
        a = self._mix(attn_in, cos, sin, attn, kv_cache, backend, q_scale)
        h = x + self._scaled(self.post_attention_layernorm(a))
        mlp_in = h if self.layout == "post" else self.pre_feedforward_layernorm(h)
        return h + self._scaled(self.post_feedforward_layernorm(self._feed_forward(h, mlp_in)))

    def _feed_forward(self, h: torch.Tensor, mlp_in: torch.Tensor) -> torch.Tensor:  # [T, H]
        """The MLP of the normed residual; with experts beside it (cfg.moe_beside_dense):
        post_1(mlp(pre(h))) + post_2(experts(pre_2(h))), the router scoring h itself."""
        out = self.mlp(mlp_in)
        if self.moe is None:
            return out
        routed = self.moe(self.pre_feedforward_layernorm_2(h), router_input=h)
        return self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier

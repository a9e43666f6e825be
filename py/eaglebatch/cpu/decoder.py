"""`NativeDecoder`: whole decoder layers on the extension's CPU path
(`rust/src/cpu/decoder_layer.rs`) for the few query rows of CPU decode and verify steps, and the
fast paths of the target (`NativeTargetLayers`) and of an EAGLE draft head (`NativeDraftLayer`)
that run them.

Why: at batch 1 torch spends ~0.1 ms per layer dispatching the small ops around a layer's
GEMMs (norms, RoPE, views, cache writes), ~3 ms of a ~20 ms target forward on this project's
2-core CPU, for plain decoding and for every verify and draft step. One native call per run of
layers does the same math on the same kernels (small GEMM, paged attention) without it.

A step runs natively when the attention backend planned it for the native kernel
(`AttentionBackend.native_plan`: the cpu backend, float32 cache, few query rows per sequence)
and its rows are `eligible` (at most SMALL_GEMM_MAX_ROWS float32 CPU rows, no gradient).
Everything else (prefill, large batches, bf16) runs the model's own torch layers. Every
operation is per row, so a verify step still reproduces the decode step bit for bit; the norms
and SiLU round differently from torch's (tests compare the two).

A NativeDecoder holds the addresses of the layers' tensors (and references, so they stay
alive): `accelerate` drops it, and it is rebuilt on the next eligible step (or when the RoPE
table was rebuilt).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from eaglebatch import _native
from eaglebatch.attention.base import AttentionMetadata, NativeAttentionPlan
from eaglebatch.cpu.gemm import GGML_BF16, GGML_F32, SMALL_GEMM_MAX_ROWS, linear
from eaglebatch.cpu.swap import become, restore
from eaglebatch.cpu.tensors import eligible, native_ptr, native_ptr_or_null
from eaglebatch.model.causal_lm import CausalLM
from eaglebatch.model.config import ModelConfig
from eaglebatch.model.rotary import RotaryEmbedding


def _projections(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A layer's q, k, v, o, gate, up, down projections (the native side's order)."""
    a, m = layer.self_attn, layer.mlp
    return a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj


class NativeDecoder:
    """The decoder layers `layers` (each with input_layernorm or None, self_attn.{q,k,v,o}_proj,
    post_attention_layernorm, mlp.{gate,up,down}_proj) and their RoPE table."""

    def __init__(
        self,
        layers: list[nn.Module],
        rotary: RotaryEmbedding,
        eps: float,
        threads: int,
        given_input: bool = False,
    ) -> None:
        """given_input: the caller always passes the first layer's attention input (EAGLE
        draft layers), whose input_layernorm then plays no part here."""
        self.threads = threads
        self.rope_table = rotary.cos_table  # `current`: the table this object points into
        self._keep: list[torch.Tensor] = []  # every tensor whose address the native side holds
        addrs, types, self.in_features = [], [], []
        int8 = False  # engine.activations: int8, which use_quantized_weights set on block weights
        attn0, mlp0 = layers[0].self_attn, layers[0].mlp
        self.hidden = mlp0.down_proj.out_features
        self.num_kv_heads, self.head_dim = attn0.num_kv_heads, attn0.head_dim
        for layer in layers:
            a = layer.self_attn
            projs = _projections(layer)
            w = [self._weight(p) for p in projs]
            int8 |= any(getattr(getattr(p, "quantized", None), "takes_int8", False) for p in projs)
            norm_in = None if given_input else layer.input_layernorm.weight
            n_in = self._hold(norm_in, (self.hidden,))
            n_post = self._hold(layer.post_attention_layernorm.weight, (self.hidden,))
            biases = [self._hold(p.bias, (p.out_features,)) for p in projs]
            qk = [self._hold(getattr(getattr(a, n, None), "weight", None), (self.head_dim,))
                  for n in ("q_norm", "k_norm")]  # Qwen3's per-head norms; 0: none  # fmt: skip
            addrs.append(
                [n_in, *(p for p, _ in w[:4]), n_post, *(p for p, _ in w[4:]), *biases, *qk]
            )
            types.append([ty for _, ty in w])
            self.in_features.append(a.q_proj.in_features)
        table = (rotary.cos_table.shape[0], self.head_dim)
        cos, sin = self._hold(rotary.cos_table, table), self._hold(rotary.sin_table, table)
        self._decoder = _native.CpuDecoder(
            addrs, types, self.in_features,
            self.hidden, mlp0.gate_proj.out_features,
            attn0.num_heads, attn0.num_kv_heads, attn0.head_dim, eps, attn0.scale,
            cos, sin, table[0], int8,
        )  # fmt: skip

    def _hold(self, t: torch.Tensor | None, shape: tuple[int, ...]) -> int:
        """The address of float32 `t` (a contiguous copy if need be), kept alive here; 0: None."""
        if t is None:
            return 0
        t = t.detach().contiguous()
        self._keep.append(t)
        return native_ptr(t, torch.float32, shape)

    def _weight(self, linear: nn.Linear) -> tuple[int, int]:
        """(address, GGML type number) of the weight the kernel reads: the module's GGUF
        blocks (cpu/quantized.py) or exact bf16 copy (cpu/gemm.py) when it has them, else the
        float32 weight, which must be contiguous."""
        shape = (linear.out_features, linear.in_features)
        blocks = getattr(linear, "quantized", None)
        if blocks is not None:
            self._keep.append(blocks.blocks)
            return blocks.blocks.data_ptr(), blocks.ggml_type  # checked when it was built
        bf16 = getattr(linear, "weight_bf16", None)
        if bf16 is not None:
            self._keep.append(bf16)
            return native_ptr(bf16, torch.bfloat16, shape), GGML_BF16
        w = linear.weight.detach()
        self._keep.append(w)
        return native_ptr(w, torch.float32, shape), GGML_F32

    def current(self, rotary: RotaryEmbedding) -> bool:
        """False once the RoPE table was rebuilt (a longer one): build a new object."""
        return self.rope_table is rotary.cos_table

    def forward(
        self,
        x: torch.Tensor,  # float32 [T, H] residual stream, updated in place
        positions: torch.Tensor,  # int64 [T]
        meta: AttentionMetadata,
        plan: NativeAttentionPlan,  # the attention backend's native_plan(meta)
        kv_caches: list[torch.Tensor],  # the caches of layers first..last
        first: int,
        last: int,
        input: torch.Tensor | None = None,  # float32 [T, in] layer `first`'s attention input
    ) -> None:
        t = x.shape[0]
        x_ptr = native_ptr(x, torch.float32, (t, self.hidden))
        if input is not None:
            input = input.contiguous()
        in_ptr = native_ptr_or_null(input, torch.float32, (t, self.in_features[first]))
        _, num_blocks, block_size = kv_caches[0].shape[:3]
        cache = (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        caches = [native_ptr(c, torch.float32, cache) for c in kv_caches]
        # the Rust side checks every size and index before writing
        self._decoder.forward(
            x_ptr, in_ptr, first, last,
            np.ascontiguousarray(positions.numpy(), dtype=np.int64),
            np.ascontiguousarray(meta.slot_mapping.numpy(), dtype=np.int64),
            plan.cu_seqlens_q, plan.seq_lens, plan.block_tables,
            caches, num_blocks, block_size, self.threads,
        )  # fmt: skip


def _native_decoder(
    model: nn.Module,  # a NativeTargetLayers or NativeDraftLayer
    x: torch.Tensor,  # [T, in] the step's rows
    meta: AttentionMetadata,
    layers: Iterable[nn.Module],
    rotary: RotaryEmbedding,
    eps: float,
    given_input: bool = False,
) -> tuple[NativeDecoder, NativeAttentionPlan] | None:
    """The model's NativeDecoder over `layers` (built on its first native step, rebuilt after
    the RoPE table was) and the step's attention plan, or None where the model's torch layers
    run the step: the backend did not plan it for the native kernel, or x is not eligible."""
    plan = model.backend.native_plan(meta)
    params = (p for layer in layers for p in layer.parameters())  # read in grad mode only
    if plan is None or not eligible(x, SMALL_GEMM_MAX_ROWS, params):
        return None
    native = model.native_decoder
    if native is None or not native.current(rotary):
        native = NativeDecoder(list(layers), rotary, eps, model.small_gemm_threads, given_input)
        model.native_decoder = native
    return native, plan


class NativeLmHead:
    """The fast path of a target whose decoder layers run as torch's (`native_layers_fit` says
    no; swapped in as NativeCausalLM): its LM head on the native GEMM, tied or not, as every other
    linear of it (and a tied head read as stored, cpu/quantized.py) -- one rule for which
    kernel computes a product, so a float32 load and one from GGUF blocks or 16-bit weights
    give the same logits bit for bit."""

    state = ("small_gemm_threads",)
    small_gemm_threads: int

    def lm_head_forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        if self.lm_head is not None:  # a NativeLinear (float32 or GGUF blocks)
            return self.lm_head(hidden)
        weight = self.model.embed_tokens.weight  # tied
        return linear(hidden, weight, threads=self.small_gemm_threads)


class NativeTargetLayers(NativeLmHead):
    """The fast path of a `CausalLM` (swapped in as NativeCausalLM): runs of its
    decoder layers in one native call each, and its LM head on the native GEMM."""

    state = ("small_gemm_threads", "native_decoder")
    small_gemm_threads: int
    native_decoder: NativeDecoder | None

    def run_layers(
        self,
        h: torch.Tensor,  # [T, H] residual stream
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        first: int,
        last: int,
    ) -> torch.Tensor:  # [T, H]
        found = _native_decoder(
            self, h, attn, self.model.layers, self.model.rotary_emb, self.config.rms_norm_eps
        )
        if found is None:
            return super().run_layers(h, positions, attn, kv_caches, first, last)
        native, plan = found
        h = h.clone()  # updated in place; the caller may hold the input (a captured state)
        native.forward(h, positions, attn, plan, kv_caches[first:last], first, last)
        return h


class NativeDraftLayer:
    """The fast path of an EAGLE draft head (speculative/eagle.py, swapped in as
    NativeEagleDraft): its decoder layer in one native call over every row."""

    state = ("small_gemm_threads", "native_decoder")
    small_gemm_threads: int
    native_decoder: NativeDecoder | None

    def run_layer(
        self,
        x: torch.Tensor,  # [T, in] the layer's attention input
        residual: torch.Tensor,  # [T, h]
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        select: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [S or T, h]
        eps = self.config.layer.rms_norm_eps
        found = _native_decoder(self, x, meta, [self.layer], self.rotary_emb, eps, True)
        if found is None:
            return super().run_layer(x, residual, positions, meta, kv_cache, select)
        native, plan = found
        h = residual.to(torch.float32, copy=True).contiguous()  # [T, h] updated in place
        native.forward(h, positions, meta, plan, [kv_cache], 0, 1, input=x)
        return h if select is None else h.index_select(0, select)


def native_layers_fit(cfg: ModelConfig) -> bool:
    """Whether the native decoder layer computes `cfg`'s layers: pre-norm RMSNorm, SiLU, per-head
    or no q/k norms, dense MLPs (no experts), RoPE over every dimension of every layer, full
    attention without sinks or output gate, no multipliers, no per-position query scale
    (rust/src/cpu/decoder_layer.rs implements exactly this)."""
    return (cfg.norm_kind == "rms" and cfg.norm_layout == "pre" and cfg.activation == "silu"
            and cfg.qk_norm in ("none", "head") and cfg.residual_multiplier == 1.0
            and cfg.rope_layers is None and cfg.rope_local_theta is None
            and cfg.rotary_dim is None
            and cfg.query_position_scale is None
            and cfg.layer_head_dims is None and cfg.layer_kv_heads is None
            and cfg.kv_source_layers is None and cfg.k_eq_v_layers is None
            and not (cfg.v_norm or cfg.layer_scalar or cfg.per_layer_input_size)
            and not (cfg.attention_sinks or cfg.attention_output_gate)
            and cfg.layer_intermediate_sizes is None and cfg.num_experts == 0
            and not cfg.linear_layers
            and all(cfg.window_of(i) is None for i in range(cfg.num_hidden_layers)))  # fmt: skip


def use_native_layers(model: nn.Module, threads: int) -> None:
    """Swaps the native decoder layers into `model` -- a CausalLM, or an EAGLE draft
    head (a module with `run_layer`) -- with `threads` GEMM threads, or makes it plain (0)."""
    if threads <= 0:
        restore(model)
    elif isinstance(model, CausalLM) and native_layers_fit(model.config):
        become(model, NativeTargetLayers, small_gemm_threads=threads, native_decoder=None)
    elif isinstance(model, CausalLM):
        # layers the native one does not compute: their linears (cpu/gemm.py) and LM head run
        # natively
        become(model, NativeLmHead, small_gemm_threads=threads)
    elif hasattr(model, "run_layer") and native_layers_fit(model.config.layer):
        become(model, NativeDraftLayer, small_gemm_threads=threads, native_decoder=None)

"""`NativeDecoder`: whole decoder layers on the extension's CPU path
(`rust/src/decoder_layer.rs`) for the few query rows of CPU decode and verify steps.

Why: at batch 1 torch spends ~0.1 ms per layer dispatching the small ops around a layer's
GEMMs (norms, RoPE, views, cache writes), ~3 ms of a ~20 ms target forward on this project's
2-core CPU, for plain decoding and for every verify and draft step. One native call per run of
layers does the same math on the same kernels (small GEMM, paged attention) without it.

A step runs natively when `eligible`: no autograd, at most SMALL_GEMM_MAX_ROWS float32 rows on
the CPU, and an attention step the cpu backend planned for its kernel
(`CpuAttentionBackend.prepare`: float32 cache, few query rows per sequence). Everything else
(prefill, large batches, CUDA, bf16, training) stays on the torch modules. The switch is the
model's `small_gemm_threads` (`engine.cpu_gemm`), so the native path runs exactly where the
native GEMM does. Every operation is per row, so a verify step still reproduces the decode
step bit for bit; the norms and SiLU round differently from torch's (tests compare the two).

The object holds the addresses of the layers' tensors (and references, so they stay alive):
`use_small_gemm` drops it, and it is rebuilt on the next eligible step.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from eaglebatch import _native
from eaglebatch.attention.base import AttentionBackend, AttentionMetadata
from eaglebatch.model.linear import SMALL_GEMM_MAX_ROWS, Linear
from eaglebatch.model.rotary import RotaryEmbedding


def eligible(
    x: torch.Tensor, backend: AttentionBackend, meta: AttentionMetadata, threads: int
) -> bool:
    """Whether a step over x [T, in] can run on the native layers."""
    return (
        threads > 0
        and backend.native_plan(meta) is not None
        and 0 < x.shape[0] <= SMALL_GEMM_MAX_ROWS
        and x.dtype == torch.float32
        and x.is_cpu
        and not torch.is_grad_enabled()
    )


def _weight(linear: Linear) -> tuple[torch.Tensor, bool]:
    """The tensor the kernel reads: the exact bf16 copy when the module has one."""
    bf16 = linear.weight_bf16
    if bf16 is not None:
        return bf16, True
    return linear.weight.detach(), False


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
        addrs, flags, in_features = [], [], []
        attn0 = layers[0].self_attn
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            projs = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            weights = [_weight(p) for p in projs]
            norm_in = None if given_input else layer.input_layernorm
            norm_post = layer.post_attention_layernorm.weight
            norms = [None if norm_in is None else norm_in.weight, norm_post]
            biases = [p.bias for p in projs]
            tensors = [t if t is None else t.detach().contiguous() for t in norms + biases]
            for t, bf16 in weights + [(t, False) for t in tensors]:
                if t is not None:
                    # the native side reads flagged weights as bfloat16, all else as float32
                    dtype = torch.bfloat16 if bf16 else torch.float32
                    if t.dtype != dtype or not t.is_contiguous() or not t.is_cpu:
                        raise ValueError("NativeDecoder: contiguous float32 CPU tensors only")
                    self._keep.append(t)
            ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
            w = [ptr(t) for t, _ in weights]
            n_in, n_post = ptr(tensors[0]), ptr(tensors[1])
            addrs.append([n_in, *w[:4], n_post, *w[4:], *(ptr(b) for b in tensors[2:])])
            flags.append([bf for _, bf in weights])
            in_features.append(a.q_proj.in_features)
        cos, sin = rotary.cos_table.contiguous(), rotary.sin_table.contiguous()
        self._keep += [cos, sin]
        mlp0 = layers[0].mlp
        self.hidden = mlp0.down_proj.out_features
        self.in_features = in_features
        self._decoder = _native.CpuDecoder(
            addrs, flags, in_features,
            mlp0.down_proj.out_features, mlp0.gate_proj.out_features,
            attn0.num_heads, attn0.num_kv_heads, attn0.head_dim, eps, attn0.scale,
            cos.data_ptr(), sin.data_ptr(), cos.shape[0],
        )  # fmt: skip

    def current(self, rotary: RotaryEmbedding) -> bool:
        """False once the RoPE table was rebuilt (a longer one): build a new object."""
        return self.rope_table is rotary.cos_table

    def forward(
        self,
        x: torch.Tensor,  # float32 [T, H] residual stream, updated in place
        positions: torch.Tensor,  # int64 [T]
        meta: AttentionMetadata,  # prepared by the cpu backend for its kernel (`eligible`)
        kv_caches: list[torch.Tensor],  # the caches of layers first..last
        first: int,
        last: int,
        input: torch.Tensor | None = None,  # float32 [T, in] layer `first`'s attention input
    ) -> None:
        plan = meta.backend_state  # the backend's native_plan (`eligible`)
        for cache in kv_caches:
            if cache.dtype != torch.float32 or not cache.is_contiguous() or not cache.is_cpu:
                raise ValueError("NativeDecoder: float32 contiguous CPU KV caches only")
        t = x.shape[0]
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape != (t, self.hidden):
            raise ValueError(f"NativeDecoder: x must be contiguous float32 [T, {self.hidden}]")
        if input is not None:
            input = input.contiguous()
            if input.dtype != torch.float32 or input.shape != (t, self.in_features[first]):
                raise ValueError(
                    f"NativeDecoder: input must be float32 [T, {self.in_features[first]}]"
                )
        _, num_blocks, block_size = kv_caches[0].shape[:3]
        slot_mapping = meta.slot_mapping.numpy()
        # by address: x, input and the caches are live contiguous float32 CPU tensors (checked
        # above); the Rust side checks every size and index before writing
        self._decoder.forward(
            x.data_ptr(), 0 if input is None else input.data_ptr(), first, last,
            np.ascontiguousarray(positions.numpy(), dtype=np.int64),
            np.ascontiguousarray(slot_mapping, dtype=np.int64),
            plan.cu_seqlens_q, plan.seq_lens, plan.block_tables,
            [c.data_ptr() for c in kv_caches], num_blocks, block_size, self.threads,
        )  # fmt: skip

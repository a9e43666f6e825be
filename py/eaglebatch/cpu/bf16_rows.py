"""The extension's bfloat16 RMSNorm and RoPE for a bfloat16 model on the CPU: one native pass
each instead of torch's several ops with fresh buffers (rust/src/cpu/bf16_rows.rs says why
and what they cost). Values are transformers' in bfloat16, rounded where its ops round: RoPE
gives torch's bits; the norm's float32 sum of squares may add in another order than torch's
(a result then differs by one unit in the last place, rarely).

Swapped in by `use_bf16_rows` (the worker, when engine.cpu_gemm is not "torch") into plain
`RMSNorm`s (not Gemma's or OLMo's, which compute another order) and plain `Attention`s (their
`rotate`). A call that is not `eligible` -- another dtype or device, a partial rotation, or a
gradient to keep -- runs torch's code.
"""

from __future__ import annotations

import torch
from torch import nn

from eaglebatch import _native
from eaglebatch.cpu.swap import become, restore
from eaglebatch.cpu.tensors import native_ptr
from eaglebatch.model.decoder_layer import Attention, RMSNorm


def eligible(x: torch.Tensor) -> bool:
    """Whether a call over x runs natively: a non-empty contiguous bfloat16 CPU tensor with
    autograd off."""
    return (
        x.dtype == torch.bfloat16
        and x.is_cpu
        and x.numel() > 0
        and x.is_contiguous()
        and not torch.is_grad_enabled()
    )


class Bf16Norm:
    """The fast path of a plain `RMSNorm` over [..., H] bfloat16 rows (swapped in as
    NativeRMSNorm)."""

    state = ("bf16_threads",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        if not eligible(x) or self.weight.dtype != torch.bfloat16:
            return super().forward(x)
        h = self.weight.shape[0]
        rows = x.numel() // h
        out = torch.empty_like(x)
        _native.rms_norm_bf16(
            native_ptr(x.view(rows, h), torch.bfloat16, (rows, h)),
            native_ptr(self.weight, torch.bfloat16, (h,)),
            native_ptr(out.view(rows, h), torch.bfloat16, (rows, h)),
            rows, h, self.eps, self.bf16_threads,
        )  # fmt: skip
        return out


class Bf16Rotary:
    """The fast path of a plain `Attention`'s RoPE (swapped in as NativeAttention): q or k
    [T, H, D] rotated over all D values by bfloat16 cos, sin [T, 1, D]."""

    state = ("bf16_threads",)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not (eligible(x) and eligible(cos) and eligible(sin)) or x.dim() != 3:
            return super().rotate(x, cos, sin)
        tokens, heads, d = x.shape
        if cos.shape != (tokens, 1, d) or sin.shape != cos.shape or d % 2:
            return super().rotate(x, cos, sin)
        out = torch.empty_like(x)
        _native.rotary_bf16(
            native_ptr(x, torch.bfloat16, (tokens, heads, d)),
            native_ptr(cos, torch.bfloat16, (tokens, 1, d)),
            native_ptr(sin, torch.bfloat16, (tokens, 1, d)),
            native_ptr(out, torch.bfloat16, (tokens, heads, d)),
            tokens, heads, d, self.bf16_threads,
        )  # fmt: skip
        return out


_SWAPS = {RMSNorm: Bf16Norm, Attention: Bf16Rotary}  # plain class -> its fast path


def use_bf16_rows(module: nn.Module, threads: int) -> None:
    """Swaps the bfloat16 kernels into every plain RMSNorm and Attention of `module`, on up to
    `threads` of torch's threads; 0 threads makes them plain again."""
    for m in module.modules():
        mixin = _SWAPS.get(type(m).__dict__.get("plain_class", type(m)))  # cpu/swap.py
        if mixin is None:
            continue
        if threads > 0:
            become(m, mixin, bf16_threads=threads)
        elif isinstance(m, mixin):
            restore(m)

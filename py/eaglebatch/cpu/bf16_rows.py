"""The extension's bfloat16 RMSNorm for a bfloat16 model on the CPU: one native pass instead
of torch's float32 passes with fresh buffers (rust/src/cpu/bf16_rows.rs says why and what
they cost). Values are transformers' in bfloat16, rounded where its ops round; only the float32
sum of squares may add in another order than torch's (a result then differs by one unit in the
last place, rarely).

Swapped in by `use_bf16_rows` (the worker, when engine.cpu_gemm is not "torch") into plain
`RMSNorm`s (not Gemma's or OLMo's, which compute another order). A call that is not
`eligible` -- another dtype or device, or a gradient to keep -- runs torch's forward.
"""

from __future__ import annotations

import torch
from torch import nn

from eaglebatch import _native
from eaglebatch.cpu.swap import become, restore
from eaglebatch.cpu.tensors import native_ptr
from eaglebatch.model.decoder_layer import RMSNorm


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


def use_bf16_rows(module: nn.Module, threads: int) -> None:
    """Swaps the bfloat16 RMSNorm into every plain RMSNorm of `module`, on up to `threads` of
    torch's threads; 0 threads makes them plain again."""
    for m in module.modules():
        if type(m).__dict__.get("plain_class", type(m)) is not RMSNorm:  # cpu/swap.py
            continue
        if threads > 0:
            become(m, Bf16Norm, bf16_threads=threads)
        elif isinstance(m, Bf16Norm):
            restore(m)

"""The extension's RMSNorm (`_native.rms_norm`) for float32 CPU rows: one native call instead
of torch's several small ops. Swapped into draft heads only (`accelerate(native_norms=True)`):
a draft's numerics change which drafts are proposed, never the output; the target keeps
torch's rounding. Rows are normalised independently, so a row's bits do not depend on the
others of the call.
"""

from __future__ import annotations

import torch
from torch import nn

from eaglebatch import _native
from eaglebatch.cpu.swap import become, restore
from eaglebatch.cpu.tensors import eligible, native_ptr
from eaglebatch.model.decoder_layer import RMSNorm


class NativeNorm:
    """The fast path of an `RMSNorm` (swapped in as NativeRMSNorm): `eligible` rows, any
    number of them, through the extension; torch's forward otherwise."""

    state = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        if not eligible(x, None, (self.weight,)):
            return super().forward(x)
        x = x.contiguous()
        rows, h = x.shape
        out = torch.empty_like(x)
        _native.rms_norm(
            native_ptr(x, torch.float32, (rows, h)),
            native_ptr(self.weight, torch.float32, (h,)),
            native_ptr(out, torch.float32, (rows, h)),
            rows, h, self.eps,
        )  # fmt: skip
        return out


def use_native_norms(module: nn.Module, on: bool = True) -> None:
    """Swaps the native RMSNorm into every `RMSNorm` of `module` (on), or makes them plain. Only
    plain RMSNorms: its subclasses (Gemma's, OLMo's) compute another order or value."""
    for m in module.modules():
        plain = type(m).__dict__.get("plain_class", type(m))  # cpu/swap.py
        if plain is RMSNorm and on:
            become(m, NativeNorm)
        elif plain is RMSNorm:
            restore(m)

"""`Linear` and `linear`: torch's, except that few-row float32 products on the CPU can go
through the extension's small GEMM (`rust/src/small_gemm.rs`).

Why: a CPU decode step multiplies a handful of rows (1 per sequence, k + 1 in a verify step)
by every weight matrix. MKL, behind `F.linear`, takes ~1.9x the 1-row time for 4 rows on
AVX-512 CPUs (and on AVX2-only CPUs reads a 1-row step's weights at a fraction of the memory
bandwidth); the native kernel (AVX-512F, or AVX2 with FMA) reads each weight once for all rows
(4 rows ~1.1x one), and a
row's result does not depend on the other rows of the call, so a verify step reproduces the
1-row decode step bit for bit. Prefill and large batches (> SMALL_GEMM_MAX_ROWS rows) stay on
`F.linear`, as does anything that needs autograd.

The switch is per module (`small_gemm_threads`, 0 = off), set by `use_small_gemm`; nothing is
global, so a model built for training or for CUDA is untouched. A module whose float32 weight
holds bfloat16 values exactly (a draft head shipped in bf16) can also keep a bf16 copy
(`weight_bf16`): the kernel widens it exactly while loading, so the result is the same bits
from half the memory traffic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eaglebatch import _native

SMALL_GEMM_AVAILABLE: bool = _native.SMALL_GEMM_AVAILABLE
SMALL_GEMM_MAX_ROWS: int = _native.SMALL_GEMM_MAX_ROWS


def linear(
    x: torch.Tensor,  # [m, k]
    weight: torch.Tensor,  # [n, k]
    bias: torch.Tensor | None = None,  # [n]
    threads: int = 0,
    weight_bf16: torch.Tensor | None = None,  # bfloat16 [n, k] holding exactly `weight`'s values
) -> torch.Tensor:  # [m, n]
    """`F.linear(x, weight, bias)`; with `threads` > 0, a float32 CPU product of at most
    SMALL_GEMM_MAX_ROWS rows that needs no gradient runs on the native kernel instead, reading
    `weight_bf16` when given (same result: see the module docstring)."""
    if (
        threads <= 0
        or x.dim() != 2
        or not 0 < x.shape[0] <= SMALL_GEMM_MAX_ROWS
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or not x.is_cpu
        or not weight.is_cpu
        or not weight.is_contiguous()
        or weight.shape[1] != x.shape[1]
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight, bias)
    x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=torch.float32)
    narrow = (
        weight_bf16 is not None
        and weight_bf16.dtype == torch.bfloat16
        and weight_bf16.is_cpu
        and weight_bf16.is_contiguous()
        and weight_bf16.shape == weight.shape
    )
    w = weight_bf16 if narrow else weight
    # the native side reads x [m, k] (float32) and w [n, k] (float32, or bfloat16 when narrow)
    # and writes out [m, n] by address: all C-contiguous, on the CPU and alive for the call
    # (checked above)
    _native.small_gemm(x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, k, threads, narrow)
    return out if bias is None else out.add_(bias)


def exact_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 copy of a float32 `weight` when every value is a bfloat16 value (the copy is
    then exact), else None."""
    if weight.dtype != torch.float32:
        return None
    w = weight.detach()
    if bool((w.view(torch.int32) & 0xFFFF).any()):
        return None
    return w.to(torch.bfloat16).contiguous()


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) that calls `linear` above."""

    small_gemm_threads: int = 0
    weight_bf16: torch.Tensor | None = None  # exact bf16 copy of weight (use_small_gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.small_gemm_threads, self.weight_bf16)


def use_small_gemm(module: nn.Module, threads: int, bf16_weights: bool = False) -> bool:
    """Turns the native small GEMM on (`threads` > 0: up to that many threads of torch's
    OpenMP team per call) or off (0) for every submodule that has the `small_gemm_threads`
    switch. With `bf16_weights`, each `Linear` whose weight holds bfloat16 values exactly also
    gets its bf16 copy (`weight_bf16`; call this again if the weights change). Returns whether
    the kernel is on, which needs it to be available on this CPU."""
    threads = threads if SMALL_GEMM_AVAILABLE else 0
    for m in module.modules():
        if hasattr(m, "small_gemm_threads"):
            m.small_gemm_threads = threads
        if hasattr(m, "native_decoder"):
            m.native_decoder = None  # model/native_decoder.py: rebuilt with these weights
        if isinstance(m, Linear):
            m.weight_bf16 = exact_bf16(m.weight) if threads > 0 and bf16_weights else None
    return threads > 0

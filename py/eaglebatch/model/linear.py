"""`Linear` and `linear`: torch's, except that few-row float32 products on the CPU can go
through the extension's small GEMM (`rust/src/small_gemm.rs`).

Why: a CPU decode step multiplies a handful of rows (1 per sequence, k + 1 in a verify step)
by every weight matrix. MKL, behind `F.linear`, takes ~1.9x the 1-row time for 4 rows on
AVX-512 CPUs; the native kernel reads each weight once for all rows (4 rows ~1.1x one), and a
row's result does not depend on the other rows of the call, so a verify step reproduces the
1-row decode step bit for bit. Prefill and large batches (> SMALL_GEMM_MAX_ROWS rows) stay on
`F.linear`, as does anything that needs autograd.

The switch is per module (`small_gemm_threads`, 0 = off), set by `use_small_gemm`; nothing is
global, so a model built for training or for CUDA is untouched.
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
) -> torch.Tensor:  # [m, n]
    """`F.linear(x, weight, bias)`; with `threads` > 0, a float32 CPU product of at most
    SMALL_GEMM_MAX_ROWS rows that needs no gradient runs on the native kernel instead."""
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
    # the native side reads x [m, k] and weight [n, k] and writes out [m, n] by address: all
    # three are float32, C-contiguous, on the CPU and alive for the call (checked above)
    _native.small_gemm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), m, n, k, threads)
    return out if bias is None else out.add_(bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) that calls `linear` above."""

    small_gemm_threads: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.small_gemm_threads)


def use_small_gemm(module: nn.Module, threads: int) -> bool:
    """Turns the native small GEMM on (`threads` > 0: up to that many threads of torch's
    OpenMP team per call) or off (0) for every submodule that has the `small_gemm_threads`
    switch. Returns whether it is on, which needs the kernel to be available on this CPU."""
    threads = threads if SMALL_GEMM_AVAILABLE else 0
    for m in module.modules():
        if hasattr(m, "small_gemm_threads"):
            m.small_gemm_threads = threads
    return threads > 0

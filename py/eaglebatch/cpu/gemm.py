"""The extension's small GEMM (`rust/src/cpu/small_gemm.rs`) for few-row float32 products on the
CPU, and the `nn.Linear` fast path built on it.

Why: a CPU decode step multiplies a handful of rows (1 per sequence, k + 1 in a verify step)
by every weight matrix. MKL, behind `F.linear`, takes ~1.9x the 1-row time for 4 rows on
AVX-512 CPUs (and on AVX2-only CPUs reads a 1-row step's weights at a fraction of the memory
bandwidth); the native kernel (AVX-512F, or AVX2 with FMA) reads each weight once for all rows
(4 rows ~1.1x one), and a row's result does not depend on the other rows of the call, so a
verify step reproduces the 1-row decode step bit for bit. Prefill and large batches (more than
SMALL_GEMM_MAX_ROWS rows) stay on `F.linear`, as does anything that needs autograd.

`use_small_gemm` swaps `SmallGemmLinear` into every `nn.Linear` of a module (cpu/swap.py); a
module whose float32 weight holds bfloat16 values exactly (a draft head shipped in bf16) can
also keep a bf16 copy (`weight_bf16`): the kernel widens it exactly while loading, so the
result is the same bits from half the memory traffic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eaglebatch import _native
from eaglebatch.cpu.swap import become, restore
from eaglebatch.cpu.tensors import eligible, native_ptr

SMALL_GEMM_AVAILABLE: bool = _native.SMALL_GEMM_AVAILABLE
SMALL_GEMM_MAX_ROWS: int = _native.SMALL_GEMM_MAX_ROWS
GGML_F32, GGML_BF16 = 0, 30  # the kernels' weight formats, numbered as GGML's types


def linear(
    x: torch.Tensor,  # [m, k]
    weight: torch.Tensor,  # float32 [n, k]
    bias: torch.Tensor | None = None,  # [n]
    threads: int = 0,
    weight_bf16: torch.Tensor | None = None,  # bfloat16 [n, k] holding exactly `weight`'s values
) -> torch.Tensor:  # [m, n]
    """`F.linear(x, weight, bias)`; with `threads` > 0 and an `eligible` x (at most
    SMALL_GEMM_MAX_ROWS float32 CPU rows, no gradient through x or weight), the native kernel
    computes it on up to `threads` threads, reading `weight_bf16` when given (the same result:
    see the module docstring)."""
    if threads <= 0 or not eligible(x, SMALL_GEMM_MAX_ROWS, (weight,)):
        return F.linear(x, weight, bias)
    x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=torch.float32)
    if weight_bf16 is None:
        w, ty = native_ptr(weight, torch.float32, (n, k)), GGML_F32
    else:
        w, ty = native_ptr(weight_bf16, torch.bfloat16, (n, k)), GGML_BF16
    x_ptr, out_ptr = native_ptr(x, torch.float32, (m, k)), native_ptr(out, torch.float32, (m, n))
    _native.small_gemm(x_ptr, w, out_ptr, m, n, k, threads, ty)
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


class SmallGemmLinear:
    """The fast path of an `nn.Linear` (swapped in as NativeLinear): its few-row products run on
    the native kernel through `linear`; the same parameters, names and values otherwise."""

    state = ("small_gemm_threads", "weight_bf16")
    small_gemm_threads: int  # threads per call
    weight_bf16: torch.Tensor | None  # exact bf16 copy of weight (use_small_gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.small_gemm_threads, self.weight_bf16)


def use_small_gemm(module: nn.Module, threads: int, bf16_weights: bool = False) -> bool:
    """Swaps the native small GEMM into every `nn.Linear` of `module` (`threads` > 0: up to
    that many threads of torch's OpenMP team per call), or makes them plain again (0). With
    `bf16_weights`, each one whose weight holds bfloat16 values exactly also gets its bf16 copy
    (`weight_bf16`; call this again if the weights change). Returns whether the kernel is on,
    which needs it to be available on this CPU."""
    threads = threads if SMALL_GEMM_AVAILABLE else 0
    for m in module.modules():
        if not isinstance(m, nn.Linear) or hasattr(m, "quantized"):
            continue  # (GGUF blocks always run natively: cpu/quantized.py)
        if threads <= 0:
            restore(m)
            continue
        copy = exact_bf16(m.weight) if bf16_weights else None
        become(m, SmallGemmLinear, small_gemm_threads=threads, weight_bf16=copy)
    return threads > 0

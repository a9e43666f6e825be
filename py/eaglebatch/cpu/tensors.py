"""What the extension's CPU kernels take, and how a tensor crosses into them.

`eligible` is the one per-call rule of the fast path: a call runs natively when its input is a
2-d float32 CPU tensor of few rows and nothing needs a gradient. Everything else stays on
torch's ops, which compute the same values up to float32 rounding.

`native_ptr` is the one place a tensor's address is taken for the extension (`_native`:
small_gemm, rms_norm, paged_attention, CpuDecoder). Those read or write raw addresses as
C-contiguous arrays of a given dtype and size, so the helper checks exactly that -- dtype,
CPU device, C-contiguity and shape -- and raises ValueError otherwise: a wrong tensor is an
error, never a read past a buffer. The caller keeps the tensor alive while the native side uses
the address (a local for one call; `NativeDecoder._keep` for the decoder's weights).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def eligible(
    x: torch.Tensor,  # [rows, features]
    max_rows: int | None,
    params: Iterable[torch.Tensor] = (),
) -> bool:
    """Whether a call over x runs on the native kernels: x is a 2-d float32 CPU tensor of
    1..max_rows rows (any number of rows: None) and nothing needs a gradient -- grad mode is
    off, or neither x nor any of `params` (the weights the kernel reads; iterated only in grad
    mode) requires one."""
    rows = x.shape[0] if x.dim() == 2 else 0
    return (
        0 < rows
        and (max_rows is None or rows <= max_rows)
        and x.dtype == torch.float32
        and x.is_cpu
        and not (
            torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
        )
    )


def native_ptr(
    t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | None = None
) -> int:
    """The address of t's data, for a native kernel that reads (or writes) it as a C-contiguous
    `dtype` array of `shape` on the CPU; ValueError unless t is exactly that."""
    if t.dtype != dtype or not t.is_cpu or not t.is_contiguous() or (
        shape is not None and t.shape != shape
    ):
        want = f"a C-contiguous {dtype} CPU tensor" + ("" if shape is None else f" {shape}")
        layout = "" if t.is_contiguous() else "non-contiguous "
        got = f"{layout}{t.dtype} {tuple(t.shape)} on {t.device}"
        raise ValueError(f"native kernels take {want}, got {got}")
    return t.data_ptr()


def native_ptr_or_null(
    t: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...] | None = None
) -> int:
    """`native_ptr`, or 0 (the kernels' "none") for a missing optional tensor (a bias)."""
    return 0 if t is None else native_ptr(t, dtype, shape)

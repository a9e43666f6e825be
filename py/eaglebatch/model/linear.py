"""Linear layers that keep a second, transposed weight layout for the row counts where it is faster.

On CPU the BLAS picks a GEMM kernel from the shape. For some small row counts, `x @ W^T` with W^T
stored contiguous ([in, out]) beats `F.linear(x, W)` with W as loaded ([out, in]): measured on a
2-core AVX-512 VM over the 30 layers of SmolLM2-135M, 4-5 rows (a K = 3 verify at batch 1) cost
~29 ms instead of ~36, while 1-3 rows and 16+ rows gain nothing or lose. Which row counts win
depends on the CPU and the BLAS build, so `tune_row_layouts` measures it once at load time.

Invariants: `weight_t` equals `weight.t()` (weights are frozen at inference); a layer with no
`small_rows` is exactly nn.Linear. Inputs are 2-D [T, in] (the packed token layout).
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    small_rows: frozenset[int] = frozenset()  # row counts that use weight_t
    weight_t: torch.Tensor | None = None  # [in, out] contiguous copy of weight.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if x.shape[0] in self.small_rows:
            out = x @ self.weight_t
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


def _time(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@torch.inference_mode()
def tune_row_layouts(
    layers: list[nn.Module],
    max_rows: int = 16,
    min_gain: float = 0.12,
    reps: int = 7,
    memory_fraction: float = 0.1,
    min_bytes: int = 16 << 20,
) -> list[int]:
    """Times every `Linear` of the first four decoder layers at 1..max_rows rows in both layouts
    and gives the transposed one to the row counts where it is at least `min_gain` faster (best
    of `reps`, interleaved). CPU only. Skipped (returns []) for models whose linear weights are
    under `min_bytes` (call overhead, not the kernel, decides their speed: tiny test models stay
    plain nn.Linear) and where the extra copy of the weights would exceed `memory_fraction` of
    the machine's memory. Returns the row counts chosen."""
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, Linear)]
    if not linears or linears[0].weight.device.type != "cpu":
        return []
    extra = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    if extra < min_bytes:
        return []
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return []
    if extra > memory_fraction * memory:
        return []
    probe = [m for layer in layers[:4] for m in layer.modules() if isinstance(m, Linear)]
    probe_t = [m.weight.t().contiguous() for m in probe]
    chosen = []
    for rows in range(1, max_rows + 1):
        xs = [torch.randn(rows, m.in_features, dtype=m.weight.dtype) for m in probe]

        def plain(xs=xs):
            for m, x in zip(probe, xs):
                F.linear(x, m.weight)

        def transposed(xs=xs):
            for wt, x in zip(probe_t, xs):
                x @ wt

        plain(), transposed()  # warm-up
        t_plain = t_transposed = float("inf")
        for _ in range(reps):  # interleaved, so a busy moment hits both layouts
            t_plain = min(t_plain, _time(plain, 1))
            t_transposed = min(t_transposed, _time(transposed, 1))
        if t_transposed < (1 - min_gain) * t_plain:
            chosen.append(rows)
    if chosen:
        for m in linears:
            m.weight_t = m.weight.detach().t().contiguous()
            m.small_rows = frozenset(chosen)
    return chosen

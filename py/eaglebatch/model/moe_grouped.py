"""The routed experts of one step as two grouped GEMMs (torch's grouped matmul,
`torch.nn.functional.grouped_mm` = `torch._grouped_mm`), for SparseMoeBlock (moe.py).

Why this kernel: it ships with torch (no extra dependency, maintained as part of torch; the
public wrapper since torch 2.10 -- older torch keeps the per-expert loop), takes the
per-expert row offsets as a device tensor, so one call covers every expert with no host sync
and shapes fixed by the step's T * k rows (it runs inside CUDA graphs), and it runs on the CPU
too: the same code path in the CPU tests, where it equals the per-expert nn.Linear loop bit
for bit in float32 (one mm per group). A fused-MoE kernel (flashinfer's, vLLM's Triton one)
would fuse the routing and activation as well, but brings a JIT or wheel per CUDA version and
its own activation set and summation order; our experts keep their own `glu` (moe.py
Expert), which two plain GEMMs leave free.

What torch 2.15 requires (aten/native/GroupedMMUtils.h, cuda/GroupedBlas.cpp):
- float32, bfloat16 or float16; both operands and the output of one dtype;
- row strides of 16 bytes' multiple: hidden and expert-inner sizes * itemsize % 16 == 0;
  on CUDA also 16-byte-aligned data and per-expert (batch) strides;
- int32 offsets, 1-D, contiguous: offs[e] ends expert e's rows (a group may be empty);
- no bias.
On CUDA its own kernel (CUTLASS, no sync) runs only for bfloat16 on compute capability 9.x or
10.x (H100/H200, B200); anything else (float32, float16, A100, L4, RTX 50) takes its fallback,
a loop of mm over the groups that copies the offsets to the host: fine eagerly (the sync the
per-expert loop has anyway), impossible while a CUDA graph captures -- there SparseMoeBlock runs
its dense masked path instead (`fits_capture`).

The layout: each layer's expert weights live in two stacked tensors, gate and up rows together
[E, 2I, H] (gate first) and down [E, H, I], built by `stack_experts`; each expert's
nn.Linear weight is re-pointed at its slice, so checkpoint loaders fill them by their
per-expert names (they copy into the parameters) and nothing is held twice. `ON_CPU` lets
tests run this path on the CPU; CPU runs otherwise keep the per-expert loop, whose linears
may be native or GGUF blocks (cpu/quantized.py swaps them, which would leave the stack stale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Tests only: stack the experts (and so run this path) on the CPU too. Read when a block's
# parameters move (`SparseMoeBlock._apply`: .to(), to_empty()), so set it before building.
ON_CPU = False

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _projections(experts: nn.ModuleList) -> list[nn.Module]:
    return [p for ex in experts for p in (ex.gate_proj, ex.up_proj, ex.down_proj)]


def stackable(experts: nn.ModuleList) -> bool:
    """Whether the grouped GEMMs can run these experts: the grouped matmul exists, every
    projection is a plain nn.Linear (no CPU fast path or GGUF blocks swapped in) without bias,
    of one float dtype on CUDA (the CPU with `ON_CPU`), with rows of 16-byte multiples."""
    projs = _projections(experts)
    w = projs[0].weight
    return (
        hasattr(F, "grouped_mm")
        and (w.is_cuda or (w.device.type == "cpu" and ON_CPU))
        and all(type(p) is nn.Linear and p.bias is None for p in projs)
        and all(p.weight.dtype == w.dtype and p.weight.device == w.device for p in projs)
        and w.dtype in _DTYPES
        and all(n * w.element_size() % 16 == 0 for n in w.shape)  # [I, H]: both
    )


@torch.no_grad()
def stack_experts(experts: nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(gate_up [E, 2I, H], down [E, H, I]) holding the experts' current weights, each
    expert's weights now views of them; None (weights untouched) where not `stackable`."""
    if not stackable(experts):
        return None
    inner, hidden = experts[0].gate_proj.weight.shape
    w = experts[0].gate_proj.weight
    gate_up = torch.empty(len(experts), 2 * inner, hidden, dtype=w.dtype, device=w.device)
    down = torch.empty(len(experts), hidden, inner, dtype=w.dtype, device=w.device)
    for e, ex in enumerate(experts):
        for lin, view in ((ex.gate_proj, gate_up[e, :inner]), (ex.up_proj, gate_up[e, inner:]),
                          (ex.down_proj, down[e])):  # fmt: skip
            view.copy_(lin.weight)
            lin.weight.data = view  # the same Parameter (loaders hold it), now the slice
    return gate_up, down


def fits_capture(x: torch.Tensor) -> bool:
    """Whether torch's grouped matmul runs without a host sync on `x`'s CUDA device: its own
    kernel is bfloat16 on compute capability 9.x / 10.x only (see the module doc)."""
    return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] in (9, 10)


def grouped_experts(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
    stacked: tuple[torch.Tensor, torch.Tensor], glu,
) -> torch.Tensor:  # fmt: skip
    """sum over each token's k experts, ascending by expert id from zero, of weight *
    down(glu(gate x, up x)): x [T, H], weights [T, k], experts int64 [T, k] -> [T, H].
    Every index computed on the device (no host sync, shapes fixed by T * k). Within an
    expert its rows run in token order and the k slot outputs add in expert order, one
    elementwise add each (no atomics): the sums of the per-expert loop, bit for bit where
    the GEMMs agree."""
    gate_up, down = stacked
    t, k = experts.shape
    experts, by_id = torch.sort(experts, dim=-1)  # each token's slots by ascending expert
    weights = weights.gather(-1, by_id)
    flat, order = torch.sort(experts.reshape(-1), stable=True)  # slot rows grouped by expert
    ids = torch.arange(gate_up.shape[0], device=x.device, dtype=flat.dtype)
    offs = torch.searchsorted(flat, ids, right=True).to(torch.int32)  # end of expert e's rows
    rows = x.index_select(0, order // k)  # [T*k, H]
    inner = down.shape[-1]
    gu = F.grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
    h = glu(gu[:, :inner], gu[:, inner:]).contiguous()
    y = F.grouped_mm(h, down.transpose(1, 2), offs=offs)  # [T*k, H]
    y = (y * weights.reshape(-1)[order, None]).to(x.dtype)
    slots = torch.empty_like(y).index_copy_(0, order, y).view(t, k, x.shape[1])  # back to (t, j)
    out = torch.zeros_like(x)
    for j in range(k):
        out = out + slots[:, j]
    return out

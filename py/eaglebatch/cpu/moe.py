"""The routed MLP of a mixture-of-experts layer (model/moe.py `SparseMoeBlock`) in one native
call per step (`_native.moe_experts`, rust/src/cpu/moe.rs), swapped in as NativeSparseMoeBlock.

Why: the plain grouped path makes three GEMM calls and several torch ops per active expert, ~100
active experts per layer at batch 32 on a 128-expert top-8 model; the native call groups the
step's rows by expert and runs every expert's gate, up, activation and down in a few parallel
regions. It computes what `_grouped` computes, in its order (each token's weighted expert
outputs summed from zero in ascending expert order) on the same GEMM kernel (so the same bits
as NativeLinear's products; the activation rounds as the Rust one does), and a row's result
does not depend on the other rows of the step.

A step runs natively when x is `eligible` (float32 CPU rows, no gradient) and every active
expert has at most SMALL_GEMM_MAX_ROWS rows; a prefill with more keeps the per-expert path,
which expands block weights for torch's GEMM (the dequantized model's result). The experts'
weights are read as the modules hold them: GGUF blocks (`QuantizedLinear.quantized`), an exact
bf16 copy (`weight_bf16`) or the float32 weight. The activation is the experts' `act` when it
is one the kernel has (silu, GELU's tanh form); an expert may instead name it in a
`native_activation` attribute, ("clamped_swiglu", alpha, limit) for gpt-oss's. Experts whose
activation the kernel lacks keep the plain path.

The table of the experts' addresses is built on the first native step (after
`use_quantized_weights`, which runs before any step) and kept with references to the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from eaglebatch import _native
from eaglebatch.cpu.gemm import GGML_BF16, GGML_F32, SMALL_GEMM_MAX_ROWS
from eaglebatch.cpu.swap import become, restore
from eaglebatch.cpu.tensors import eligible, native_ptr
from eaglebatch.model import decoder_layer
from eaglebatch.model.moe import SparseMoeBlock, expert_rows

# the model's activation names the kernel computes (model/decoder_layer.py's table)
_KERNEL_ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass
class ExpertTable:
    """A layer's experts as the native call takes them: per expert (rows) the gate, up and down
    weights' addresses, GGML types and bias addresses (0: none), with the tensors held."""

    hidden: int
    inner: int
    activation: tuple[str, float, float]  # (kernel name, alpha, limit)
    int8: bool  # engine.activations: int8, set on block weights by use_quantized_weights
    matrices: np.ndarray  # uint64 [E, 3]
    types: np.ndarray  # uint32 [E, 3]
    biases: np.ndarray  # uint64 [E, 3]
    keep: list[torch.Tensor] = field(default_factory=list)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, threads: int
    ) -> torch.Tensor:  # [T, H], [T, k], int64 [T, k] -> [T, H]
        x = x.contiguous()
        t = x.shape[0]
        out = torch.empty_like(x)
        name, alpha, limit = self.activation
        _native.moe_experts(
            native_ptr(x, torch.float32, (t, self.hidden)),
            native_ptr(out, torch.float32, (t, self.hidden)), self.hidden, self.inner,
            np.ascontiguousarray(experts.numpy(), dtype=np.int64),
            np.ascontiguousarray(weights.detach().numpy(), dtype=np.float32),
            self.matrices, self.types, self.biases, name, alpha, limit, threads, self.int8,
        )  # fmt: skip
        return out


def _activation(expert: nn.Module) -> tuple[str, float, float] | None:
    """The kernel's name (and alpha, limit) of an expert's activation, None if it lacks it."""
    named = getattr(expert, "native_activation", None)
    if named is not None:
        return named
    if getattr(expert, "combine", None) is not None:  # an activation other than act(gate) * up
        return None
    for name in _KERNEL_ACTIVATIONS:
        if decoder_layer._ACTIVATIONS[name] is getattr(expert, "act", None):
            return name, 0.0, 0.0
    return None


def _weight(linear: nn.Module, keep: list[torch.Tensor]) -> tuple[int, int] | None:
    """(address, GGML type) of the weight the GEMM reads -- blocks, exact bf16 copy or float32
    -- held in `keep`; None for one it cannot read (not float32, or not contiguous)."""
    blocks = getattr(linear, "quantized", None)
    if blocks is not None:
        keep.append(blocks.blocks)
        return blocks.blocks.data_ptr(), blocks.ggml_type  # checked when it was built
    bf16 = getattr(linear, "weight_bf16", None)
    w, ty = (bf16, GGML_BF16) if bf16 is not None else (linear.weight.detach(), GGML_F32)
    if w.dtype not in (torch.float32, torch.bfloat16) or not w.is_contiguous() or not w.is_cpu:
        return None
    keep.append(w)
    return w.data_ptr(), ty


def _bias(linear: nn.Module, keep: list[torch.Tensor]) -> int:
    b = getattr(linear, "bias", None)
    if b is None:
        return 0
    b = b.detach().to(torch.float32).contiguous()
    keep.append(b)
    return native_ptr(b, torch.float32, (linear.out_features,))


def expert_table(block: SparseMoeBlock) -> ExpertTable | None:
    """The block's experts for the native call, None where the kernel cannot run them."""
    first = block.experts[0]
    act = _activation(first)
    if act is None or any(_activation(e) != act for e in block.experts):
        return None
    keep: list[torch.Tensor] = []
    rows = []
    for e in block.experts:
        projs = (e.gate_proj, e.up_proj, e.down_proj)
        ws = [_weight(p, keep) for p in projs]
        if any(w is None for w in ws):
            return None
        rows.append(([w[0] for w in ws], [w[1] for w in ws], [_bias(p, keep) for p in projs]))
    int8 = any(getattr(getattr(p, "quantized", None), "takes_int8", False)
               for e in block.experts for p in (e.gate_proj, e.up_proj, e.down_proj))  # fmt: skip
    return ExpertTable(
        hidden=first.down_proj.out_features, inner=first.gate_proj.out_features,
        activation=act, int8=int8,
        matrices=np.array([r[0] for r in rows], dtype=np.uint64),
        types=np.array([r[1] for r in rows], dtype=np.uint32),
        biases=np.array([r[2] for r in rows], dtype=np.uint64), keep=keep,
    )  # fmt: skip


def rows_fit(experts: torch.Tensor, rows: torch.Tensor | None) -> bool:
    """Whether every expert of the step has at most SMALL_GEMM_MAX_ROWS rows (`rows`: the
    step's `expert_rows`, where counted)."""
    if experts.numel() <= SMALL_GEMM_MAX_ROWS:
        return True
    return int((expert_rows(experts, 0) if rows is None else rows).max()) <= SMALL_GEMM_MAX_ROWS


class NativeMoe:
    """The fast path of a SparseMoeBlock (swapped in as NativeSparseMoeBlock): the routed
    experts of an eligible step in one native call; the router and the shared expert as
    before."""

    state = ("small_gemm_threads", "native_experts")
    small_gemm_threads: int
    native_experts: ExpertTable | bool | None  # None: not built yet; False: not readable

    def _grouped(self, x, weights, experts, rows=None) -> torch.Tensor:
        if not eligible(x, None, self.parameters()) or not rows_fit(experts, rows):
            return super()._grouped(x, weights, experts, rows)
        if self.native_experts is None:
            self.native_experts = expert_table(self) or False
        if self.native_experts is False:
            return super()._grouped(x, weights, experts, rows)
        return self.native_experts.forward(x, weights, experts, self.small_gemm_threads)


def use_native_moe(model: nn.Module, threads: int) -> None:
    """Swaps the native routed MLP into every SparseMoeBlock of `model` with `threads` threads
    of torch's OpenMP team per call, or makes them plain again (0)."""
    for m in model.modules():
        if not isinstance(m, SparseMoeBlock):
            continue
        if threads <= 0:
            restore(m)
        else:
            become(m, NativeMoe, small_gemm_threads=threads, native_experts=None)

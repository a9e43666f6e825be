"""CPU steps straight from a checkpoint's stored weights (`engine.weights: quantized`): a GGUF
file's quantized blocks, or the 16-bit floats of a bf16/fp16 checkpoint (half_weights.py).

A `QuantizedWeight` holds one weight matrix [n, k] as the checkpoint stores it: n rows of
`row_bytes` bytes of blocks (rows in the checkpoint's order, gguf_blocks.py; a 16-bit float
is a block of one element). The extension's GEMM and embedding gather expand the blocks in
registers to the exact float32 values of the dequantized checkpoint
(rust/src/cpu/quant.rs), so a model that reads them computes bit for bit what the float32
model computes, from ~7x fewer bytes for Q4_1 and 2x for bf16 (the memory-bound part of a CPU
decode step is reading the weights).

`use_quantized_weights` swaps them into a built, accelerated float32 CPU model, one way: each
nn.Linear whose weight has blocks becomes a QuantizedLinear (swapped in as NativeLinear), the
embedding a QuantizedEmbedding, and their float32 `weight` parameters are dropped (the memory
is returned). A tied LM head becomes a QuantizedLinear `lm_head` over the embedding's blocks.
A product of up to SMALL_GEMM_MAX_ROWS rows runs natively from the blocks; a larger one
(prefill, which is compute-bound) expands the weight (in slices past 64 MiB) and runs torch's
GEMM on it, the dequantized model's own path for such rows; a call that needs a gradient is
an error, never a silent fallback.

`engine.activations: int8` (opt-in, GGUF block formats only) gives up that equality for speed:
every product with a block weight, whatever its row count, quantizes each row of x to 8-bit
blocks of 32 and multiplies in integers, as llama.cpp does (rust/src/cpu/int8_gemm.rs defines
the result; rows stay independent of each other, so speculative decoding still reproduces
plain decoding of the same int8 model). 16-bit float weights and embedding lookups stay exact.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from eaglebatch import _native
from eaglebatch.cpu.gemm import SMALL_GEMM_MAX_ROWS
from eaglebatch.cpu.swap import become
from eaglebatch.cpu.tensors import eligible, native_ptr

# A prefill product expands at most this many weight elements (64 MiB of float32) at a time:
# a whole weight up to 16M elements (every matrix of a 1B-3B model but the LM head), whose
# product is then the dequantized model's bit for bit; a larger one in slices of rows, whose
# products torch's GEMM may sum in another order (equal to float rounding).
EXPANDED_SLICE_ELEMENTS = 1 << 24

# GGML type numbers the kernels read from blocks (rust/src/cpu/quant.rs), with (elements, bytes)
# per block.
BLOCK_TYPES: dict[int, tuple[str, int, int]] = {
    1: ("F16", 1, 2),
    30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    14: ("Q6_K", 256, 210),
    39: ("MXFP4", 32, 17),
}


def row_bytes(ggml_type: int, k: int) -> int | None:
    """Bytes of a row of k elements of a block type, None when k is not whole blocks."""
    _, elems, nbytes = BLOCK_TYPES[ggml_type]
    return k // elems * nbytes if k > 0 and k % elems == 0 else None


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A weight [n, k] as GGUF blocks: `blocks` uint8 [n, row_bytes(ggml_type, k)]."""

    blocks: torch.Tensor
    ggml_type: int
    shape: tuple[int, int]  # (n, k): out_features, in_features
    int8: bool = False  # engine.activations: int8 (block formats; see the module doc)

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.ggml_type not in BLOCK_TYPES or row_bytes(self.ggml_type, k) is None:
            raise ValueError(f"GGML type {self.ggml_type} with k = {k}: not readable blocks")
        native_ptr(self.blocks, torch.uint8, (n, row_bytes(self.ggml_type, k)))

    @property
    def type_name(self) -> str:
        return BLOCK_TYPES[self.ggml_type][0]

    @property
    def is_block_format(self) -> bool:
        """A GGUF block format (not a 16-bit float, a block of one element)."""
        return BLOCK_TYPES[self.ggml_type][1] > 1

    @property
    def takes_int8(self) -> bool:
        """Its products quantize x to 8 bits (int8 asked for and a block format)."""
        return self.int8 and self.is_block_format

    def linear(self, x: torch.Tensor, threads: int) -> torch.Tensor:  # [m, k] -> [m, n]
        """x @ W^T in float32: up to SMALL_GEMM_MAX_ROWS rows (decode, verify) on the native
        kernel from the blocks; more rows (prefill) as the dequantized model computes them,
        torch's GEMM over the exact float32 values, expanded EXPANDED_SLICE_ELEMENTS at most
        at a time. With int8 activations every row count runs on the native integer kernel,
        SMALL_GEMM_MAX_ROWS rows per call."""
        if x.shape[0] == 0 and x.dtype == torch.float32 and x.is_cpu:
            return torch.empty((0, self.shape[0]), dtype=torch.float32)  # nothing to compute
        if not eligible(x, None):
            raise ValueError(
                "quantized weights run float32 CPU inference only (got "
                f"{x.dtype} {tuple(x.shape)} on {x.device}, grad {torch.is_grad_enabled()})"
            )
        x = x.contiguous()
        if x.shape[0] > SMALL_GEMM_MAX_ROWS and not self.takes_int8:
            return self._expanded_linear(x)
        out = torch.empty((x.shape[0], self.shape[0]), dtype=torch.float32)
        for r in range(0, x.shape[0], SMALL_GEMM_MAX_ROWS):  # int8: rows are independent
            self._native_linear(x[r : r + SMALL_GEMM_MAX_ROWS], out[r : r + SMALL_GEMM_MAX_ROWS],
                                threads)  # fmt: skip
        return out

    def _native_linear(self, x: torch.Tensor, out: torch.Tensor, threads: int) -> None:
        """out [m, n] = x [m, k] @ W^T on the extension, m <= SMALL_GEMM_MAX_ROWS."""
        (n, k), m = self.shape, x.shape[0]
        _native.small_gemm(
            native_ptr(x, torch.float32, (m, k)), self.blocks.data_ptr(),
            native_ptr(out, torch.float32, (m, n)), m, n, k, threads, self.ggml_type,
            self.takes_int8,
        )  # fmt: skip

    def _expanded_linear(self, x: torch.Tensor) -> torch.Tensor:  # [m, k] -> [m, n]
        n, k = self.shape
        step = max(1, EXPANDED_SLICE_ELEMENTS // k)
        if step >= n:  # one slice: the whole weight
            return torch.nn.functional.linear(x, self.rows(torch.arange(n)))
        out = torch.empty((x.shape[0], n), dtype=torch.float32)
        for r in range(0, n, step):
            rows = self.rows(torch.arange(r, min(n, r + step)))  # [s, k] exact float32
            out[:, r : r + step] = torch.nn.functional.linear(x, rows)
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:  # int [T] -> float32 [T, k]
        """Rows `ids` as float32 (an embedding lookup); the extension checks every id."""
        n, k = self.shape
        flat = np.ascontiguousarray(ids.reshape(-1).cpu().numpy(), dtype=np.int64)
        out = torch.empty((flat.shape[0], k), dtype=torch.float32)
        if flat.shape[0] == 0:
            return out.reshape(*ids.shape, k)
        _native.gather_rows(self.blocks.data_ptr(), self.ggml_type, n, k, flat,
                            native_ptr(out, torch.float32, (flat.shape[0], k)))  # fmt: skip
        return out.reshape(*ids.shape, k)


class QuantizedLinear:
    """An nn.Linear whose weight is GGUF blocks (swapped in as NativeLinear)."""

    state = ("small_gemm_threads", "quantized")
    small_gemm_threads: int
    quantized: QuantizedWeight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., k] -> [..., n]
        out = self.quantized.linear(x.reshape(-1, x.shape[-1]), self.small_gemm_threads)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class QuantizedEmbedding:
    """An nn.Embedding whose table is GGUF blocks (swapped in as NativeEmbedding)."""

    state = ("quantized",)
    quantized: QuantizedWeight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # int [...] -> float32 [..., H]
        return self.quantized.rows(ids)


def _drop_weight(module: nn.Module) -> None:
    """Removes the float32 `weight` parameter (its memory goes back once unreferenced)."""
    del module._parameters["weight"]


def use_quantized_weights(
    model: nn.Module, weights: dict[str, QuantizedWeight], threads: int, int8: bool = False
) -> list[str]:
    """Swaps `weights` (by parameter name, e.g. "model.layers.0.mlp.up_proj.weight") into the
    nn.Linear and nn.Embedding modules of `model` on `threads` GEMM threads, dropping their
    float32 weights; a tied LM head (`model.lm_head is None`) reads the embedding's blocks.
    `int8`: the block formats' products take x as 8 bits (engine.activations: int8).
    One way: the model cannot be made plain again. Returns the names swapped."""
    if threads <= 0:
        raise ValueError("quantized weights need the native CPU kernels (threads > 0)")
    if int8:
        weights = {n: dataclasses.replace(qw, int8=True) for n, qw in weights.items()}
    done = []
    for name, module in model.named_modules():
        qw = weights.get(f"{name}.weight")
        if qw is None or not isinstance(module, nn.Linear | nn.Embedding):
            continue
        want = (module.num_embeddings, module.embedding_dim) if isinstance(
            module, nn.Embedding) else (module.out_features, module.in_features)  # fmt: skip
        if qw.shape != want:
            raise ValueError(f"{name}: blocks of shape {qw.shape}, the module is {want}")
        if isinstance(module, nn.Embedding):
            become(module, QuantizedEmbedding, quantized=qw)
        else:
            become(module, QuantizedLinear, small_gemm_threads=threads, quantized=qw)
        _drop_weight(module)
        done.append(f"{name}.weight")
    embed = weights.get("model.embed_tokens.weight")
    if embed is not None and getattr(model, "lm_head", False) is None:
        head = nn.Linear(embed.shape[1], embed.shape[0], bias=False, device="meta")
        become(head, QuantizedLinear, small_gemm_threads=threads, quantized=embed)
        _drop_weight(head)
        model.lm_head = head  # tied: the same blocks as the embedding
    return done

"""The CPU fast path: the extension's kernels swapped into a float32 CPU model once, when it is
built (docs/architecture.md, "The CPU fast path").

The model code (model/llama.py, speculative/eagle.py) is plain torch. `accelerate` swaps the
fast path into a built model (cpu/swap.py: the modules keep their identity, parameters and
names; only methods change):

  * every `nn.Linear` -> NativeLinear: few-row products on the native small GEMM (gemm.py);
  * a CausalLM -> NativeCausalLM, an EAGLE draft head -> NativeEagleDraft:
    runs of decoder layers in one native call (decoder.py), the LM head on the small GEMM;
  * every mixture-of-experts `SparseMoeBlock` -> NativeSparseMoeBlock: a step's routed experts in
    one native call (moe.py);
  * with `native_norms` (draft heads), every `RMSNorm` -> NativeRMSNorm (norm.py);
  * every Gated DeltaNet (hybrid models) -> NativeGatedDeltaNet: the decode / verify steps'
    delta rule in one native call (deltanet.py).

Each swapped-in method decides per call with the one rule `tensors.eligible` and otherwise
runs the plain method; every tensor reaches the extension through `tensors.native_ptr`. The
"cpu" attention backend (attention.py) answers whether a step's attention can run natively
(`native_plan`). A model built for CUDA, bf16 or training is never accelerated.
"""

from __future__ import annotations

import torch
from torch import nn

from eaglebatch.cpu.decoder import use_native_layers
from eaglebatch.cpu.deltanet import use_native_deltanet
from eaglebatch.cpu.gemm import SMALL_GEMM_AVAILABLE, SMALL_GEMM_MAX_ROWS, use_small_gemm
from eaglebatch.cpu.moe import use_native_moe
from eaglebatch.cpu.norm import use_native_norms

__all__ = ["SMALL_GEMM_AVAILABLE", "SMALL_GEMM_MAX_ROWS", "accelerate", "gemm_threads"]


def accelerate(
    model: nn.Module, threads: int, *, bf16_weights: bool = False, native_norms: bool = False
) -> bool:
    """Swaps the CPU fast path into `model` (a CausalLM or an EAGLE draft head whose
    parameters are float32 on the CPU), its kernels on up to `threads` threads of torch's
    OpenMP team; with 0 threads, or where this CPU cannot run the kernels, makes `model` plain
    torch again. `bf16_weights`: read weights that hold bfloat16 values exactly from bf16
    copies (the same bits); `native_norms`: the native RMSNorm too. Call it once the weights
    are loaded (again if they change). Returns whether the fast path is on."""
    threads = threads if SMALL_GEMM_AVAILABLE else 0
    if threads > 0:
        for name, p in model.named_parameters():
            if p.dtype != torch.float32 or not p.is_cpu:
                raise ValueError(f"accelerate: {name} is {p.dtype} on {p.device}, not float32 "
                                 "on the CPU")
    on = use_small_gemm(model, threads, bf16_weights)
    use_native_norms(model, on and native_norms)
    use_native_layers(model, threads)
    use_native_moe(model, threads)
    use_native_deltanet(model, threads)
    return on


def gemm_threads(model: nn.Module) -> int:
    """The threads `accelerate` gave `model` (0: plain torch), e.g. for its draft head."""
    return getattr(model, "small_gemm_threads", 0)

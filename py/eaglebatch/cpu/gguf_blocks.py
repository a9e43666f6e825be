"""Which of a GGUF model's weights the CPU steps read as blocks (`engine.weights: quantized`,
cpu/quantized.py runs them), straight from the file's memory map (model/gguf_checkpoint.py).

Invariants:
- a weight is read as blocks when its tensor is 2-D, of a block type the kernels read
  (`BLOCK_TYPES`, F16 and BF16 included) and whole blocks per row; its float32 parameter is
  then never filled (not resident); the kernels expand the blocks to exactly the gguf
  dequantizer's values, so the run computes what the dequantized float32 model computes;
- every other tensor (other quantized types, float tensors) is dequantized into its float32
  parameter at load, said once in the log for quantized types.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter

import numpy as np
import torch

from eaglebatch.cpu.quantized import BLOCK_TYPES, QuantizedWeight, row_bytes
from eaglebatch.model import CausalLM
from eaglebatch.model.gguf_checkpoint import GgufCheckpoint

log = logging.getLogger(__name__)

_FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16


def checkpoint(gguf: str | os.PathLike[str], cfg) -> GgufCheckpoint:
    """GGUF file `gguf`'s tensors for the parameters of a model of `cfg` (ModelConfig), the
    readable block types dequantized by the extension (`expand`)."""
    with torch.device("meta"):
        names = [n for n, _ in CausalLM(cfg, max_positions=2).named_parameters()]
    return GgufCheckpoint(gguf, cfg, names, expand=expand)


def expand(data: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> np.ndarray | None:
    """float32 [n, k] of quantized rows `data` (uint8 [n, row bytes]) through the extension
    (the gguf dequantizer's values bit for bit, tests/test_quantized.py, and far faster); None
    for a type or width it does not read."""
    if ggml_type not in BLOCK_TYPES or row_bytes(ggml_type, shape[1]) is None:
        return None
    with warnings.catch_warnings():  # a read-only map: only read
        warnings.simplefilter("ignore", UserWarning)
        raw = data.reshape(shape[0], -1).view(np.uint8)  # fp16 tensors come as float16
        qw = QuantizedWeight(torch.from_numpy(raw), ggml_type, shape)
    return qw.rows(torch.arange(shape[0])).numpy()


def _readable(ck: GgufCheckpoint, name: str) -> bool:
    shape = ck.shapes()[name]
    ty = ck.ggml_type(name)
    return (len(shape) == 2 and ty in BLOCK_TYPES and row_bytes(ty, shape[1]) is not None
            and ck.blocks_readable(name))  # fmt: skip


def kept_names(ck: GgufCheckpoint) -> frozenset[str]:
    """The parameters read as blocks (module doc)."""
    return frozenset(n for n in ck.tensors if _readable(ck, n))


def block_bytes(ck: GgufCheckpoint) -> dict[str, int]:
    """name -> bytes of its blocks, for the weights read as blocks (the memory estimate)."""
    return {n: ck.nbytes(n) for n in kept_names(ck)}


def quantized_weights(ck: GgufCheckpoint) -> dict[str, QuantizedWeight]:
    """The blocks of every weight read as blocks, logging once what is dequantized instead."""
    kept = kept_names(ck)
    other = Counter(
        ck.tensors[n].type_name for n in ck.tensors
        if n not in kept and ck.ggml_type(n) not in _FLOAT_TYPES
    )  # fmt: skip
    if other:
        kinds = ", ".join(f"{c} x {kind}" for kind, c in sorted(other.items()))
        readable = ", ".join(v[0] for v in BLOCK_TYPES.values())
        log.warning("weights: %s run from dequantized float32 weights (the CPU kernels read "
                    "%s)", kinds, readable)  # fmt: skip
    return {n: QuantizedWeight(ck.blocks(n), ck.ggml_type(n), ck.shapes()[n]) for n in kept}

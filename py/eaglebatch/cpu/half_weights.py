"""Which of a bf16 or fp16 safetensors checkpoint's weights the CPU steps read in their 16-bit
form (`engine.weights: quantized`, cpu/quantized.py runs them), straight from a read-only
memory map of the files: no float32 copy, and the pages are the page cache's, shared by every
process that maps the same files (shards of one job on a node).

Invariants:
- a weight is read in 16 bits when it is an nn.Linear's or nn.Embedding's (the matrices of
  the decoder layers, the embedding and an untied LM head) and its tensor is 2-D BF16 or F16;
  its float32 parameter is then never filled (not resident);
- widening bf16 or fp16 to float32 is exact and the kernels widen in registers the very
  values the float32 model holds, so the run computes what the float32 model computes, bit for
  bit, from half the bytes;
- every other tensor (norms, float32 tensors) is loaded into its float32 parameter.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from eaglebatch.cpu.quantized import QuantizedWeight
from eaglebatch.model import CausalLM
from eaglebatch.model.weights import (
    SafetensorsEntry,
    checkpoint_files,
    read_safetensors_entries,
    text_tower_name,
)

# safetensors dtype -> the kernels' format (GGML's type numbers)
HALF_TYPES = {"F16": 1, "BF16": 30}


def _tensors(path: Path, cfg) -> dict[str, tuple[str, int, SafetensorsEntry]]:
    """parameter name -> (file, data offset, entry) of the 16-bit tensors that are the weights
    of a model of `cfg` (ModelConfig)'s linears and embedding, named as the model names them
    (a tied checkpoint's own lm_head.weight and other towers' tensors are left out)."""
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions=2)
    kinds = (nn.Linear, nn.Embedding)  # what cpu/quantized.py swaps
    wanted = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, kinds)}
    found = {}
    for file in checkpoint_files(path):
        start, entries = read_safetensors_entries(file)
        for name, e in entries.items():
            name = text_tower_name(name) if cfg.text_tower else name
            if name in wanted and len(e.shape) == 2 and e.dtype in HALF_TYPES:
                found[name] = (file, start, e)
    return found


def kept_names(path: str | os.PathLike[str], cfg) -> frozenset[str]:
    """The parameters read in 16 bits (module doc) of the checkpoint in folder `path` of a
    model of `cfg` (ModelConfig); empty for a float32 checkpoint."""
    return frozenset(_tensors(Path(path), cfg))


def half_bytes(path: str | os.PathLike[str], cfg) -> dict[str, int]:
    """name -> bytes of the weights read in 16 bits (the memory estimate)."""
    return {n: e.end - e.begin for n, (_, _, e) in _tensors(Path(path), cfg).items()}


def half_weights(path: str | os.PathLike[str], cfg) -> dict[str, QuantizedWeight]:
    """The 16-bit weights (module doc) as views of the files' memory maps."""
    weights, maps = {}, {}
    for name, (file, start, e) in _tensors(Path(path), cfg).items():
        if file not in maps:  # one map per file; each view keeps its map open
            maps[file] = np.memmap(file, dtype=np.uint8, mode="r")
        rows, k = e.shape
        data = maps[file][start + e.begin : start + e.end].reshape(rows, 2 * k)
        with warnings.catch_warnings():  # a read-only map: the kernels only read
            warnings.simplefilter("ignore", UserWarning)
            weights[name] = QuantizedWeight(torch.from_numpy(data), HALF_TYPES[e.dtype], e.shape)
    return weights

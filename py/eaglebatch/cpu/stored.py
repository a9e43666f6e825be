"""The weights a CPU run reads as its checkpoint stores them (`engine.weights: quantized`): a
GGUF file's blocks (gguf_blocks.py) or a bf16/fp16 safetensors folder's 16-bit floats
(half_weights.py), both from a memory map of the files, both widened in registers to exactly
the float32 values (cpu/quantized.py). One entry point per question the engine asks, so the
worker and the memory estimate agree on which weights those are.
"""

from __future__ import annotations

from pathlib import Path

from eaglebatch.cpu import gguf_blocks, half_weights
from eaglebatch.cpu.quantized import QuantizedWeight
from eaglebatch.model.config import ModelConfig
from eaglebatch.model.gguf_checkpoint import GgufCheckpoint


def has_stored_weights(folder: Path, gguf: Path | None) -> bool:
    """Whether the model (its folder, the GGUF file of its weights if any: job/model_files.py)
    has weights the kernels read as stored: a GGUF file, or 2-D bf16 or fp16 parameters in its
    safetensors files (headers and config only)."""
    return gguf is not None or bool(half_weights.kept_names(folder, ModelConfig.from_dir(folder)))


def stored_names(folder: Path, cfg, ck: GgufCheckpoint | None) -> frozenset[str]:
    """The parameters read as stored: their float32 copies are never filled. `ck`: the GGUF
    file's checkpoint when the model is one."""
    if ck is not None:
        return gguf_blocks.kept_names(ck)
    return half_weights.kept_names(folder, cfg)


def stored_bytes(folder: Path, gguf: Path | None, cfg) -> dict[str, int]:
    """name -> bytes of each weight read as stored (the memory estimate)."""
    if gguf is not None:
        return gguf_blocks.block_bytes(gguf_blocks.checkpoint(gguf, cfg))
    return half_weights.half_bytes(folder, cfg)


def load_stored(
    folder: Path, cfg, ck: GgufCheckpoint | None
) -> tuple[str, dict[str, QuantizedWeight]]:
    """(what they are, for the summary, and) the weights read as stored, by parameter name."""
    if ck is not None:
        return "GGUF blocks", gguf_blocks.quantized_weights(ck)
    return "safetensors 16-bit", half_weights.half_weights(folder, cfg)

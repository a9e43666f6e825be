"""A GGUF model's quantized blocks, matched to the converted checkpoint's weights and kept
beside it (`engine.weights: quantized`, cpu/quantized.py runs them).

Invariants:
- a tensor's blocks are used only when the `gguf` package's dequantizer turns them into
  exactly (bit for bit) the converted checkpoint's float32 weight, rows in the checkpoint's
  order: the converter may reorder rows (transformers undoes llama.cpp's q/k permutation), so
  the row order is found by matching rows, never assumed; anything else stays dequantized;
- only block types the kernels read (`BLOCK_TYPES`) are kept; every other quantized type runs
  from the dequantized float32 weights, said once in the log;
- the blocks are written once, next to the converted folder's weights, as
  `eaglebatch-quantized.blocks` (safetensors, atomic rename) and read from there afterwards;
  the converted folder is keyed by the GGUF file's content, so the two always belong together.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from eaglebatch.cpu.quantized import BLOCK_TYPES, QuantizedWeight

log = logging.getLogger(__name__)

BLOCKS_FILE = "eaglebatch-quantized.blocks"
VERSION = "1"  # of the file's layout; another version is rebuilt


def _tensor_name_map(reader, num_layers: int):
    """gguf's HF -> GGUF tensor-name map for the file's architecture."""
    # lazy: the gguf package, only when GGUF blocks are matched
    import gguf

    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in by_name:
        raise ValueError(f"architecture {arch!r} unknown to the gguf package")
    return gguf.get_tensor_name_map(by_name[arch], num_layers)


def _row_order(deq: np.ndarray, want: np.ndarray) -> np.ndarray | None:
    """Indices p with deq[p] == want bit for bit (rows of [n, k] float32), None if none."""
    if np.array_equal(deq.view(np.uint32), want.view(np.uint32)):
        return np.arange(deq.shape[0])
    index: dict[bytes, int] = {}
    for i, row in enumerate(deq):
        index.setdefault(row.tobytes(), i)
    order = [index.get(row.tobytes()) for row in want]
    return None if any(i is None for i in order) else np.asarray(order)


def _match(tensor, weight: torch.Tensor) -> QuantizedWeight | None:
    """The blocks of GGUF tensor `tensor` in `weight`'s row order, if they dequantize to it."""
    from gguf.quants import dequantize

    ggml_type = int(tensor.tensor_type)
    blocks = np.asarray(tensor.data)
    n, k = weight.shape
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[0] != n:
        return None
    deq = dequantize(blocks, tensor.tensor_type).reshape(n, -1)
    want = weight.detach().float().cpu().numpy()
    if deq.shape != want.shape:
        return None
    order = _row_order(deq.astype(np.float32, copy=False), want)
    if order is None:
        return None
    data = torch.from_numpy(np.ascontiguousarray(blocks[order]))
    return QuantizedWeight(data, ggml_type, (n, k))


def _candidates(model: nn.Module) -> dict[str, torch.Tensor]:
    """The float32 weights of the model's nn.Linear and nn.Embedding modules, by name."""
    return {
        f"{name}.weight": m.weight
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear | nn.Embedding) and isinstance(m.weight, torch.Tensor)
    }


def extract(
    gguf_path: Path, model: nn.Module, num_layers: int
) -> tuple[dict[str, QuantizedWeight], str]:
    """Blocks for every weight of `model` that a readable GGUF tensor of `gguf_path` holds
    exactly, and a note of what stays dequantized and why ("" when nothing does)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    names = _tensor_name_map(reader, num_layers)
    tensors = {t.name: t for t in reader.tensors}
    found: dict[str, QuantizedWeight] = {}
    other: Counter[str] = Counter()
    for name, weight in _candidates(model).items():
        base = names.get_name(name.removesuffix(".weight"))
        t = tensors.get(f"{base}.weight") if base else None
        if t is None or t.tensor_type.name in ("F32", "F16", "BF16"):
            continue
        if int(t.tensor_type) not in BLOCK_TYPES:
            other[t.tensor_type.name] += 1
            continue
        qw = _match(t, weight)
        if qw is None:
            other[f"{t.tensor_type.name} (not the checkpoint's values)"] += 1
        else:
            found[name] = qw
    note = ""
    if other:
        kinds = ", ".join(f"{c} x {kind}" for kind, c in sorted(other.items()))
        readable = ", ".join(v[0] for v in BLOCK_TYPES.values())
        note = (f"weights: {kinds} run from dequantized float32 weights (the CPU kernels read "
                f"{readable})")  # fmt: skip
    return found, note


def save(path: Path, weights: dict[str, QuantizedWeight], note: str) -> None:
    """Writes `weights` (and `extract`'s note) to `path` atomically (tmp + fsync + rename)."""
    from safetensors.torch import save_file

    meta = {"version": VERSION, "note": note, "types": json.dumps(
        {n: [w.ggml_type, *w.shape] for n, w in weights.items()})}  # fmt: skip
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({n: w.blocks for n, w in weights.items()}, str(tmp), metadata=meta)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path) -> tuple[dict[str, QuantizedWeight], str] | None:
    """The blocks and note saved at `path`, None when absent or of another version."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        types = _types(f)
        if types is None:
            return None
        found = {n: QuantizedWeight(f.get_tensor(n), t, (rows, k)) for n, (t, rows, k) in
                 types.items()}  # fmt: skip
        return found, (f.metadata() or {}).get("note", "")


def _types(f) -> dict[str, list[int]] | None:
    """name -> [ggml type, rows, k] from an open blocks file's header; None for another
    version."""
    meta = f.metadata() or {}
    if meta.get("version") != VERSION:
        return None
    return json.loads(meta["types"])


def kept_names(model_dir: Path) -> frozenset[str]:
    """The weight names whose blocks are kept beside `model_dir` (read from the file's header;
    empty when there are none yet): a worker need not load their float32 copies."""
    from safetensors import safe_open

    path = model_dir / BLOCKS_FILE
    if not path.is_file():
        return frozenset()
    with safe_open(str(path), framework="pt") as f:
        return frozenset(_types(f) or ())


def quantized_weights(
    model_dir: Path, gguf_path: Path | None, model: nn.Module, num_layers: int
) -> dict[str, QuantizedWeight]:
    """The blocks kept beside `model_dir` (built from `gguf_path` against the loaded `model`
    on first use); {} for a checkpoint without a GGUF file."""
    path = model_dir / BLOCKS_FILE
    kept = load(path)
    if kept is None:
        if gguf_path is None:
            return {}
        kept = extract(gguf_path, model, num_layers)
        try:
            save(path, *kept)
        except OSError as e:  # a read-only cache: rebuilt next time, nothing lost
            log.warning("weights: could not keep the quantized blocks in %s (%s)", path, e)
    found, note = kept
    if note:
        log.warning("%s", note)
    return found

"""Loading Hugging Face safetensors checkpoints by parameter name."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(path: str | os.PathLike[str]) -> list[str]:
    """The checkpoint's *.safetensors files: those named by the shard index if there is one,
    else every *.safetensors file in the directory."""
    root = os.fspath(path)
    index = os.path.join(root, INDEX_FILE)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = [os.path.join(root, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise FileNotFoundError(f"{index} names shards that do not exist: {missing}")
    else:
        files = sorted(
            os.path.join(root, name) for name in os.listdir(root) if name.endswith(".safetensors")
        )
    if not files:
        raise FileNotFoundError(f"no *.safetensors checkpoint in {root}")
    return files


def iter_tensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, one at a time."""
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def load_named_tensors(
    module: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    ignore: tuple[str, ...] = (),
    source: str = "checkpoint",
) -> None:
    """Copies tensors into `module`'s parameters of the same name, cast to each parameter's dtype
    and device. Every parameter must be loaded exactly once; a tensor matching no parameter is an
    error unless its name ends with one of `ignore`."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in tensors:
        param = params.get(name)
        if param is None:
            if not (ignore and name.endswith(ignore)):
                unexpected.append(name)
            continue
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if unexpected or missing:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_short(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_short(sorted(unexpected))}")
        raise ValueError(f"{source} does not match the model: {'; '.join(parts)}")


def _short(names: list[str], limit: int = 8) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more

"""Loading Hugging Face safetensors checkpoints by parameter name."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

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
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted({os.path.basename(str(v)) for v in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise ValueError(f"{index} is not a valid shard index") from None
        files = [os.path.join(root, name) for name in names]
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


# Bytes per element of the safetensors dtypes.
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors file: its bytes are file[data_start + begin : data_start +
    end]."""

    dtype: str  # safetensors' name: "BF16", "F16", "F32", ...
    shape: tuple[int, ...]
    begin: int
    end: int


def read_safetensors_entries(file: str) -> tuple[int, dict[str, SafetensorsEntry]]:
    """(offset of the data in the file, {tensor name: entry}) from a safetensors file's header,
    after checking that the header parses and that every tensor's bytes lie inside the file (a
    truncated download fails here). Reads only the header. Raises ValueError naming the
    file."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > min(size - 8, _MAX_HEADER):
            raise ValueError(f"{file} is not a safetensors file (or is truncated)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):
            raise ValueError(f"{file} has an unreadable safetensors header") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file} has an unreadable safetensors header")
    data_bytes = size - 8 - n
    entries = {}
    for name, t in header.items():
        if name != "__metadata__":
            entries[name] = _checked_entry(file, name, t, data_bytes)
    return 8 + n, entries


def read_safetensors_header(file: str) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from a safetensors file's header (`read_safetensors_entries`)."""
    return {name: e.shape for name, e in read_safetensors_entries(file)[1].items()}


def _checked_entry(file: str, name: str, t: object, data_bytes: int) -> SafetensorsEntry:
    """Header entry `t`, after checking its dtype, shape and byte range."""
    try:
        shape = tuple(t["shape"])
        begin, end = t["data_offsets"]
        item = _DTYPE_BYTES[t["dtype"]]
        ok = all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end))
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{file}: tensor {name!r} has a malformed header entry")
    if end - begin != math.prod(shape) * item or end > data_bytes:
        raise ValueError(
            f"{file}: tensor {name!r} needs bytes {begin}..{end} of {data_bytes} "
            f"(the file is truncated or damaged)"
        )
    return SafetensorsEntry(t["dtype"], shape, begin, end)


def checkpoint_shapes(path: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """{name: shape} over every checkpoint file, from the headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in checkpoint_files(path):
        for name, shape in read_safetensors_header(file).items():
            if name in shapes:
                raise ValueError(f"{file}: tensor {name!r} is also in another checkpoint file")
            shapes[name] = shape
    return shapes


def check_shapes(
    expected: dict[str, tuple[int, ...]],
    found: dict[str, tuple[int, ...]],
    *,
    ignore: tuple[str, ...] = (),
    source: str = "checkpoint",
) -> None:
    """The rule of load_named_tensors over shapes alone: every expected tensor present once with
    its shape, nothing unexpected unless its name ends with one of `ignore`."""
    for name, shape in found.items():
        want = expected.get(name)
        if want is not None and tuple(shape) != tuple(want):
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(shape)}, "
                f"the model expects {tuple(want)}"
            )
    unexpected = [n for n in found if n not in expected and not (ignore and n.endswith(ignore))]
    _check_complete(sorted(set(expected) - set(found)), sorted(unexpected), source)


def _check_complete(missing: list[str], unexpected: list[str], source: str) -> None:
    if unexpected or missing:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_short(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_short(unexpected)}")
        raise ValueError(f"{source} does not match the model: {'; '.join(parts)}")


_OTHER_TOWERS = tuple(p + t for p in ("", "model.")
                      for t in ("vision_tower.", "multi_modal_projector.", "audio_tower.",
                                "embed_vision.", "embed_audio.", "visual."))  # fmt: skip


def is_mtp_tensor(name: str) -> bool:
    """A tensor of the checkpoint's multi-token-prediction layer (mtp.*): a drafter's
    (speculative/mtp.py), not the decoder's; a model load leaves it unread."""
    return name.startswith("mtp.")


def text_tower_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as the text model names it (language_model.model.X
    and model.language_model.X -> model.X, language_model.lm_head -> lm_head); None for the
    other towers' tensors, which a text run does not load."""
    if name.startswith(_OTHER_TOWERS):
        return None
    for old, new in (("model.language_model.", "model."), ("language_model.", "")):
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def iter_tensors(
    path: str | os.PathLike[str], skip: Callable[[str], bool] = lambda name: False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, one at a time, but those whose
    name `skip` says (never read)."""
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if not skip(name):
                    yield name, f.get_tensor(name)


def load_named_tensors(
    module: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    ignore: tuple[str, ...] = (),
    source: str = "checkpoint",
    skip: frozenset[str] = frozenset(),
) -> None:
    """Copies tensors into `module`'s parameters of the same name, cast to each parameter's dtype
    and device. Every parameter must be loaded exactly once, but those in `skip`, which are left
    as they are (the caller replaces them); a tensor matching no parameter is an error unless its
    name ends with one of `ignore`."""
    params = dict(module.named_parameters())
    loaded: set[str] = set(skip) & set(params)
    unexpected: list[str] = []
    for name, tensor in tensors:
        param = params.get(name)
        if param is None:
            if not (ignore and name.endswith(ignore)):
                unexpected.append(name)
            continue
        if name in skip:
            continue
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    _check_complete(sorted(set(params) - loaded), sorted(unexpected), source)


def _short(names: list[str], limit: int = 8) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more

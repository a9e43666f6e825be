"""A GGUF file's header and tensor table, read lean: the metadata's scalars, strings and short
arrays of numbers (per-layer settings: a list); longer arrays, such as the tokenizer's 50-250k
tokens, are stepped over, not built (the `gguf` package's reader spends seconds making an
object per token), and each tensor as a numpy view of a
read-only memory map of the file (nothing of the data is read until used).

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64
metadata count; metadata entries (string key, u32 type, value); tensor infos (string name,
u32 dims, u64 x dims (innermost first), u32 GGML type, u64 offset); data from the next
multiple of `general.alignment` (32 when absent). A string is a u64 length and UTF-8 bytes.
The views follow the `gguf` package's reader: F32 / F16 / F64 / I8-I64 typed with the
dimensions reversed, every other type uint8 [rows, bytes per row].
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

# GGUF metadata value types -> struct format (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_SHORT = 4096  # the longest array of numbers `meta` holds as a list (per-layer settings)
# GGML types with a numpy item type (the rest are blocks of bytes)
_ITEMS = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
          28: np.float64}  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the innermost (row) dimension first
    ggml_type: int
    data_offset: int  # from the start of the file
    n_bytes: int
    data: np.ndarray  # a view of the map (see the module doc)

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name


class _Cursor:
    def __init__(self, buf, pos: int = 0) -> None:
        self.buf, self.pos = buf, pos

    def unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return text

    def value(self, vtype: int):
        """A metadata value; an array of at most _SHORT numbers as a list, any other array
        stepped over and returned as ("array", count)."""
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item == _STRING:
                for _ in range(count):
                    self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
            elif item == _ARRAY:
                for _ in range(count):
                    self.value(_ARRAY)
            elif count <= _SHORT:
                return [self.unpack(_SCALARS[item]) for _ in range(count)]
            else:
                self.pos += count * struct.calcsize(_SCALARS[item])
            return ("array", count)
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF metadata type {vtype}")
        return self.unpack(_SCALARS[vtype])


class GgufFile:
    """GGUF file `path`: `meta` (key -> scalar, string, list of numbers or ("array", count))
    and `tensors` (name -> TensorInfo). Raises ValueError on a file that is not GGUF v2/v3."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        c = _Cursor(self.map)
        if len(self.map) < 24 or bytes(self.map[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (magic)")
        version = struct.unpack_from("<I", self.map, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (v2 and v3 are read)")
        c.pos = 8
        n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
        self.meta = {}
        for _ in range(n_kv):
            key = c.string()
            self.meta[key] = c.value(c.unpack("<I"))
        infos = [self._info(c) for _ in range(n_tensors)]
        align = int(self.meta.get("general.alignment", 32))
        start = -(-c.pos // align) * align
        self.tensors = {name: self._tensor(name, dims, ty, start + off)
                        for name, dims, ty, off in infos}  # fmt: skip

    @staticmethod
    def _info(c: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = c.string()
        dims = tuple(c.unpack("<Q") for _ in range(c.unpack("<I")))
        return name, dims, c.unpack("<I"), c.unpack("<Q")

    def _tensor(self, name: str, dims: tuple[int, ...], ty: int, offset: int) -> TensorInfo:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ty)]
        elems = int(np.prod(dims))
        n_bytes = elems * size // block
        if offset + n_bytes > len(self.map):
            raise ValueError(f"tensor {name} lies past the end of the file (truncated?)")
        if ty in _ITEMS:
            data = np.frombuffer(self.map, _ITEMS[ty], elems, offset).reshape(dims[::-1])
        else:
            rows = elems // dims[0]
            data = np.frombuffer(self.map, np.uint8, n_bytes, offset).reshape(rows, -1)
        return TensorInfo(name, dims, ty, offset, n_bytes, data)

    @cached_property
    def architecture(self) -> str:
        arch = self.meta.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError("no general.architecture in the header")
        return arch

    def drop_pages(self, offset: int, size: int) -> None:
        """Drops the whole pages of [offset, offset + size) from this process's memory (read
        again from the file if touched)."""
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (offset + size) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self.map.madvise(mmap.MADV_DONTNEED, start, end - start)

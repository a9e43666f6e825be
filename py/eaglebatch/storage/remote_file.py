"""A remote object as a read-only, seekable binary file for pyarrow (footers, schemas, parts):
each read is a ranged read through the Rust block cache (rust/src/storage/remote_file.rs),
so pyarrow fetches the footer and the column chunks it needs, not the whole object."""

from __future__ import annotations

import io


class RemoteFile(io.RawIOBase):
    def __init__(self, native, url: str):
        self._native = native  # _native.RemoteFile
        self.url = url
        self._size = native.size()
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def size(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self._size - self._pos
        data = self._native.read_at(self._pos, size) if size > 0 else b""
        self._pos += len(data)
        return data

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self.read(-1)

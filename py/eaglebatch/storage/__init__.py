"""Object storage: `s3://`, `gs://` and `az://` URLs for input files, output directories and the
OpenAI Batch results file, through the Rust layer (`_native.ObjectStore`, rust/src/storage.rs)
that also reads the inputs and writes the parts: one layer, one set of credentials and
retries. pyarrow only parses the bytes it serves (remote_file.py).

Invariants:
- a path is remote exactly when it starts with one of SCHEMES (the Rust side's rule);
- a remote path is a `RemotePath` (paths.py), which offers the part of `pathlib.Path` that the
  output and input code uses, so that code is one code for both;
- `location(path, storage)` is the one place a job's path string becomes either.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from eaglebatch.storage.paths import SCHEMES, RemotePath, is_remote, store_for

__all__ = ["SCHEMES", "RemotePath", "arrow_reader", "footer_bytes", "is_remote", "location",
           "parquet_footer", "parquet_source", "store_for"]


def location(path: str | Path, storage) -> Path | RemotePath:
    """The job's path `path` (a string from the job) as a local Path or a RemotePath reached
    with `storage` (the job's StorageConfig)."""
    if isinstance(path, RemotePath):
        return path
    text = str(path)
    return RemotePath(text, store_for(storage)) if is_remote(text) else Path(text)


def parquet_source(path: Path | RemotePath):
    """What pyarrow.parquet opens to read `path`'s data: the path itself, or the remote
    object's bytes in memory (parts are small: output.part_rows rows). pyarrow never reads
    through a Python file object here: its I/O threads would call back into Python."""
    return arrow_reader(path.read_bytes()) if isinstance(path, RemotePath) else path


def parquet_footer(path: Path | RemotePath):
    """What pyarrow.parquet opens to read `path`'s footer alone (metadata, schema): the path,
    or for a remote object a buffer of its footer between the magic bytes."""
    if not isinstance(path, RemotePath):
        return path
    return arrow_reader(b"PAR1" + footer_bytes(path))


def arrow_reader(data: bytes) -> pa.BufferReader:
    """A reader over a copy of `data` in Arrow's own memory. Invariant: pyarrow never holds a
    Python-owned buffer here. Its I/O threads may drop the last reference to the buffer after
    the read returned, even while the interpreter shuts down; freeing a Python buffer takes the
    GIL, and a thread that asks for it then is ended inside a noexcept destructor: the process
    aborts ("terminate called without an active exception") after its work is done."""
    buf = pa.allocate_buffer(len(data))
    with memoryview(buf) as view, view.cast("B") as out:  # Arrow's format is "b"
        out[:] = data
    return pa.BufferReader(buf)


def footer_bytes(path: RemotePath) -> bytes:
    """A remote Parquet object's footer and its 8-byte tail (two ranged reads, whatever the
    object's size): what fingerprint.footer_sha256 hashes of a local file."""
    with path.open("rb") as f:
        f.seek(-8, 2)
        tail = f.read(8)
        size = int.from_bytes(tail[:4], "little")
        if tail[4:] != b"PAR1" or size + 12 > f.raw.size():
            raise OSError(f"{path}: not a Parquet file (no footer)")
        f.seek(-(8 + size), 2)
        return f.read(size) + tail

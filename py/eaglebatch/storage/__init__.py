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

from eaglebatch.storage.paths import SCHEMES, RemotePath, is_remote, store_for

__all__ = ["SCHEMES", "RemotePath", "is_remote", "location", "parquet_source", "store_for"]


def location(path: str | Path, storage) -> Path | RemotePath:
    """The job's path `path` (a string from the job) as a local Path or a RemotePath reached
    with `storage` (the job's StorageConfig)."""
    if isinstance(path, RemotePath):
        return path
    text = str(path)
    return RemotePath(text, store_for(storage)) if is_remote(text) else Path(text)


def parquet_source(path: Path | RemotePath):
    """What pyarrow.parquet opens for `path`: the path itself, or a seekable reader of the
    remote object (ranged reads)."""
    return path.open("rb") if isinstance(path, RemotePath) else path

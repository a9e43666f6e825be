"""The output directory: Parquet part files written by the Rust writer.

Invariant: every `part-*.parquet` in the directory is complete (the writer writes a hidden
temporary name, closes the footer, fsyncs it, renames it and fsyncs the directory). Hidden
`.part-*.tmp` files are leftovers of a killed run and are safe to delete once this run holds the
directory's lock (`.eaglebatch.lock`, an flock the kernel drops when the process dies, however
it dies): two runs never write one directory at once. Whether the parts belong to this job
(resume) or another one is decided in resume.py.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import JobError

try:
    import fcntl
except ImportError:  # not POSIX: no lock
    fcntl = None

PART_GLOB = "part-*.parquet"
LOCK_NAME = ".eaglebatch.lock"
_held: dict[Path, int] = {}  # directory -> open, locked file descriptor


def part_files(path: Path) -> list[Path]:
    return sorted(path.glob(PART_GLOB)) if path.is_dir() else []


def _lock(path: Path) -> None:
    key = path.resolve()
    if fcntl is None or key in _held:
        return
    fd = os.open(key / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise JobError(
            f"output.path: {path} is in use by another running eaglebatch job; wait for it to "
            f"finish or stop it, or choose another output.path"
        ) from None
    _held[key] = fd


def release_output_dir(path: Path) -> None:
    """Drops the lock taken by prepare_output_dir (process exit drops it too)."""
    fd = _held.pop(path.resolve(), None)
    if fd is not None:
        os.close(fd)


def prepare_output_dir(path: Path, restart: bool) -> None:
    """Locks the directory for this run, creates it, deletes a killed run's temporary files and,
    with `restart`, every earlier result. Earlier part files are otherwise kept: the run
    resumes after them."""
    if path.exists() and not path.is_dir():
        raise JobError(f"output.path: {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        _lock(path)
        for tmp in path.glob(".part-*.tmp"):
            tmp.unlink(missing_ok=True)
        probe = path / ".part-write-check.tmp"  # fail now, not at the first part file
        probe.write_bytes(b"")
        probe.unlink()
        if restart:
            for p in part_files(path):
                p.unlink()
    except OSError as e:
        raise JobError(f"output.path: cannot prepare {path}: {e.strerror or e}") from None

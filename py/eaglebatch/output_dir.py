"""The output directory: Parquet part files written by the Rust writer.

Invariant: every `part-*.parquet` in the directory is complete (the writer writes a hidden
temporary name, closes the footer, fsyncs it, renames it and fsyncs the directory). Hidden
`.part-*.tmp` files are leftovers of a killed run and are always safe to delete. Whether the
parts belong to this job (resume) or another one is decided in resume.py.
"""

from __future__ import annotations

from pathlib import Path

from .config import JobError

PART_GLOB = "part-*.parquet"


def part_files(path: Path) -> list[Path]:
    return sorted(path.glob(PART_GLOB)) if path.is_dir() else []


def prepare_output_dir(path: Path, restart: bool) -> None:
    """Creates the directory, deletes a killed run's temporary files and, with `restart`, every
    earlier result. Earlier part files are otherwise kept: the run resumes after them."""
    if path.exists() and not path.is_dir():
        raise JobError(f"output.path: {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
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

"""The output directory: Parquet part files written by the Rust writer.

Invariant: every `part-*.parquet` in the directory is complete (the writer writes a hidden
temporary name, closes the footer, fsyncs and renames). Hidden `.part-*.tmp` files are
leftovers of a killed run and are always safe to delete.
"""

from __future__ import annotations

from pathlib import Path

from .config import JobError

PART_GLOB = "part-*.parquet"


def part_files(path: Path) -> list[Path]:
    return sorted(path.glob(PART_GLOB)) if path.is_dir() else []


def prepare_output_dir(path: Path, restart: bool) -> None:
    if path.exists() and not path.is_dir():
        raise JobError(f"output.path: {path} exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    for tmp in path.glob(".part-*.tmp"):
        tmp.unlink(missing_ok=True)
    parts = part_files(path)
    if parts and not restart:
        raise JobError(
            f"output.path: {path} already holds {len(parts)} part file(s) from an earlier run; "
            f"pass --restart to delete them and start over"
        )
    for p in parts:
        p.unlink()

"""The output directory: Parquet part files written by the Rust writer, and nothing else.

Invariants:
- every visible `part-*.parquet` is complete: the writer writes a hidden `.part-*.tmp` name,
  closes the footer, fsyncs it, renames it and fsyncs the directory;
- eaglebatch deletes only what it can prove it wrote: its part files (their footer carries
  `eaglebatch.job_hash`) and its own hidden `.part-*.tmp` leftovers. Any other visible entry
  (another program's parts, an input file, a subdirectory) makes the run refuse, naming it, with
  or without `--restart`: `pyarrow.parquet.read_table(dir)` would mix it into the result;
- a run holds an exclusive flock on an open descriptor of the directory itself, so deleting a
  file cannot break the lock; the kernel drops it when the process ends, however it ends.
Whether our parts belong to this job (resume) or to another one is decided in resume.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .config import JobError

try:
    import fcntl
except ImportError:  # not POSIX: no lock
    fcntl = None

PART_GLOB = "part-*.parquet"
OWNER_KEY = b"eaglebatch.job_hash"  # present in the footer of every part eaglebatch writes
TMP_GLOB = ".part-*.tmp"
_held: dict[Path, int] = {}  # directory -> open, locked descriptor of the directory


def part_files(path: Path) -> list[Path]:
    return sorted(path.glob(PART_GLOB)) if path.is_dir() else []


@dataclass
class DirContents:
    """What a directory holds, as far as eaglebatch is concerned."""

    # eaglebatch part files -> their footer's key-value metadata (read once, here)
    ours: dict[Path, dict[bytes, bytes]] = field(default_factory=dict)
    foreign: list[Path] = field(default_factory=list)  # visible entries we did not write
    unreadable: list[tuple[Path, str]] = field(default_factory=list)  # part-*.parquet, no footer


def _footer_metadata(part: Path) -> dict[bytes, bytes]:
    """`part`'s footer key-value metadata. Raises on an unreadable footer."""
    return pq.read_metadata(part).metadata or {}


def scan_dir(path: Path) -> DirContents:
    """Classifies the visible entries of `path` (hidden `.x` and `_x` names are skipped, as
    pyarrow's dataset discovery skips them)."""
    out = DirContents()
    if not path.is_dir():
        return out
    for entry in sorted(path.iterdir()):
        if entry.name.startswith((".", "_")):
            continue
        if not (entry.is_file() and not entry.is_symlink() and entry.match(PART_GLOB)):
            out.foreign.append(entry)
            continue
        try:
            meta = _footer_metadata(entry)
        except (pa.ArrowException, OSError) as e:
            out.unreadable.append((entry, str(e)))
            continue
        if OWNER_KEY in meta:
            out.ours[entry] = meta
        else:
            out.foreign.append(entry)
    return out


def _names(paths: list[Path], limit: int = 5) -> str:
    shown = ", ".join(p.name + ("/" if p.is_dir() else "") for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def check_only_ours(path: Path, contents: DirContents) -> None:
    """Raises JobError naming what in `path` eaglebatch did not write (and will not delete)."""
    if contents.foreign:
        raise JobError(
            f"output.path: {path} holds {len(contents.foreign)} file(s) eaglebatch did not write "
            f"({_names(contents.foreign)}); eaglebatch never deletes or mixes in other files: "
            f"move them away or choose another output.path"
        )
    if contents.unreadable:
        part, why = contents.unreadable[0]
        raise JobError(
            f"output.path: {part} is not a readable Parquet file ({why}), so eaglebatch cannot "
            f"tell whether it wrote it; if it is a damaged eaglebatch part, delete it (its rows "
            f"are generated again), otherwise move it away or choose another output.path"
        )


def _lock(path: Path) -> None:
    key = path.resolve()
    if fcntl is None or key in _held:
        return
    fd = os.open(key, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
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
    with `restart`, eaglebatch's earlier part files. Refuses (JobError) when the directory
    holds anything eaglebatch did not write. Earlier parts are otherwise kept: the run resumes
    after them."""
    if path.exists() and not path.is_dir():
        raise JobError(f"output.path: {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        _lock(path)
    except OSError as e:
        raise JobError(f"output.path: cannot prepare {path}: {e.strerror or e}") from None
    try:
        _clean(path, restart)
    except BaseException:
        release_output_dir(path)
        raise


def _clean(path: Path, restart: bool) -> None:
    try:
        contents = scan_dir(path)
        check_only_ours(path, contents)
        for tmp in path.glob(TMP_GLOB):
            tmp.unlink(missing_ok=True)
        probe = path / ".part-write-check.tmp"  # fail now, not at the first part file
        probe.write_bytes(b"")
        probe.unlink()
        if restart:
            for p in contents.ours:
                p.unlink()
    except OSError as e:
        raise JobError(f"output.path: cannot prepare {path}: {e.strerror or e}") from None

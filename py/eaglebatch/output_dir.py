"""The output directory: Parquet part files written by the Rust writer, and nothing else.

Layout: `output.path/part-*.parquet` (a run over every row), `output.path/shard-*-of-*/` (one
per shard of an array job, shards.py) and `output.path/unit-*-*/` (one per unit of a Ray run).
`pyarrow.parquet.read_table(output.path)` reads them all as one table.

Invariants:
- every visible `part-*.parquet` is complete: the writer writes a hidden `.part-*.tmp` name,
  closes the footer, fsyncs it, renames it and fsyncs the directory;
- eaglebatch deletes only what it can prove it wrote: its part files (their footer carries
  `eaglebatch.job_hash`) and its own hidden `.part-*.tmp` leftovers. Any other visible entry
  (another program's parts, an input file, a subdirectory of another name) makes the run
  refuse, naming it, with or without `--restart`: `read_table(output.path)` would mix it in;
- locks are flocks on an open descriptor of the directory itself (deleting a file cannot break
  them; the kernel drops them when the process ends, however it ends): a run over every row
  and a Ray driver hold output.path exclusively; a shard holds output.path shared and its own
  subdirectory exclusively; a Ray unit holds its subdirectory exclusively.
Whether our parts belong to this job (resume) or to another one is decided in resume.py.
"""

from __future__ import annotations

import os
import re
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
SUBDIR = re.compile(r"shard-\d+-of-\d+|unit-\d+-\d+")  # the subdirectories runs write
OWNER_KEY = b"eaglebatch.job_hash"  # present in the footer of every part eaglebatch writes
TMP_GLOB = ".part-*.tmp"
_held: dict[Path, int] = {}


class DirectoryInUse(JobError):
    """Another running eaglebatch process holds the directory's lock."""
  # directory -> open, locked descriptor of the directory


def part_files(path: Path) -> list[Path]:
    return sorted(path.glob(PART_GLOB)) if path.is_dir() else []


@dataclass
class DirContents:
    """What a directory holds, as far as eaglebatch is concerned."""

    # eaglebatch part files -> their footer's key-value metadata (read once, here)
    ours: dict[Path, dict[bytes, bytes]] = field(default_factory=dict)
    foreign: list[Path] = field(default_factory=list)  # visible entries we did not write
    unreadable: list[tuple[Path, str]] = field(default_factory=list)  # part-*.parquet, no footer
    subdirs: list[Path] = field(default_factory=list)  # shard / unit directories (top only)


def _footer_metadata(part: Path) -> dict[bytes, bytes]:
    """`part`'s footer key-value metadata. Raises on an unreadable footer."""
    return pq.read_metadata(part).metadata or {}


def scan_dir(path: Path, top: bool = False) -> DirContents:
    """Classifies the visible entries of `path` (hidden `.x` and `_x` names are skipped, as
    pyarrow's dataset discovery skips them); `top`: output.path, where shard and unit
    directories are ours too."""
    out = DirContents()
    if not path.is_dir():
        return out
    for entry in sorted(path.iterdir()):
        if entry.name.startswith((".", "_")):
            continue
        if top and SUBDIR.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink():
            out.subdirs.append(entry)
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


def scan_tree(path: Path) -> dict[Path, DirContents]:
    """output.path and each of its shard / unit directories -> what it holds."""
    top = scan_dir(path, top=True)
    return {path: top} | {d: scan_dir(d) for d in top.subdirs}


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


def _lock(path: Path, exclusive: bool = True) -> None:
    key = path.resolve()
    if fcntl is None or key in _held:
        return
    fd = os.open(key, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirectoryInUse(
            f"output.path: {path} is in use by another running eaglebatch job; wait for it to "
            f"finish or stop it, or choose another output.path"
        ) from None
    _held[key] = fd


def release_output_dir(path: Path, subdir: str | None = None) -> None:
    """Drops the locks taken by prepare_output_dir (process exit drops them too)."""
    for d in ([path / subdir] if subdir else []) + [path]:
        fd = _held.pop(d.resolve(), None)
        if fd is not None:
            os.close(fd)


def prepare_output_dir(
    path: Path, restart: bool, subdir: str | None = None, unit: bool = False
) -> None:
    """Locks output.path for this run (module doc), creates it, deletes a killed run's temporary
    files and, with `restart`, eaglebatch's earlier part files. Without `subdir` the run owns
    the whole tree; with one (a shard or a Ray unit) it owns that subdirectory alone and holds
    output.path shared; a Ray `unit` runs under its driver's exclusive lock of output.path and
    checks only its own directory. Refuses (JobError) when the tree holds anything eaglebatch
    did not write. Earlier parts are otherwise kept: the run resumes after them."""
    if path.exists() and not path.is_dir():
        raise JobError(f"output.path: {path} exists and is not a directory")
    own = path if subdir is None else path / subdir
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not unit:
            _lock(path, exclusive=subdir is None)
        if subdir is not None:
            own.mkdir(exist_ok=True)
            _lock(own)
    except OSError as e:
        release_output_dir(path, subdir)
        raise JobError(f"output.path: cannot prepare {own}: {e.strerror or e}") from None
    try:
        _clean(path, own, restart, unit)
    except BaseException:
        release_output_dir(path, subdir)
        raise


def _clean(path: Path, own: Path, restart: bool, unit: bool) -> None:
    """Checks the tree under `path` (a unit: `own` alone); cleans `own` (with its subdirectories
    when it is `path`)."""
    try:
        tree = {own: scan_dir(own)} if unit else scan_tree(path)
        for d, contents in tree.items():
            check_only_ours(d, contents)
        mine = [d for d in tree if own == path or d == own] or [own]
        for d in mine:
            for tmp in d.glob(TMP_GLOB):
                tmp.unlink(missing_ok=True)
            if restart:
                for p in tree.get(d, DirContents()).ours:
                    p.unlink()
                if d not in (path, own) and not any(d.iterdir()):
                    d.rmdir()  # another run's emptied subdirectory (ours stays: it is locked)
        probe = own / ".part-write-check.tmp"  # fail now, not at the first part file
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise JobError(f"output.path: cannot prepare {own}: {e.strerror or e}") from None

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
  them; the kernel drops them when the process ends, however it ends; the file system must
  honour flock across every machine that writes, as local disks and most cluster file systems
  do): a run over every row holds output.path and every subdirectory exclusively; a Ray driver
  holds output.path exclusively; a shard holds output.path shared, its own subdirectory
  exclusively and the unit directories shared; a Ray unit holds its subdirectory exclusively;
- what a run may write is decided under the locks it depends on: the shard-count check and the
  claim of a shard's directory happen under the admission lock (`.eaglebatch.lock`), and no
  run writes rows of a unit directory another process holds.
Whether our parts belong to this job (resume) or to another one is decided in resume.py.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eaglebatch.errors import JobError
from eaglebatch.output.remote_dir import prepare_remote, release_remote
from eaglebatch.storage import RemotePath, parquet_footer
from eaglebatch.storage.lease import LeaseHeld

try:
    import fcntl
except ImportError:  # not POSIX: no lock
    fcntl = None

PART_GLOB = "part-*.parquet"
SUBDIR = re.compile(r"shard-\d+-of-\d+|unit-\d+-\d+")  # the subdirectories runs write
OWNER_KEY = b"eaglebatch.job_hash"  # present in the footer of every part eaglebatch writes
TMP_GLOB = ".part-*.tmp"
ADMISSION_LOCK = ".eaglebatch.lock"  # output_dir._admission
_held: dict[Path, int] = {}  # directory -> open, locked descriptor of the directory


class DirectoryInUse(JobError):
    """Another running eaglebatch process holds the directory's lock."""


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
    return pq.read_metadata(parquet_footer(part)).metadata or {}


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


def _checked_tree(path) -> dict[Path, DirContents]:
    """scan_tree(path), refused (JobError) where it holds what eaglebatch did not write."""
    tree = scan_tree(path)
    for d, contents in tree.items():
        check_only_ours(d, contents)
    return tree


def _checked_dir(d) -> dict[Path, DirContents]:
    """A Ray unit's own directory, checked as _checked_tree checks a tree."""
    contents = scan_dir(d)
    check_only_ours(d, contents)
    return {d: contents}


def _lock(path: Path, exclusive: bool = True) -> None:
    key = path.resolve()
    if fcntl is None or key in _held:
        return
    fd = os.open(key, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        unit = path.name.startswith("unit-")
        hint = " (a Ray engine actor may still be writing it)" if unit else ""
        raise DirectoryInUse(
            f"output.path: {path} is in use by another running eaglebatch job{hint}; wait for it "
            f"to finish or stop it, or choose another output.path"
        ) from None
    _held[key] = fd


@contextmanager
def _admission(path: Path):
    """Serialises, between the runs that share output.path (shards), the checks that decide
    what a run may write and the claim of its subdirectory: a blocking flock on a hidden file
    of output.path, held for milliseconds (a run holding output.path exclusively needs none)."""
    if fcntl is None:
        yield
        return
    fd = os.open(path / ADMISSION_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _lock_subdirs(path: Path, subdir: str | None, busy_ok: bool) -> list[Path]:
    """Fences the shard and unit directories this run does not own: a run over every row holds
    each exclusively, a shard holds the unit directories shared (a Ray engine actor that
    outlived its driver holds its unit exclusively). Raises DirectoryInUse for one another
    process holds, or (`busy_ok`: a Ray driver, whose units wait for them) returns those."""
    busy = []
    for d in sorted(e for e in path.iterdir() if SUBDIR.fullmatch(e.name) and e.is_dir()):
        if subdir is not None and (d.name == subdir or not d.name.startswith("unit-")):
            continue  # a shard: its own directory, or another shard's (same N, other rows)
        try:
            _lock(d, exclusive=subdir is None)
        except DirectoryInUse:
            if not busy_ok:
                raise
            busy.append(d)
    return busy


def release_output_dir(path: Path, subdir: str | None = None, unit: bool = False) -> None:
    """Drops the locks taken by prepare_output_dir (process exit drops them too): a unit's own
    directory, or output.path and every directory under it this process holds (an object
    store: the leases, remote_dir.py)."""
    if isinstance(path, RemotePath):
        release_remote(path, subdir)
        return
    top = path.resolve()
    if unit:
        held = [(path / subdir).resolve()] if subdir else []
    else:
        held = [k for k in _held if k == top or top in k.parents]
    for key in held:
        fd = _held.pop(key, None)
        if fd is not None:
            os.close(fd)


def release_subdirs(path: Path) -> None:
    """Drops this process's locks of the directories under output.path, keeping output.path's
    (a Ray driver, before its actors take their units; on an object store it holds none)."""
    if isinstance(path, RemotePath):
        return
    top = path.resolve()
    for key in [k for k in _held if top in k.parents]:
        os.close(_held.pop(key))


def check_output_kind(path: Path | RemotePath) -> None:
    """output.path is a directory or absent (a run creates it): a file there, or on an object
    store an object under that name (not a prefix), is a JobError naming output.path.
    `validate` and every run check this one rule, once, in prepare.check_job_input."""
    if isinstance(path, RemotePath):
        if path.is_file():
            raise JobError(f"output.path: {path} is an object, not a directory (a prefix)")
    elif path.exists() and not path.is_dir():
        raise JobError(f"output.path: {path} exists and is not a directory")


def prepare_output_dir(
    path: Path, restart: bool, subdir: str | None = None, unit: bool = False,
    admit: Callable[[], None] | None = None, busy_ok: bool = False, storage=None,
) -> list[Path]:  # fmt: skip
    """Locks output.path for this run (module doc), creates it, deletes a killed run's temporary
    files and, with `restart`, eaglebatch's earlier part files. Without `subdir` the run owns
    the whole tree; with one (a shard) it owns that subdirectory alone and holds output.path
    shared; a Ray `unit` runs under its driver's exclusive lock of output.path, in a directory
    the driver created, and checks only that. `admit` (the shard-count check) runs under the
    admission lock, before the subdirectory is claimed. Refuses (JobError) when the tree holds
    anything eaglebatch did not write. Earlier parts are otherwise kept: the run resumes after
    them. Returns the subdirectories another process holds (`busy_ok`, see _lock_subdirs).
    On an object store (`path` a RemotePath, `storage` the job's section) leases stand in for
    the locks (remote_dir.py); Ray units do not run there. The caller checked the path's kind
    (check_output_kind, in prepare.prepare: every run prepares before it opens its output)."""
    if isinstance(path, RemotePath):
        own = path / subdir if unit else None
        scan = (lambda: _checked_tree(path)) if own is None else (lambda: _checked_dir(own))
        try:
            prepare_remote(path, restart, subdir, admit, storage, scan, unit)
        except LeaseHeld as e:
            raise DirectoryInUse(f"output.path: {e}; wait for it to finish or stop it, or "
                                 f"choose another output.path") from None  # fmt: skip
        return []
    own = path if subdir is None else path / subdir
    busy: list[Path] = []
    try:
        if unit:
            if not own.is_dir():
                raise JobError(f"output.path: {own} does not exist: a Ray unit runs only in a "
                               f"directory its driver created")  # fmt: skip
            _lock(own)
        else:
            path.mkdir(parents=True, exist_ok=True)
            _lock(path, exclusive=subdir is None)
            with _admission(path) if subdir is not None else nullcontext():
                if admit is not None:
                    admit()
                if subdir is not None:
                    own.mkdir(exist_ok=True)
                    _lock(own)
                busy = _lock_subdirs(path, subdir, busy_ok and not restart)
        _clean(path, own, restart, unit, busy)
    except OSError as e:
        release_output_dir(path, subdir, unit)
        raise JobError(f"output.path: cannot prepare {own}: {e.strerror or e}") from None
    except BaseException:
        release_output_dir(path, subdir, unit)
        raise
    return busy


def _clean(path: Path, own: Path, restart: bool, unit: bool, busy: list[Path]) -> None:
    """Checks the tree under `path` (a unit: `own` alone); cleans `own` (with its subdirectories
    when it is `path`, but those another process holds)."""
    try:
        tree = _checked_dir(own) if unit else _checked_tree(path)
        mine = [d for d in tree if (own == path and d not in busy) or d == own] or [own]
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

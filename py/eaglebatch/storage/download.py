"""A local copy of a remote model (`model: s3://bucket/models/x/` or a `.gguf` object): the
model code loads local files (safetensors are memory-mapped), so a remote model is copied once
into the cache and used from there.

Invariants:
- after `cached_copy` returns, the copy holds exactly the remote listing's objects (hidden
  `.x` objects excepted), each with the size and e_tag recorded beside it
  (`.eaglebatch-source.json`, written atomically): an object that changed is copied again and
  a file whose object is no longer listed is removed, so the folder (and the run identity
  fingerprinted from it) is the remote one as of this listing;
- one process at a time brings a copy up to date: an exclusive lock on `<copy>.lock` beside it
  is held from the listing's comparison to the last write (a second process, e.g. another
  shard starting on the same node, waits and then finds the copy current);
- objects are streamed to disk in `CHUNK` ranged reads (memory stays bounded whatever their
  size) into a new hidden temporary file (temp_file.py: `.NAME.XXXX.tmp`, the parts' mode)
  and renamed: a file appears under its name only complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from eaglebatch.errors import JobError, StorageFailed
from eaglebatch.storage.paths import RemotePath, checked
from eaglebatch.temp_file import new_temp_file

try:
    import fcntl
except ImportError:  # not POSIX: no lock (one process per cache)
    fcntl = None

CHUNK = 64 << 20  # bytes per ranged read
SOURCE = ".eaglebatch-source.json"  # {relative name: [size, e_tag]} of the copied objects


def cached_copy(remote: RemotePath, cache: Path) -> Path:
    """The local copy of `remote` under `cache`: the folder (a prefix) or the file (an
    object), copied or brought up to date as the module doc says."""
    dest = cache / hashlib.sha256(remote.url.encode()).hexdigest()[:16]
    listing = _listing(remote)
    dest.mkdir(parents=True, exist_ok=True)
    with _locked(dest.with_name(dest.name + ".lock")):
        _sync(listing, dest)
    return dest / remote.name if remote.is_file() else dest


def _listing(remote: RemotePath) -> dict[str, RemotePath]:
    """The objects of `remote` (a folder's, at any depth, or the object itself) by their name
    relative to the folder (the object's parent), hidden ones left out."""
    if remote.is_file():
        objects, base = [remote], remote.parent.url
    else:
        objects, base = remote.walk_objects(), remote.url
    named = {o.url[len(base) + 1:]: o for o in objects}
    listing = {rel: o for rel, o in named.items()
               if not any(p.startswith(".") for p in rel.split("/"))}  # fmt: skip
    if not listing:
        raise JobError(f"model: {remote} does not exist or holds no objects")
    return listing


@contextlib.contextmanager
def _locked(path: Path):
    """Holds an exclusive lock on the file `path` (created if needed) while the block runs."""
    if fcntl is None:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _sync(listing: dict[str, RemotePath], dest: Path) -> None:
    """Makes `dest` hold exactly `listing` (module doc). Caller holds the lock."""
    record = _record(dest)
    wanted = {rel: [obj.stat().st_size, obj.e_tag] for rel, obj in listing.items()}
    stale = [rel for rel in _local_files(dest) if rel not in wanted]
    for rel in stale:  # first: a name may turn from a file into a folder or back
        (dest / rel).unlink()
        record.pop(rel, None)
    if stale:
        _remove_empty_dirs(dest)
        _write_record(dest, record)
    for rel, obj in listing.items():
        if record.get(rel) != wanted[rel] or not (dest / rel).is_file():
            _copy(obj, dest / rel)
            record[rel] = wanted[rel]
            _write_record(dest, record)
    if set(record) != set(wanted):  # entries of files that were gone before this call
        _write_record(dest, {rel: record[rel] for rel in wanted})


def _local_files(dest: Path) -> list[str]:
    """Every file under `dest` but the record, by its name relative to `dest`."""
    files = (p.relative_to(dest).as_posix() for p in dest.rglob("*") if not p.is_dir())
    return sorted(rel for rel in files if rel != SOURCE)


def _remove_empty_dirs(dest: Path) -> None:
    for d in sorted((p for p in dest.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):  # not empty: it still holds listed files
            d.rmdir()


def _record(dest: Path) -> dict:
    try:
        record = json.loads((dest / SOURCE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(dest: Path, record: dict) -> None:
    fd, tmp = new_temp_file(dest / SOURCE)
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True))
        os.replace(tmp, dest / SOURCE)
    finally:
        tmp.unlink(missing_ok=True)


def _copy(obj: RemotePath, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = new_temp_file(target)
    try:
        with open(fd, "wb") as out:  # closes the descriptor whatever fails below
            reader = checked(obj.store.open_file, obj.url)
            size, pos = reader.size(), 0
            while pos < size:
                chunk = checked(reader.read_at, pos, CHUNK)
                if not chunk:
                    raise StorageFailed(f"{obj}: the object ended at {pos} of {size} bytes")
                out.write(chunk)
                pos += len(chunk)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)

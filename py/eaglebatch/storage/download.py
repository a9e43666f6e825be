"""A local copy of a remote model (`model: s3://bucket/models/x/` or a `.gguf` object): the
model code loads local files (safetensors are memory-mapped), so a remote model is copied once
into the cache and used from there.

Invariants:
- objects are streamed to disk in `CHUNK` ranged reads (memory stays bounded whatever their
  size) and each appears under its name only complete (a hidden `.NAME.part`, renamed);
- a copy is reused while every object still has the size and e_tag recorded beside it
  (`.eaglebatch-source.json`); an object that changed is copied again;
- hidden objects (`.x`) are not copied.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from eaglebatch.errors import JobError
from eaglebatch.storage.paths import RemotePath, checked

CHUNK = 64 << 20  # bytes per ranged read
SOURCE = ".eaglebatch-source.json"


def cached_copy(remote: RemotePath, cache: Path) -> Path:
    """The local copy of `remote` under `cache`: the folder (a prefix) or the file (an
    object), copied or refreshed as the module doc says."""
    dest = cache / hashlib.sha256(remote.url.encode()).hexdigest()[:16]
    if remote.is_file():
        objects, base = [remote], remote.parent.url
    else:
        objects, base = remote.walk_objects(), remote.url
    objects = [o for o in objects if not any(p.startswith(".") for p in _rel(o, base).split("/"))]
    if not objects:
        raise JobError(f"model: {remote} does not exist or holds no objects")
    dest.mkdir(parents=True, exist_ok=True)
    record = _record(dest)
    for obj in objects:
        rel = _rel(obj, base)
        seen = [obj.stat().st_size, obj.e_tag]
        if record.get(rel) != seen or not (dest / rel).is_file():
            _copy(obj, dest / rel)
            record[rel] = seen
            (dest / SOURCE).write_text(json.dumps(record))
    return dest / remote.name if remote.is_file() else dest


def _rel(obj: RemotePath, base: str) -> str:
    return obj.url[len(base) + 1:]


def _record(dest: Path) -> dict:
    try:
        return json.loads((dest / SOURCE).read_text())
    except (OSError, ValueError):
        return {}


def _copy(obj: RemotePath, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.part")
    reader = checked(obj.store.open_file, obj.url)
    size, pos = reader.size(), 0
    with tmp.open("wb") as out:
        while pos < size:
            chunk = checked(reader.read_at, pos, CHUNK)
            out.write(chunk)
            pos += len(chunk)
    os.replace(tmp, target)

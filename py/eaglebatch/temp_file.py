"""Temporary files written beside their final name and renamed over it when complete.

Invariants:
- a temporary file is hidden (`.NAME.XXXX.tmp`) and created exclusively: no namesake (another
  process's or thread's temporary file, or anything else) is truncated;
- its mode is what any new file of this process gets, 0666 less the umask, as the Parquet
  parts get (mkstemp's 0600 would leave results, cached models and prompt files readable by
  their owner alone).
"""

from __future__ import annotations

import os
from pathlib import Path


def new_temp_file(path: Path) -> tuple[int, Path]:
    """A new hidden file beside `path`, open for writing: (descriptor, its path). The caller
    renames it over `path` once complete and unlinks it on a failure."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")

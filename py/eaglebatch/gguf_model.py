"""A GGUF file as `model:`: converted once into a cached Hugging Face-style folder, then loaded
like any folder.

The conversion is the embedded default's (`defaults.convert_gguf`: transformers' GGUF loader
and the `gguf` package dequantize; nothing hand-written). Invariants:
- the cache is keyed by the file's content (sha256), so a moved or renamed file is not
  converted again and an edited one is; the hash of a (path, size, mtime) seen before is
  remembered in `gguf-hashes.json` next to the folders, so a start does not reread gigabytes;
- a folder is published by an atomic rename once complete (a crash leaves none behind);
- a file that is not GGUF, or whose architecture the loader cannot convert, is a JobError
  naming the file and the architecture, before any work.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from . import defaults
from .config import JobError

MAGIC = b"GGUF"


def is_gguf_path(model: str) -> bool:
    return model.lower().endswith(".gguf")


def _architecture(path: Path) -> str:
    """`general.architecture` from the file's header (the `gguf` package's reader)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    except (KeyError, IndexError, ValueError, OSError) as e:
        raise JobError(f"model: {path} is not a readable GGUF file ({e})") from None


def _content_hash(path: Path, index: Path) -> str:
    """sha256 of the file, remembered per (resolved path, size, mtime)."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        known = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(key), str):
        return known[key]
    from .resume import sha256_file

    digest = sha256_file(path)
    known[key] = digest
    tmp = index.with_name(f".{index.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known, indent=0, sort_keys=True), encoding="utf-8")
    os.replace(tmp, index)  # last writer wins: every entry it drops is recomputed, never wrong
    return digest


def gguf_model_dir(model: str) -> Path:
    """The converted folder of GGUF file `model`, converting it on first use."""
    path = Path(model)
    if not path.is_file():
        raise JobError(f"model: GGUF file {model} not found")
    with path.open("rb") as f:
        if f.read(4) != MAGIC:
            raise JobError(f"model: {path} does not start with the GGUF magic: not a GGUF file")
    arch = _architecture(path)
    root = defaults.cache_dir() / "models"
    root.mkdir(parents=True, exist_ok=True)
    digest = _content_hash(path, root / "gguf-hashes.json")
    final = root / f"gguf-{digest[:24]}-v{defaults.FORMAT_VERSION}"
    if (final / "config.json").is_file():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
    try:
        try:
            defaults.convert_gguf(path, tmp)
        except (ValueError, KeyError, NotImplementedError, RuntimeError) as e:
            raise JobError(
                f"model: {path}: cannot convert a GGUF file of architecture {arch!r} "
                f"(transformers' GGUF loader: {str(e)[:200]})"
            ) from None
        defaults.publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


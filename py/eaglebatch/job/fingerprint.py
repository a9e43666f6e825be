"""Fingerprints of what decides a job's outputs, for its identity (resume.py): model folders by
their small files' contents and their weights' names, sizes and mtimes; input files by their
content (a Parquet footer's hash, a JSONL file's whole hash), not by where they live. Plain
functions of files, imported by resume and by the model converters (of the package: only
storage, for remote input files)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow.parquet as pq

from eaglebatch.storage import arrow_reader, footer_bytes
from eaglebatch.storage.download import SOURCE

# Small text files of a model / draft folder whose exact content matters.
_MODEL_TEXT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
    "eaglebatch_source.json",  # a GGUF model's folder: the file's sha256 (job/gguf_model.py)
)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def folder_fingerprint(d: Path) -> dict:
    """Content hashes of the small files; name, size and mtime of the weight files (hashing
    gigabytes of weights on every start would be too slow; an in-place overwrite changes the
    mtime). In the copy of a remote model the weights' mtimes are each machine's own, so there
    a weight file is named by the size and e_tag of the object it was copied from (the same on
    every machine, and new whenever the object changes: storage/download.py)."""
    texts = {n: sha256_file(d / n) for n in _MODEL_TEXT_FILES if (d / n).is_file()}
    source = _copied_from(d)
    weights = sorted(
        [f.name, *source.get(f.name, [f.stat().st_size, f.stat().st_mtime_ns // 1_000_000_000])]
        for pattern in ("*.safetensors", "*.bin")
        for f in d.glob(pattern)
    )
    return {"files": texts, "weights": weights}


def _copied_from(d: Path) -> dict:
    """{file name: [size, e_tag]} of the objects a remote model's copy was made from ({}: not
    a copy)."""
    try:
        record = json.loads((d / SOURCE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict):
        return {}
    return {k: v for k, v in record.items() if isinstance(v, list) and len(v) == 2}


def footer_sha256(path: Path) -> str:
    """sha256 of a Parquet file's footer (schema, row groups, statistics): cheap to read and it
    changes with almost any rewrite of the data."""
    with path.open("rb") as f:
        f.seek(-8, 2)
        tail = f.read(8)
        size = int.from_bytes(tail[:4], "little")
        f.seek(-(8 + size), 2)
        return hashlib.sha256(f.read(size) + tail).hexdigest()


def input_fingerprint(files: list[Path], jsonl: bool = False) -> list[list]:
    """[name relative to the files' common directory, rows, bytes, footer hash] per input file:
    the content, not where it lives, so a moved or differently spelled input is the same."""
    names = _relative_names(files)
    return [[name, *_content_fingerprint(f, jsonl)] for name, f in zip(names, files)]


def _relative_names(files: list) -> list[str]:
    """Each file's name relative to the files' common directory (local paths resolved; remote
    ones, which have a `url`, by their URLs' common prefix)."""
    if not files:
        return []
    if hasattr(files[0], "url"):
        dirs = [f.url.rsplit("/", 1)[0].split("/") for f in files]
        common = os.path.commonprefix(dirs)
        return [f.url[len("/".join(common)) + 1:] for f in files]
    base = Path(os.path.commonpath([f.resolve().parent for f in files]))
    return [f.resolve().relative_to(base).as_posix() for f in files]


def _content_fingerprint(f: Path, jsonl: bool) -> list:
    """[rows, bytes, hash]: a Parquet file's footer hash, or a JSONL file's whole-content hash
    (it has no footer; rows None), streamed."""
    if not jsonl and not isinstance(f, Path):  # a remote object: its footer read once
        footer = footer_bytes(f)
        rows = pq.read_metadata(arrow_reader(b"PAR1" + footer)).num_rows
        return [rows, f.stat().st_size, hashlib.sha256(footer).hexdigest()]
    if not jsonl:
        return [pq.read_metadata(f).num_rows, f.stat().st_size, footer_sha256(f)]
    h = hashlib.sha256()
    with f.open("rb") as data:
        while chunk := data.read(1 << 20):
            h.update(chunk)
    return [None, f.stat().st_size, h.hexdigest()]

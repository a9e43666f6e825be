"""Input files: resolve a path / directory / glob to Parquet files and check their columns.

Checked before any model is loaded so a bad job fails in milliseconds. Only Parquet footers are
read here; rows are streamed later by the Rust reader.
"""

from __future__ import annotations

import glob
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from . import defaults
from .config import InputConfig, JobError


def resolve_input_files(path: str) -> list[Path]:
    builtins = {defaults.BUILTIN_SHAREGPT: defaults.sharegpt_parquet,
                defaults.BUILTIN_SHAREGPT_TURNS: defaults.sharegpt_turns_parquet}
    if path in builtins:
        return [builtins[path]()]
    if path.startswith("builtin:"):
        raise JobError(f"input.path: unknown builtin '{path}' (known: {', '.join(builtins)})")
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.parquet") if not f.name.startswith((".", "_")))
        if not files:
            raise JobError(f"input.path: directory {p} holds no .parquet files")
        return files
    if p.is_file():
        return [p]
    if glob.has_magic(path):
        files = sorted(Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file())
        if not files:
            raise JobError(f"input.path: glob '{path}' matches no files")
        return files
    raise JobError(f"input.path: {path} does not exist")


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_messages(t: pa.DataType) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return False
    item = t.value_type
    if not pa.types.is_struct(item):
        return False
    names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
    return all(k in names and _is_string(names[k]) for k in ("role", "content"))


def _is_id(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or _is_string(t)


def check_input(cfg: InputConfig) -> tuple[list[Path], int]:
    """Returns the input files and their total row count (capped by input.limit)."""
    files = resolve_input_files(cfg.path)
    total = 0
    for f in files:
        try:
            meta = pq.read_metadata(f)
            schema = pq.read_schema(f)
        except (pa.ArrowInvalid, OSError) as e:
            raise JobError(f"input.path: {f} is not a readable Parquet file ({e})") from None
        total += meta.num_rows
        checks = [(cfg.id_column, "input.id_column", _is_id, "an integer or string")]
        if cfg.messages_column is not None:
            checks.append(
                (cfg.messages_column, "input.messages_column", _is_messages,
                 "a list of {role: string, content: string} structs")
            )
        else:
            checks.append((cfg.text_column, "input.prompt_column", _is_string, "a string"))
        for column, key, ok, want in checks:
            if column is None:
                continue
            if column not in schema.names:
                names = ", ".join(schema.names)
                raise JobError(f"{key}: column '{column}' not found in {f} (columns: {names})")
            typ = schema.field(column).type
            if not ok(typ):
                raise JobError(f"{key}: column '{column}' in {f} has type {typ}, expected {want}")
    if cfg.limit is not None:
        total = min(total, cfg.limit)
    return files, total

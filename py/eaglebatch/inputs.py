"""Input files: resolve a path / directory / glob to Parquet files and check their columns.

Checked before any model is loaded so a bad job fails in milliseconds. Only Parquet footers are
read here; rows are streamed later by the Rust reader.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from . import defaults
from .config import InputConfig, JobError


def resolve_input_files(path: str, suffix: str = ".parquet") -> list[Path]:
    builtins = {defaults.BUILTIN_SHAREGPT: defaults.sharegpt_parquet,
                defaults.BUILTIN_SHAREGPT_TURNS: defaults.sharegpt_turns_parquet}
    if path in builtins:
        return [builtins[path]()]
    if path.startswith("builtin:"):
        raise JobError(f"input.path: unknown builtin '{path}' (known: {', '.join(builtins)})")
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob(f"*{suffix}") if _visible(f.relative_to(p)))
        if not files:
            raise JobError(f"input.path: directory {p} holds no {suffix} files")
        return files
    if p.is_file():
        return [p]
    if glob.has_magic(path):
        files = sorted(Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file())
        if not files:
            raise JobError(f"input.path: glob '{path}' matches no files")
        return files
    raise JobError(f"input.path: {path} does not exist")


def _visible(rel: Path) -> bool:
    """pyarrow's (and Spark's) rule: files and directories named `.x` or `_x` are not data."""
    return not any(part.startswith((".", "_")) for part in rel.parts)


def _glob_match(parts: list[str], pattern: list[str]) -> bool:
    """Whether path components `parts` match glob components `pattern` (`**` = any depth)."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob_match(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob_match(
        parts[1:], pattern[1:]
    )


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def input_may_read(input_path: str, files: list[Path], path: Path) -> bool:
    """Whether `path` (resolved) is an input file, lies in the input directory or matches the
    input glob: a file written there would be read as input by the next run."""
    if any(f.resolve() == path for f in files):
        return True
    p = Path(input_path)
    if p.is_dir():
        return _inside(path, p.resolve())
    if p.exists() or not glob.has_magic(input_path):
        return False
    pattern = Path(os.path.abspath(input_path)).as_posix().split("/")
    return _glob_match(path.as_posix().split("/"), pattern)


def check_output_apart(input_path: str, files: list[Path], output_path: str) -> None:
    """Refuses an output directory that is, contains or lies inside an input: a later run would
    read its own output as input, and read_table over the mix returns a wrong table."""
    out = Path(output_path).expanduser().resolve()
    clash = f"output.path: {output_path} must not be, contain or lie inside input.path"
    if any(_inside(f.resolve(), out) for f in files):
        raise JobError(f"{clash} ({input_path}): it would hold input files")
    p = Path(input_path)
    if p.is_dir() and (_inside(out, p.resolve()) or _inside(p.resolve(), out)):
        raise JobError(f"{clash} ({input_path}): its part files would become input")
    if not p.exists() and glob.has_magic(input_path):
        part = (out / "part-00000.parquet").as_posix().split("/")
        pattern = Path(os.path.abspath(input_path)).as_posix().split("/")
        if _glob_match(part, pattern):
            raise JobError(f"{clash}: its part files would match the glob '{input_path}'")


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


def _dense(t: pa.DataType) -> pa.DataType:
    """A dictionary-encoded column's value type (the reader reads through the keys)."""
    return t.value_type if pa.types.is_dictionary(t) else t


def _is_int(t: pa.DataType) -> bool:
    return pa.types.is_integer(_dense(t))  # int8..int64, uint8..uint64


def _is_number(t: pa.DataType) -> bool:
    return _is_int(t) or pa.types.is_floating(_dense(t))  # and float16, float32, float64


def _is_stop(t: pa.DataType) -> bool:
    t = _dense(t)
    listed = pa.types.is_list(t) or pa.types.is_large_list(t)
    return _is_string(t) or (listed and _is_string(t.value_type))


def _is_bool(t: pa.DataType) -> bool:
    return pa.types.is_boolean(_dense(t))


def _is_ids(t: pa.DataType) -> bool:
    t = _dense(t)
    listed = pa.types.is_list(t) or pa.types.is_large_list(t)
    return listed and pa.types.is_integer(t.value_type)


# The column types of each sampling key (input.sampling_columns): the rule of
# rust/src/sampling_params.rs `check_column_type`, which checks again when it opens the files.
_INT_KEYS = ("max_new_tokens", "min_new_tokens", "top_k", "seed", "logprobs")
_BOOL_KEYS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


def _sampling_check(key: str) -> tuple:
    if key == "stop":
        return _is_stop, "a string or list<string>"
    if key == "stop_token_ids":
        return _is_ids, "a list of integers"
    if key in _INT_KEYS:
        return _is_int, "an integer"
    if key in _BOOL_KEYS:
        return _is_bool, "a boolean"
    return _is_number, "a number (integer or float)"


# The Parquet codecs the Rust reader decodes (rust/src/reader.rs `codec_supported`): every
# one pyarrow writes.
_READABLE_CODECS = ("UNCOMPRESSED", "SNAPPY", "GZIP", "LZ4", "LZ4_RAW", "ZSTD", "BROTLI")


BATCH_URLS = ("/v1/chat/completions", "/v1/completions")
_BLANK = b" \t\n\r\x0c"  # ASCII whitespace as Rust's is_ascii_whitespace
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark opening a file is not part of line 1


@dataclass(frozen=True)
class BatchInput:
    """What an OpenAI Batch input holds, read before any work (inputs.check_batch_input)."""

    files: list[Path]
    total: int  # requests: non-blank lines, capped by input.limit
    first_url: str  # the first line's served url (the default of parts without `endpoint`)
    chat: bool  # a line is a chat request: its messages need the chat template


def check_batch_input(cfg: InputConfig) -> BatchInput:
    """OpenAI Batch JSONL: the files, their requests and what they ask. Each line names its
    own endpoint (openai_batch.rs; one file may mix them); at least one line must be a request
    to one eaglebatch serves. Lines are parsed only while that is unknown, and then only those
    that may be chat requests (they hold "chat"), until one is. A file may open with a UTF-8
    byte order mark and end its lines in CRLF, as openai_batch.rs reads it."""
    files = resolve_input_files(cfg.path, ".jsonl")
    total, first, chat = 0, None, False
    for f in files:
        try:
            with open(f, "rb") as lines:
                for i, line in enumerate(lines):
                    line = line.removeprefix(_BOM) if i == 0 else line
                    if not line.strip(_BLANK):  # the reader's rule (openai_batch.rs is_blank)
                        continue
                    total += 1
                    if first is None or (not chat and b"chat" in line):
                        url = _line_url(line)
                        first = first or url
                        chat = url == BATCH_URLS[0]
        except OSError as e:
            raise JobError(f"input.path: cannot read {f} ({e})") from None
    if first is None and total:
        raise JobError(f"input.path: no line of {cfg.path} is a request to "
                       f"{' or '.join(BATCH_URLS)}")  # fmt: skip
    if cfg.limit is not None:
        total = min(total, cfg.limit)
    return BatchInput(files, total, first or BATCH_URLS[0], chat)


def _line_url(line: bytes) -> str | None:
    try:
        url = json.loads(line).get("url")
    except (ValueError, AttributeError):
        return None
    return url if url in BATCH_URLS else None


def check_input(cfg: InputConfig) -> tuple[list[Path], int]:
    """Returns the input files and their total row count (capped by input.limit)."""
    if cfg.openai_batch:
        batch = check_batch_input(cfg)
        return batch.files, batch.total
    files = resolve_input_files(cfg.path)
    total = 0
    id_types: dict[str, Path] = {}
    for f in files:
        try:
            meta = pq.read_metadata(f)
            schema = pq.read_schema(f)
        except (pa.ArrowException, OSError) as e:
            raise JobError(f"input.path: {f} is not a readable Parquet file ({e})") from None
        total += meta.num_rows
        _check_columns(cfg, f, schema)
        _check_codecs(cfg, f, meta)
        if cfg.id_column is not None:
            id_types.setdefault(str(schema.field(cfg.id_column).type), f)
        if len(id_types) > 1:
            (t1, f1), (t2, f2) = list(id_types.items())[:2]
            raise JobError(
                f"input.id_column: column '{cfg.id_column}' has type {t1} in {f1} but {t2} in "
                f"{f2}; the output id column has one type, so every input file must agree"
            )
    if cfg.limit is not None:
        total = min(total, cfg.limit)
    return files, total


def _check_columns(cfg: InputConfig, f: Path, schema: pa.Schema) -> None:
    """Raises JobError naming the key when a configured column is missing or mistyped."""
    checks = [(cfg.id_column, "input.id_column", _is_id, "an integer or string")]
    if cfg.messages_column is not None:
        checks.append(
            (cfg.messages_column, "input.messages_column", _is_messages,
             "a list of {role: string, content: string} structs")
        )
    else:
        checks.append((cfg.text_column, "input.prompt_column", _is_string, "a string"))
    for key, column in sorted(cfg.sampling_columns.items()):
        checks.append((column, f"input.sampling_columns.{key}", *_sampling_check(key)))
    for column, key, ok, want in checks:
        if column is None:
            continue
        if column not in schema.names:
            names = ", ".join(schema.names)
            raise JobError(f"{key}: column '{column}' not found in {f} (columns: {names})")
        typ = schema.field(column).type
        if not ok(typ):
            raise JobError(f"{key}: column '{column}' in {f} has type {typ}, expected {want}")


def _check_codecs(cfg: InputConfig, f: Path, meta: pq.FileMetaData) -> None:
    """Raises JobError naming the file, column and codec when a column the reader reads is
    compressed with a codec it cannot decode (the check rust/src/reader.rs makes again)."""
    read = {cfg.text_column, cfg.messages_column, cfg.id_column, *cfg.sampling_columns.values()}
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        for c in range(rg.num_columns):
            col = rg.column(c)
            root = col.path_in_schema.split(".")[0]
            if root in read and col.compression not in _READABLE_CODECS:
                raise JobError(
                    f"input.path: column '{root}' of {f} is compressed with {col.compression}, "
                    f"which eaglebatch cannot read (supported: "
                    f"{', '.join(c.lower() for c in _READABLE_CODECS)}); rewrite the file"
                )

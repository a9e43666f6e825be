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

from eaglebatch.errors import JobError
from eaglebatch.job import builtin
from eaglebatch.job.column_types import (
    MIXING_RULE,
    dense,
    is_int,
    is_list_of,
    is_number,
    is_text,
    unified,
)
from eaglebatch.job.config import InputConfig, JobConfig
from eaglebatch.storage import RemotePath, is_remote, location, parquet_footer


def resolve_input_files(path: str, suffix: str = ".parquet", storage=None) -> list[Path]:
    """input.path's files: a builtin, a file, a directory's visible `suffix` files at any depth,
    or a glob's visible matches (remote paths: the same rules over a listing)."""
    builtins = {builtin.BUILTIN_SHAREGPT: builtin.sharegpt_parquet,
                builtin.BUILTIN_SHAREGPT_TURNS: builtin.sharegpt_turns_parquet}
    if path in builtins:
        return [builtins[path]()]
    if path.startswith("builtin:"):
        raise JobError(f"input.path: unknown builtin '{path}' (known: {', '.join(builtins)})")
    if is_remote(path):
        return _remote_input_files(location(path, storage), path, suffix)
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob(f"*{suffix}") if _visible(f.relative_to(p)))
        if not files:
            raise JobError(f"input.path: directory {p} holds no {suffix} files")
        return files
    if p.is_file():
        return [p]
    if glob.has_magic(path):
        pattern = Path(os.path.abspath(path)).as_posix().split("/")
        files = sorted(Path(f) for f in glob.glob(path, recursive=True)
                       if Path(f).is_file() and _glob_visible(Path(os.path.abspath(f)), pattern))
        if not files:
            raise JobError(f"input.path: glob '{path}' matches no files")
        return files
    raise JobError(f"input.path: {path} does not exist")


def _remote_input_files(root: RemotePath, path: str, suffix: str) -> list[RemotePath]:
    """resolve_input_files' rules for an object-store URL: one listing of the longest prefix
    before any wildcard."""
    if glob.has_magic(path):
        scheme, rest = path.split("://", 1)
        parts = rest.split("/")
        fixed = next(i for i, c in enumerate(parts) if glob.has_magic(c))
        base = RemotePath(f"{scheme}://{'/'.join(parts[:fixed])}", root.store)
        pattern = parts[fixed:]
        files = [f for f in base.walk_objects()
                 if _glob_match(rel := f.url[len(base.url) + 1:].split("/"), pattern)
                 and _glob_visible(Path(*rel), pattern)]  # fmt: skip
        if not files:
            raise JobError(f"input.path: glob '{path}' matches no objects")
        return files
    if path.endswith(suffix) and root.is_file():
        return [root]
    objects = root.walk_objects()
    files = [f for f in objects if f.name.endswith(suffix)
             and _visible(Path(f.url[len(root.url) + 1:]))]  # fmt: skip
    if not files:
        what = "holds no " + suffix + " objects" if objects else "does not exist"
        raise JobError(f"input.path: {path} {what}")
    return files


def _visible(rel: Path) -> bool:
    """pyarrow's (and Spark's) rule: files and directories named `.x` or `_x` are not data."""
    return not any(part.startswith((".", "_")) for part in rel.parts)


def _glob_visible(f: Path, pattern: list[str]) -> bool:
    """The directory rule (`_visible`) for a glob's matches: a `.x` / `_x` component is data only
    where the pattern names it by a component opening with the same character (`_raw/*.jsonl`,
    `_x*.parquet`), so `out/**/*.jsonl` does not read `out/run/_results.jsonl`."""
    for c in f.as_posix().split("/"):
        if c.startswith((".", "_")) and not any(
            pc[:1] == c[:1] and fnmatch.fnmatchcase(c, pc) for pc in pattern
        ):
            return False
    return True


def _glob_match(parts: list[str], pattern: list[str]) -> bool:
    """Whether path components `parts` match glob components `pattern` (`**` = any depth)."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob_match(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob_match(
        parts[1:], pattern[1:]
    )


def _check_remote_apart(input_path: str, files: list, output_path: str) -> None:
    """check_output_apart by URL prefixes (a local path and a URL never overlap)."""
    if not (is_remote(input_path) and is_remote(output_path)):
        return
    out = output_path.rstrip("/") + "/"
    base = input_path.split("*")[0].split("?")[0].split("[")[0].rstrip("/") + "/"
    if any(str(f).startswith(out) for f in files) or out.startswith(base) or base.startswith(out):
        raise JobError(f"output.path: {output_path} must not be, contain or lie inside "
                       f"input.path ({input_path}): a later run would read its parts as input")


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
    return _glob_match(path.as_posix().split("/"), pattern) and _glob_visible(path, pattern)


def check_output_apart(input_path: str, files: list[Path], output_path: str) -> None:
    """Refuses an output directory that is, contains or lies inside an input: a later run would
    read its own output as input, and read_table over the mix returns a wrong table."""
    if is_remote(input_path) or is_remote(output_path):
        _check_remote_apart(input_path, files, output_path)
        return
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


def _is_messages(t: pa.DataType) -> bool:
    """A list of structs with string (or dictionary-of-string) fields role and content."""
    if not is_list_of(t, pa.types.is_struct):
        return False
    item = t.value_type
    names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
    return all(k in names and is_text(names[k]) for k in ("role", "content"))


def _is_id(t: pa.DataType) -> bool:
    return is_int(t) or is_text(t)


def _is_stop(t: pa.DataType) -> bool:
    return is_text(t) or is_list_of(dense(t), is_text)


def _is_bool(t: pa.DataType) -> bool:
    return pa.types.is_boolean(dense(t))


def _is_ids(t: pa.DataType) -> bool:
    t = dense(t)
    listed = pa.types.is_list(t) or pa.types.is_large_list(t)
    return listed and is_int(t.value_type)  # items of any width, dictionaries by their values


# The column types of each sampling key (input.sampling_columns): the rule of
# rust/src/reader/columns.rs `check_column_type`, which checks again when it opens the files.
_INT_KEYS = ("max_new_tokens", "min_new_tokens", "top_k", "seed", "logprobs")
_BOOL_KEYS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


def _sampling_check(key: str) -> tuple:
    if key == "stop":
        return _is_stop, "a string or list<string>"
    if key == "stop_token_ids":
        return _is_ids, "a list of integers"
    if key == "response_format":
        return is_text, "a string (a response_format's JSON text)"
    if key in _INT_KEYS:
        return is_int, "an integer"
    if key in _BOOL_KEYS:
        return _is_bool, "a boolean"
    return is_number, "a number (integer or float)"


# The Parquet codecs the Rust reader decodes (rust/src/reader/validate.rs `codec_supported`): every
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


def check_batch_input(cfg: InputConfig, storage=None) -> BatchInput:
    """OpenAI Batch JSONL: the files, their requests and what they ask. Each line names its
    own endpoint (openai_batch.rs; one file may mix them); at least one line must be a request
    to one eaglebatch serves. Lines are parsed only while that is unknown, and then only those
    that may be chat requests (they hold "chat"), until one is. A file may open with a UTF-8
    byte order mark and end its lines in CRLF, as openai_batch.rs reads it."""
    files = resolve_input_files(cfg.path, ".jsonl", storage)
    total, first, chat = 0, None, False
    for f in files:
        try:
            with f.open("rb") if is_remote(f) else open(f, "rb") as lines:
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


def check_input(cfg: InputConfig, storage=None) -> tuple[list[Path], int]:
    """Returns the input files and their total row count (capped by input.limit); `storage`:
    the job's storage section, for remote paths."""
    if cfg.openai_batch:
        batch = check_batch_input(cfg, storage)
        return batch.files, batch.total
    files = resolve_input_files(cfg.path, storage=storage)
    total = 0
    types = ColumnTypes()
    for f in files:
        try:
            meta = pq.read_metadata(parquet_footer(f))
            schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, OSError) as e:
            raise JobError(f"input.path: {f} is not a readable Parquet file ({e})") from None
        total += meta.num_rows
        _check_columns(cfg, f, schema)
        read = {cfg.text_column, cfg.messages_column, cfg.id_column, *cfg.sampling_columns.values()}
        _check_codecs(read, f, meta)
        if cfg.id_column is not None:  # ids are written decoded: by the dictionary's values
            types.add("input.id_column", cfg.id_column, dense(schema.field(cfg.id_column).type), f)
    if cfg.limit is not None:
        total = min(total, cfg.limit)
    return files, total


def kept_columns(job: JobConfig, files: list[Path]) -> tuple[str, ...]:
    """`output.keep_columns` resolved against the input files: the names to copy into each
    output row ("*": every column of the first file but an id column named `id`), each in
    every file, of one type across them (`ColumnTypes`, by a dictionary's values), readable,
    and named as no column this job's output has (scheduler_config.output_columns). The Rust
    reader makes the same checks."""
    keep = job.output.keep_columns
    if not keep or not files:
        return ()
    # lazy: numpy and the extension, only for a job that keeps input columns
    from eaglebatch.job.scheduler_config import output_columns

    if keep == "*":
        first = pq.read_schema(parquet_footer(files[0])).names
        keep = tuple(c for c in first if not (c == "id" == job.input.id_column))
    own = output_columns(job)  # this job's: a column it does not write is free to keep
    for c in keep:
        if c in own:
            star = job.output.keep_columns == "*"
            hint = ' (list the columns to keep instead of "*")' if star else ""
            raise JobError(
                f"output.keep_columns: column '{c}' clashes with the output column of that "
                f"name{hint}; this job's output columns are {', '.join(own)}"
            )
    types = ColumnTypes()
    for f in files:
        meta = pq.read_metadata(parquet_footer(f))
        schema = meta.schema.to_arrow_schema()
        for c in keep:
            types.add("output.keep_columns", c,
                      dense(column_type(schema, c, "output.keep_columns", f)), f)  # fmt: skip
        _check_codecs(set(keep), f, meta)
    return tuple(keep)


class ColumnTypes:
    """The output type of each column written from the input, over the files seen so far
    (`column_types.unified`); a file whose type is of another kind than an earlier file's is
    a JobError naming the key, the column and both files."""

    def __init__(self) -> None:
        # column -> (unified type so far, first file's type, first file)
        self._seen: dict[str, tuple[pa.DataType, pa.DataType, Path]] = {}

    def add(self, key: str, column: str, t: pa.DataType, f: Path) -> None:
        if column not in self._seen:
            self._seen[column] = (t, t, f)
            return
        out, first, first_file = self._seen[column]
        both = unified(out, t)
        if both is None:
            raise JobError(
                f"{key}: column '{column}' has type {first} in {first_file} but {t} in {f}; "
                f"the output column has one type, so every input file must agree: {MIXING_RULE}"
            )
        self._seen[column] = (both, first, first_file)

    def output_type(self, column: str) -> pa.DataType:
        return self._seen[column][0]


def _check_columns(cfg: InputConfig, f: Path, schema: pa.Schema) -> None:
    """Raises JobError naming the key when a configured column is missing, mistyped or appears
    more than once (the Rust reader's checks, validate.rs, made before any model loads)."""
    checks = [(cfg.id_column, "input.id_column", _is_id, "an integer or string")]
    if cfg.messages_column is not None:
        checks.append(
            (cfg.messages_column, "input.messages_column", _is_messages,
             "a list of {role: string, content: string} structs")
        )
    else:
        checks.append((cfg.text_column, "input.prompt_column", is_text, "a string"))
    checks.append((cfg.continuation_column, "input.continuation_column", is_text, "a string"))
    checks.append((cfg.choices_column, "input.choices_column",
                   lambda t: is_list_of(t, is_text), "list<string>"))  # fmt: skip
    for key, column in sorted(cfg.sampling_columns.items()):
        checks.append((column, f"input.sampling_columns.{key}", *_sampling_check(key)))
    for column, key, ok, want in checks:
        if column is None:
            continue
        typ = column_type(schema, column, key, f)
        if not ok(typ):
            raise JobError(f"{key}: column '{column}' in {f} has type {typ}, expected {want}")


def column_type(schema: pa.Schema, column: str, key: str, f: Path) -> pa.DataType:
    """The type of the column the job reads by `key`; JobError when the file has no column of
    that name or several (which one the job means is unknowable: none is picked)."""
    count = schema.names.count(column)
    if count == 0:
        names = ", ".join(schema.names)
        raise JobError(f"{key}: column '{column}' not found in {f} (columns: {names})")
    if count > 1:
        times = "twice" if count == 2 else f"{count} times"
        raise JobError(f"{key}: column '{column}' appears {times} in {f}; rename all but one "
                       f"(the job cannot tell which one it means)")  # fmt: skip
    return schema.field(column).type


def _check_codecs(read: set, f: Path, meta: pq.FileMetaData) -> None:
    """Raises JobError naming the file, column and codec when a column the reader reads is
    compressed with a codec it cannot decode (the check rust/src/reader/validate.rs makes again)."""
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

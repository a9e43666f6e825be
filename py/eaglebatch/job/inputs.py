"""Input files: resolve a path / directory / glob to the files the job reads, then check them
through the extension (rust/src/reader/validate.rs: the one copy of the column, type, codec and
OpenAI Batch rules, which the scheduler applies again as it opens the files).

Checked before any model is loaded so a bad job fails in milliseconds. Only Parquet footers
(and OpenAI Batch lines until their endpoints are known) are read here; rows are streamed
later by the Rust reader.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from dataclasses import dataclass
from pathlib import Path

from eaglebatch.errors import JobError
from eaglebatch.job import builtin
from eaglebatch.job.config import InputConfig, JobConfig
from eaglebatch.storage import RemotePath, is_remote, location


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


@dataclass(frozen=True)
class BatchInput:
    """What an OpenAI Batch input holds, read before any work (inputs.check_batch_input)."""

    files: list[Path]
    total: int  # requests: non-blank lines, capped by input.limit
    # the first line's served url (the default of parts without `endpoint`; None: no lines)
    first_url: str | None
    chat: bool  # a line is a chat request: its messages need the chat template


def check_batch_input(cfg: InputConfig, storage=None, task: str = "generate") -> BatchInput:
    """OpenAI Batch JSONL: the files, their requests and what they ask (the extension's
    survey of the lines, rust/src/openai_batch.rs: each line names its own endpoint, and at
    least one must be a request to one the job's `task` serves)."""
    files = resolve_input_files(cfg.path, ".jsonl", storage)
    got = _check(_input_config(cfg, files, storage, task))
    return BatchInput(files, got["total_rows"], got["first_url"], got["chat"])


def check_input(cfg: InputConfig, storage=None) -> tuple[list[Path], int]:
    """Returns the input files and their total row count (capped by input.limit); `storage`:
    the job's storage section, for remote paths. Every file is checked as the reader reads it:
    Parquet, the columns the job reads present once and of a readable type (one type across
    files), a codec the reader decodes."""
    if cfg.openai_batch:
        batch = check_batch_input(cfg, storage)
        return batch.files, batch.total
    files = resolve_input_files(cfg.path, storage=storage)
    return files, _check(_input_config(cfg, files, storage))["total_rows"]


def kept_columns(job: JobConfig, files: list[Path]) -> tuple[str, ...]:
    """`output.keep_columns` resolved against the input files by the extension: the names to
    copy into each output row ("*": every column of the first file but an id column named
    `id`), each in every file, of one type across them and named as no column this job's
    output has."""
    keep = job.output.keep_columns
    if not keep or not files:
        return ()
    # lazy: numpy and the extension, only for a job that keeps input columns
    from eaglebatch.job.scheduler_config import job_only_config, storage_section

    config = job_only_config(job, input_files=[str(f) for f in files],
                             keep_columns=[] if keep == "*" else list(keep),
                             storage=storage_section(job.storage))  # fmt: skip
    return tuple(_check(config, keep_all=keep == "*")["kept"])


def _input_config(cfg: InputConfig, files: list, storage, task: str = "generate"):
    """The run's settings as far as reading `files` goes: the input section's (the rest
    stand-ins that read nothing)."""
    # lazy: numpy and the extension, which `import eaglebatch` never needs
    from eaglebatch.job.scheduler_config import sectioned, storage_section

    return sectioned(
        input_files=[str(f) for f in files], prompt_column=cfg.text_column,
        messages_column=cfg.messages_column, id_column=cfg.id_column, limit=cfg.limit,
        input_format="openai-batch" if cfg.openai_batch else "parquet",
        sampling_columns=dict(cfg.sampling_columns),
        continuation_column=cfg.continuation_column, choices_column=cfg.choices_column,
        tokenizer_file="", chat_template=None, bos_token=None, eos_token=None, eos_token_ids=[],
        output_dir="", file_metadata={}, num_blocks=0, max_model_len=0,
        storage=storage_section(storage), task=task,
    )  # fmt: skip


def _check(config, keep_all: bool = False) -> dict:
    """The extension's `check_inputs`; its user errors as JobError."""
    # lazy: the extension, which `import eaglebatch` never needs
    from eaglebatch import _native

    try:
        return _native.check_inputs(config, keep_all)
    except _native.UserInputError as e:
        raise JobError(str(e)) from None

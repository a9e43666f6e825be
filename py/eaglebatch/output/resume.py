"""Resuming a job: its identity (everything that decides its outputs) and the rows already done.

Invariants:
- every part file a run writes carries `eaglebatch.job_hash`, the sha256 of the canonical JSON
  of the job's identity (kept in full under `eaglebatch.job_identity` for error messages);
- a run continues output.path only if every part file under it (its shard and unit
  directories included, directory.py) carries its own hash; the rows in those parts (by
  `row_index`, the stable input position) are skipped by the Rust reader, so over all runs of
  a job, sharded or not, each input row is written exactly once;
- resume reads every page of those parts: a damaged part or a row_index written twice is
  reported with the way out, never silently ignored or overwritten.

The identity covers what changes an output row, by resolved value and content rather than by
spelling or location: the model files, the input files (names relative to their common directory,
row counts, sizes, footer hashes) and columns,
the sampling section, max_model_len, the resolved dtype, include_token_ids, and the draft head
only when sampling (greedy speculative decoding is lossless: same tokens as plain decoding). It
leaves out what only changes speed or memory (batch size, KV budget, part_rows, threads).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eaglebatch.errors import JobError
from eaglebatch.job.config import JobConfig
from eaglebatch.job.fingerprint import folder_fingerprint, input_fingerprint
from eaglebatch.output.directory import OWNER_KEY, SUBDIR, check_only_ours, scan_dir, scan_tree
from eaglebatch.storage import parquet_source

HASH_KEY = OWNER_KEY.decode()  # the key that marks a part as ours (directory.py)
IDENTITY_KEY = "eaglebatch.job_identity"
# sample keys are row_index * SAMPLE_STRIDE + sample_index: the most samples of a row (n)
SAMPLE_STRIDE = 4096
IDENTITY_VERSION = 2


def job_identity(
    job: JobConfig,
    input_files: list[Path],
    model,  # model_files.ModelFiles (its chat template may be the job's)
    draft_dir: Path | None,
    dtype: str,
    max_model_len: int,
) -> dict:
    """What decides the output rows (see the module docstring), by resolved value. JSON."""
    inp = job.input
    identity = {
        "version": IDENTITY_VERSION,
        "model": folder_fingerprint(model.dir),
        "input": {
            "files": input_fingerprint(input_files, inp.openai_batch),
            "prompt_column": inp.text_column,
            "messages_column": inp.messages_column,
            "id_column": inp.id_column,
            "apply_chat_template": inp.apply_chat_template,
            "limit": inp.limit,
            **({"sampling_columns": dict(inp.sampling_columns)} if inp.sampling_columns else {}),
            **({"format": "openai-batch"} if inp.openai_batch else {}),
            # added later: left out at their defaults so that earlier jobs still resume
            **({"add_special_tokens": False} if not inp.add_special_tokens else {}),
            **_scoring_identity(job),
        },
        "sampling": _sampling_identity(job),
        "engine": {"max_model_len": max_model_len, "dtype": dtype,
                   # added later: left out at its default so that earlier jobs still resume
                   **({"activations": "int8"} if job.engine.activations == "int8" else {})},
        "output": _output_identity(job),
    }
    if job.model_chat_template is not None:  # the template used, by content
        identity["chat_template"] = hashlib.sha256(model.chat_template.encode()).hexdigest()
    if draft_dir is not None and job.sampling.temperature > 0:
        identity["draft"] = {
            "files": folder_fingerprint(draft_dir),
            "speculative": job.speculative.model_dump(mode="json"),
        }
    return identity


def _scoring_identity(job: JobConfig) -> dict:
    """A scoring job's task and columns (nothing for generation: earlier jobs resume)."""
    if not job.scoring:
        return {}
    out = {"task": job.task, "continuation_column": job.input.continuation_column,
           "choices_column": job.input.choices_column}  # fmt: skip
    if job.pooled:
        out["embed"] = job.embed.model_dump(mode="json")
    return out


# Sampling keys added after identity version 2, left out while at their defaults so that a job
# written before they existed still resumes (its outputs were made with those defaults).
_LATER_SAMPLING_DEFAULTS = {
    "stop_token_ids": [], "ignore_eos": False, "n": 1, "min_new_tokens": 0,
    "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "min_p": 0.0, "include_stop_str_in_output": False, "skip_special_tokens": True,
}


def _output_identity(job: JobConfig) -> dict:
    """The output keys that change what a row holds (logprobs only when a row may carry them:
    the scheduler's `writes_logprobs` rule, where an openai-batch line may ask for them)."""
    out = {"include_token_ids": job.output.include_token_ids}
    inp = job.input
    if job.output.logprobs or "logprobs" in inp.sampling_columns or inp.openai_batch:
        out["logprobs"] = job.output.logprobs
        out["logprobs_mode"] = job.output.logprobs_mode
    if job.output.prompt_logprobs:
        out["prompt_logprobs"] = job.output.prompt_logprobs
    if job.output.keep_columns:  # "*" resolves by the input files, which the identity holds
        keep = job.output.keep_columns
        out["keep_columns"] = keep if keep == "*" else list(keep)
    return out


def _sampling_identity(job: JobConfig) -> dict:
    dump = job.sampling.model_dump(mode="json")
    return {k: v for k, v in dump.items() if _LATER_SAMPLING_DEFAULTS.get(k, object()) != v}


def identity_hash(identity: dict) -> str:
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class ResumeState:
    """What earlier runs of this job left in its output directory."""

    done_rows: np.ndarray  # int64 row indices with all their samples written (sorted, unique)
    part_files: int
    error_rows: np.ndarray  # int64 the done rows that have an error row (sorted)
    # subdirectory name ("" for output.path itself) -> how many part files it holds
    dirs: dict[str, int]
    # keys row_index * SAMPLE_STRIDE + sample_index of the samples written of rows that are not
    # done (sorted); the scheduler generates only their other samples
    partial_samples: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    def skipped_in(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(done rows, written sample keys of the others) for a run over rows [start, end):
        the scheduler ignores sample keys of rows outside its range."""
        rows = self.done_rows[(self.done_rows >= start) & (self.done_rows < end)]
        return rows, self.partial_samples

    def rows_done(self, total_rows: int, start: int = 0) -> int:
        """How many of the rows [start, total_rows) are done."""
        return _count_in(self.done_rows, start, total_rows)

    def errors_in(self, start: int, end: int) -> int:
        return _count_in(self.error_rows, start, end)


def _count_in(sorted_rows: np.ndarray, start: int, end: int) -> int:
    lo, hi = np.searchsorted(sorted_rows, [start, end])
    return int(hi - lo)


def _flatten(d: object, prefix: str = "") -> dict[str, object]:
    if isinstance(d, dict):
        items = [(f"{prefix}.{k}" if prefix else str(k), v) for k, v in d.items()]
    elif isinstance(d, list) and d and isinstance(d[0], (dict, list)):
        items = [(f"{prefix}[{i}]", v) for i, v in enumerate(d)]
    else:
        return {prefix: d}
    out: dict[str, object] = {}
    for k, v in items:
        out.update(_flatten(v, k))
    return out


def _shown(value: object, limit: int = 120) -> str:
    text = "(absent)" if value is None else json.dumps(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _what_changed(ours: dict, theirs_json: bytes | None) -> str:
    if theirs_json is None:
        return "it has no eaglebatch job identity"
    try:
        theirs = json.loads(theirs_json)
    except ValueError:
        return "its job identity is unreadable"
    if theirs.get("version") != ours.get("version"):
        version = theirs.get("version")
        return f"it was written by another eaglebatch version (job identity {version})"
    a, b = _flatten(theirs), _flatten(ours)
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if not keys:
        return "its job hash differs"
    shown = [f"{k}: {_shown(a.get(k))} -> {_shown(b.get(k))}" for k in keys[:4]]
    more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
    return "it differs in " + "; ".join(shown) + more


def _read_part(part: Path, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sample keys (`sample_key`) of one of our part files, each row's n (its `n` column:
    an OpenAI Batch line's own; else the job's) and the row indices of its error rows, after
    reading every column of every row group (a damaged page fails here, not in a user's
    read_table). Raises JobError naming the file."""
    try:
        pf = pq.ParquetFile(parquet_source(part))
        rows, ns, errors = [], [], []
        for g in range(pf.num_row_groups):
            table = pf.read_row_group(g)
            index = table.column("row_index").to_numpy()
            rows.append(sample_key(index, table.column("sample_index").to_numpy()))
            own = "n" in table.column_names
            ns.append(table.column("n").to_numpy() if own else np.full(len(index), n))
            errors.append(index[table.column("error").is_valid().to_numpy(zero_copy_only=False)])
    except (pa.ArrowException, OSError, KeyError, ValueError) as e:
        raise JobError(
            f"output.path: {part} is damaged ({e}); delete it (its rows are generated again) "
            f"or pass --restart to delete all of this directory's eaglebatch results"
        ) from None
    if not rows:
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(rows), np.concatenate(ns).astype(np.int64), np.concatenate(errors)


def sample_key(row_index, sample_index):
    """Resume's key of a sample (rust/src/run.rs `sample_key`: the same), whatever the
    row's n (at most SAMPLE_STRIDE)."""
    return np.asarray(row_index, np.int64) * SAMPLE_STRIDE + np.asarray(sample_index, np.int64)


def _check_unique(rows: list[np.ndarray], parts: list[Path]) -> np.ndarray:
    """All sample keys (`sample_key`), sorted; raises JobError naming a row (and sample)
    written twice and its parts."""
    done = np.concatenate(rows) if rows else np.empty(0, np.int64)
    order = np.argsort(done, kind="stable")
    sorted_rows = done[order]
    twice = np.flatnonzero(sorted_rows[1:] == sorted_rows[:-1])
    if twice.size == 0:
        return sorted_rows.astype(np.int64)
    key = int(sorted_rows[twice[0]])
    owner = np.repeat(np.arange(len(parts)), [len(r) for r in rows])
    names = sorted({_relative(parts[i]) for i in owner[done == key]})
    row, sample = divmod(key, SAMPLE_STRIDE)
    what = "" if sample == 0 else f" (sample_index {sample})"
    raise JobError(
        f"output.path: row_index {row}{what} was written more than once ({twice.size} "
        f"duplicate row(s); it is in {' and '.join(names)}): the directory was written by two "
        f"runs at once or parts were copied in. Delete the later of those parts (their rows "
        f"are generated again) or pass --restart to start over"
    )


def _relative(part: Path) -> str:
    """A part's name, with its shard / unit directory when it is in one."""
    return part.name if SUBDIR.fullmatch(part.parent.name) is None else (
        f"{part.parent.name}/{part.name}"
    )


def scan_output(path: Path, identity: dict, only: Path | None = None) -> ResumeState:
    """Reads the row indices of the part files under `path` (its shard and unit directories
    included; `only`: that one directory of it), after checking that eaglebatch wrote them,
    for this job, readably and each row once. Raises JobError (naming the file and what
    differs or is wrong) when not."""
    ours = identity_hash(identity).encode()
    n = identity["sampling"].get("n", 1)
    done: list[np.ndarray] = []
    needed: list[np.ndarray] = []
    errors: list[np.ndarray] = []
    parts: list[Path] = []
    dirs: dict[str, int] = {}
    tree = scan_tree(path) if only is None else {only: scan_dir(only)}
    for d, contents in tree.items():
        check_only_ours(d, contents)
        dirs["" if d == path else d.name] = len(contents.ours)
        for part, meta in contents.ours.items():
            if meta.get(HASH_KEY.encode()) != ours:
                why = _what_changed(identity, meta.get(IDENTITY_KEY.encode()))
                raise JobError(
                    f"output.path: {path} holds results of a different job "
                    f"({_relative(part)}: {why}); pass --restart to delete them and start "
                    f"over, or choose another output.path"
                )
            rows, ns, errs = _read_part(part, n)
            done.append(rows)
            needed.append(ns)
            errors.append(errs)
            parts.append(part)
    keys = _check_unique(done, parts)
    error_rows = np.unique(np.concatenate(errors)) if errors else np.empty(0, np.int64)
    done_rows = _complete_rows(done, needed)
    complete = np.isin(keys // SAMPLE_STRIDE, done_rows)
    return ResumeState(
        done_rows=done_rows, part_files=len(parts),
        error_rows=error_rows.astype(np.int64), dirs=dirs,
        partial_samples=keys[~complete].astype(np.int64),
    )  # fmt: skip


def _complete_rows(keys: list[np.ndarray], needed: list[np.ndarray]) -> np.ndarray:
    """The rows (sorted) whose samples written number their n (every sample of a row
    carries its row's n)."""
    if not keys:
        return np.empty(0, np.int64)
    rows = np.concatenate(keys) // SAMPLE_STRIDE
    need = np.concatenate(needed)
    uniq, first, counts = np.unique(rows, return_index=True, return_counts=True)
    return uniq[counts >= need[first]].astype(np.int64)

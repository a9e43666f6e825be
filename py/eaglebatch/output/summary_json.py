"""Machine-readable summaries for pipelines: `run --summary-json PATH` and `status --json`.

`run` writes one JSON object however it ends (`exit_reason`: "complete" when every row of the
run's scope is done, "interrupted", "failed" or "refused", with `exit_status` and `error`), so
a pipeline step reads one file instead of parsing the summary table (or, with `-` or
`/dev/stdout`, one line of JSON on stdout: commands/summary_report.py). The file is written under
a hidden temporary name and renamed: a reader never sees half of it. Its path is checked before
any work (`check_summary_path`, JobError): an existing file is replaced only when it is a summary
eaglebatch wrote (its `eaglebatch_summary` key), never inside output.path or where the input
would read it, and its directory must be writable; a FIFO, device or socket is refused unread.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

from eaglebatch.errors import JobError
from eaglebatch.job.inputs import input_may_read
from eaglebatch.output.results_file import check_writable, write_json_atomic
from eaglebatch.progress import accept_length, generation_seconds
from eaglebatch.storage import is_remote

MARK = "eaglebatch_summary"  # key (value: format version) of every summary this module writes

# the run's counters and figures, as the scheduler's summary names them (None when absent)
STAT_KEYS = ("requests", "errors", "skipped", "prompt_tokens", "output_tokens", "cached_tokens",
             "prefill_tokens", "preemptions", "latency_p50", "latency_p90", "latency_p99",
             "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "spec_steps", "spec_tokens",
             "units", "units_retried", "actors", "startup_s", "resident_mib",
             "peak_resident_mib", "kv_cache_mib", "expert_rows_per_active", "weights",
             "threads", "structured_rows", "grammar_compiles", "mask_seconds_p50",
             "mask_seconds_p99")  # fmt: skip


def plain(v):
    """A JSON value: numpy scalars as Python numbers, non-finite floats as null."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def run_summary(job, stats: dict | None, wall_s: float | None, exit_reason: str,
                exit_status: int, error: str | None = None) -> dict:  # fmt: skip
    """The summary object of one `run` (see the module doc); `job` None: the job file itself
    was refused."""
    stats = stats or {}
    out = stats.get("output_tokens")
    rate = out / wall_s if out is not None and wall_s else None
    results = None if job is None else job.output.results_file
    summary = {
        MARK: 1,
        "exit_reason": exit_reason,
        "exit_status": exit_status,
        "error": error,
        "output_path": None if job is None else str(job.output.path),
        "results_file": None if results is None else str(results),
        "wall_s": wall_s,
        "output_tok_s": rate,
        "generation_s": generation_seconds(stats.get("step_seconds")),
        "acceptance_length": accept_length(stats) if stats.get("spec_steps") else None,
    }
    summary |= {k: plain(stats.get(k)) for k in STAT_KEYS}
    return summary


def write_json(path: str | Path, obj: dict) -> None:
    """Writes the summary `obj` to `path` atomically (numpy scalars as numbers)."""
    write_json_atomic(Path(path), obj, default=plain)


def check_summary_path(path: str) -> Path:
    """`--summary-json PATH` before any work: the resolved path, or JobError when it names a
    directory, an existing file that is no summary of ours, or a place that cannot be written."""
    key = f"--summary-json: {path}"
    p = Path(os.path.abspath(os.path.expanduser(path)))
    if p.is_dir():
        raise JobError(f"{key} is a directory")
    _refuse_special(p, key)
    if p.exists() and not _is_summary(p):
        raise JobError(f"{key} exists and is not a summary eaglebatch wrote; it is never "
                       f"replaced: choose another path")  # fmt: skip
    check_writable(p.parent, key)
    return p


def check_summary_apart(p: Path, job) -> None:
    """Refuses a summary path inside output.path (resume would find a file it did not write) or
    where the job's input would read it."""
    if is_remote(job.output.path):
        return
    out = Path(job.output.path).resolve()
    if p.resolve() == out or out in p.resolve().parents:
        raise JobError(f"--summary-json: {p} lies inside output.path, which holds only the "
                       f"job's parts; choose a path outside it")  # fmt: skip
    if input_may_read(job.input.path, [], p.resolve()):
        raise JobError(f"--summary-json: {p} would be read as input (input.path "
                       f"{job.input.path}); choose a path outside the input")  # fmt: skip


def _refuse_special(p: Path, key: str) -> None:
    """A FIFO, device or socket is never opened (reading one to check it can block forever,
    before any work): refused, pointing at `-` for a stream on stdout."""
    try:
        mode = p.stat().st_mode
    except OSError:  # missing (or unreadable: the writability check names it)
        return
    if not stat.S_ISREG(mode):
        raise JobError(f"{key} is not a regular file (a FIFO, device or socket); the summary "
                       f"is written as a file, or to stdout with --summary-json -")  # fmt: skip


def _is_summary(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            obj = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and MARK in obj


def status_summary(st) -> dict:
    """`status --json`: status.JobStatus as one object."""
    def one(r) -> dict:
        return {"name": r.name, "start": r.start, "end": r.end, "done": r.done,
                "error_rows": r.errors, "complete": r.complete}  # fmt: skip

    return {
        "complete": st.complete,
        "output_path": st.output_path,
        "rows": st.total.end,
        "rows_done": st.total.done,
        "error_rows": st.total.errors,
        "part_files": st.part_files,
        "unit_dirs": st.unit_dirs,
        "shards": [one(r) for r in st.shards],
    }

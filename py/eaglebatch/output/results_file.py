"""Where the OpenAI Batch results file (output.format: openai-batch) may go, and proof that an
existing one is ours to replace.

Rules, checked before any work (JobError, exit 2):
- the default is `output.path/_results.jsonl`: inside eaglebatch's own directory under a name
  that resume, `status` and pyarrow skip (`_x`, as Spark's `_SUCCESS`), so no input directory
  or `*.jsonl` glob beside output.path reads it as input; an explicit `output.results_path`
  inside output.path must likewise be a `_x` / `.x` name at its top;
- the results path is no input file, lies in no input directory and matches no input glob;
- an existing file is replaced only when eaglebatch wrote it for this job or this
  output.path: its sidecar `.<name>.eaglebatch.json` (beside it) records the job hash, the
  output path and the file's identity (inode, size, mtime) - a file changed or replaced by
  anyone else no longer matches and is refused, like any file eaglebatch did not write;
- its directory exists or can be created, and is writable.

Replacing is crash-safe: the new file is written under a hidden temporary name and fsynced, the
sidecar then lists both the old and the new identity, the rename follows, and the sidecar is
rewritten with the new one alone; a crash at any point leaves a file the sidecar vouches for.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eaglebatch.errors import JobError
from eaglebatch.job.inputs import input_may_read
from eaglebatch.temp_file import new_temp_file

DEFAULT_NAME = "_results.jsonl"


def sidecar(results: Path) -> Path:
    return results.with_name(f".{results.name}.eaglebatch.json")


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _read_sidecar(results: Path) -> dict:
    try:
        meta = json.loads(sidecar(results).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def owned(results: Path, job_hash: str, output_path: Path) -> bool:
    """Whether the existing file `results` is one eaglebatch wrote for this job or for the same
    output.path (and nobody changed it since)."""
    meta = _read_sidecar(results)
    try:
        ident = _identity(results.stat())
    except OSError:
        return False
    same_job = meta.get("job_hash") == job_hash
    same_output = meta.get("output_path") == str(output_path.resolve())
    return ident in meta.get("files", []) and (same_job or same_output)


def check_results_path(
    results: Path, output_path: Path, job_hash: str, input_path: str, files: list[Path]
) -> None:
    """Refuses (JobError naming output.results_path) every results path of the module doc's
    rules, before any work."""
    key = f"output.results_path: {results}"
    r, out = results.resolve(), output_path.resolve()
    if out in r.parents and r.relative_to(out).parts[0][0] not in "_.":
        raise JobError(f"{key} lies inside output.path, where only part files may be; name it "
                       f"{out / DEFAULT_NAME} or put it outside output.path")  # fmt: skip
    if r == out or input_may_read(input_path, files, r):
        raise JobError(f"{key} would be read as input (input.path {input_path}) or is an input; "
                       f"choose a path outside the input")  # fmt: skip
    if r.is_dir():
        raise JobError(f"{key} is a directory")
    if r.exists() and not owned(r, job_hash, out):
        raise JobError(
            f"{key} exists and eaglebatch did not write it for this job (no matching "
            f"{sidecar(results).name} beside it): eaglebatch never replaces another file; move it "
            f"away or choose another results_path"
        )
    check_writable(r.parent, key)


def check_writable(parent: Path, key: str) -> None:
    """Refuses (JobError naming `key`) unless the first existing ancestor of `parent` is a
    writable directory: a file can then be written there, its missing folders created."""
    d = parent
    while not d.exists() and d != d.parent:
        d = d.parent
    if not d.is_dir():
        raise JobError(f"{key}: cannot write in {d}: it is not a directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise JobError(f"{key}: cannot write in {d} (permission denied)")


def write_json_atomic(path: Path, obj, default=None) -> None:
    """Writes `obj` as JSON to `path`: a new hidden temporary file beside it (no namesake is
    truncated), fsynced, renamed over `path`; nothing is left behind on a failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = new_temp_file(path)
    try:
        with open(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, default=default)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_sidecar(results: Path, meta: dict) -> None:
    write_json_atomic(sidecar(results), meta)


def replace_results(tmp: Path, results: Path, job_hash: str, output_path: Path) -> None:
    """Renames the complete, fsynced `tmp` over `results` (module doc: crash-safe), recording
    it as this job's."""
    meta = {"job_hash": job_hash, "output_path": str(output_path.resolve())}
    files = [_identity(tmp.stat())]
    if results.exists():
        if not owned(results, job_hash, output_path):  # appeared while the job ran
            tmp.unlink(missing_ok=True)
            raise JobError(
                f"output.results_path: {results} appeared while the job ran and eaglebatch did "
                f"not write it; it is left as it is: move it away and run again (the rows are "
                f"done: only the results file is written)"
            )
        files.append(_identity(results.stat()))
    _write_sidecar(results, meta | {"files": files})
    os.replace(tmp, results)
    _write_sidecar(results, meta | {"files": files[:1]})
    dir_fd = os.open(results.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)

"""`eaglebatch run-batch -i in.jsonl -o out.jsonl --model M [--draft D]`: vLLM's `run-batch`
form. It writes the job file a user would have written and runs it, so it resumes, shards and
reports as any job:

- `OUT.job.yaml`: the job (input: the batch file, format openai-batch; output: the parts
  directory and the results file OUT), marked as written by run-batch on its first line;
- `OUT.parts/`: the job's Parquet parts (resume reads them; a rerun continues after them);
- OUT: the OpenAI Batch results file, written once every request is done.

A job file already there is rewritten only if run-batch wrote it (its marker line); anything
else at that path is refused, as every file eaglebatch did not write.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from eaglebatch.errors import JobError
from eaglebatch.job import builtin
from eaglebatch.job.config import apply_overrides, job_from_dict
from eaglebatch.job.secrets import endpoint_has_credentials, is_secret_option
from eaglebatch.storage.paths import is_remote

if TYPE_CHECKING:  # pyarrow and torch: imported only once the command runs
    from eaglebatch.prepare import CheckedInput

MARKER = "# written by `eaglebatch run-batch`; rerun the same command (or `eaglebatch run` on"
MARKER_2 = "# this file) to resume"


def job_path(out: Path) -> Path:
    return out.with_name(out.name + ".job.yaml")


def job_text(inp: Path, out: Path, model: str, draft: str | None, overrides: list[str]) -> str:
    """The job file for `-i inp -o out --model model [--draft draft]` (absolute paths), with
    the `--set` overrides written in, so that `eaglebatch run` / `status` on it is this job."""
    job = {
        "model": model,
        **({"draft": draft} if draft else {}),
        "input": {"path": str(inp), "format": "openai-batch"},
        "output": {"path": str(out.with_name(out.name + ".parts")), "format": "openai-batch",
                   "results_path": str(out)},  # fmt: skip
    }
    job = apply_overrides(job, overrides)
    _refuse_credentials(job.get("storage"), job_path(out))
    return f"{MARKER}\n{MARKER_2}\n" + yaml.safe_dump(job, sort_keys=False)


def _refuse_credentials(storage, path: Path) -> None:
    """A credential given with --set would be written in clear to the job file (which must
    hold it for `eaglebatch run` on the file to reach the store): refused, naming the key."""
    if not isinstance(storage, dict):
        return
    named = []
    if isinstance(storage.get("endpoint"), str) and endpoint_has_credentials(storage["endpoint"]):
        named.append("storage.endpoint (its user:password@)")
    options = storage.get("options")
    if isinstance(options, dict):
        named += [f"storage.options.{k}" for k in options if is_secret_option(str(k))]
    if named:
        raise JobError(f"--set {', '.join(named)}: a credential would be written in clear to "
                       f"{path}; give it through the environment instead (AWS_ACCESS_KEY_ID, "
                       f"AWS_SECRET_ACCESS_KEY, ...; docs/scale-out.md)")  # fmt: skip


def _model_ref(model: str) -> str:
    """A model path as an absolute path (the job file's directory is not the shell's), a
    builtin name or an object-store URL as it is."""
    if model.startswith("builtin:") or builtin.is_builtin_model(model) or is_remote(model):
        return model
    return str(Path(model).expanduser().resolve())


def write_job(
    inp: str, out: str, model: str, draft: str | None, overrides: list[str]
) -> tuple[Path, CheckedInput]:
    """Writes (or rewrites, when run-batch wrote it) OUT.job.yaml once the job passes the
    checks that need no model (`check_batch_job`); returns its path and what those checks
    found (`run` of that file takes them: they run once). Nothing is written for a refused
    job (JobError)."""
    # lazy: pyarrow (through the input checks), only once the command runs (fast --help)
    from eaglebatch.output.results_file import check_writable

    inp_p, out_p = Path(inp).expanduser().resolve(), Path(out).expanduser().resolve()
    if not inp_p.is_file():
        raise JobError(f"-i: {inp} is not a file")
    check_writable(out_p.parent, f"-o: {out}")  # under a regular file: refused in words
    path = job_path(out_p)
    text = job_text(inp_p, out_p, _model_ref(model), draft and _model_ref(draft), overrides)
    if path.exists():
        try:
            ours = path.read_text(encoding="utf-8").startswith(MARKER)
        except (OSError, UnicodeDecodeError):
            ours = False
        if not ours:
            raise JobError(f"-o: {path} exists and run-batch did not write it; eaglebatch never "
                           f"replaces another file: move it away or choose another -o")  # fmt: skip
    checked = check_batch_job(yaml.safe_load(text), path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path, checked


def check_batch_job(data: dict, base_dir: Path) -> CheckedInput:
    """The job's checks that need no model, as `run` makes them (prepare.check_job_input, the
    results path's rules), before its job file is written: a job `run` would refuse for its
    input, its output or OUT itself (`-o model/config.json`) leaves no file behind."""
    # lazy: pyarrow, only once the arguments are checked
    from eaglebatch.output.results_file import check_results_path
    from eaglebatch.prepare import check_job_input

    job = job_from_dict(data, base_dir=base_dir)
    checked = check_job_input(job)
    if job.output.results_file is not None:  # a file there is ours only for this output.path
        check_results_path(job.output.results_file, Path(job.output.path), "", job.input.path,
                           checked.files)  # fmt: skip
    return checked

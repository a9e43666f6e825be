"""`eaglebatch.run`: a job run from Python exactly as `eaglebatch run` runs it (resume,
exactly once, shards, Ray), returning the run's summary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from eaglebatch.errors import JobError, native_error
from eaglebatch.job.config import JobConfig, job_from_dict, load_job
from eaglebatch.output.shards import parse_shard, written_counts
from eaglebatch.prepare import prepare
from eaglebatch.runner import WHOLE, RunScope, RunSummary, open_output, run_prepared
from eaglebatch.storage import location


def load(job: str | Path | Mapping[str, Any], overrides: Sequence[str] | str = ()) -> JobConfig:
    """A job file's path, or a job as a mapping (relative paths against the working
    directory), with `--set`-style overrides ("key.path=value"; one such string alone is one
    override), validated. JobError naming the argument when either is of another type."""
    sets = _overrides(overrides)
    if isinstance(job, str | Path):
        return load_job(job, sets)
    if isinstance(job, Mapping):
        return job_from_dict(dict(job), sets)
    raise JobError(f"job: expected a job file's path or a job as a mapping, not "
                   f"{type(job).__name__}")  # fmt: skip


def _overrides(overrides: Sequence[str] | str) -> list[str]:
    """The overrides as a list: a bare string is one "key.path=value" override (not a sequence
    of one-character overrides); anything else must be a sequence of such strings."""
    if isinstance(overrides, str):
        return [overrides]
    if not isinstance(overrides, Sequence):
        raise JobError(f"overrides: expected a list of \"key.path=value\" strings, not "
                       f"{type(overrides).__name__}")  # fmt: skip
    for i, o in enumerate(overrides):
        if not isinstance(o, str):
            raise JobError(f"overrides[{i}]: expected a \"key.path=value\" string, not "
                           f"{type(o).__name__}")  # fmt: skip
    return list(overrides)


def run(
    job: str | Path | Mapping[str, Any], overrides: Sequence[str] | str = (), *,
    restart: bool = False, shard: str | None = None, progress: bool = False,
) -> RunSummary:  # fmt: skip
    """Runs the job to completion; a rerun resumes after the rows already written (`restart`
    deletes them first). `overrides`: as `load`'s. `shard`: "i/N" as the CLI's --shard.
    Raises JobError for a bad job (the CLI's exit-2 message), RunFailed for a failure mid-run
    (finished rows kept) and Interrupted on SIGINT / SIGTERM. `engine.executor: ray` runs on
    Ray as `--ray` does."""
    try:
        cfg = load(job, overrides)
        if cfg.engine.executor == "ray":
            if shard is not None:
                raise JobError("shard and engine.executor ray: a Ray run spreads the whole job")
            return _on_ray(cfg, restart, progress)
        return _here(cfg, shard, restart, progress)
    except Exception as e:
        if native_error(e) == "user":
            raise JobError(str(e)) from None
        raise


def _here(cfg: JobConfig, shard_text: str | None, restart: bool, progress: bool) -> RunSummary:
    prep = prepare(cfg)
    shard = None
    if shard_text is not None:
        written = written_counts(location(cfg.output.path, cfg.storage))
        shard = parse_shard(shard_text, None, written=written)
    scope = WHOLE if shard is None else RunScope.shard(shard, prep.total_rows)
    resume = open_output(prep, restart=restart, scope=scope)
    if not progress:
        return run_prepared(prep, resume=resume, scope=scope)
    # lazy: rich, only when progress is shown
    from eaglebatch.progress import ProgressView

    first, end = scope.rows(prep.total_rows)
    with ProgressView((end - first) * cfg.sampling.n) as view:
        return run_prepared(prep, progress=view, resume=resume, scope=scope)


def _on_ray(cfg: JobConfig, restart: bool, progress: bool) -> RunSummary:
    # lazy: Ray and rich, only for a Ray run
    from rich.console import Console

    # lazy: Ray, only for a Ray run
    from eaglebatch.ray_executor import import_ray, run_on_ray

    import_ray()
    console = Console(stderr=True, quiet=not progress)
    stats, wall = run_on_ray(prepare(cfg), cfg.ray.address, restart, console)
    return RunSummary(stats=stats, wall_s=wall)

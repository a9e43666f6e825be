"""`eaglebatch` command line: run, validate, bench.

User errors (bad job key or value, missing file or column) print one message and exit with
status 2, no traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path

import click

from . import __version__
from .config import JobError, load_job

USER_ERROR = 2

_set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY.PATH=VALUE",
    help="Override a job key, e.g. --set engine.max_batch_size=32 (value parsed as YAML).",
)


def _user_errors(fn: Callable) -> Callable:
    """Maps user errors (ours and the Rust side's) to one line on stderr and exit status 2."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except JobError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(USER_ERROR)
        except Exception as e:  # the native extension's user-facing error class
            if type(e).__name__ == "UserInputError":
                click.echo(f"error: {e}", err=True)
                sys.exit(USER_ERROR)
            raise

    return wrapper


@click.group()
@click.version_option(__version__, prog_name="eaglebatch")
def main() -> None:
    """Offline batch LLM generation: Parquet in, Parquet out."""


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@_user_errors
def validate(job_file: str, overrides: tuple[str, ...]) -> None:
    """Check a job (schema, input files and columns, model files) without generating."""
    from . import defaults
    from .inputs import check_input
    from .model_files import check_model_dir, resolve_draft_dir

    job = load_job(job_file, overrides)
    files, total = check_input(job.input)
    if defaults.is_builtin_model(job.model):
        defaults.require_builtin_model_package()
        model = f"{job.model} (builtin)"
    else:
        model = str(check_model_dir(Path(job.model)).dir)
    draft = f", draft {resolve_draft_dir(job.draft)}" if job.draft is not None else ""
    output = ""
    if not defaults.is_builtin_model(job.model):  # a builtin would be materialised first
        from .engine import prepare
        from .resume import scan_output

        prep = prepare(job)  # the output directory must hold this job's results, if any
        state = scan_output(Path(job.output.path), prep.identity)
        if state.part_files:
            output = f", output: {state.rows_done(total)} rows already done (run resumes)"
    click.echo(
        f"ok: {job_file}: {len(files)} input file(s), {total} rows, model {model}{draft}{output}"
    )


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option("--restart", is_flag=True, help="Delete results of an earlier run and start over.")
@_user_errors
def run(job_file: str, overrides: tuple[str, ...], restart: bool) -> None:
    """Run a job: generate every prompt of the input and write Parquet part files.

    Running it again continues after the rows earlier runs finished (resume)."""
    from rich.console import Console

    from .engine import RunFailed, open_output, prepare, run_prepared
    from .interrupt import Interrupted
    from .progress import ProgressView, summary_table

    job = load_job(job_file, overrides)
    console = Console(stderr=True)
    try:
        prep = prepare(job)
        resume = open_output(prep, restart=restart)
        done = resume.rows_done(prep.total_rows)
        console.print(
            f"eaglebatch {__version__}: {prep.total_rows} rows from {len(prep.input_files)} "
            f"file(s) -> {job.output.path}"
        )
        if resume.part_files:
            console.print(
                f"resuming: {done} of {prep.total_rows} rows already done in "
                f"{resume.part_files} part file(s); generating the other {prep.total_rows - done}",
                soft_wrap=True,
            )
        with ProgressView(prep.total_rows - done, console) as view:
            result = run_prepared(prep, progress=view, resume=resume)
    except RunFailed as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_status)
    except Interrupted as e:
        in_all = done + e.rows_written
        console.print(
            f"{e} ({in_all} of {prep.total_rows} rows done in all)", markup=False, soft_wrap=True
        )
        sys.exit(e.exit_status)
    except KeyboardInterrupt:
        # Before or after the step loop (which handles signals itself): nothing half-written.
        console.print(
            f"interrupted; rows finished so far are in {job.output.path}; "
            f"run the same command again to resume",
            markup=False,
            soft_wrap=True,
        )
        sys.exit(130)
    console.print(summary_table(result.stats, result.wall_s))


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option(
    "--batch-size",
    "batch_sizes",
    multiple=True,
    type=click.IntRange(min=1),
    help="eaglebatch max batch sizes to measure (repeatable; default: the job's).",
)
@click.option(
    "--hf-batch-size",
    "hf_batch_sizes",
    multiple=True,
    type=click.IntRange(min=1),
    help="Also time transformers' generate at this batch size (repeatable).",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write figures here.")
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Runs per engine, plain and speculative alternating; the speedup is the median of "
    "each speculative run over the plain run before it. At batch size 1 the two alternate "
    "request by request within each run.",
)
@_user_errors
def bench(
    job_file: str,
    overrides: tuple[str, ...],
    batch_sizes: tuple[int, ...],
    hf_batch_sizes: tuple[int, ...],
    json_path: str | None,
    repeat: int,
) -> None:
    """Measure output tok/s and latency on the job's prompts, side by side with baselines."""
    from .bench import run_bench

    job = load_job(job_file, overrides)
    run_bench(job, list(batch_sizes), list(hf_batch_sizes), json_path, repeat=repeat)


@main.command("train-draft")
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@_user_errors
def train_draft(job_file: str, overrides: tuple[str, ...]) -> None:
    """Train an EAGLE-3 draft head for the job's model (self-distillation); resumable."""
    from rich.console import Console

    from .train.job import load_train_job
    from .train.trainer import train_draft as run_training

    job = load_train_job(job_file, list(overrides))
    run_training(job, Console(stderr=True))


if __name__ == "__main__":
    main()

"""`eaglebatch` command line: run, status, validate, bench, train-draft.

User errors (bad job key or value, missing file or column) print one message and exit with
status 2, no traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path

import click

from eaglebatch import __version__
from eaglebatch.commands.run_batch import write_job
from eaglebatch.commands.status import job_status, status_lines
from eaglebatch.commands.summary_report import SummaryReport
from eaglebatch.errors import JobError, StorageFailed, native_error
from eaglebatch.interrupt import Interrupted
from eaglebatch.job import builtin
from eaglebatch.job.config import load_job
from eaglebatch.job.model_files import check_model_dir, resolve_draft_dir, resolve_model_dir
from eaglebatch.output.shards import parse_shard, written_counts
from eaglebatch.storage import location
from eaglebatch.train.job import load_train_job

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
        except StorageFailed as e:  # an object store refused or failed: names the URL
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except Exception as e:  # the native extension's user-facing error class
            if native_error(e) == "user":
                click.echo(f"error: {e}", err=True)
                sys.exit(USER_ERROR)
            raise

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="eaglebatch")
def main() -> None:
    """Offline batch LLM generation: Parquet in, Parquet out."""


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@_user_errors
def validate(job_file: str, overrides: tuple[str, ...]) -> None:
    """Check a job (schema, input files and columns, model files) without generating."""
    # lazy: pyarrow, torch and rich load only for the command that uses them (fast --help)
    from eaglebatch.prepare import check_job_input

    job = load_job(job_file, overrides)
    checked = check_job_input(job)  # input and output.path, before a model is copied, as run
    model_dir = None
    if builtin.is_builtin_model(job.model):  # not materialised: run's checks that need no copy
        builtin.require_builtin_model_package(job.model)
        files, total = _check_builtin_job(job, checked)
        model, output = f"{job.model} (builtin)", ""
    else:
        model_dir = resolve_model_dir(job.model, job.storage)  # a GGUF: converted; a URL: copied
        model = str(check_model_dir(model_dir).dir)
        files, total, output = _check_job(job, checked)
    draft = ""
    if job.draft == builtin.MTP_DRAFT:
        if model_dir is None:  # run's check (prepare) on a builtin's materialised folder
            raise JobError(f"draft: mtp: the builtin model {job.model} has no MTP layer")
        draft = ", draft mtp (the model's own MTP layer)"
    elif job.draft is not None:
        draft = f", draft {resolve_draft_dir(job.draft)}"
    click.echo(
        f"ok: {job_file}: {len(files)} input file(s), {total} rows, model {model}{draft}{output}"
    )


def _check_job(job, checked) -> tuple[list, int, str]:
    """`run`'s checks (prepare.prepare; `checked`: its check_job_input, made), and whether the
    output holds this job's rows already: (input files, rows, what the output holds)."""
    # lazy: pyarrow, torch and rich load only for the command that uses them (fast --help)
    from eaglebatch.output.resume import scan_output
    from eaglebatch.prepare import prepare

    prep = prepare(job, checked=checked)  # the output must hold this job's results, if any
    state = scan_output(location(job.output.path, job.storage), prep.identity)
    output = ""
    if state.part_files:
        output = f", output: {state.rows_done(prep.total_rows)} rows already done (run resumes)"
    if prep.memory_plan is not None:
        output += f"\nmemory: {prep.memory_plan.describe()}"
    return prep.input_files, prep.total_rows, output


def _check_builtin_job(job, checked) -> tuple[list, int]:
    """`prepare`'s checks that need no materialised model, for a builtin: the same functions
    (`checked`: check_job_input's, made; engine section, the job's chat template, the results
    path)."""
    # lazy: pyarrow, torch and rich load only for the command that uses them (fast --help)
    from eaglebatch.job.engine_settings import ModelWeights, check_engine
    from eaglebatch.output.results_file import check_results_path

    check_engine(job, ModelWeights.builtin(job.model))
    _check_job_template(job)
    if job.output.results_file is not None:  # a file there is ours only for this output.path
        check_results_path(job.output.results_file, Path(job.output.path), "",
                           job.input.path, checked.files)  # fmt: skip
    return checked.files, checked.total


def _check_job_template(job) -> None:
    """The job's model_chat_template file must compile when prompts go through it."""
    # lazy: pyarrow, torch and rich load only for the command that uses them (fast --help)
    from eaglebatch.job.checks import check_chat_template, read_chat_template, renders_chat
    from eaglebatch.job.inputs import check_batch_input

    batch_chat = job.input.openai_batch and check_batch_input(job.input, job.storage, job.task).chat
    path = job.model_chat_template
    if path is not None and renders_chat(job, batch_chat):
        check_chat_template(read_chat_template(path), f"model_chat_template: {path}")


def _announce(console, prep, scope, resume) -> tuple[int, int]:
    """Prints what this run covers and what is already done; returns (rows, done) of it."""
    start, end = scope.rows(prep.total_rows)
    done = resume.rows_done(end, start)
    what = f"{prep.total_rows} rows"
    if scope.row_range is not None:
        what = f"{scope.subdir}: rows [{start}, {end}) of {prep.total_rows}"
    console.print(
        f"eaglebatch {__version__}: {what} from {len(prep.input_files)} file(s) -> "
        f"{scope.output_dir(prep.job.output.path)}",
        soft_wrap=True,
    )
    if prep.memory_plan is not None:
        console.print(f"memory: {prep.memory_plan.describe()}", soft_wrap=True)
    if done:
        console.print(
            f"resuming: {done} of {end - start} rows already done in {resume.part_files} part "
            f"file(s); generating the other {end - start - done}",
            soft_wrap=True,
        )
    return end - start, done


_shard_option = click.option(
    "--shard",
    "shard_text",
    metavar="i/N|auto",
    help="Generate shard i of N (0-based: a contiguous range of rows) into "
    "output.path/shard-0000i-of-0000N/. 'auto' reads SLURM_ARRAY_TASK_ID and "
    "SLURM_ARRAY_TASK_COUNT, or JOB_COMPLETION_INDEX (Kubernetes Indexed Jobs) with --shards.",
)
_shards_option = click.option(
    "--shards",
    "shard_count",
    type=int,
    help="The number of shards, for --shard auto where the environment does not say it.",
)


_ray_option = click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[ADDRESS]",
    help="Run on Ray: engine actors on the cluster at ADDRESS ('auto': the one this machine "
    "belongs to; none: a Ray instance of this machine). Same as engine.executor: ray.",
)


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option("--restart", is_flag=True, help="Delete results of an earlier run and start over.")
@_shard_option
@_shards_option
@_ray_option
@click.option("--summary-json", "summary_json", type=click.Path(dir_okay=False),
              help="Also write the run's summary (rows, tokens, throughput, latency, exit "
              "reason) to this file as one JSON object, however the run ends.")  # fmt: skip
@_user_errors
def run(
    job_file: str,
    overrides: tuple[str, ...],
    restart: bool,
    shard_text: str | None,
    shard_count: int | None,
    ray_address: str | None,
    summary_json: str | None,
    checked=None,
) -> None:
    """Run a job: generate every prompt of the input and write Parquet part files.

    Running it again continues after the rows earlier runs finished (resume). With --shard it
    generates one shard, with --ray it runs on a Ray cluster; with --restart it deletes the
    results of this run's scope first."""
    # `checked` (no option: run-batch's): the job file's check_job_input, made before writing it

    report = SummaryReport(summary_json)
    try:
        report.job = job = load_job(job_file, overrides)
        report.check_apart(job)
        written = written_counts(location(job.output.path, job.storage))
        shard = parse_shard(shard_text, shard_count, written=written)
        if ray_address is not None or job.engine.executor == "ray":
            if shard is not None:
                raise JobError("--shard and --ray: a Ray run spreads the whole job; choose one")
            _run_on_ray(job, ray_address or job.ray.address, restart, report, checked)
        else:
            _run_here(job, shard, restart, report, checked)
    except Exception as e:  # refused (before any work), a user error while it ran, or a bug
        if isinstance(e, JobError) or native_error(e) == "user":
            report.write(None, None, "refused", USER_ERROR, str(e))
        else:  # the traceback follows (exit status 1): the summary says so first
            report.write(None, None, "failed", 1, f"{type(e).__name__}: {e}")
        raise


@main.command("run-batch")
@click.option("-i", "--input-file", "inp", required=True, type=click.Path(dir_okay=False),
              help="The OpenAI Batch requests (JSONL).")
@click.option("-o", "--output-file", "out", required=True, type=click.Path(dir_okay=False),
              help="The OpenAI Batch results file to write.")
@click.option("--model", required=True, help="A model folder, a .gguf file or a builtin name.")
@click.option("--draft", default=None, help="An EAGLE draft head (speculative decoding).")
@_set_option
@click.option("--restart", is_flag=True, help="Delete results of an earlier run and start over.")
@click.option("--summary-json", "summary_json", type=click.Path(dir_okay=False),
              help="Also write the run's summary to this file as one JSON object.")
@_user_errors
@click.pass_context
def run_batch(
    ctx, inp: str, out: str, model: str, draft: str | None, overrides: tuple[str, ...],
    restart: bool, summary_json: str | None,
) -> None:  # fmt: skip
    """vLLM's run-batch form: write OUT.job.yaml for the batch file and run it (parts in
    OUT.parts/, results in OUT). Rerun the same command to resume."""

    job_file, checked = write_job(inp, out, model, draft, list(overrides))  # --set written in
    click.echo(f"job file: {job_file}", err=True)
    ctx.invoke(run, job_file=str(job_file), overrides=(), restart=restart,
               shard_text=None, shard_count=None, ray_address=None,
               summary_json=summary_json, checked=checked)  # fmt: skip


def _run_on_ray(job, address: str | None, restart: bool, report: SummaryReport,
                checked=None) -> None:  # fmt: skip
    from rich.console import Console

    # lazy: pyarrow, torch and rich load only for the command that uses them (fast --help)
    from eaglebatch.prepare import prepare
    from eaglebatch.progress import ray_summary_table, summary_table
    from eaglebatch.ray_executor import import_ray, run_on_ray
    from eaglebatch.runner import RunFailed

    import_ray()  # before anything else: a missing Ray is one message
    console = Console(stderr=True)
    try:
        stats, wall = run_on_ray(prepare(job, checked=checked), address, restart, console)
    except RunFailed as e:
        click.echo(f"error: {e}", err=True)
        report.exit("failed", e.exit_status, str(e))
    except KeyboardInterrupt:
        console.print(f"interrupted; rows finished so far are in {job.output.path}; run the "
                      "same command again to resume", markup=False, soft_wrap=True)  # fmt: skip
        report.exit("interrupted", 130, "interrupted")
    console.print(summary_table(stats, wall))
    console.print(ray_summary_table(stats))
    report.write(stats, wall, "complete", 0)


def _run_here(job, shard, restart: bool, report: SummaryReport, checked=None) -> None:
    from rich.console import Console

    # lazy: pyarrow, torch and rich load only for the command that uses them (fast --help)
    from eaglebatch.prepare import prepare
    from eaglebatch.progress import ProgressView, summary_table
    from eaglebatch.runner import WHOLE, RunFailed, RunScope, open_output, run_prepared

    console = Console(stderr=True)
    try:
        prep = prepare(job, checked=checked)
        scope = WHOLE if shard is None else RunScope.shard(shard, prep.total_rows)
        resume = open_output(prep, restart=restart, scope=scope)
        rows, done = _announce(console, prep, scope, resume)
        with ProgressView(rows - done, console) as view:
            result = run_prepared(prep, progress=view, resume=resume, scope=scope)
    except RunFailed as e:
        click.echo(f"error: {e}", err=True)
        report.exit("failed", e.exit_status, str(e))
    except Interrupted as e:
        in_all = done + e.rows_written
        console.print(f"{e} ({in_all} of {rows} rows done in all)", markup=False, soft_wrap=True)
        report.exit("interrupted", e.exit_status, str(e))
    except KeyboardInterrupt:
        # Before or after the step loop (which handles signals itself): nothing half-written.
        console.print(
            f"interrupted; rows finished so far are in {job.output.path}; "
            f"run the same command again to resume",
            markup=False,
            soft_wrap=True,
        )
        report.exit("interrupted", 130, "interrupted")
    console.print(summary_table(result.stats, result.wall_s))
    report.write(result.stats, result.wall_s, "complete", 0)


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as one JSON object.")
@_user_errors
def status(job_file: str, overrides: tuple[str, ...], as_json: bool) -> None:
    """Rows done per shard and overall. Exit status 0 only when the job is complete: every row
    of the input is in the output exactly once (1 while rows are missing)."""

    st = job_status(load_job(job_file, overrides))
    if as_json:
        import json

        # lazy: pyarrow, torch and rich load only for the command that uses them (fast --help)
        from eaglebatch.output.summary_json import status_summary

        click.echo(json.dumps(status_summary(st)))
    else:
        for line in status_lines(st):
            click.echo(line)
    sys.exit(0 if st.complete else 1)


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
    # lazy: pyarrow, torch and rich load only for the command that uses them (fast --help)
    from eaglebatch.commands.bench import run_bench

    job = load_job(job_file, overrides)
    run_bench(job, list(batch_sizes), list(hf_batch_sizes), json_path, repeat=repeat)


@main.command("train-draft")
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@_user_errors
def train_draft(job_file: str, overrides: tuple[str, ...]) -> None:
    """Train an EAGLE-3 draft head for the job's model (self-distillation); resumable."""
    from rich.console import Console

    # lazy: pyarrow, torch and rich load only for the command that uses them (fast --help)
    from eaglebatch.train.trainer import train_draft as run_training

    job = load_train_job(job_file, list(overrides))
    run_training(job, Console(stderr=True))


if __name__ == "__main__":
    main()

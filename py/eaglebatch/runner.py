"""Running a prepared job (prepare.py): job config -> Rust scheduler + torch worker -> the
step loop.

The loop is deliberately thin:

    for plan in scheduler: result = worker.step(plan); scheduler.commit(result)

Everything that is not tensor math happens in Rust with the GIL released.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eaglebatch import __version__
from eaglebatch.errors import JobError, native_error
from eaglebatch.interrupt import Interrupted, StopSignals
from eaglebatch.job.checks import renders_chat
from eaglebatch.job.config import job_to_dict
from eaglebatch.job.pooling import pool_spec, scheduler_settings
from eaglebatch.output.directory import prepare_output_dir, release_output_dir
from eaglebatch.output.resume import HASH_KEY, IDENTITY_KEY, ResumeState, scan_output
from eaglebatch.output.shards import Shard, shard_of_dir
from eaglebatch.prepare import PreparedJob, requests_known
from eaglebatch.step_work import StepWork
from eaglebatch.storage import location


@dataclass(frozen=True)
class RunScope:
    """The rows a run generates and where it writes them: every row into output.path, or a
    row range into a subdirectory of it (a shard, a Ray unit; output/directory.py)."""

    subdir: str | None = None
    row_range: tuple[int, int] | None = None  # [start, end) of the input's row_index
    # a Ray unit: runs under its driver's exclusive lock of output.path (the driver checked the
    # tree and passes what was done elsewhere), so it checks and reads only its own directory
    unit: bool = False

    @classmethod
    def shard(cls, shard: Shard, total_rows: int) -> RunScope:
        return cls(subdir=shard.dir_name, row_range=shard.rows(total_rows))

    def rows(self, total_rows: int) -> tuple[int, int]:
        return self.row_range or (0, total_rows)

    def output_dir(self, output_path: str) -> str:
        return output_path if self.subdir is None else f"{output_path.rstrip('/')}/{self.subdir}"


WHOLE = RunScope()


def check_shard_count(out: Path, subdir: str | None) -> None:
    """One output.path holds the shards of one N: a shard of another N is a JobError."""
    ours = shard_of_dir(subdir or "")
    if ours is None or not out.is_dir():
        return
    other = sorted(
        d.name for d in out.iterdir() if (s := shard_of_dir(d.name)) and s.count != ours.count
    )
    if other:
        raise JobError(
            f"output.path: {out} holds shards of another number of shards ({', '.join(other[:3])}"
            f"{' ...' if len(other) > 3 else ''}), but this run is shard {ours}: run every shard "
            f"with the same N (a run without --shard resumes any split), or delete those "
            f"directories to start over"
        )


def open_output(
    prep: PreparedJob, restart: bool = False, scope: RunScope = WHOLE, ray_driver: bool = False
) -> ResumeState:
    """Locks and prepares the output directory (the scope's part of it) and reads what earlier
    runs of this job finished anywhere under output.path. Fails (JobError) before any model is
    loaded if it holds another job's results or another run is writing it (a `ray_driver`
    leaves unit directories another process holds to its units, which wait for them).
    `run_prepared` releases the lock."""
    out = location(prep.job.output.path, prep.job.storage)
    admit = None if scope.unit else lambda: check_shard_count(out, scope.subdir)
    prepare_output_dir(out, restart, scope.subdir, unit=scope.unit, admit=admit,
                       busy_ok=ray_driver, storage=prep.job.storage)  # fmt: skip
    try:
        return scan_output(out, prep.identity, only=out / scope.subdir if scope.unit else None)
    except BaseException:
        release_output_dir(out, scope.subdir, scope.unit)
        raise


@dataclass
class RunSummary:
    stats: dict
    wall_s: float

    @property
    def output_tok_s(self) -> float:
        return self.stats["output_tokens"] / self.wall_s if self.wall_s > 0 else 0.0


ProgressFn = Callable[[dict], None]


def file_metadata(prep: PreparedJob) -> dict[str, str]:
    # lazy: torch and the extension, which validate and status never need
    import torch

    return {
        "eaglebatch.job": json.dumps(job_to_dict(prep.job), sort_keys=True),
        HASH_KEY: prep.job_hash,
        IDENTITY_KEY: json.dumps(prep.identity, sort_keys=True),
        "eaglebatch.version": __version__,
        "torch.version": torch.__version__,
    }


def scheduler_config(
    prep: PreparedJob, worker, metadata: dict[str, str], skip_rows=None, scope: RunScope = WHOLE,
    skip_samples=None,
):
    """The scheduler's settings for this job, worker (KV blocks, max_model_len) and scope;
    `skip_rows` / `skip_samples`: what earlier runs wrote (ResumeState.skipped_in)."""
    # lazy: numpy, which validate and status never need
    from eaglebatch.job.scheduler_config import from_job, storage_section

    job, mf = prep.job, prep.model
    return from_job(
        job,
        input_files=[str(f) for f in prep.input_files],
        prompt_column=job.input.text_column,
        input_format="openai-batch" if job.input.openai_batch else "parquet",
        task=job.task,
        row_range=scope.row_range,
        tokenizer_file=str(mf.tokenizer_file),
        chat_template=mf.chat_template if renders_chat(job, prep.batch_chat) else None,
        bos_token=mf.bos_token,
        eos_token=mf.eos_token,
        eos_token_ids=list(mf.eos_token_ids),
        vocab_size=prep.vocab_size,
        reasoning_ids=list(prep.reasoning_ids),
        output_dir=scope.output_dir(job.output.path),
        storage=storage_section(job.storage),
        file_metadata=metadata,
        keep_columns=list(prep.kept_columns),
        num_blocks=worker.num_blocks,
        max_model_len=worker.max_model_len,
        max_draft_tokens=prep.engine.max_draft_tokens,
        overlap=prep.engine.overlap,
        **state_settings(worker.target.state_plan),
        skip_rows=skip_rows,
        skip_samples=skip_samples,
        **scheduler_settings(job, worker.target.pool),
    )


def state_settings(states) -> dict[str, int]:
    """The scheduler's recurrent-state settings of a hybrid model's pool (StatePlan; None: the
    model has none)."""
    if states is None:
        return {}
    return {"state_checkpoint_interval": states.interval,
            "state_checkpoints": states.checkpoints}  # fmt: skip


def build_scheduler(
    prep: PreparedJob, worker, metadata: dict[str, str], skip_rows=None, scope: RunScope = WHOLE,
    skip_samples=None,
):
    # lazy: the extension, which validate and status never need
    from eaglebatch._native import Scheduler

    scheduler = Scheduler(scheduler_config(prep, worker, metadata, skip_rows, scope, skip_samples))
    worker.bind(scheduler)  # a SpecWorker drafts under the grammars and validates
    return scheduler


def build_worker(prep: PreparedJob, graph_mode: str | None = None, for_job: bool = True):
    """The plain Worker, or a SpecWorker around it when the job names a draft head, with its
    graph steps captured (`graph_mode`: "cuda" | "eager" | "off"; default from engine.cuda_graph
    and the device). `for_job`: the CPU's default KV cache holds what this job can use at once
    (`worker.job_kv`); False for a worker that serves later jobs of any size."""
    # lazy: torch and the extension, which validate and status never need
    from eaglebatch.worker import Worker, job_kv

    job, settings = prep.job, prep.engine
    eng = job.engine
    mode = graph_mode or settings.graph_mode
    rows = 0 if mode == "off" else eng.max_batch_size  # the largest capture bucket
    kv = job_kv(job, settings, requests_known(job, prep.total_rows)) if for_job else None
    if prep.draft_dir is None:
        worker = Worker.from_job(job, prep.model, settings, graph_rows=rows, job_tokens=kv)
        worker.enable_graphs(mode, eng.max_batch_size)
        return worker
    # lazy: torch and the extension, which validate and status never need
    from eaglebatch.speculative.worker import SpecWorker

    target = Worker.from_job(
        job, prep.model, settings, extra_kv_layers=1, graph_rows=rows,
        graph_q=settings.max_draft_tokens + 1, job_tokens=kv,
    )  # fmt: skip
    try:
        worker = SpecWorker.from_job(target, prep.draft_dir, job.speculative, eng.max_batch_size,
                                     job.forced_draft_tokens)  # fmt: skip
    except ValueError as e:
        raise JobError(f"draft: {job.draft}: {e}") from None
    worker.enable_graphs(mode, eng.max_batch_size)
    return worker


def run_prepared(
    prep: PreparedJob,
    worker=None,
    progress: ProgressFn | None = None,
    restart: bool = False,
    resume: ResumeState | None = None,
    scope: RunScope = WHOLE,
) -> RunSummary:
    """Runs a prepared job to completion, continuing after the rows earlier runs of the same job
    wrote (`resume`, from `open_output`; read here when not given). `worker` may be passed in to
    reuse loaded weights (benchmarks); its KV cache must be sized for this job's engine settings.

    On SIGINT / SIGTERM it stops between two steps, writes the finished rows and raises
    `Interrupted` (see interrupt.py). `scope`: the rows and the directory (a shard's)."""
    out = location(prep.job.output.path, prep.job.storage)
    try:
        if resume is None:
            resume = open_output(prep, restart=restart, scope=scope)
        summary = _run(prep, worker, progress, resume, scope)
        if scope.subdir is None:
            write_batch_results(prep)
        return summary
    finally:
        release_output_dir(out, scope.subdir, scope.unit)


def write_batch_results(prep: PreparedJob) -> None:
    """output.format openai-batch: the results file of the finished job (openai_results.py),
    by the run that holds output.path (a whole run, a Ray driver)."""
    out = prep.job.output
    if out.results_file is None:
        return
    # lazy: pyarrow, only for an openai-batch job's results file
    from eaglebatch.output.openai_results import CHAT, write_results

    chat = prep.job.input.renders_chat
    endpoint = prep.openai_endpoint or (CHAT if chat else "/v1/completions")
    write_results(Path(out.path), out.results_file, endpoint, prep.job.model, prep.job_hash)


class RunFailed(Exception):
    """The run stopped on an error after it started (a damaged input page, a full disk): the
    rows finished before it are in complete part files and a rerun resumes after them."""

    def __init__(self, cause: str, rows_written: int | None, output_dir: str, user_error: bool):
        self.exit_status = 2 if user_error else 1
        self.cause = cause
        kept = "the rows finished before it" if rows_written is None else f"{rows_written} rows"
        super().__init__(
            f"{cause}\nthe run stopped; {kept} of this run are in complete part files in "
            f"{output_dir}; fix the cause and run the same command again to resume (finished "
            f"rows are kept and never written twice)"
        )


def _salvage(scheduler) -> int | None:
    """After a failure: closes the rows already finished into a last part. Returns how many
    rows this run wrote, None when the writer failed too."""
    try:
        return int(scheduler.abort()["rows_written"])
    except Exception:  # the writer itself failed (e.g. the disk is full): nothing to add
        return None


def _run(prep: PreparedJob, worker, progress, resume: ResumeState, scope: RunScope):
    # lazy: torch, which validate and status never need
    from eaglebatch.model.moe_counts import count_routing

    if worker is None:
        worker = build_worker(prep)
    # a pooled task's head (job/pooling.py): a loaded worker serves any task (Engine calls)
    worker.target.pool = pool_spec(prep.job, prep.model.dir)
    first, end = scope.rows(prep.total_rows)
    skip, samples = resume.skipped_in(first, end)
    scheduler = build_scheduler(prep, worker, file_metadata(prep), skip, scope, samples)
    target = worker.target  # the Worker of the target model (a SpecWorker's, or itself)
    routing = count_routing(target.model) if target.device.type == "cpu" else None
    start = time.monotonic()
    try:
        stats = _step_loop(prep, scheduler, worker, progress, routing)
    except Interrupted:
        raise
    except Exception as e:
        written = _salvage(scheduler)
        if (kind := native_error(e)) is not None:
            out = scope.output_dir(prep.job.output.path)
            raise RunFailed(str(e), written, out, kind == "user") from None
        raise
    wall = time.monotonic() - start
    graphs = worker.graph_stats()  # Worker and SpecWorker: None when graphs are off
    if graphs is not None:
        stats["cuda_graphs"] = graphs
    drafts = worker.draft_stats()  # SpecWorker: where the drafts came from; Worker: None
    if drafts is not None:
        stats["drafts"] = drafts
    if routing is not None:
        stats["expert_rows_per_active"] = routing.rows_per_active
    stats["weights"] = target.weights
    stats["threads"] = target.threads
    stats["kv_cache_mib"] = sum(c.numel() * c.element_size() for c in target.kv_caches) / 2**20
    if target.model.states is not None:
        stats["recurrent_state_mib"] = target.model.states.nbytes / 2**20
    stats.update(resident_memory())
    if progress is not None:
        progress(progress_counters(prep, scheduler.progress(), stats["step_work"]))
    stats.pop("step_work")
    return RunSummary(stats=stats, wall_s=wall)


def progress_counters(prep: PreparedJob, counters: dict, work: StepWork) -> dict:
    """The scheduler's counters, the step loop's seconds and tokens per kind of step, the
    batch size and the most output tokens a row may generate (the ETA's cap: max_model_len
    where a sampling column sets rows' own max_new_tokens; 0 for scoring)."""
    job = prep.job
    if job.task != "generate":
        cap = 0
    elif "max_new_tokens" in job.input.sampling_columns:
        cap = prep.engine.max_model_len
    else:
        cap = job.sampling.max_new_tokens
    return {**counters, "max_new_tokens": cap, "max_batch_size": job.engine.max_batch_size,
            "step_work": work.snapshot()}


def resident_memory() -> dict[str, float]:
    """This process's resident memory now and at its peak, in MiB (Linux /proc)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        now = peak
    return {"resident_mib": now, "peak_resident_mib": peak}


def _step_loop(prep: PreparedJob, scheduler, worker, progress: ProgressFn | None,
               routing=None) -> dict:  # fmt: skip
    """`for plan in scheduler: commit(worker.step(plan))` until every row is written (overlapped
    with engine.overlap: `overlapped_steps`); stops between two steps on SIGINT / SIGTERM
    (raises Interrupted). Returns the run's stats, with step_seconds: per kind of step
    (prefill, mixed, decode, verify) the seconds its steps took. `routing`: the model's
    moe_counts.RoutingCounts, each step closed with its kind."""
    last_report = 0.0
    seconds: dict[str, float] = {}  # plan kind -> seconds of its steps (planning to commit)
    work = StepWork()  # ... and the tokens they computed, for the ETA
    steps = overlapped_steps if prep.engine.overlap else serial_steps
    with StopSignals() as stop:
        mark = time.monotonic()
        for plan in steps(scheduler, worker):
            now = time.monotonic()
            # "mixed": a decode step that also carried prompt chunks (chunked prefill)
            mixed = plan.kind == "decode" and plan.num_tokens > plan.num_seqs
            kind = "mixed" if mixed else plan.kind
            seconds[kind] = seconds.get(kind, 0.0) + now - mark
            if routing is not None:
                routing.close_step(kind)
            counters = scheduler.progress() if progress is not None else None
            if counters is not None:
                work.add(kind, now - mark, counters, plan.num_seqs, plan.num_tokens)
            mark = now
            if stop.signum is not None:
                written = scheduler.abort()
                raise Interrupted(stop.signum, written["rows_written"], prep.job.output.path)
            if progress is not None and now - last_report > 0.2:
                last_report = now
                progress(progress_counters(prep, counters, work))
        stats = dict(scheduler.finish())
        stats["step_seconds"] = seconds
        stats["step_work"] = work
        return stats


def serial_steps(scheduler, worker):
    """Plans, runs and commits one step at a time; yields each committed plan."""
    plain_steps = False  # what the worker last asked of the scheduler (set_plain_steps)
    while (plan := scheduler.next_plan()) is not None:
        # (tokens, num_tokens) or, speculating, (tokens, num_tokens, num_accepted)
        scheduler.commit(*worker.step(plan))
        if worker.plain_steps != plain_steps:
            plain_steps = worker.plain_steps
            scheduler.set_plain_steps(plain_steps)
        yield plan


def overlapped_steps(scheduler, worker):
    """Plain decoding with one step in flight: step t+1 is planned (its placeholders stand for
    step t's tokens) and launched before step t is committed, so the host's planning, commit
    and preparation run while the device computes (CUDA). Where the scheduler cannot plan
    ahead (None) the step in flight is committed first. Yields each committed plan."""
    plan, pending = scheduler.next_plan(), None  # pending: (plan, Launched) in flight
    while plan is not None:
        launched = worker.launch(plan, None if pending is None else pending[1])
        if pending is not None:
            scheduler.commit(*worker.collect(pending[1]))
            yield pending[0]
        pending = (plan, launched)
        plan = scheduler.next_plan_ahead()
        if plan is None:
            scheduler.commit(*worker.collect(launched))
            yield pending[0]
            pending = None
            plan = scheduler.next_plan()

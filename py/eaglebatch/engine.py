"""The engine: job config -> Rust scheduler + torch worker -> the step loop.

The loop is deliberately thin:

    for plan in scheduler: result = worker.step(plan); scheduler.commit(result)

Everything that is not tensor math happens in Rust with the GIL released.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .config import JobConfig, JobError, job_to_dict
from .inputs import check_input
from .model_files import ModelFiles, model_files, resolve_draft_dir
from .output_dir import prepare_output_dir


@dataclass(frozen=True)
class PreparedJob:
    """Everything checked before any generation: a bad job fails here, in milliseconds."""

    job: JobConfig
    input_files: list[Path]
    total_rows: int
    model: ModelFiles
    draft_dir: Path | None


def prepare(job: JobConfig) -> PreparedJob:
    files, total = check_input(job.input)
    mf = model_files(job.model)
    if job.input.messages_column is not None or job.input.apply_chat_template:
        if mf.chat_template is None:
            raise JobError(
                f"input: chat messages need a chat template, and model {mf.dir} has none"
            )
    draft = resolve_draft_dir(job.draft) if job.draft is not None else None
    return PreparedJob(job=job, input_files=files, total_rows=total, model=mf, draft_dir=draft)


@dataclass
class RunSummary:
    stats: dict
    wall_s: float

    @property
    def output_tok_s(self) -> float:
        return self.stats["output_tokens"] / self.wall_s if self.wall_s > 0 else 0.0


ProgressFn = Callable[[dict], None]


def file_metadata(job: JobConfig) -> dict[str, str]:
    import torch

    return {
        "eaglebatch.job": json.dumps(job_to_dict(job), sort_keys=True),
        "eaglebatch.version": __version__,
        "torch.version": torch.__version__,
    }


def build_scheduler(prep: PreparedJob, worker, metadata: dict[str, str]):
    from ._native import Scheduler

    job, mf = prep.job, prep.model
    eng, smp = job.engine, job.sampling
    text_column = job.input.text_column
    return Scheduler(
        input_files=[str(f) for f in prep.input_files],
        prompt_column=text_column,
        messages_column=job.input.messages_column,
        id_column=job.input.id_column,
        limit=job.input.limit,
        apply_chat_template=job.input.apply_chat_template,
        tokenizer_file=str(mf.tokenizer_file),
        chat_template=mf.chat_template,
        bos_token=mf.bos_token,
        eos_token=mf.eos_token,
        eos_token_ids=list(mf.eos_token_ids),
        output_dir=job.output.path,
        part_rows=job.output.part_rows,
        file_metadata=metadata,
        include_token_ids=job.output.include_token_ids,
        max_new_tokens=smp.max_new_tokens,
        stop=list(smp.stop),
        temperature=smp.temperature,
        top_p=smp.top_p,
        top_k=smp.top_k,
        seed=smp.seed,
        num_blocks=worker.num_blocks,
        block_size=eng.block_size,
        max_batch_size=eng.max_batch_size,
        max_num_batched_tokens=max(eng.max_num_batched_tokens, 1),
        max_model_len=worker.max_model_len,
        num_speculative_tokens=job.num_speculative_tokens,
    )


def build_worker(prep: PreparedJob):
    """The plain Worker, or a SpecWorker around it when the job names a draft head."""
    from .worker import Worker

    job = prep.job
    if prep.draft_dir is None:
        return Worker.from_job(job, prep.model)
    from .speculative.worker import SpecWorker

    target = Worker.from_job(job, prep.model, extra_kv_layers=1)
    try:
        return SpecWorker.from_target(
            target,
            prep.draft_dir,
            num_speculative_tokens=job.speculative.num_steps,
            max_batch_size=job.engine.max_batch_size,
            topk=job.speculative.topk,
            adaptive=job.speculative.adaptive,
        )
    except ValueError as e:
        raise JobError(f"draft: {prep.draft_dir}: {e}") from None


def run_prepared(
    prep: PreparedJob,
    worker=None,
    progress: ProgressFn | None = None,
    restart: bool = False,
) -> RunSummary:
    """Runs a prepared job to completion. `worker` may be passed in to reuse loaded weights
    (benchmarks); its KV cache must be sized for this job's engine settings."""
    prepare_output_dir(Path(prep.job.output.path), restart=restart)
    if worker is None:
        worker = build_worker(prep)
    scheduler = build_scheduler(prep, worker, file_metadata(prep.job))
    start = time.monotonic()
    last_report = 0.0
    while (plan := scheduler.next_plan()) is not None:
        # (tokens, num_tokens) or, speculating, (tokens, num_tokens, num_accepted)
        scheduler.commit(*worker.step(plan))
        now = time.monotonic()
        if progress is not None and now - last_report > 0.2:
            last_report = now
            progress(scheduler.progress())
    stats = dict(scheduler.finish())
    wall = time.monotonic() - start
    if progress is not None:
        progress(scheduler.progress())
    return RunSummary(stats=stats, wall_s=wall)

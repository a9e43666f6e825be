"""`prepare`: a job and everything it names checked before any work, in milliseconds (a bad
job is one JobError naming the key, file or column): the input files and columns, the output
directory's place and kind, the model's config, tokenizer and checkpoint headers, the engine
section resolved, the memory a CPU run takes, the draft head, the chat template and
response_format (job/checks.py). What it returns, `PreparedJob`, is what runner.py runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eaglebatch.errors import JobError
from eaglebatch.job import memory
from eaglebatch.job.builtin import MTP_DRAFT
from eaglebatch.job.checks import (
    check_chat_template,
    check_response_format,
    reasoning_ids,
    renders_chat,
    template_origin,
    with_chat_template,
)
from eaglebatch.job.config import JobConfig
from eaglebatch.job.inputs import check_batch_input, check_input, check_output_apart, kept_columns
from eaglebatch.job.model_files import ModelFiles, model_files, resolve_draft_dir
from eaglebatch.job.pooling import pool_spec
from eaglebatch.job.state_budget import state_plan
from eaglebatch.model.config import ModelConfig
from eaglebatch.output.directory import check_output_kind
from eaglebatch.output.results_file import check_results_path
from eaglebatch.output.resume import identity_hash, job_identity
from eaglebatch.storage import location

if TYPE_CHECKING:  # torch: imported only when a run needs it
    from eaglebatch.job.engine_settings import EngineSettings


@dataclass(frozen=True)
class PreparedJob:
    """Everything checked before any generation: a bad job fails here, in milliseconds."""

    job: JobConfig
    input_files: list[Path]
    total_rows: int
    model: ModelFiles
    draft_dir: Path | None
    # What decides the outputs (resume.py); recorded in every part file.
    identity: dict
    # OpenAI Batch input: its first line's url (the endpoint of rows whose parts have no
    # endpoint column), and whether a line is a chat request (inputs.check_batch_input)
    openai_endpoint: str | None = None
    batch_chat: bool = False
    # config.json's vocab_size: a row's stop_token_ids must be below it
    vocab_size: int = 0
    # output.keep_columns resolved against the input files (inputs.kept_columns)
    kept_columns: tuple[str, ...] = ()
    # the engine section resolved once (job/engine_settings.py); None only in tests' stand-ins
    engine: EngineSettings | None = None
    # output.reasoning: the ids of its (start, end) tags; () when off
    reasoning_ids: tuple[int, ...] = ()
    # what a CPU run will hold in memory (job/memory.py); None on other devices
    memory_plan: memory.MemoryPlan | None = None

    @property
    def job_hash(self) -> str:
        return identity_hash(self.identity)


def _check_model_config(job: JobConfig, mf: ModelFiles, rows: int):
    """Checks config.json, the checkpoint's tensor names and shapes (headers only), the engine
    section and the memory the run will take without loading weights (`rows`: the input's);
    returns the engine settings resolved (the one resolution of this process), the model's
    config and the memory plan."""
    # lazy: torch and the extension, which validate and status never need
    from eaglebatch.job.engine_settings import resolve_engine
    from eaglebatch.model.causal_lm import CausalLM

    try:
        cfg = ModelConfig.from_dir(mf.dir)
        shapes = CausalLM.check_checkpoint(mf.dir, cfg, gguf=mf.gguf)
    except (ValueError, OSError) as e:
        raise JobError(f"model: {mf.dir}: {e}") from None
    if max(mf.max_token_id, *mf.eos_token_ids, -1) >= cfg.vocab_size:
        raise JobError(
            f"model: {mf.dir}: the tokenizer has ids up to "
            f"{max(mf.max_token_id, *mf.eos_token_ids)} but config.json's vocab_size is "
            f"{cfg.vocab_size}: tokenizer.json does not belong to these weights"
        )
    bad = [t for t in job.sampling.stop_token_ids if t >= cfg.vocab_size]
    if bad:
        raise JobError(f"sampling.stop_token_ids: {bad} are not ids of model {mf.dir}, whose "
                       f"vocab_size is {cfg.vocab_size}")  # fmt: skip
    settings = resolve_engine(job, mf, cfg)
    return settings, cfg, _memory_plan(job, mf, cfg, settings, shapes, rows)


def _check_task(job: JobConfig, mf: ModelFiles, cfg) -> None:
    """The model can do the job's task: a sequence classifier only classifies or scores
    (reward); a pooled task's head resolves (job/pooling.py: JobError naming the key)."""
    if cfg.head_outputs and job.task not in ("classify", "reward"):
        raise JobError(f"task: model {mf.dir} is a sequence classifier (a score head, no LM "
                       f"head): it runs task: classify or reward, not {job.task}")  # fmt: skip
    pool_spec(job, mf.dir)


def requests_known(job: JobConfig, rows: int) -> int | None:
    """The samples a job over `rows` input rows generates, where the job alone says (not for
    OpenAI Batch lines, which may set their own n, nor for scoring tasks)."""
    if job.input.openai_batch or job.task != "generate":
        return None
    return rows * job.sampling.n


def _memory_plan(job: JobConfig, mf: ModelFiles, cfg, settings: EngineSettings, shapes: dict,
                 rows: int):  # fmt: skip
    """What a CPU run will hold (job/memory.py); None on other devices."""
    # lazy: torch and the extension, which validate and status never need
    from eaglebatch.cpu.stored import stored_bytes
    from eaglebatch.worker import job_kv, plan_kv_budget

    if settings.device.type != "cpu":
        return None
    eng = job.engine
    blocks = stored_bytes(mf.dir, mf.gguf, cfg) if settings.quantized else {}
    itemsize = settings.dtype.itemsize
    seq = settings.max_model_len + settings.max_draft_tokens
    extra = 1 if job.draft is not None else 0  # a draft head's layer over the same blocks
    states = state_plan(eng, cfg)
    kv = plan_kv_budget(eng, cfg, seq, settings.dtype, settings.device, extra,
                        job=job_kv(job, settings, requests_known(job, rows)),
                        states=states)  # the worker's rule  # fmt: skip
    plan = memory.MemoryPlan(
        model_bytes=memory.model_bytes(shapes, itemsize, blocks),
        kv_bytes=kv.num_blocks * kv.bytes_per_block, kv_key=kv.sized_by,
        available_bytes=memory.available_memory(),
        buffer_bytes=memory.buffer_bytes(cfg, eng.max_num_batched_tokens, eng.max_batch_size,
                                         itemsize),
        experts=memory.mapped_experts(blocks, cfg), states=states,
    )  # fmt: skip
    return plan


def _check_draft(job: JobConfig, draft: Path | None, mf: ModelFiles, cfg: ModelConfig) -> None:
    """A draft head must fit the model (hidden size, vocabulary, aux layers: draft_check) and
    its checkpoint files be whole (headers against file sizes), from config.json and the
    headers, before any weight loads; `draft: mtp` needs the model's checkpoint to carry its
    MTP layer (speculative/mtp_config.py)."""
    # lazy: torch and the extension, which validate and status never need
    from eaglebatch.speculative.draft_check import check_draft_dir
    from eaglebatch.speculative.draft_config import read_raw_config
    from eaglebatch.speculative.mtp import check_mtp_dir

    if draft is None:
        return
    try:
        if job.draft != MTP_DRAFT:
            check_draft_dir(draft, cfg)
        elif mf.gguf is not None:
            raise ValueError(f"the model is the GGUF file {mf.gguf}; the MTP layer loads from a "
                             "safetensors checkpoint only")  # fmt: skip
        else:
            check_mtp_dir(draft, read_raw_config(draft), cfg)
    except (ValueError, OSError) as e:
        raise JobError(f"draft: {job.draft}: {e}") from None


@dataclass(frozen=True)
class CheckedInput:
    """What `check_job_input` found: the input files, their rows, the OpenAI Batch input's
    first url and whether it has chat lines, the kept columns resolved."""

    files: list[Path]
    total: int
    endpoint: str | None
    batch_chat: bool
    kept: tuple[str, ...]


def check_job_input(job: JobConfig) -> CheckedInput:
    """`prepare`'s checks that need no model (the one copy: `validate` of a model it does not
    materialise runs these): the input files and the columns the job reads, the kept columns
    against the columns this job writes, output.path apart from the input and of a directory's
    kind (the one place a start checks that: open_output's prepare_output_dir relies on it)."""
    endpoint, batch_chat = None, False
    if job.input.openai_batch:
        batch = check_batch_input(job.input, job.storage, job.task)
        files, total, endpoint, batch_chat = batch.files, batch.total, batch.first_url, batch.chat
    else:
        files, total = check_input(job.input, job.storage)
    kept = kept_columns(job, files)
    check_output_apart(job.input.path, files, job.output.path)
    check_output_kind(location(job.output.path, job.storage))
    return CheckedInput(files, total, endpoint, batch_chat, kept)


def prepare(
    job: JobConfig, check_memory: bool = True, checked: CheckedInput | None = None
) -> PreparedJob:
    """Checks the job and everything it names before any work (a bad job is a JobError);
    `check_memory`: also refuse a run this machine's memory cannot hold (`status` reports
    on a job that may run elsewhere); `checked`: check_job_input(job), where the caller ran
    it already (before copying a model, before writing a job file), so it runs once a start."""
    checked = check_job_input(job) if checked is None else checked
    files, total, endpoint, batch_chat = checked.files, checked.total, checked.endpoint, (
        checked.batch_chat)  # fmt: skip
    kept = checked.kept
    mf = with_chat_template(model_files(job.model, job.storage), job.model_chat_template)
    if renders_chat(job, batch_chat):
        if mf.chat_template is None:
            raise JobError(
                f"input: chat messages need a chat template, and model {job.model} has none; "
                f"name a template file with model_chat_template: path/to/template.jinja"
            )
        check_chat_template(mf.chat_template, template_origin(job, mf))
    draft = resolve_draft_dir(job.draft, model_dir=mf.dir) if job.draft is not None else None
    engine, cfg, mem = _check_model_config(job, mf, total)
    _check_task(job, mf, cfg)
    vocab_size = cfg.vocab_size
    _check_draft(job, draft, mf, cfg)  # against the model's config.json, checked just above
    if mem is not None and check_memory:
        memory.check(mem, job.engine.kv_cache_tokens, str(job.model))
    check_response_format(job, mf, vocab_size)
    identity = job_identity(job, files, mf, draft, engine.dtype_name, engine.max_model_len)
    if job.output.results_file is not None:
        check_results_path(job.output.results_file, Path(job.output.path),
                           identity_hash(identity), job.input.path, files)  # fmt: skip
    return PreparedJob(
        job=job, input_files=files, total_rows=total, model=mf, draft_dir=draft, identity=identity,
        openai_endpoint=endpoint, batch_chat=batch_chat, vocab_size=vocab_size, kept_columns=kept,
        engine=engine, reasoning_ids=reasoning_ids(job, mf), memory_plan=mem,
    )

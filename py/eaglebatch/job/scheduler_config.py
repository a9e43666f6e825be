"""`SchedulerConfig`: the run's settings, the one object that crosses the boundary, in sections.

Built once from the job (`from_job`, called by runner.scheduler_config) and handed to
`_native.Scheduler(config)`, which reads it by attribute, section by section, into the Rust
`RunConfig` (rust/src/config.rs and config/sections.rs; rust/src/python/scheduler_config.rs
reads it, and a test holds the two field lists equal) and validates it there once. The
sections: `input` (what the reader and the input checks read), `sampling` (every row's
defaults: the Rust side reads them as one `SamplingParams`), `output` (what the writer
writes), `storage` (how object-store paths are reached) and `policy` (the scheduling
policy's); `task` beside them. (The class keeps its name: `_native.pyi` and the callers name
it; the job schema's sections are job/config.py's `InputConfig`, `OutputConfig`, ... hence
`*Section` here.)

One declaration per setting on this side: a setting the job spells (`sampling.temperature`,
`engine.block_size`, `output.part_rows`, ...) is declared by the job schema (job/config.py:
its key, type, default and check) and copied here by name (`JOB_SECTIONS`); its field below
takes its default from the schema (`_job`), so the two cannot disagree. The other fields are
what the run resolves (files, the model's tokens, the worker's sizes, the engine settings, the
scope, resume) and are passed to `from_job` by name. Every field name is unique across the
sections, so `sectioned` builds a config from settings by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from eaglebatch.job.config import (
    EngineConfig,
    InputConfig,
    JobConfig,
    OutputConfig,
    SamplingConfig,
)

# the job's sections whose keys are scheduler settings of the same name
JOB_SECTIONS = {"input": InputConfig, "output": OutputConfig, "sampling": SamplingConfig,
                "engine": EngineConfig}  # fmt: skip


def _job(section: str, key: str) -> Any:
    """The field's default: the job schema's default of `section.key` (copied when mutable)."""
    default = JOB_SECTIONS[section].model_fields[key].get_default(call_default_factory=True)
    if isinstance(default, tuple | list | Mapping):
        return field(default_factory=lambda: _plain(default))
    return default


@dataclass(frozen=True, kw_only=True)
class InputSection:
    """What the reader and the input checks read."""

    # Parquet files (already resolved from the job's input.path) and their columns.
    input_files: list[str]
    prompt_column: str | None  # the job's, or None when prompts are messages or batch lines
    messages_column: str | None = _job("input", "messages_column")
    id_column: str | None = _job("input", "id_column")
    limit: int | None = _job("input", "limit")
    # "parquet", or "openai-batch" (JSONL lines, each naming its endpoint)
    input_format: str = "parquet"
    # Rows [start, end) of the input's row_index (after limit) to generate; None = all.
    row_range: tuple[int, int] | None = None
    # sampling key -> input column of per-row values
    sampling_columns: dict[str, str] = _job("input", "sampling_columns")
    continuation_column: str | None = _job("input", "continuation_column")
    choices_column: str | None = _job("input", "choices_column")
    # pooled tasks: the instruction prompt before each raw prompt, and what a prompt over
    # max_model_len becomes (start | end | error; embed.truncate)
    prompt_prefix: str = ""
    truncate: str = "error"
    # Prompt construction / tokenization.
    add_special_tokens: bool = _job("input", "add_special_tokens")
    apply_chat_template: bool = _job("input", "apply_chat_template")
    tokenizer_file: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    # reasoning models: the template's enable_thinking (None: its default)
    enable_thinking: bool | None = _job("input", "enable_thinking")
    # Resume: int64 [N] row indices earlier runs wrote (skipped without tokenizing), or None.
    skip_rows: np.ndarray | None = None
    # Resume: int64 keys row_index * 4096 + sample_index (resume.sample_key) of the samples
    # written of rows not in skip_rows (those samples are not generated again).
    skip_samples: np.ndarray | None = None
    # Reader: rows per Parquet batch, and the most rows queued between reader and scheduler
    # (not job keys: the streaming test's bound and the throughput both hold at these).
    read_batch_rows: int = 1024
    queue_rows: int = 4096


@dataclass(frozen=True, kw_only=True)
class SamplingSection:
    """Every row's sampling defaults (the job's `sampling` section, key for key, with
    output.logprobs and what the model resolves); a row's columns or batch line override
    them."""

    max_new_tokens: int = _job("sampling", "max_new_tokens")
    stop: list[str] = _job("sampling", "stop")
    temperature: float = _job("sampling", "temperature")
    top_p: float = _job("sampling", "top_p")
    top_k: int = _job("sampling", "top_k")
    seed: int = _job("sampling", "seed")
    n: int = _job("sampling", "n")
    min_new_tokens: int = _job("sampling", "min_new_tokens")
    min_p: float = _job("sampling", "min_p")
    ignore_eos: bool = _job("sampling", "ignore_eos")
    stop_token_ids: list[int] = _job("sampling", "stop_token_ids")
    include_stop_str_in_output: bool = _job("sampling", "include_stop_str_in_output")
    skip_special_tokens: bool = _job("sampling", "skip_special_tokens")
    repetition_penalty: float = _job("sampling", "repetition_penalty")
    frequency_penalty: float = _job("sampling", "frequency_penalty")
    presence_penalty: float = _job("sampling", "presence_penalty")
    logprobs: int = _job("output", "logprobs")  # top alternatives per output token
    # structured output: the job's format (read as JSON text by the Rust side; None = none)
    response_format: dict[str, Any] | None = _job("sampling", "response_format")
    # the model's EOS ids, < its vocab_size (checked by prepare.prepare); a row stops at them
    # unless it ignores EOS
    eos_token_ids: list[int]
    # config.json's vocab_size: a row's stop_token_ids must be below it (0 = unchecked)
    vocab_size: int = 0


@dataclass(frozen=True, kw_only=True)
class OutputSection:
    """What the writer writes: a directory or an object-store URL, its parts and columns."""

    output_dir: str
    part_rows: int = _job("output", "part_rows")
    file_metadata: dict[str, str]
    include_token_ids: bool = _job("output", "include_token_ids")
    # input columns copied into each output row (output.keep_columns, "*" resolved)
    keep_columns: list[str] = field(default_factory=list)
    prompt_logprobs: int = _job("output", "prompt_logprobs")  # top alternatives per prompt token
    # Also close a part once its oldest row has waited this long (None = by part_rows only).
    flush_interval_s: float | None = _job("output", "flush_interval_s")
    # the ids of output.reasoning's (start, end) tags ([] = no reasoning split)
    reasoning_ids: list[int] = field(default_factory=list)
    # pooled tasks' head (job/pooling.py PoolSpec; rust/src/pooled.rs): the positions pooled,
    # the worker's contributions' width, embed's normalisation and cut (0: all), classify's
    # labels and whether they are independent (sigmoid)
    pooling: str = "last"
    pool_width: int = 0
    pool_normalize: bool = False
    pool_dimensions: int = 0
    labels: list[str] = field(default_factory=list)
    multi_label: bool = False


@dataclass(frozen=True, kw_only=True)
class StorageSection:
    """The job's storage section: how s3:// gs:// az:// paths are reached."""

    endpoint: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    unconditional: bool = False  # storage.unsafe_no_conditional_writes


@dataclass(frozen=True, kw_only=True)
class PolicySection:
    """The scheduling policy's: paged KV cache, batching and the step kinds."""

    num_blocks: int  # the worker's KV budget
    block_size: int = _job("engine", "block_size")
    max_batch_size: int = _job("engine", "max_batch_size")
    max_num_batched_tokens: int = _job("engine", "max_num_batched_tokens")
    max_model_len: int  # resolved (EngineSettings)
    # W, the most draft tokens of one verify round (0 = plain decoding): the lookahead
    # (EngineSettings.max_draft_tokens; K = speculative.num_steps is the head's chain)
    max_draft_tokens: int = 0
    prefix_caching: bool = _job("engine", "prefix_caching")
    chunked_prefill: bool = _job("engine", "chunked_prefill")
    overlap: bool = False  # resolved (EngineSettings): plain decoding, a step in flight
    # a hybrid model's recurrent states (job/state_budget.py): tokens between the checkpoints
    # of a prompt's state (a multiple of block_size; 0: no recurrent state, nothing changes)
    # and the checkpoint rows (0: prefix caching never hits)
    state_checkpoint_interval: int = 0
    state_checkpoints: int = 0


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    # generate | score | perplexity | embed | classify | reward (the job's task; score.rs)
    task: str = "generate"
    input: InputSection
    sampling: SamplingSection
    output: OutputSection
    storage: StorageSection = field(default_factory=StorageSection)
    policy: PolicySection


# the config's sections by attribute name
SECTIONS = {"input": InputSection, "sampling": SamplingSection, "output": OutputSection,
            "storage": StorageSection, "policy": PolicySection}  # fmt: skip
# every section field's name -> its section's (the names are unique across the sections)
SECTION_OF = {f.name: name for name, cls in SECTIONS.items() for f in fields(cls)}


def sectioned(**settings: Any) -> SchedulerConfig:
    """The config of `settings` by name: each section's fields by their own names, `task`, or a
    section whole by its name (`storage=StorageSection(...)`). A name no section has, or a
    required field not given, raises TypeError naming it."""
    parts: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    top = {}
    for name, value in settings.items():
        if name in SECTION_OF:
            parts[SECTION_OF[name]][name] = value
        elif name in SECTIONS or name == "task":
            top[name] = value
        else:
            raise TypeError(f"SchedulerConfig has no setting {name!r}")
    built = {name: cls(**parts[name]) for name, cls in SECTIONS.items() if name not in top}
    return SchedulerConfig(**built, **top)


def storage_section(storage) -> StorageSection:
    """The job's storage section as the run reads it (None: the defaults)."""
    if storage is None:
        return StorageSection()
    return StorageSection(endpoint=storage.endpoint, options=dict(storage.options),
                          unconditional=storage.unsafe_no_conditional_writes)  # fmt: skip


def from_job(job: JobConfig, **resolved: Any) -> SchedulerConfig:
    """The job's settings of the same name from its sections (JOB_SECTIONS), with `resolved`,
    the rest, by name (a resolved value replaces the job's: `prompt_column` after the input
    format, `keep_columns` after "*", `max_model_len` and `overlap` as the engine resolved)."""
    names = SECTION_OF.keys()
    taken = {}
    for section in JOB_SECTIONS:
        values = getattr(job, section)
        for key in type(values).model_fields.keys() & names - resolved.keys():
            taken[key] = _plain(getattr(values, key))
    return sectioned(**taken, **resolved)


def _plain(value: Any) -> Any:
    """Tuples (and lists) as new lists and mappings as dicts, as the Rust side reads them."""
    if isinstance(value, tuple | list):
        return list(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value


def job_only_config(job: JobConfig, **resolved: Any) -> SchedulerConfig:
    """The job's settings with stand-ins for what the model, the worker and the input files
    resolve (`resolved` replaces any by name): enough for the rules that follow from the job's
    keys alone (its output columns, its input checks). `reasoning_ids`: two ids when
    output.reasoning is on, as the tags' ids will be."""
    standins = dict(
        input_files=[], prompt_column=job.input.text_column, task=job.task,
        input_format="openai-batch" if job.input.openai_batch else "parquet",
        tokenizer_file="", chat_template=None, bos_token=None, eos_token=None, eos_token_ids=[],
        reasoning_ids=[0, 1] if job.output.reasoning is not None else [],
        output_dir=str(job.output.path), file_metadata={}, keep_columns=[], num_blocks=0,
        max_model_len=0, overlap=False,
    )  # fmt: skip
    return from_job(job, **(standins | resolved))

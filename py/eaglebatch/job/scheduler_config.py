"""`SchedulerConfig`: the Rust scheduler's settings, the one object that crosses the boundary.

Built once from the job (engine.build_scheduler) and handed to `_native.Scheduler(config)`,
which reads it by attribute into the Rust struct of the same name (rust/src/config.rs, same
field names) and validates it there once. Adding a setting touches this class, the Rust struct,
its validation and its use — nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    # Input: Parquet files (already resolved from the job's input.path) and their columns.
    input_files: list[str]
    prompt_column: str | None
    messages_column: str | None
    id_column: str | None
    limit: int | None
    # "parquet", or "openai-batch" (JSONL lines, each naming its endpoint)
    input_format: str = "parquet"
    # Rows [start, end) of the input's row_index (after limit) to generate; None = all.
    row_range: tuple[int, int] | None = None
    # Prompt construction / tokenization.
    apply_chat_template: bool
    tokenizer_file: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    # the model's EOS ids, < its vocab_size (checked by engine.prepare); a row stops at them
    # unless it ignores EOS
    eos_token_ids: list[int]
    # config.json's vocab_size: a row's stop_token_ids must be below it (0 = unchecked)
    vocab_size: int = 0
    # Output.
    output_dir: str
    part_rows: int
    file_metadata: dict[str, str]
    include_token_ids: bool
    # input columns copied into each output row (output.keep_columns, resolved)
    keep_columns: list[str] = field(default_factory=list)
    # Sampling / stopping.
    max_new_tokens: int
    stop: list[str]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    n: int = 1  # samples per input row
    min_new_tokens: int = 0
    min_p: float = 0.0  # vLLM's min-p (0 = off)
    ignore_eos: bool = False  # do not stop at eos_token_ids
    stop_token_ids: list[int] = field(default_factory=list)  # ids that end a row like EOS
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it
    skip_special_tokens: bool = True  # false: special tokens appear in output_text
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int = 0  # top alternatives per output token (output.logprobs; 0 = no column)
    prompt_logprobs: int = 0  # top alternatives per prompt token (output.prompt_logprobs)
    # sampling key -> input column of per-row values (input.sampling_columns)
    sampling_columns: dict[str, str] = field(default_factory=dict)
    # Paged KV cache and batching.
    num_blocks: int
    block_size: int
    max_batch_size: int
    max_num_batched_tokens: int
    max_model_len: int
    # W, the most draft tokens of one verify round (0 = plain decoding): the lookahead.
    max_draft_tokens: int = 0
    # Automatic prefix caching (engine.prefix_caching): requests share their prompts' full blocks.
    prefix_caching: bool = True
    # Chunked prefill (engine.chunked_prefill): prompts in chunks of max_num_batched_tokens.
    chunked_prefill: bool = False
    # Overlap (engine.overlap, plain decoding): the next step planned while one is in flight.
    overlap: bool = False
    # Resume: int64 [N] row indices earlier runs wrote (skipped without tokenizing), or None.
    skip_rows: np.ndarray | None = None
    # Resume: int64 keys row_index * 4096 + sample_index (resume.sample_key) of the samples written
    # of rows not in skip_rows (those samples are not generated again).
    skip_samples: np.ndarray | None = None
    # Also close a part once its oldest row has waited this long (None = by part_rows only).
    flush_interval_s: float | None = None
    # Reader: rows per Parquet batch, and the most rows queued between reader and scheduler.
    read_batch_rows: int = 1024
    queue_rows: int = 4096

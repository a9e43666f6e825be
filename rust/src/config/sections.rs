//! The run's config sections (`RunConfig`'s fields besides `task`): what the reader and the
//! input checks read, the job's sampling defaults, what the writer writes, the scheduling
//! policy's settings. Plain data; `RunConfig::validate` checks them once.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::sampling_params::SamplingParams;

/// What the reader and the input checks read: files, columns, resume rows, prompt
/// construction and the reader's batch sizes.
#[derive(Debug, Clone, Default)]
pub struct InputConfig {
    pub input_files: Vec<PathBuf>,
    pub prompt_column: Option<String>,
    pub messages_column: Option<String>,
    pub id_column: Option<String>,
    /// The input files' format: "parquet", or "openai-batch" (JSONL requests, openai_batch.rs).
    pub input_format: String,
    pub limit: Option<u64>,
    /// Rows `[start, end)` of the input (by `row_index`, after `limit`) this run generates;
    /// None = all (a shard or a unit of a scaled-out job). Rows before `start` are read for
    /// their ids alone, so duplicate ids are decided exactly as in a run over every row.
    pub row_range: Option<(u64, u64)>,
    /// Resume: row indices already written by an earlier run of the same job (any order,
    /// duplicates allowed). The reader skips them without tokenizing; they are never written.
    pub skip_rows: Vec<i64>,
    /// Resume with `n > 1`: the samples already written of rows not in `skip_rows`, as keys
    /// `row_index * MAX_SAMPLES + sample_index`; those samples are not generated again.
    pub skip_samples: Vec<i64>,
    /// `task: score`: a string column of continuations, or a list<string> column of choices
    /// (exactly one of them).
    pub continuation_column: Option<String>,
    pub choices_column: Option<String>,
    /// `task: embed`: text put before each raw prompt (the model's instruction prompt chosen by
    /// `embed.prompt_name`; "" = none).
    pub prompt_prefix: String,
    /// Pooled tasks: what a prompt longer than max_model_len becomes: "start" (its first
    /// tokens go), "end" (its last tokens go) or "error" (an error row).
    pub truncate: String,
    /// Per-row sampling: sampling key -> input column whose non-null values override the job's
    /// (sampling_params.rs; read by reader/columns.rs).
    pub sampling_columns: BTreeMap<String, String>,
    /// Raw prompts are encoded with the tokenizer's special tokens (BOS, ...); rendered chats
    /// never are (their template writes them).
    pub add_special_tokens: bool,
    pub apply_chat_template: bool,
    pub tokenizer_file: PathBuf,
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Reasoning models: the chat template's `enable_thinking` variable (None: unset).
    pub enable_thinking: Option<bool>,
    /// Rows per Parquet batch, and the most rows queued between reader and run.
    pub read_batch_rows: usize,
    pub queue_rows: usize,
}

/// The job's sampling defaults: every row's `SamplingParams` (a row's sampling columns or
/// batch line override them), with what a row does not carry.
#[derive(Debug, Clone, Default)]
pub struct SamplingConfig {
    /// Every row's defaults, as the bindings read them (empty stop strings dropped, `seed`
    /// None, `response_format` parsed from the text below, None when it does not parse:
    /// `RunConfig::validate` reports that).
    pub params: SamplingParams,
    /// The job's seed: a row without its own derives its seed from it and its row index.
    pub seed: i64,
    /// The job's `sampling.response_format` as JSON text ("" = none): a given one, even
    /// `{"type": "text"}`, gives the output its `structured` column.
    pub response_format: String,
    /// The model's EOS ids: a row stops at them unless it ignores EOS.
    pub eos_token_ids: Vec<u32>,
}

/// What the writer writes: where, in which parts, with which optional columns.
#[derive(Debug, Clone, Default)]
pub struct OutputConfig {
    pub output_dir: PathBuf,
    pub part_rows: usize,
    pub file_metadata: BTreeMap<String, String>,
    pub include_token_ids: bool,
    /// Input columns copied into each output row (after the output's own columns), with their
    /// types (`output.keep_columns`, resolved: no "*" here).
    pub keep_columns: Vec<String>,
    /// Close the current part file once its oldest row has waited this long (None = only by
    /// `part_rows`), so a crash of a slow job loses at most about this much finished work.
    pub flush_interval_s: Option<f64>,
    /// Top alternatives per prompt token in the `prompt_logprobs` column (0 = no column);
    /// such requests compute their whole prompt (no prefix-cache hit).
    pub prompt_logprobs: u32,
    /// `output.reasoning`: the ids of its (start, end) tags, empty when off; the text between
    /// them is the `reasoning_text` column and a response_format applies after the end tag.
    pub reasoning_ids: Vec<u32>,
    /// Pooled tasks (pooled.rs `PoolHead`): the positions pooled (last | mean | cls), the
    /// width of the worker's contributions, embed's normalisation and Matryoshka cut (0 = all),
    /// classify's labels and whether they are independent (sigmoid).
    pub pooling: String,
    pub pool_width: usize,
    pub pool_normalize: bool,
    pub pool_dimensions: usize,
    pub labels: Vec<String>,
    pub multi_label: bool,
}

/// The scheduling policy's settings (scheduler.rs): the paged KV cache, batching and the step
/// kinds; the rest of `RunConfig` is the run's.
#[derive(Debug, Clone, Default)]
pub struct PolicyConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_batch_size: usize,
    pub max_num_batched_tokens: usize,
    /// Never the KV capacity, so an output does not depend on the budget.
    pub max_model_len: usize,
    /// W, the most draft tokens a verify step checks (0 = plain decoding; the draft head's
    /// chain K = `speculative.num_steps` is at most W, prompt lookup may draft up to W). With
    /// W > 0 decode steps are "verify" steps whose per-row query is the last token plus W
    /// placeholders.
    pub max_draft_tokens: usize,
    /// Automatic prefix caching: full KV blocks are shared by requests whose tokens start alike.
    pub prefix_caching: bool,
    /// Chunked prefill: prompts are computed `max_num_batched_tokens` tokens per step at most,
    /// in the steps that decode the running requests (scheduler/chunked.rs).
    pub chunked_prefill: bool,
    /// Plain decoding: allow `next_plan_ahead`, the step after a pending one planned before
    /// that one is committed (scheduler/overlap.rs).
    pub overlap: bool,
    /// Hybrid models (recurrent state per sequence): tokens between state checkpoints, a
    /// multiple of `block_size`; 0 = no recurrent state (state_checkpoints.rs).
    pub state_checkpoint_interval: usize,
    /// How many recurrent-state checkpoints the worker keeps (0: prefix caching never hits).
    pub state_checkpoints: usize,
}

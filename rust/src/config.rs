//! `SchedulerConfig`: the scheduler's settings, the one object that crosses the boundary.
//!
//! The Python side builds its twin (`eaglebatch.job.scheduler_config.SchedulerConfig`, a frozen
//! dataclass with the same field names) once from the job; with the `python` feature the
//! bindings read this struct from it field by field, by attribute name
//! (python/scheduler_config.rs: this module knows nothing of Python). Plain data; `validate`
//! checks the options once, up front, so the rest of the crate can rely on them (e.g.
//! `block_size >= 1`). Adding a setting touches this struct, the dataclass, the bindings' field
//! list, `validate` and its use — nowhere else.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sampling_params::{SamplingParams, COLUMN_KEYS};
use crate::score::{ScoreShape, Task};
use crate::structured::ResponseFormat;
use crate::writer::WriterConfig;
use arrow_schema::DataType;
use tokenizers::Tokenizer;

#[derive(Debug, Clone, Default)]
pub struct SchedulerConfig {
    // Input.
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
    /// What each row computes: "generate" (the default), "score" (the continuation or
    /// choices column's log-probabilities after the prompt) or "perplexity" (the prompt's own
    /// rolling log-probability); score.rs.
    pub task: String,
    /// `task: score`: a string column of continuations, or a list<string> column of choices
    /// (exactly one of them).
    pub continuation_column: Option<String>,
    pub choices_column: Option<String>,
    // Prompt construction / tokenization.
    /// Raw prompts are encoded with the tokenizer's special tokens (BOS, ...); rendered chats
    /// never are (their template writes them).
    pub add_special_tokens: bool,
    pub apply_chat_template: bool,
    pub tokenizer_file: PathBuf,
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// The model's EOS ids: a row stops at them unless it ignores EOS.
    pub eos_token_ids: Vec<u32>,
    /// The model's vocabulary size: every stop token id is below it (0: unchecked).
    pub vocab_size: usize,
    /// Object storage (`storage.endpoint`, `storage.options`): how `s3://`, `gs://` and
    /// `az://` input files and output directories are reached (storage.rs).
    pub storage_endpoint: Option<String>,
    pub storage_options: BTreeMap<String, String>,
    pub storage_unconditional: bool,
    // Output.
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
    // Sampling / stopping.
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub seed: i64,
    /// EOS / stop token ids masked and stop strings unchecked before this many output tokens.
    pub min_new_tokens: usize,
    /// vLLM's min-p (0 = off), applied by the worker.
    pub min_p: f32,
    /// Do not stop at `eos_token_ids` (`stop_token_ids` still stop).
    pub ignore_eos: bool,
    /// Ids that end a request like EOS.
    pub stop_token_ids: Vec<u32>,
    /// The text keeps the stop string that ended it.
    pub include_stop_str_in_output: bool,
    /// Decode texts without special tokens (false: they appear in them).
    pub skip_special_tokens: bool,
    /// vLLM's penalties: repetition (1 = off) over prompt and output tokens, frequency and
    /// presence (0 = off) over output tokens; applied by the worker.
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// Top alternatives per output token in the `logprobs` column (0 = no column unless a
    /// sampling column maps `logprobs`).
    pub logprobs: u32,
    /// Top alternatives per prompt token in the `prompt_logprobs` column (0 = no column);
    /// such requests compute their whole prompt (no prefix-cache hit).
    pub prompt_logprobs: u32,
    /// Reasoning models: the chat template's `enable_thinking` variable (None: unset).
    pub enable_thinking: Option<bool>,
    /// `output.reasoning`: the ids of its (start, end) tags, empty when off; the text between
    /// them is the `reasoning_text` column and a response_format applies after the end tag.
    pub reasoning_ids: Vec<u32>,
    /// Structured output: the job's `sampling.response_format` as JSON text ("" = none; a
    /// row's column or batch line may set its own).
    pub response_format: String,
    /// Per-row sampling: sampling key -> input column whose non-null values override the job's
    /// (sampling_params.rs; read by reader/columns.rs).
    pub sampling_columns: BTreeMap<String, String>,
    /// Samples per input row (`sample_index` 0..n-1), each its own sequence; they share the
    /// prompt's blocks.
    pub n: usize,
    /// The scheduling policy's settings (scheduler.rs).
    pub policy: PolicyConfig,
    pub read_batch_rows: usize,
    pub queue_rows: usize,
}

/// The scheduling policy's settings (scheduler.rs): the paged KV cache, batching and the step
/// kinds; the rest of `SchedulerConfig` is the run's.
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
}

impl SchedulerConfig {
    /// For the crate's tests: a config with the given input/tokenizer/output and small sizes
    /// for the rest (every setting not named here is its type's zero, empty or false). A run's
    /// config names every setting (the bindings read each field from Python, whose defaults
    /// are the job schema's), so no default here decides what a job does.
    #[cfg(test)]
    pub fn new(
        input_files: Vec<PathBuf>,
        prompt_column: &str,
        tokenizer_file: PathBuf,
        output_dir: PathBuf,
    ) -> Self {
        SchedulerConfig {
            input_files,
            prompt_column: Some(prompt_column.to_string()),
            input_format: "parquet".to_string(),
            task: "generate".to_string(),
            add_special_tokens: true,
            tokenizer_file,
            output_dir,
            part_rows: 10_000,
            max_new_tokens: 16,
            top_p: 1.0,
            skip_special_tokens: true,
            repetition_penalty: 1.0,
            n: 1,
            policy: PolicyConfig {
                num_blocks: 1024,
                block_size: 16,
                max_batch_size: 64,
                max_num_batched_tokens: 8192,
                max_model_len: 4096,
                prefix_caching: true,
                ..Default::default()
            },
            read_batch_rows: 1024,
            queue_rows: 4096,
            ..Default::default()
        }
    }

    /// Checks every setting once, up front (sizes, then sampling, then inputs).
    pub fn validate(&self) -> Result<()> {
        self.validate_sizes()?;
        if self.policy.overlap && self.policy.max_draft_tokens > 0 {
            return Err(Error::user(
                "overlap needs plain decoding (max_draft_tokens 0): a verify round's token \
                 count is known only at its commit",
            ));
        }
        self.validate_sampling()?;
        self.validate_task()?;
        self.validate_inputs()
    }

    /// The object-store settings, as storage.rs takes them.
    pub fn storage(&self) -> crate::storage::StorageSettings {
        crate::storage::StorageSettings {
            endpoint: self.storage_endpoint.clone(),
            options: self.storage_options.clone(),
            unconditional: self.storage_unconditional,
        }
    }

    /// The job's task.
    pub fn task(&self) -> Result<Task> {
        Task::parse(&self.task)
    }

    /// The writer's settings for this job: which optional columns its output has is decided
    /// here only (`own_output_columns` and the writer read the same switches); `id_type`, the
    /// kept columns' types and the decoder come from the opened input and the tokenizer.
    pub fn writer_config(
        &self,
        id_type: DataType,
        kept: Vec<(String, DataType)>,
        decoder: Option<Arc<Tokenizer>>,
    ) -> WriterConfig {
        WriterConfig {
            output_dir: self.output_dir.clone(),
            storage: self.storage(),
            part_rows: self.part_rows,
            file_metadata: self.file_metadata.clone(),
            include_token_ids: self.include_token_ids,
            logprobs: self.writes_logprobs(),
            prompt_logprobs: self.prompt_logprobs > 0,
            structured: self.may_be_structured(),
            reasoning: self.reasoning_ids.len() == 2,
            endpoint: self.openai_batch(),
            score: self.score_shape(),
            id_type,
            kept,
            flush_interval: self
                .flush_interval_s
                .map(std::time::Duration::from_secs_f64),
            decoder,
        }
    }

    /// The names of the columns this job's output has before any kept input column, in order.
    pub fn own_output_columns(&self) -> Vec<String> {
        let schema =
            crate::writer::output_schema(&self.writer_config(DataType::Int64, vec![], None));
        schema.fields().iter().map(|f| f.name().clone()).collect()
    }

    /// A scoring job's output shape (None: generation).
    pub fn score_shape(&self) -> Option<ScoreShape> {
        match self.task().ok()? {
            Task::Generate => None,
            Task::Perplexity => Some(ScoreShape::Rolling),
            Task::Score if self.choices_column.is_some() => Some(ScoreShape::Choices),
            Task::Score => Some(ScoreShape::Pair),
        }
    }

    /// A scoring task names its columns and generates nothing else.
    fn validate_task(&self) -> Result<()> {
        let task = self.task()?;
        let columns = [&self.continuation_column, &self.choices_column];
        let named = columns.iter().filter(|c| c.is_some()).count();
        match task {
            Task::Score if named != 1 => Err(Error::user(
                "task score needs exactly one of input.continuation_column and \
                 input.choices_column",
            )),
            Task::Generate | Task::Perplexity if named > 0 => Err(Error::user(format!(
                "input.continuation_column and input.choices_column are for task score, not \
                 {}",
                self.task
            ))),
            Task::Score | Task::Perplexity if self.n > 1 || self.prompt_logprobs > 0 => {
                Err(Error::user(format!(
                    "task {}: sampling.n and output.prompt_logprobs do not apply to a scoring \
                     task",
                    self.task
                )))
            }
            Task::Score | Task::Perplexity if self.openai_batch() => Err(Error::user(format!(
                "task {}: OpenAI Batch input is for generation",
                self.task
            ))),
            _ => Ok(()),
        }
    }

    /// Counts and sizes: positive, and within what the crate's index types hold.
    fn validate_sizes(&self) -> Result<()> {
        let positive = [
            ("part_rows", self.part_rows),
            ("max_new_tokens", self.max_new_tokens),
            ("num_blocks", self.policy.num_blocks),
            ("block_size", self.policy.block_size),
            ("max_batch_size", self.policy.max_batch_size),
            ("max_num_batched_tokens", self.policy.max_num_batched_tokens),
            ("max_model_len", self.policy.max_model_len),
            ("read_batch_rows", self.read_batch_rows),
            ("queue_rows", self.queue_rows),
            ("n", self.n),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(Error::user(format!("{name} must be >= 1, got 0")));
            }
        }
        if self.policy.max_model_len < 2 {
            return Err(Error::user(format!(
                "max_model_len must be >= 2 (one prompt token and one generated token), got {}",
                self.policy.max_model_len
            )));
        }
        if self.policy.num_blocks > i32::MAX as usize || self.policy.block_size > (1 << 20) {
            return Err(Error::user(format!(
                "num_blocks ({}) or block_size ({}) out of range",
                self.policy.num_blocks, self.policy.block_size
            )));
        }
        if self.n > crate::sampling_params::MAX_SAMPLES {
            return Err(Error::user(format!("n must be <= 4096, got {}", self.n)));
        }
        if self.policy.max_draft_tokens > 64 {
            return Err(Error::user(format!(
                "max_draft_tokens must be <= 64, got {}",
                self.policy.max_draft_tokens
            )));
        }
        if self.policy.max_model_len > i32::MAX as usize {
            return Err(Error::user("max_model_len must fit in int32"));
        }
        if let Some((start, end)) = self.row_range {
            if start > end {
                return Err(Error::user(format!(
                    "row_range must have start <= end, got [{start}, {end})"
                )));
            }
        }
        if let Some(s) = self.flush_interval_s {
            if !(s > 0.0 && s.is_finite()) {
                return Err(Error::user(format!(
                    "flush_interval_s must be a finite number > 0, got {s}"
                )));
            }
        }
        Ok(())
    }

    /// Input files, columns, resume rows and the chat template.
    fn validate_inputs(&self) -> Result<()> {
        if self
            .skip_rows
            .iter()
            .chain(&self.skip_samples)
            .any(|&r| r < 0)
        {
            return Err(Error::user("skip_rows / skip_samples must be >= 0"));
        }
        if self.input_files.is_empty() {
            return Err(Error::user(
                "input_files is empty: give at least one Parquet file",
            ));
        }
        // openai-batch: each line names its endpoint (openai_batch.rs)
        if self.input_format != "parquet" && !self.openai_batch() {
            return Err(Error::user(format!(
                "input_format must be parquet or openai-batch, got {:?}",
                self.input_format
            )));
        } else if !self.openai_batch()
            && self.prompt_column.is_none()
            && self.messages_column.is_none()
        {
            return Err(Error::user(
                "neither prompt_column nor messages_column is set: one of them is required",
            ));
        }
        self.validate_keep_columns()?;
        if self.needs_chat_template() && self.chat_template.as_deref().is_none_or(str::is_empty) {
            return Err(Error::user(
                "a chat template is required (messages_column or apply_chat_template) but \
                 chat_template is empty: the tokenizer has no chat template; pass one",
            ));
        }
        Ok(())
    }

    /// Kept input columns: distinct, none named as a column this job's output has (an optional
    /// column it does not write, `logprob` in a generation job, is free), Parquet input only.
    pub(crate) fn validate_keep_columns(&self) -> Result<()> {
        let key = "output.keep_columns";
        if self.openai_batch() && !self.keep_columns.is_empty() {
            return Err(Error::user(format!(
                "{key}: an OpenAI Batch input has no columns to keep (its lines' custom_id is \
                 the id column)"
            )));
        }
        let own = self.own_output_columns();
        for (i, name) in self.keep_columns.iter().enumerate() {
            if self.keep_columns[..i].contains(name) {
                return Err(Error::user(format!(
                    "{key}: column '{name}' is named twice"
                )));
            }
            if own.contains(name) {
                return Err(Error::user(format!(
                    "{key}: column '{name}' clashes with the output column of that name; this \
                     job's output columns are {}",
                    own.join(", ")
                )));
            }
        }
        Ok(())
    }

    /// The job's sampling parameters (`sampling` section), unchecked: the defaults of every
    /// row, which a row's sampling columns or batch line override.
    pub fn sampling_params(&self) -> SamplingParams {
        SamplingParams {
            max_new_tokens: self.max_new_tokens,
            min_new_tokens: self.min_new_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: None,
            repetition_penalty: self.repetition_penalty,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            stop: self
                .stop
                .iter()
                .filter(|s| !s.is_empty())
                .cloned()
                .collect(),
            logprobs: self.logprobs,
            min_p: self.min_p,
            ignore_eos: self.ignore_eos,
            stop_token_ids: self.stop_token_ids.clone(),
            include_stop_str_in_output: self.include_stop_str_in_output,
            skip_special_tokens: self.skip_special_tokens,
            vocab_size: self.vocab_size,
            n: self.n,
            response_format: self.job_response_format().ok().flatten().map(Arc::new),
        }
    }

    /// The job's response_format, parsed (None: none, or `{"type": "text"}`).
    pub fn job_response_format(&self) -> std::result::Result<Option<ResponseFormat>, String> {
        match self.response_format.trim() {
            "" => Ok(None),
            text => ResponseFormat::parse_request(text),
        }
    }

    /// Whether a row may be structured: the job, a sampling column or a batch line may set a
    /// response_format (the output then has a `structured` column).
    pub fn may_be_structured(&self) -> bool {
        !self.response_format.trim().is_empty()
            || self.sampling_columns.contains_key("response_format")
            || self.openai_batch()
    }

    /// Sampling parameters: in their ranges (`SamplingParams::check`, the rule every row's
    /// overrides meet too), n > 1 only when sampling, known sampling-column keys.
    fn validate_sampling(&self) -> Result<()> {
        self.job_response_format()
            .map_err(|e| Error::user(format!("sampling.{e}")))?;
        self.sampling_params().check().map_err(Error::user)?;
        if self.n > 1 && self.temperature == 0.0 {
            return Err(Error::user(format!(
                "n = {} samples per row need temperature > 0: greedy samples are all the same",
                self.n
            )));
        }
        if self.prompt_logprobs > crate::sampling_params::MAX_LOGPROBS {
            return Err(Error::user(format!(
                "prompt_logprobs must be in 0..={}, got {}",
                crate::sampling_params::MAX_LOGPROBS,
                self.prompt_logprobs
            )));
        }
        if self.prompt_logprobs > 0 && self.n > 1 {
            return Err(Error::user(
                "prompt_logprobs with n > 1 samples per row is not supported",
            ));
        }
        if let Some(k) = self
            .sampling_columns
            .keys()
            .find(|k| !COLUMN_KEYS.contains(&k.as_str()))
        {
            return Err(Error::user(format!(
                "sampling_columns: unknown key '{k}'; the keys are {}",
                COLUMN_KEYS.join(", ")
            )));
        }
        Ok(())
    }

    /// Whether output rows carry a `logprobs` column (a batch line may ask for them).
    pub fn writes_logprobs(&self) -> bool {
        self.logprobs > 0 || self.sampling_columns.contains_key("logprobs") || self.openai_batch()
    }

    /// Whether every prompt is rendered with the chat template: a messages column or the
    /// apply_chat_template setting (then a template is required).
    pub fn needs_chat_template(&self) -> bool {
        self.messages_column.is_some() || self.apply_chat_template
    }

    /// Whether the chat template, when given, is compiled: prompts need it, or batch lines may
    /// (chat lines; without a template each is an error row).
    pub fn uses_chat_template(&self) -> bool {
        self.needs_chat_template() || self.openai_batch()
    }

    /// Whether the input is OpenAI Batch JSONL.
    pub fn openai_batch(&self) -> bool {
        self.input_format == "openai-batch"
    }
}

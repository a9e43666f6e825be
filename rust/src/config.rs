//! `RunConfig`: the run's settings, the one object that crosses the boundary, in sections
//! (config/sections.rs): input, sampling, output, storage and the scheduling policy's.
//!
//! The Python side builds its twin (`eaglebatch.job.scheduler_config.RunConfig`, a frozen
//! dataclass whose section dataclasses have the same field names) once from the job; with the
//! `python` feature the bindings read this struct from it section by section, field by field,
//! by attribute name (python/scheduler_config.rs: this module knows nothing of Python). Plain
//! data; `validate` checks the options once, up front, so the rest of the crate can rely on
//! them (e.g. `block_size >= 1`). Adding a setting touches its section's struct and dataclass,
//! the bindings' field list, `validate` and its use — nowhere else.

pub mod sections;
mod validate;

pub use sections::{InputConfig, OutputConfig, PolicyConfig, SamplingConfig};

#[cfg(test)]
use std::path::PathBuf;
use std::sync::Arc;

use crate::error::Result;
use crate::pooled::{Head, PoolHead, Pooling};
use crate::sampling_params::SamplingParams;
use crate::score::{ScoreShape, Task};
use crate::storage::StorageSettings;
use crate::structured::ResponseFormat;
use crate::writer::WriterConfig;
use arrow_schema::DataType;
use tokenizers::Tokenizer;

/// The run's config: the job's task and its sections.
#[derive(Debug, Clone, Default)]
pub struct RunConfig {
    /// What each row computes: "generate" (the default), "score" (the continuation or
    /// choices column's log-probabilities after the prompt) or "perplexity" (the prompt's own
    /// rolling log-probability); score.rs.
    pub task: String,
    pub input: InputConfig,
    pub sampling: SamplingConfig,
    pub output: OutputConfig,
    /// Object storage (`storage.endpoint`, `storage.options`): how `s3://`, `gs://` and
    /// `az://` input files and output directories are reached (storage.rs).
    pub storage: StorageSettings,
    pub policy: PolicyConfig,
}

impl RunConfig {
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
        RunConfig {
            task: "generate".to_string(),
            input: InputConfig {
                input_files,
                prompt_column: Some(prompt_column.to_string()),
                input_format: "parquet".to_string(),
                add_special_tokens: true,
                tokenizer_file,
                read_batch_rows: 1024,
                queue_rows: 4096,
                ..Default::default()
            },
            sampling: SamplingConfig {
                params: SamplingParams {
                    max_new_tokens: 16,
                    top_p: 1.0,
                    skip_special_tokens: true,
                    repetition_penalty: 1.0,
                    n: 1,
                    ..Default::default()
                },
                ..Default::default()
            },
            output: OutputConfig {
                output_dir,
                part_rows: 10_000,
                ..Default::default()
            },
            storage: StorageSettings::default(),
            policy: PolicyConfig {
                num_blocks: 1024,
                block_size: 16,
                max_batch_size: 64,
                max_num_batched_tokens: 8192,
                max_model_len: 4096,
                prefix_caching: true,
                ..Default::default()
            },
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
        let out = &self.output;
        WriterConfig {
            output_dir: out.output_dir.clone(),
            storage: self.storage.clone(),
            part_rows: out.part_rows,
            file_metadata: out.file_metadata.clone(),
            include_token_ids: out.include_token_ids,
            logprobs: self.writes_logprobs(),
            prompt_logprobs: out.prompt_logprobs > 0,
            structured: self.may_be_structured(),
            reasoning: out.reasoning_ids.len() == 2,
            endpoint: self.openai_batch(),
            score: self.score_shape(),
            pooled: self.pool_head().map(Arc::new),
            id_type,
            kept,
            flush_interval: out.flush_interval_s.map(std::time::Duration::from_secs_f64),
            decoder,
        }
    }

    /// The names of the columns this job's output has before any kept input column, in order.
    pub fn own_output_columns(&self) -> Vec<String> {
        let schema =
            crate::writer::output_schema(&self.writer_config(DataType::Int64, vec![], None));
        schema.fields().iter().map(|f| f.name().clone()).collect()
    }

    /// A pooled task's head (pooled.rs; None: another task). `validate` checks its settings.
    pub fn pool_head(&self) -> Option<PoolHead> {
        let task = match self.task().ok()? {
            Task::Embed => Head::Embed,
            Task::Classify => Head::Classify,
            Task::Reward => Head::Reward,
            Task::Generate | Task::Score | Task::Perplexity => return None,
        };
        let out = &self.output;
        Some(PoolHead {
            task,
            pooling: Pooling::parse(&out.pooling).unwrap_or(Pooling::Last),
            width: out.pool_width,
            normalize: out.pool_normalize,
            dimensions: out.pool_dimensions,
            labels: out.labels.clone(),
            multi_label: out.multi_label,
            lines: self.openai_batch(),
        })
    }

    /// A scoring job's output shape (None: generation or a pooled task).
    pub fn score_shape(&self) -> Option<ScoreShape> {
        match self.task().ok()? {
            Task::Generate | Task::Embed | Task::Classify | Task::Reward => None,
            Task::Perplexity => Some(ScoreShape::Rolling),
            Task::Score if self.input.choices_column.is_some() => Some(ScoreShape::Choices),
            Task::Score => Some(ScoreShape::Pair),
        }
    }

    /// The job's sampling parameters (`sampling` section), unchecked: the defaults of every
    /// row, which a row's sampling columns or batch line override.
    pub fn sampling_params(&self) -> SamplingParams {
        self.sampling.params.clone()
    }

    /// The job's response_format, parsed (None: none, or `{"type": "text"}`).
    pub fn job_response_format(&self) -> std::result::Result<Option<ResponseFormat>, String> {
        match self.sampling.response_format.trim() {
            "" => Ok(None),
            text => ResponseFormat::parse_request(text),
        }
    }

    /// Whether a row may be structured: the job, a sampling column or a batch line may set a
    /// response_format (the output then has a `structured` column).
    pub fn may_be_structured(&self) -> bool {
        !self.sampling.response_format.trim().is_empty()
            || self.input.sampling_columns.contains_key("response_format")
            || self.openai_batch()
    }

    /// Whether output rows carry a `logprobs` column (a batch line may ask for them).
    pub fn writes_logprobs(&self) -> bool {
        self.sampling.params.logprobs > 0
            || self.input.sampling_columns.contains_key("logprobs")
            || self.openai_batch()
    }

    /// Whether every prompt is rendered with the chat template: a messages column or the
    /// apply_chat_template setting (then a template is required).
    pub fn needs_chat_template(&self) -> bool {
        self.input.messages_column.is_some() || self.input.apply_chat_template
    }

    /// Whether the chat template, when given, is compiled: prompts need it, or batch lines may
    /// (chat lines; without a template each is an error row).
    pub fn uses_chat_template(&self) -> bool {
        self.needs_chat_template() || self.openai_batch()
    }

    /// Whether the input is OpenAI Batch JSONL.
    pub fn openai_batch(&self) -> bool {
        self.input.input_format == "openai-batch"
    }
}

//! `RunConfig::validate`: every setting checked once, up front, so the rest of the crate can
//! rely on them.

use super::RunConfig;
use crate::error::{Error, Result};
use crate::sampling_params::{COLUMN_KEYS, MAX_LOGPROBS, MAX_SAMPLES};
use crate::score::Task;

impl RunConfig {
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

    /// A scoring task names its columns and generates nothing else.
    fn validate_task(&self) -> Result<()> {
        let task = self.task()?;
        let columns = [&self.input.continuation_column, &self.input.choices_column];
        let named = columns.iter().filter(|c| c.is_some()).count();
        let n = self.sampling.params.n;
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
            Task::Score | Task::Perplexity if n > 1 || self.output.prompt_logprobs > 0 => {
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
            t if t.pooled() => self.validate_pooled(named, n),
            _ => Ok(()),
        }
    }

    /// A pooled task (pooled.rs): one sequence per row, a head that knows its width.
    fn validate_pooled(&self, named: usize, n: usize) -> Result<()> {
        let task = &self.task;
        if named > 0 || n > 1 || self.output.prompt_logprobs > 0 {
            return Err(Error::user(format!(
                "task {task}: input.continuation_column, input.choices_column, sampling.n and \
                 output.prompt_logprobs do not apply"
            )));
        }
        if self.policy.max_draft_tokens > 0 {
            return Err(Error::user(format!(
                "task {task}: a draft head is for generation"
            )));
        }
        crate::pooled::Pooling::parse(&self.output.pooling)?;
        crate::pooled::Truncate::parse(&self.input.truncate)?;
        Ok(())
    }

    /// Counts and sizes: positive, and within what the crate's index types hold.
    fn validate_sizes(&self) -> Result<()> {
        let (policy, n) = (&self.policy, self.sampling.params.n);
        let positive = [
            ("part_rows", self.output.part_rows),
            ("max_new_tokens", self.sampling.params.max_new_tokens),
            ("num_blocks", policy.num_blocks),
            ("block_size", policy.block_size),
            ("max_batch_size", policy.max_batch_size),
            ("max_num_batched_tokens", policy.max_num_batched_tokens),
            ("max_model_len", policy.max_model_len),
            ("read_batch_rows", self.input.read_batch_rows),
            ("queue_rows", self.input.queue_rows),
            ("n", n),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, value)| *value == 0) {
            return Err(Error::user(format!("{name} must be >= 1, got 0")));
        }
        if policy.max_model_len < 2 {
            return Err(Error::user(format!(
                "max_model_len must be >= 2 (one prompt token and one generated token), got {}",
                policy.max_model_len
            )));
        }
        if policy.num_blocks > i32::MAX as usize || policy.block_size > (1 << 20) {
            return Err(Error::user(format!(
                "num_blocks ({}) or block_size ({}) out of range",
                policy.num_blocks, policy.block_size
            )));
        }
        if n > MAX_SAMPLES {
            return Err(Error::user(format!("n must be <= 4096, got {n}")));
        }
        if policy.max_draft_tokens > 64 {
            return Err(Error::user(format!(
                "max_draft_tokens must be <= 64, got {}",
                policy.max_draft_tokens
            )));
        }
        if policy.max_model_len > i32::MAX as usize {
            return Err(Error::user("max_model_len must fit in int32"));
        }
        let interval = policy.state_checkpoint_interval;
        if !interval.is_multiple_of(policy.block_size)
            || (interval == 0 && policy.state_checkpoints > 0)
            || policy.state_checkpoints > i32::MAX as usize
        {
            return Err(Error::user(format!(
                "state_checkpoint_interval ({interval}) must be a multiple of block_size ({}), \
                 and > 0 where state_checkpoints ({}) is",
                policy.block_size, policy.state_checkpoints
            )));
        }
        self.validate_ranges()
    }

    /// The row range and the flush interval.
    fn validate_ranges(&self) -> Result<()> {
        if let Some((start, end)) = self.input.row_range {
            if start > end {
                return Err(Error::user(format!(
                    "row_range must have start <= end, got [{start}, {end})"
                )));
            }
        }
        if let Some(s) = self.output.flush_interval_s {
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
        let input = &self.input;
        if input
            .skip_rows
            .iter()
            .chain(&input.skip_samples)
            .any(|&r| r < 0)
        {
            return Err(Error::user("skip_rows / skip_samples must be >= 0"));
        }
        if input.input_files.is_empty() {
            return Err(Error::user(
                "input_files is empty: give at least one Parquet file",
            ));
        }
        // openai-batch: each line names its endpoint (openai_batch.rs)
        if input.input_format != "parquet" && !self.openai_batch() {
            return Err(Error::user(format!(
                "input_format must be parquet or openai-batch, got {:?}",
                input.input_format
            )));
        } else if !self.openai_batch()
            && input.prompt_column.is_none()
            && input.messages_column.is_none()
        {
            return Err(Error::user(
                "neither prompt_column nor messages_column is set: one of them is required",
            ));
        }
        self.validate_keep_columns()?;
        if self.needs_chat_template() && input.chat_template.as_deref().is_none_or(str::is_empty) {
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
        let keep = &self.output.keep_columns;
        if self.openai_batch() && !keep.is_empty() {
            return Err(Error::user(format!(
                "{key}: an OpenAI Batch input has no columns to keep (its lines' custom_id is \
                 the id column)"
            )));
        }
        let own = self.own_output_columns();
        for (i, name) in keep.iter().enumerate() {
            if keep[..i].contains(name) {
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

    /// Sampling parameters: in their ranges (`SamplingParams::check`, the rule every row's
    /// overrides meet too), n > 1 only when sampling, known sampling-column keys.
    fn validate_sampling(&self) -> Result<()> {
        self.job_response_format()
            .map_err(|e| Error::user(format!("sampling.{e}")))?;
        let params = &self.sampling.params;
        params.check().map_err(Error::user)?;
        if params.n > 1 && params.temperature == 0.0 {
            return Err(Error::user(format!(
                "n = {} samples per row need temperature > 0: greedy samples are all the same",
                params.n
            )));
        }
        let prompt_logprobs = self.output.prompt_logprobs;
        if prompt_logprobs > MAX_LOGPROBS {
            return Err(Error::user(format!(
                "prompt_logprobs must be in 0..={MAX_LOGPROBS}, got {prompt_logprobs}"
            )));
        }
        if prompt_logprobs > 0 && params.n > 1 {
            return Err(Error::user(
                "prompt_logprobs with n > 1 samples per row is not supported",
            ));
        }
        let columns = self.input.sampling_columns.keys();
        if let Some(k) = columns
            .into_iter()
            .find(|k| !COLUMN_KEYS.contains(&k.as_str()))
        {
            return Err(Error::user(format!(
                "sampling_columns: unknown key '{k}'; the keys are {}",
                COLUMN_KEYS.join(", ")
            )));
        }
        Ok(())
    }
}

//! A run: one job's generation from its input to its output around a scheduling policy
//! (scheduler.rs). The run owns the input (the reader thread's channel, the rows and samples
//! skipped on resume), the output (the writer thread, error and output rows, finish and abort),
//! the statistics, the scored rows' gathering (score.rs) and the structured-output grammars; the
//! `Scheduler` decides what each step computes. `_native.Scheduler` (python.rs) wraps a run.
//!
//! Invariants:
//! - every request read from the input leaves through the writer exactly once (finished or
//!   error row); `next_plan` returns `None` only after the input is exhausted and nothing is
//!   waiting or running. Rows in `skip_rows` (written by an earlier run) are never read as
//!   requests, so a resumed job writes each input row once over all its runs;
//! - `abort` writes every row already handed to the writer and nothing else: requests still
//!   waiting or running are dropped unwritten (a resumed run generates them).

use std::collections::HashSet;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::Receiver;
use tokenizers::Tokenizer;

use crate::chat_template::ChatTemplate;
use crate::config::RunConfig;
use crate::error::{Error, Result};
use crate::pooled::{PoolHead, PoolInput, Truncate};
use crate::reader::{
    spawn_reader, validate_inputs, InputSpec, ReaderMsg, ReaderOptions, ScoreOptions, TextLimit,
};
use crate::sampling_params::MAX_SAMPLES;
use crate::scheduler::{Planned, Scheduler, StepKind, StepPlan};
use crate::score::Gather;
use crate::stats::{Stats, Summary, SummaryValue};
use crate::stop::StopCriteria;
use crate::structured::Grammars;
use crate::writer::{Writer, WriterConfig, WriterSummary};

pub use pooled::PooledSums;
pub use structured::DraftMasks;

pub struct Run {
    cfg: RunConfig,
    sched: Scheduler,
    /// `cfg.input.skip_samples` as a set (`sample_key`s).
    skip_samples: HashSet<i64>,
    /// The samples this run is to generate, as far as known: rows times the job's n, less
    /// the samples written before, corrected by each batch line's own n as it is read
    /// (`stats.requests_total` is this, at least 0).
    requests_expected: i64,
    tokenizer: Arc<Tokenizer>,
    input: Receiver<ReaderMsg>,
    input_done: bool,
    /// Set when the reader failed (message, whether a user error): every later `next_plan`
    /// and `finish` reports it again, with the same kind.
    input_failed: Option<(String, bool)>,
    _reader: JoinHandle<()>,
    writer: Writer,
    criteria: StopCriteria,
    stats: Stats,
    finished: bool,
    /// Structured output's grammar compiler, built at the first constrained row.
    grammars: Option<Arc<Grammars>>,
    /// Masked drafting's rows in the pending verify plan (run/structured.rs).
    session: Vec<structured::DraftSession>,
    /// Scoring tasks: the finished parts of rows whose other parts still run.
    gather: Gather,
    /// Pooled tasks: the head that makes a row's value (pooled.rs).
    pool_head: Option<Arc<PoolHead>>,
}

impl Run {
    /// Loads the tokenizer from `cfg.input.tokenizer_file`, then see `with_tokenizer`.
    pub fn new(cfg: RunConfig) -> Result<Self> {
        cfg.validate()?;
        let path = &cfg.input.tokenizer_file;
        if !path.is_file() {
            return Err(Error::user(format!(
                "tokenizer file not found: {}",
                path.display()
            )));
        }
        let tokenizer = Tokenizer::from_file(path)
            .map_err(|e| Error::user(format!("cannot load tokenizer {}: {e}", path.display())))?;
        Self::with_tokenizer(cfg, tokenizer)
    }

    /// Validates the input files, then starts the reader and writer threads. Checks run in
    /// this order (the first failure is the error): config, tokenizer settings, chat
    /// template, input files, output directory, reader start.
    pub fn with_tokenizer(cfg: RunConfig, tokenizer: Tokenizer) -> Result<Self> {
        cfg.validate()?;
        let tokenizer = untruncated(tokenizer)?;
        let template = compile_template(&cfg)?;
        let spec = validate_inputs(&cfg)?;
        let range = (spec.row_start, spec.row_end);
        let (skip_rows, skipped) = sorted_skip_rows(&cfg.input.skip_rows, range);
        let skip_samples = samples_to_skip(&cfg, &skip_rows, range);
        // signed: a batch line's own n may exceed the job's, its written samples too
        let expected = ((spec.range_rows() - skipped) * cfg.sampling.params.n as u64) as i64
            - skip_samples.len() as i64;
        let mut stats = Stats::new(expected.max(0) as u64);
        stats.requests_skipped = skipped * cfg.sampling.params.n as u64 + skip_samples.len() as u64;
        let writer = Writer::start(writer_config(&cfg, &spec, tokenizer.clone()))?;
        let options = reader_options(&cfg, &tokenizer, template, skip_rows);
        let (input, reader) = spawn_reader(spec, options)?;
        let criteria = StopCriteria::new(&cfg);
        let cfg_head = cfg.pool_head().map(Arc::new);
        Ok(Run {
            sched: Scheduler::new(cfg.policy.clone(), criteria.eos.clone(), cfg.sampling.seed),
            skip_samples,
            requests_expected: expected,
            criteria,
            cfg,
            tokenizer,
            input,
            input_done: false,
            input_failed: None,
            _reader: reader,
            writer,
            stats,
            finished: false,
            grammars: None,
            session: Vec::new(),
            gather: Gather::default(),
            pool_head: cfg_head,
        })
    }

    pub fn config(&self) -> &RunConfig {
        &self.cfg
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    pub fn num_free_blocks(&self) -> usize {
        self.sched.num_free_blocks()
    }

    /// With speculative decoding: while `on`, plan decode steps as plain decoding does (no
    /// lookahead slots; with chunked prefill, prompt chunks ride in them) instead of verify
    /// rounds. The worker asks for them where drafting cannot pay; it runs them as plain target
    /// steps. Takes effect at the next plan; admission still reserves the lookahead.
    pub fn set_plain_steps(&mut self, on: bool) {
        self.sched.set_plain_steps(on);
    }

    /// `progress()` of the Python API.
    pub fn progress(&self) -> Vec<(&'static str, i64)> {
        let s = &self.stats;
        vec![
            ("requests_total", s.requests_total as i64),
            ("requests_skipped", s.requests_skipped as i64),
            ("requests_done", s.requests_done as i64),
            ("requests_error", s.requests_error as i64),
            ("requests_read", s.requests_read as i64),
            ("prompt_tokens_read", s.prompt_tokens_read as i64),
            ("requests_stopped", s.requests_stopped as i64),
            ("finished_output_tokens", s.finished_output_tokens as i64),
            ("running", self.sched.running().len() as i64),
            ("waiting", self.sched.waiting_len() as i64),
            ("prompt_tokens", s.prompt_tokens as i64),
            ("output_tokens", s.output_tokens as i64),
            ("preemptions", s.preemptions as i64),
            ("cached_tokens", s.cached_tokens as i64),
            ("prefill_tokens", s.prefill_tokens as i64),
            ("free_blocks", self.sched.num_free_blocks() as i64),
        ]
    }

    /// The next step, or `None` once every input row has been written. Blocks while waiting
    /// for input when nothing is runnable.
    pub fn next_plan(&mut self) -> Result<Option<StepPlan>> {
        if self.finished {
            return Err(Error::internal("next_plan() after finish()"));
        }
        if self.sched.num_pending() > 0 {
            return Err(Error::internal(
                "next_plan() called again before commit() of the previous plan",
            ));
        }
        loop {
            self.pull_input(false)?;
            if let Some(planned) = self.sched.schedule(&mut self.stats)? {
                return Ok(Some(self.with_masks(planned)));
            }
            // Nothing waiting or running. After an input failure every row read before it has
            // now been generated and written; the failure is reported on every later call.
            if self.input_done {
                return match self.input_failure() {
                    Some(e) => Err(e),
                    None => Ok(None),
                };
            }
            self.pull_input(true)?;
        }
    }

    /// The plan after the pending one, built before that one is committed
    /// (scheduler/overlap.rs), or `None` when it cannot be: commit the pending plan, then call
    /// `next_plan`.
    pub fn next_plan_ahead(&mut self) -> Result<Option<StepPlan>> {
        if self.finished || !self.cfg.policy.overlap || self.sched.num_pending() != 1 {
            return Err(Error::internal(
                "next_plan_ahead() needs overlap and exactly one pending plan",
            ));
        }
        if self.sched.ahead_blocked() {
            return Ok(None);
        }
        self.pull_input(false)?;
        let planned = self.sched.plan_ahead(&mut self.stats)?;
        Ok(planned.map(|p| self.with_masks(p)))
    }

    /// The plan with its structured-output masks (verify plans: forced drafts).
    fn with_masks(&mut self, planned: Planned) -> StepPlan {
        let Planned {
            mut plan,
            start,
            samples,
        } = planned;
        if plan.kind == StepKind::Verify {
            self.push_forced(&mut plan, start, samples.len());
        } else {
            self.push_masks(&mut plan, start, &samples);
        }
        plan.mask_words = self.grammars.as_ref().map_or(0, |g| g.mask_words());
        plan
    }

    /// Waits for the writer, checks that no KV block or slot leaked and returns the summary.
    /// Calling it before `next_plan` returned `None` flushes the rows finished so far and then
    /// reports the unfinished work as an error.
    pub fn finish(&mut self) -> Result<Summary> {
        if self.finished {
            return Err(Error::internal("finish() called twice"));
        }
        self.finished = true;
        let (running, waiting) = (self.sched.running().len(), self.sched.waiting_len());
        let unfinished = running + waiting;
        let input_left = !self.input_done;
        let complete = self.input_failed.is_none()
            && unfinished == 0
            && !input_left
            && self.sched.num_pending() == 0;
        // An incomplete run closes the rows it finished like `abort` (no empty part).
        let written = if complete {
            self.writer.finish()?
        } else {
            self.writer.abort()?
        };
        if let Some(e) = self.input_failure() {
            return Err(e);
        }
        if !complete {
            return Err(Error::internal(format!(
                "finish() before the input was exhausted ({} running, {} waiting, input {}); \
                 call next_plan() until it returns None",
                running,
                waiting,
                if input_left {
                    "not fully read"
                } else {
                    "fully read"
                }
            )));
        }
        self.sched.check_no_leak()?;
        self.stats.evictions = self.sched.evictions();
        if written.rows_written != self.stats.requests_done {
            return Err(Error::internal(format!(
                "writer wrote {} rows but {} were finished",
                written.rows_written, self.stats.requests_done
            )));
        }
        let parts = written
            .part_files
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        self.stats.requests_error += written.decode_errors; // error rows made by the writer
        let mut summary = self.stats.summary(parts);
        let busy = written.busy.as_secs_f64();
        summary.insert("writer_seconds".into(), SummaryValue::Float(Some(busy)));
        Ok(summary)
    }

    /// Stops the job early (an interrupt, or after an error such as an unreadable input):
    /// stops reading the input, drops the pending plan and every waiting or running request
    /// unwritten, and closes the writer, which writes the rows already finished into a last
    /// complete part file (none when there are none: never an empty part). Returns the rows
    /// this run wrote. No leak check: the KV blocks of the dropped requests are simply
    /// forgotten with the scheduler.
    pub fn abort(&mut self) -> Result<WriterSummary> {
        if self.finished {
            return Err(Error::internal("abort() after finish()"));
        }
        self.finished = true;
        // Dropping the receiver ends the reader thread at its next send.
        self.input = crossbeam_channel::never();
        self.input_done = true;
        self.sched.clear();
        self.writer.abort()
    }
}

/// The tokenizer with truncation and padding switched off: like transformers, prompts are
/// never truncated or padded behind the user's back.
fn untruncated(mut tokenizer: Tokenizer) -> Result<Arc<Tokenizer>> {
    tokenizer
        .with_truncation(None)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    tokenizer.with_padding(None);
    Ok(Arc::new(tokenizer))
}

/// The job's chat template, compiled only when it is used (a messages column, or
/// `apply_chat_template`); a template that does not compile is a user error.
fn compile_template(cfg: &RunConfig) -> Result<Option<ChatTemplate>> {
    match (&cfg.input.chat_template, cfg.uses_chat_template()) {
        (Some(src), true) => ChatTemplate::new(src)
            .map(|t| Some(t.with_enable_thinking(cfg.input.enable_thinking)))
            .map_err(|e| Error::user(format!("the chat template does not compile: {e}"))),
        _ => Ok(None),
    }
}

/// `skip_rows` sorted and deduplicated, with how many of them name a row this run would
/// generate (in `[start, end)`); others are kept but do not count as skipped.
fn sorted_skip_rows(skip_rows: &[i64], (start, end): (u64, u64)) -> (Vec<i64>, u64) {
    let mut rows = skip_rows.to_vec();
    rows.sort_unstable();
    rows.dedup();
    let in_range = |r: i64| r >= 0 && (start..end).contains(&(r as u64));
    let skipped = rows.iter().filter(|&&r| in_range(r)).count() as u64;
    (rows, skipped)
}

/// The writer's settings: the job's output settings plus the id column's type, which comes
/// from the validated input schema.
fn writer_config(cfg: &RunConfig, spec: &InputSpec, tokenizer: Arc<Tokenizer>) -> WriterConfig {
    cfg.writer_config(spec.id_type.clone(), spec.kept.clone(), Some(tokenizer))
}

/// The reader thread's settings for this job.
fn reader_options(
    cfg: &RunConfig,
    tokenizer: &Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    skip_rows: Vec<i64>,
) -> ReaderOptions {
    ReaderOptions {
        tokenizer: tokenizer.clone(),
        template,
        apply_chat_template: cfg.input.apply_chat_template,
        bos_token: cfg.input.bos_token.clone(),
        eos_token: cfg.input.eos_token.clone(),
        read_batch_rows: cfg.input.read_batch_rows,
        queue_rows: cfg.input.queue_rows,
        skip_rows,
        text_limit: TextLimit::new(tokenizer, text_limit_len(cfg)),
        sampling: Arc::new(cfg.sampling_params()),
        n: cfg.sampling.params.n,
        add_special_tokens: cfg.input.add_special_tokens,
        score: score_options(cfg, tokenizer),
        pool: pool_input(cfg),
    }
}

/// The longest prompt in tokens a row's text is bounded by: max_model_len, but none where a
/// pooled task truncates long prompts.
fn text_limit_len(cfg: &RunConfig) -> usize {
    match cfg.pool_head() {
        Some(_) if cfg.input.truncate != "error" => usize::MAX,
        _ => cfg.policy.max_model_len,
    }
}

/// A pooled task's prompt settings (None: another task).
fn pool_input(cfg: &RunConfig) -> Option<PoolInput> {
    cfg.pool_head()?;
    Some(PoolInput {
        prefix: cfg.input.prompt_prefix.clone(),
        truncate: Truncate::parse(&cfg.input.truncate).unwrap_or(Truncate::Error),
        max_len: cfg.policy.max_model_len,
    })
}

/// A scoring task's reader settings: the prefix token is BOS, else the first EOS id (lm-eval's
/// `prefix_token_id`), else 0.
fn score_options(cfg: &RunConfig, tokenizer: &Tokenizer) -> Option<ScoreOptions> {
    let bos = cfg
        .input
        .bos_token
        .as_deref()
        .and_then(|t| tokenizer.token_to_id(t));
    Some(ScoreOptions {
        shape: cfg.score_shape()?,
        prefix_id: bos
            .or(cfg.sampling.eos_token_ids.first().copied())
            .unwrap_or(0),
        max_len: cfg.policy.max_model_len,
    })
}

/// Resume's key of sample `s` of row `row` (py/eaglebatch/output/resume.py: the same).
fn sample_key(row: i64, s: u32) -> i64 {
    row * MAX_SAMPLES as i64 + s as i64
}

/// The keys of `cfg.input.skip_samples` (`sample_key`) that name a sample this run would generate:
/// of a row in `[start, end)` not skipped whole.
fn samples_to_skip(cfg: &RunConfig, skip_rows: &[i64], (start, end): (u64, u64)) -> HashSet<i64> {
    cfg.input
        .skip_samples
        .iter()
        .copied()
        .filter(|&k| {
            let row = k / MAX_SAMPLES as i64;
            row >= 0
                && (start..end).contains(&(row as u64))
                && skip_rows.binary_search(&row).is_err()
        })
        .collect()
}

mod commit;
mod input;
#[cfg(test)]
mod kept_tests;
mod output;
mod pooled;
#[cfg(test)]
mod sampling_tests;
mod scoring;
#[cfg(test)]
mod scoring_tests;
mod structured;
#[cfg(test)]
mod structured_tests;
#[cfg(test)]
mod tests;

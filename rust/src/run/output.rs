//! The run's output rows: a finished sequence's row (text ids for the writer to decode,
//! logprobs, reasoning split, timings) and its statistics.

use std::time::Instant;

use super::Run;
use crate::logprobs;
use crate::openai_keys::Endpoint;
use crate::scheduler::token_count;
use crate::sequence::{FinishReason, Sequence, Timing};
use crate::stats::Stats;
use crate::structured::RowMatcher;
use crate::writer::OutputRow;

/// A finished request's timings in seconds (all `None` for an error row): queue = read to
/// first scheduled, ttft = first scheduled to first token, latency = first scheduled to
/// finished, tpot = (latency - ttft) / (n - 1) for n >= 2 output tokens.
#[derive(Debug, Default, Clone, Copy)]
struct Timings {
    queue_s: Option<f64>,
    ttft_s: Option<f64>,
    latency_s: Option<f64>,
    tpot_s: Option<f64>,
}

impl Timings {
    fn of(t: &Timing, n: usize) -> Self {
        let secs = |a: Option<Instant>, b: Option<Instant>| match (a, b) {
            (Some(a), Some(b)) => Some(b.saturating_duration_since(a).as_secs_f64()),
            _ => None,
        };
        let ttft = secs(t.first_scheduled, t.first_token);
        let latency = secs(t.first_scheduled, t.finished);
        let tpot = match (ttft, latency) {
            (Some(tt), Some(l)) if n >= 2 => Some((l - tt).max(0.0) / (n - 1) as f64),
            _ => None,
        };
        Timings {
            queue_s: secs(t.read_at, t.first_scheduled),
            ttft_s: ttft,
            latency_s: latency,
            tpot_s: tpot,
        }
    }

    /// Adds the known latency, ttft and tpot to the job's reservoirs.
    fn record(&self, stats: &mut Stats) {
        if let Some(l) = self.latency_s {
            stats.latency.push(l);
        }
        if let Some(tt) = self.ttft_s {
            stats.ttft.push(tt);
        }
        if let Some(tp) = self.tpot_s {
            stats.tpot.push(tp);
        }
    }
}

impl Run {
    /// Turns a finished sequence into its output row (and records its statistics). An error
    /// row has no text, no output tokens and no timings; a row's text is decoded by the
    /// writer thread (`OutputRow::text_ids`), unless a stop string cut it.
    pub(super) fn output_row(&mut self, mut seq: Sequence) -> OutputRow {
        let reason = seq.finish_reason.unwrap_or(FinishReason::Error);
        let error = seq.error.is_some() || reason == FinishReason::Error;
        // the text of a row without stop strings: one decode, on the writer's thread
        let (text_ids, reasoning_ids) = self.output_ids(&mut seq, error);
        let n = seq.num_output();
        let timings = self.count_row(&seq, error);
        let accept_length = seq.accept_length();
        let structured = seq.matcher.as_mut().map(RowMatcher::is_accepting);
        OutputRow {
            id: seq.id,
            row_index: seq.row_index,
            sample_index: seq.sample_index as i32,
            num_samples: seq.sampling.n as i32,
            output_text: if error {
                String::new()
            } else {
                seq.output_text
            },
            finish_reason: if error { FinishReason::Error } else { reason },
            prompt_tokens: token_count(seq.prompt_ids.len()),
            output_tokens: if error { 0 } else { n as i32 },
            cached_tokens: token_count(seq.cached_tokens),
            queue_s: timings.queue_s,
            ttft_s: timings.ttft_s,
            latency_s: timings.latency_s,
            tpot_s: timings.tpot_s,
            error: seq.error,
            spec_steps: seq.spec_steps,
            accepted_tokens: seq.accepted_tokens,
            accept_length,
            stop_reason: if error { None } else { seq.stop_reason },
            kept: seq.kept,
            logprobs: (!error && seq.sampling.logprobs > 0)
                .then(|| logprobs::entries(&self.tokenizer, &seq.output_ids, &seq.logprobs)),
            prompt_logprobs: (!error && self.cfg.output.prompt_logprobs > 0).then(|| {
                let ids = seq.prompt_ids.get(1..).unwrap_or_default();
                logprobs::entries(&self.tokenizer, ids, &seq.prompt_logprobs)
            }),
            output_token_ids: if self.cfg.output.include_token_ids && !error {
                seq.output_ids
            } else {
                Vec::new()
            },
            text_ids,
            reasoning_ids,
            reasoning_text: None,
            structured: structured.filter(|_| !error),
            skip_special_tokens: seq.sampling.skip_special_tokens,
            endpoint: seq.endpoint.map(Endpoint::url),
            score: None,
        }
    }

    /// Counts a finished row in the stats; its timings (none for an error row).
    fn count_row(&mut self, seq: &Sequence, error: bool) -> Timings {
        self.stats.requests_done += 1;
        if error {
            self.stats.requests_error += 1;
            return Timings::default();
        }
        self.stats.finished_output_tokens += seq.num_output() as u64;
        self.stats.requests_stopped += (seq.finish_reason == Some(FinishReason::Stop)) as u64;
        let t = Timings::of(&seq.timing, seq.num_output());
        t.record(&mut self.stats);
        t
    }

    /// The ids the writer decodes into a finished row's `output_text` (None: the text is
    /// already made, a stop string cut it, or an error row) and, with reasoning, into its
    /// `reasoning_text`; a stop-string row's answer is its text after the reasoning's.
    fn output_ids(&self, seq: &mut Sequence, error: bool) -> (Option<Vec<u32>>, Option<Vec<u32>>) {
        let text_ids = (!error && !seq.stopped_on_string).then(|| seq.text_ids().to_vec());
        let (Some(tags), false) = (self.criteria.reasoning, error) else {
            return (text_ids, None);
        };
        let (reasoning, answer) = seq.reasoning_split(tags);
        let reasoning_ids = Some(reasoning.to_vec());
        if !seq.stopped_on_string {
            return (Some(answer.to_vec()), reasoning_ids);
        }
        let skip = seq.sampling.skip_special_tokens;
        let r = self.tokenizer.decode(reasoning, skip).unwrap_or_default();
        if let Some(rest) = seq.output_text.strip_prefix(r.as_str()) {
            seq.output_text = rest.to_string();
        }
        (None, reasoning_ids)
    }
}

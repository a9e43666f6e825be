//! Scoring tasks in the run (score.rs): a scored row's parts are queued as sequences
//! that generate nothing; each records the prompt logprobs of its scored positions and
//! finishes at the commit of the step that computed its last token; the row is written once
//! every part has finished (`score::Gather`).

use super::Run;
use crate::error::Result;
use crate::scheduler::token_count;
use crate::score::{PartResult, PartScore, RowScore};
use crate::sequence::{FinishReason, Request, Sequence};
use crate::writer::OutputRow;

impl Run {
    /// Queues a scoring row's parts, one sequence each (`sample_index` = the part's index),
    /// or writes its error row when it can never run.
    pub(super) fn accept_scored(&mut self, mut req: Request) -> Result<()> {
        let parts = std::mem::take(&mut req.score_parts);
        let error = req.error.clone().or_else(|| self.sched.score_error(&parts));
        self.stats.requests_read += 1;
        if let Some(msg) = error {
            return self.write_error_row(req, 0, msg);
        }
        let num_parts = parts.len();
        let tokens: usize = parts.iter().map(|p| p.prompt_ids.len()).sum();
        self.stats.prompt_tokens_read += tokens as u64;
        for (i, part) in parts.into_iter().enumerate() {
            let mut r = req.clone(); // its prompt_ids are empty: the part's are the prompt
            r.prompt_ids = part.prompt_ids;
            let mut seq = Sequence::new(r, i as u32);
            seq.prompt_logprobs_k = 1; // the top id tells whether the token is the argmax
            seq.score_from = Some(part.from);
            seq.num_parts = num_parts;
            self.sched.enqueue(seq);
        }
        Ok(())
    }

    /// The output row of a finished scored part's row, once all its parts are in (None
    /// before): its scores, the prompt and cached tokens of all parts, the other columns
    /// (timings, id, kept columns) from the part that finished last.
    pub(super) fn scored_row(&mut self, seq: Sequence) -> Option<OutputRow> {
        let (row_index, part, num_parts) = (seq.row_index, seq.sample_index, seq.num_parts);
        let result: PartResult = (part_score(&seq), seq.prompt_len(), seq.cached_tokens);
        let results = if num_parts == 1 {
            vec![result]
        } else {
            self.gather
                .add(row_index, part as usize, num_parts, result)?
        };
        let mut row = self.output_row(seq);
        row.sample_index = 0;
        row.prompt_tokens = token_count(results.iter().map(|r| r.1).sum());
        row.cached_tokens = token_count(results.iter().map(|r| r.2).sum());
        let mut scores = Vec::with_capacity(results.len());
        for (score, _, _) in results {
            match score {
                Ok(s) => scores.push(s),
                Err(e) if row.error.is_none() => row.error = Some(e),
                Err(_) => {}
            }
        }
        if row.error.is_some() {
            row.finish_reason = FinishReason::Error;
            row.text_ids = None;
            return Some(row);
        }
        let shape = self.cfg.score_shape().expect("a scoring task");
        row.score = Some(RowScore::of(shape, scores));
        Some(row)
    }
}

/// A finished part's score from its recorded prompt logprobs (entry t: position from - 1 + t,
/// scoring token from + t).
fn part_score(seq: &Sequence) -> std::result::Result<PartScore, String> {
    if let Some(e) = &seq.error {
        return Err(e.clone());
    }
    let from = seq.score_from.expect("a scored part");
    let tokens = &seq.prompt_ids[from..];
    if seq.prompt_logprobs.len() != tokens.len() {
        return Err(format!(
            "internal error: {} of {} scored tokens have a log-probability",
            seq.prompt_logprobs.len(),
            tokens.len()
        ));
    }
    let entries = (seq.prompt_logprobs.iter()).map(|e| (e.logprob, e.top.first().map(|&(t, _)| t)));
    Ok(PartScore::of(tokens, entries))
}

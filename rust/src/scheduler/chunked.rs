//! Chunked prefill (`chunked_prefill`): a prompt is computed at most `max_num_batched_tokens`
//! tokens per step, and prompts are admitted while the running requests keep decoding.
//!
//! - Plain decoding: every step is one plan over all running requests. The decoding rows take
//!   one token each out of the step's budget; the rows still computing their prompt
//!   (`Sequence::prefilling`, the tail of `running`) take their next chunk of what is left, in
//!   order, and new requests are admitted with first chunks of the rest. A row's query may end
//!   before its last known token (`chunk_end`): its sampled token is dropped at commit, and its
//!   next chunk follows in the next step. Rows get at least one token each, so a step can
//!   exceed the budget by the rows it holds.
//! - Speculative decoding: a verify round cannot hold prefill rows (the worker's draft phases
//!   assume one uncomputed token per row), so chunks and verify rounds alternate: a step of
//!   prefill chunks (continuing rows and new ones, within the budget), then a verify round over
//!   the decoding rows, and so on; either runs alone when the other has nothing to do. A
//!   chunk's last draft entry needs the token after it: the plan's `next_ids`. While the
//!   worker asks for plain steps (`set_plain_steps`) it is planned as plain decoding.
//!
//! Either way the decoding rows advance at least every other step while prompts are admitted,
//! so a long prompt no longer stalls them for its whole prefill.

use std::time::Instant;

use super::{Planned, Scheduler, StepKind};
use crate::error::Result;
use crate::sequence::Sequence;
use crate::stats::Stats;

impl Scheduler {
    pub(super) fn schedule_chunked(&mut self, st: &mut Stats) -> Result<Option<Planned>> {
        if self.lookahead() > 0 {
            return self.schedule_chunked_speculative(st);
        }
        self.grow_running(0, self.running.len(), st)?; // decoding rows' next slot (may preempt)
        let decoding = self.running.iter().filter(|s| !s.prefilling()).count();
        let left = self.plan_chunks(self.cfg.max_num_batched_tokens.saturating_sub(decoding));
        self.admit(Instant::now(), Some(left), st)?;
        if self.running.is_empty() {
            return self.nothing_runnable();
        }
        let kind = if decoding == 0 {
            StepKind::Prefill
        } else {
            StepKind::Decode
        };
        self.build_plan(kind, 0, self.running.len(), st).map(Some)
    }

    /// A step of prefill chunks when the last step verified (or nothing decodes), else a verify
    /// round over the decoding rows (module doc).
    fn schedule_chunked_speculative(&mut self, st: &mut Stats) -> Result<Option<Planned>> {
        // a short prompt admitted after a long one finishes first: decoding rows first, each
        // kind in admission order (stable), so that each kind is a contiguous plan
        self.running.sort_by_key(Sequence::prefilling);
        let split = self.first_prefilling();
        if split == 0 || !self.last_step_prefill {
            let left = self.plan_chunks(self.cfg.max_num_batched_tokens);
            self.admit(Instant::now(), Some(left), st)?;
            if split < self.running.len() {
                self.last_step_prefill = true;
                let rows = self.running.len() - split;
                return self
                    .build_plan(StepKind::Prefill, split, rows, st)
                    .map(Some);
            }
        }
        self.last_step_prefill = false;
        if split == 0 {
            return self.nothing_runnable();
        }
        self.grow_running(self.cfg.max_draft_tokens, split, st)?; // preempts from the tail
        let rows = self.first_prefilling();
        self.build_plan(StepKind::Verify, 0, rows, st).map(Some)
    }

    /// The index of the first running row still computing its known tokens (prefilling rows
    /// are the tail of `running`: sorted there, admitted last, and preempted first).
    fn first_prefilling(&self) -> usize {
        self.running
            .iter()
            .position(Sequence::prefilling)
            .unwrap_or(self.running.len())
    }

    /// Gives each prefilling running row its next chunk of `budget` tokens, in order (at least
    /// one token each); returns what is left for new requests.
    fn plan_chunks(&mut self, budget: usize) -> usize {
        let mut left = budget;
        for seq in self.running.iter_mut().filter(|s| s.prefilling()) {
            let chunk = (seq.len() - seq.num_computed).min(left.max(1));
            left = left.saturating_sub(chunk);
            let end = seq.num_computed + chunk;
            seq.chunk_end = (end < seq.len()).then_some(end);
        }
        left
    }
}

//! Overlap (`overlap`, plain decoding): the next plan is built while the pending one runs on
//! the device, so that planning, the plan's tensors and the last step's commit hide behind
//! the device's work (SGLang's overlap scheduler, vLLM's async scheduling).
//!
//! - `plan_ahead` (the run's `next_plan_ahead`) is called with one plan P pending. Each row
//!   that P samples a token for (its query reaches its last known token) gets a placeholder
//!   output token standing for it (`Sequence::placeholder`); then the next plan is scheduled
//!   as usual, so such a row decodes its placeholder: its `input_ids` entry is -1 and
//!   `prev_rows` names its row of P, whose sampled token the worker puts there on the device.
//!   P's commit replaces each placeholder with the real token (stop checks as usual).
//! - A row that finishes at P's commit (EOS, stop string) has computed one token too many in
//!   the plan after P: that token is dropped, and the row's blocks and slot are freed only at
//!   the next commit, once that plan has run ("draining"). Rows whose token in P certainly ends
//!   them (their length limit) are left out of the plan after P ("parked"), keeping their
//!   blocks until P's commit.
//! - Not planned ahead (`None`: commit first, then `next_plan`): rows with penalties (the
//!   placeholder would be in their token counts), scored parts (score.rs), constrained rows (structured output: the
//!   next mask follows the token in flight), nothing left to run but parked rows, or
//!   running[0] not fitting the cache beside the blocks of parked and draining rows. Those
//!   rows are out of `running`, so `grow_running` cannot preempt them: a plan built ahead keeps
//!   its invariant (running[0] fits once everyone after it is preempted) only when running[0]
//!   fits with their blocks held. Nothing is preempted before that check, so a `None` leaves
//!   the rows as they were.
//! - A row preempted while P is pending loses its placeholder; P's commit finds its run gone
//!   (a new `run_id` at readmission) and drops its token. Blocks freed while P is pending may
//!   be written by a later plan: plans run in order on one device stream, so P's writes come
//!   first.
//!
//! Greedy outputs are those of steps planned one at a time: a row's tokens do not depend on
//! which rows share its steps, only the step in which a finished row's slot is reused moves.

use std::collections::HashSet;

use super::{Planned, Scheduler};
use crate::error::{Error, Result};
use crate::sequence::{Sequence, PLACEHOLDER};
use crate::stats::Stats;

impl Scheduler {
    /// Whether no plan may be built ahead of the pending one (module doc): a running row
    /// has penalties, a grammar or a scored prompt.
    pub fn ahead_blocked(&self) -> bool {
        let blocked =
            |s: &Sequence| s.sampling.penalized() || s.matcher.is_some() || s.score_from.is_some();
        self.running.iter().any(blocked)
    }

    /// The plan after the pending one, built before that one is committed (module doc), or
    /// `None` when it cannot be. The run checks `ahead_blocked` and feeds input first.
    pub fn plan_ahead(&mut self, st: &mut Stats) -> Result<Option<Planned>> {
        if !self.cfg.overlap || self.pending.len() != 1 {
            return Err(Error::internal(
                "next_plan_ahead() needs overlap and exactly one pending plan",
            ));
        }
        let parked = self.park_finishing();
        for seq in self.running.iter_mut() {
            if seq.num_computed == seq.len() {
                seq.output_ids.push(PLACEHOLDER);
                seq.placeholder = true;
            }
        }
        let plan = if self.running.is_empty() || !self.first_row_fits(&parked) {
            None
        } else {
            self.schedule(st)?
        };
        if plan.is_none() {
            self.running.iter_mut().for_each(Sequence::drop_placeholder);
        }
        self.unpark(parked);
        Ok(plan)
    }

    /// Whether running[0], its placeholder included, fits once every other running row is
    /// preempted, while the blocks of `parked` and draining rows stay held (module doc). The
    /// blocks then in use are those of running[0], `parked` and `draining`: no other row holds
    /// any (waiting rows hold none).
    fn first_row_fits(&self, parked: &[Sequence]) -> bool {
        let first = &self.running[0];
        let need = self.bm.blocks_to_grow(&first.block_table, first.len());
        let held: HashSet<u32> = first
            .block_table
            .iter()
            .chain(parked.iter().flat_map(|s| &s.block_table))
            .chain(self.draining.iter().flat_map(|(blocks, _)| blocks))
            .copied()
            .collect();
        need + held.len() <= self.bm.num_blocks()
    }

    /// Takes out of `running` the rows whose token in the pending plan ends them by length
    /// (max_new_tokens, max_model_len): the next plan has nothing for them to compute.
    fn park_finishing(&mut self) -> Vec<Sequence> {
        let max_len = self.cfg.max_model_len;
        let ends = |s: &Sequence| {
            s.num_computed == s.len()
                && (s.num_output() + 1 >= s.sampling.max_new_tokens || s.len() + 1 >= max_len)
        };
        if !self.running.iter().any(ends) {
            return Vec::new();
        }
        let (parked, kept) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(ends);
        self.running = kept;
        parked
    }

    /// Puts parked rows back, `running` in admission order again (run_id order).
    fn unpark(&mut self, parked: Vec<Sequence>) {
        if !parked.is_empty() {
            self.running.extend(parked);
            self.running.sort_by_key(|s| s.run_id);
        }
    }
}

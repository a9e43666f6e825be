//! A step's commit: the worker's tokens (and logprobs) are checked against the pending plan,
//! appended to their rows up to each row's stop criteria (stop.rs), and the rows that
//! finished leave through the writer.

use std::time::Instant;

use super::{PooledSums, Run};
use crate::error::{Error, Result};
use crate::logprobs::{PromptLogprobs, StepLogprobs};
use crate::scheduler::{check_commit, PendingPlan, StepKind};
use crate::sequence::FinishReason;
use crate::stop::commit_tokens;

impl Run {
    /// Results of the oldest pending plan, rows in plan order (see `_native.pyi`). A
    /// malformed result is an internal error and changes nothing (the plan stays pending).
    /// Rows that left `running` since the plan was built (finished, or preempted while a later
    /// plan was built: overlap) drop their tokens.
    pub fn commit(
        &mut self,
        tokens: &[i32],
        num_tokens: &[i32],
        num_accepted: Option<&[i32]>,
        logprobs: Option<&StepLogprobs>,
        prompt_logprobs: Option<&PromptLogprobs>,
    ) -> Result<()> {
        let (lp, plp) = (logprobs, prompt_logprobs);
        self.commit_pooled(tokens, num_tokens, num_accepted, lp, plp, None)
    }

    /// `commit` with a pooled task's contributions (run/pooled.rs), one row per plan row.
    pub fn commit_pooled(
        &mut self,
        tokens: &[i32],
        num_tokens: &[i32],
        num_accepted: Option<&[i32]>,
        logprobs: Option<&StepLogprobs>,
        prompt_logprobs: Option<&PromptLogprobs>,
        pooled: Option<&PooledSums>,
    ) -> Result<()> {
        self.end_session()?; // masked drafting's matchers back where the last commit left them
        let plan = self
            .sched
            .pending()
            .ok_or_else(|| Error::internal("commit() without a plan from next_plan()"))?;
        let at = self.sched.locate(plan);
        self.check_prompt_logprobs(plan, prompt_logprobs)?;
        let most_verify_tokens = self.cfg.policy.max_draft_tokens as i32 + 1;
        check_commit(plan, most_verify_tokens, tokens, num_tokens, num_accepted)?;
        self.check_logprobs(&at, tokens.len(), logprobs)?;
        self.check_pooled(plan.rows.len(), pooled)?;
        // frees the rows of this plan that finished at the previous commit
        let plan = self.sched.take_pending()?;
        if let Some(pl) = prompt_logprobs {
            self.record_prompt_logprobs(&at, pl);
        }
        if let Some(sums) = pooled {
            self.add_pooled(&at, sums);
        }
        let now = Instant::now();
        let mut offset = 0usize;
        for (r, &n) in num_tokens.iter().enumerate() {
            let toks = &tokens[offset..offset + n as usize];
            let accepted = num_accepted.map(|acc| acc[r]);
            let lp = logprobs.map(|l| (l, offset));
            offset += n as usize;
            if let (Some(i), true) = (at[r], plan.rows[r].samples) {
                self.commit_row(plan.kind, i, toks, accepted, lp, now);
            }
        }
        self.retire_finished()
    }

    /// Prompt logprobs, when given: one count per row, one position per entry, in order.
    fn check_prompt_logprobs(&self, plan: &PendingPlan, pl: Option<&PromptLogprobs>) -> Result<()> {
        let Some(pl) = pl else { return Ok(()) };
        let n: usize = pl.row_counts.iter().map(|&c| c.max(0) as usize).sum();
        if pl.row_counts.len() != plan.rows.len() || pl.positions.len() != n {
            return Err(Error::internal(format!(
                "commit(): prompt logprobs for {} rows and {} positions, but the plan has {} \
                 rows and the counts sum to {n}",
                pl.row_counts.len(),
                pl.positions.len(),
                plan.rows.len()
            )));
        }
        pl.entries.check(n)
    }

    /// Appends each row's prompt logprobs at the next unrecorded position (entry t predicts
    /// prompt token t + 1); positions recorded before (a recomputation after a preemption) are
    /// skipped.
    fn record_prompt_logprobs(&mut self, at: &[Option<usize>], pl: &PromptLogprobs) {
        let mut j = 0usize;
        for (r, &count) in pl.row_counts.iter().enumerate() {
            let count = count.max(0) as usize;
            let Some(i) = at[r] else {
                j += count;
                continue;
            };
            let seq = &mut self.sched.running_mut()[i];
            let k = seq.prompt_logprobs_k as usize;
            let from = seq.prompt_logprobs_from();
            for _ in 0..count {
                let t = pl.positions[j] as usize;
                if t == from + seq.prompt_logprobs.len() && t + 1 < seq.prompt_len() {
                    seq.prompt_logprobs.push(pl.entries.entry(j, k));
                }
                j += 1;
            }
        }
    }

    /// A result carries logprobs of the right shape when a row of its plan asks for them.
    fn check_logprobs(
        &self,
        at: &[Option<usize>],
        t: usize,
        lp: Option<&StepLogprobs>,
    ) -> Result<()> {
        let rows = at.iter().flatten().map(|&i| &self.sched.running()[i]);
        let most = rows.map(|s| s.sampling.logprobs).max().unwrap_or(0) as usize;
        match lp {
            Some(lp) if lp.k < most => Err(Error::internal(format!(
                "commit(): logprobs with {} alternatives, but a row asks for {most}",
                lp.k
            ))),
            Some(lp) => lp.check(t),
            None if most > 0 => Err(Error::internal(
                "commit(): a row of the plan asks for logprobs but none were given",
            )),
            None => Ok(()),
        }
    }

    /// Appends one row's tokens to `running[i]` (`stop::commit_tokens`) and updates the token
    /// counters. Speculative counters count verify rounds only (a prefill yields one target
    /// token).
    fn commit_row(
        &mut self,
        kind: StepKind,
        i: usize,
        toks: &[i32],
        accepted: Option<i32>,
        logprobs: Option<(&StepLogprobs, usize)>,
        now: Instant,
    ) {
        let seq = &mut self.sched.running_mut()[i];
        if seq.score_from.is_some() {
            // a scored part generates nothing: its prompt's logprobs are recorded
            seq.timing.first_token.get_or_insert(now);
            seq.finish(FinishReason::Stop, now);
            return;
        }
        let verify = kind == StepKind::Verify;
        let appended = commit_tokens(seq, toks, verify, now, &self.tokenizer, &self.criteria);
        let k = seq.sampling.logprobs as usize;
        if let (Some((lp, offset)), true) = (logprobs, k > 0) {
            seq.logprobs
                .extend((offset..offset + appended).map(|j| lp.entry(j, k)));
        }
        self.stats.output_tokens += appended as u64;
        if let (Some(acc), StepKind::Verify) = (accepted, kind) {
            *seq.spec_steps.get_or_insert(0) += 1;
            *seq.accepted_tokens.get_or_insert(0) += acc;
            *seq.spec_tokens.get_or_insert(0) += appended as i32;
            self.stats.spec_steps += 1;
            self.stats.accepted_tokens += acc as u64;
            self.stats.spec_tokens += appended as u64;
        }
    }

    /// Takes the finished sequences out of the scheduler and sends their output rows to the
    /// writer (a scored part's row once all its parts are in).
    fn retire_finished(&mut self) -> Result<()> {
        for seq in self.sched.retire_finished()? {
            let row = match (seq.score_from, &seq.pooled) {
                (Some(_), Some(_)) => Some(self.pooled_row(seq)),
                (Some(_), None) => self.scored_row(seq),
                (None, _) => Some(self.output_row(seq)),
            };
            if let Some(row) = row {
                self.writer.send(row)?;
            }
        }
        Ok(())
    }
}

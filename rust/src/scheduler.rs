//! Continuous batching (nano-vllm / vLLM style) over a paged KV cache.
//!
//! Each step is either a PREFILL step (admit waiting requests FIFO; every admitted request's
//! query covers its whole sequence after the longest prefix of whole blocks found in the
//! prefix cache) or, when nothing can be admitted, a DECODE step over all running requests
//! (query = the tokens not yet in the KV cache, normally one).
//! When a decode step lacks KV blocks, the most recently admitted running request is preempted
//! by recomputation: its blocks and slot are freed and it goes back to the FRONT of the waiting
//! queue keeping its output tokens; its next prefill covers prompt + generated tokens.
//!
//! Invariants:
//! - `running` is in admission order; each running request holds a distinct slot in
//!   `[0, max_batch_size)` and enough blocks for all of its tokens that are in a plan;
//! - a plan's rows are `running[start..start + rows]` (prefill: the newly admitted tail;
//!   decode: everyone), and `commit` must come before the next `next_plan`;
//! - a sequence leaves `running` only finished (`retire_finished`, the run writes its row) or
//!   preempted (back to the front of `waiting`).
//!
//! The scheduler holds the policy's state only: the run (run.rs) feeds it sequences, applies
//! each commit's tokens to its running rows and writes the rows it retires.
//!
//! Prefix caching (block_manager.rs): a plan's full blocks are registered when the plan is
//! built (their K/V is written by that step, before any later admission looks them up):
//! prefill and plain decode plans, not verify plans (whose draft K/V lags). A request is
//! admitted with the cached blocks its tokens start with, less the block holding its last
//! token (one token at least is computed: its logits) and, with speculative decoding, less the
//! last block found unless the token after it is the one the block's registering sequence had
//! there (the draft's K/V at a block's last position p is computed from token p + 1, its
//! shifted input; blocks computed by rows the draft does not follow, such as plain steps', hold
//! none: a row drafting from them drafts worse, never wrongly). A request whose next uncached blocks (64 tokens or more) requests admitted
//! in the same step compute waits one step, to find them cached instead of computing them twice
//! (admission.rs); a scored part (run/scoring.rs) waits for a single such block, and
//! the requests behind it are admitted meanwhile.
//!
//! Hybrid models (a recurrent state per sequence, state_checkpoints.rs): a hit is cut back to
//! the deepest block whose end has a state checkpoint, which the plan's `state_from` restores;
//! the plan building a checkpoint position's block saves the state there (`state_saves`); and
//! a sample never forks from a sibling (whose state has moved past their prompt): it finds
//! the prompt in the prefix cache instead.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Instant;

use crate::block_manager::BlockManager;
use crate::config::PolicyConfig;
use crate::error::{Error, Result};
use crate::sequence::{Sequence, Status};
use crate::state_checkpoints::StateCheckpoints;
use crate::stats::Stats;
use admission::register_computed;
pub use plan::{
    check_commit, request_seed, sample_seed, token_count, PendingPlan, PlanRow, StepKind, StepPlan,
    STATE_CONTINUE, STATE_ZERO,
};
use plan::{check_plan_row, pending_rows_by_slot, push_end_ids, push_plan_row, push_state_saves};

/// A plan just built: the plan, and its rows' place in `running` (`running[start..start +
/// samples.len()]`, valid until the next change of `running`) with whether each samples.
#[derive(Debug)]
pub struct Planned {
    pub plan: StepPlan,
    pub start: usize,
    pub samples: Vec<bool>,
}

pub struct Scheduler {
    cfg: PolicyConfig,
    /// The model's EOS ids, sorted and distinct (masked below a row's min_new_tokens).
    eos: Vec<u32>,
    /// The job seed, mixed with the row index into each row's seed (`request_seed`).
    seed: i64,
    /// Chunked prefill with speculative decoding: whether the last step was a prefill chunk
    /// (the next one verifies the decoding rows first).
    last_step_prefill: bool,
    /// Speculative decoding: plan plain decode steps, not verify rounds (`set_plain_steps`).
    plain_steps: bool,
    /// Block copies of forked samples admitted this step, for the next plan.
    block_copies: Vec<i32>,
    bm: BlockManager,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    free_request_slots: BinaryHeap<Reverse<u32>>,
    /// Plans handed out, oldest first: one, or two with overlap (`plan_ahead`).
    pending: VecDeque<PendingPlan>,
    /// Overlap: block tables and slots of rows that finished while a later plan holding them
    /// was pending; freed at the next commit (that plan has run by then).
    draining: Vec<(Vec<u32>, u32)>,
    /// The last `Sequence::run_id` given out.
    last_run_id: u64,
    /// Blocks kept free when admitting next to running requests (vLLM's 1% watermark).
    watermark: usize,
}

impl Scheduler {
    /// An empty policy over a cache of `cfg.num_blocks` blocks; `eos` sorted and distinct.
    pub fn new(cfg: PolicyConfig, eos: Vec<u32>, seed: i64) -> Self {
        Scheduler {
            bm: BlockManager::new(cfg.num_blocks, cfg.block_size, cfg.prefix_caching).with_states(
                StateCheckpoints::new(cfg.state_checkpoint_interval, cfg.state_checkpoints),
            ),
            free_request_slots: (0..cfg.max_batch_size as u32).map(Reverse).collect(),
            watermark: cfg.num_blocks / 100,
            cfg,
            eos,
            seed,
            last_step_prefill: false,
            plain_steps: false,
            block_copies: Vec::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending: VecDeque::new(),
            draining: Vec::new(),
            last_run_id: 0,
        }
    }

    pub fn config(&self) -> &PolicyConfig {
        &self.cfg
    }

    pub fn num_free_blocks(&self) -> usize {
        self.bm.num_free_blocks()
    }

    pub fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    /// The running sequences, in admission order.
    pub fn running(&self) -> &[Sequence] {
        &self.running
    }

    pub fn running_mut(&mut self) -> &mut [Sequence] {
        &mut self.running
    }

    /// Whether nothing waits or runs.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// The oldest plan handed out and not yet committed.
    pub fn pending(&self) -> Option<&PendingPlan> {
        self.pending.front()
    }

    pub fn num_pending(&self) -> usize {
        self.pending.len()
    }

    /// Queues a sequence behind the waiting ones.
    pub fn enqueue(&mut self, seq: Sequence) {
        self.waiting.push_back(seq);
    }

    /// With speculative decoding: while `on`, plan decode steps as plain decoding does (no
    /// lookahead slots; with chunked prefill, prompt chunks ride in them) instead of verify
    /// rounds. The worker asks for them where drafting cannot pay; it runs them as plain target
    /// steps. Takes effect at the next plan; admission still reserves the lookahead.
    pub fn set_plain_steps(&mut self, on: bool) {
        self.plain_steps = on;
    }

    /// Draft placeholders per row of the next decode step: 0 for plain steps.
    fn lookahead(&self) -> usize {
        if self.plain_steps {
            0
        } else {
            self.cfg.max_draft_tokens
        }
    }

    /// Builds the next plan from `waiting` / `running`, or `None` if both are empty. A
    /// prefill step when something can be admitted, else a decode (verify) step over all
    /// running requests.
    pub fn schedule(&mut self, st: &mut Stats) -> Result<Option<Planned>> {
        if self.cfg.chunked_prefill {
            return self.schedule_chunked(st);
        }
        let admitted = self.admit(Instant::now(), None, st)?;
        if admitted > 0 {
            let start = self.running.len() - admitted;
            return self
                .build_plan(StepKind::Prefill, start, admitted, st)
                .map(Some);
        }
        if self.running.is_empty() {
            return self.nothing_runnable();
        }
        let lookahead = self.lookahead();
        self.grow_running(lookahead, self.running.len(), st)?;
        let kind = if lookahead > 0 {
            StepKind::Verify
        } else {
            StepKind::Decode
        };
        self.build_plan(kind, 0, self.running.len(), st).map(Some)
    }

    /// With nothing running: None when nothing waits either, else the internal error of a
    /// waiting request that does not fit an empty cache (admission refuses such requests).
    fn nothing_runnable(&self) -> Result<Option<Planned>> {
        match self.waiting.front() {
            Some(seq) => Err(Error::internal(format!(
                "cannot admit the next waiting request ({} tokens) into an empty cache of {} \
                 free blocks",
                seq.len(),
                self.bm.num_free_blocks()
            ))),
            None => Ok(None),
        }
    }

    /// DECODE / VERIFY room: grows the first `rows` running requests' blocks to hold their
    /// tokens plus `lookahead` slots, preempting the most recently admitted requests until it
    /// fits. running[0] always fits once everyone after it is preempted (admission invariant:
    /// its worst case fits the whole cache), so it is never preempted and makes progress. With
    /// a plan pending (overlap), parked and draining rows hold blocks that no preemption here
    /// frees: `plan_ahead` schedules only when running[0] fits beside them.
    fn grow_running(&mut self, lookahead: usize, rows: usize, st: &mut Stats) -> Result<()> {
        let mut i = 0;
        while i < rows.min(self.running.len()) {
            let need = self.bm.blocks_to_grow(
                &self.running[i].block_table,
                self.running[i].len() + lookahead,
            );
            while need > self.bm.num_free_blocks() && self.running.len() > i + 1 {
                let victim = self.running.pop().expect("len > i + 1");
                self.preempt(victim, st)?;
            }
            if need > self.bm.num_free_blocks() {
                if i == 0 {
                    return Err(Error::internal(format!(
                        "row {} alone does not fit the KV cache, though admitted",
                        self.running[0].row_index
                    )));
                }
                // Only this request is left to give blocks back; it is the most recent one.
                let victim = self.running.pop().expect("i < len");
                self.preempt(victim, st)?;
                break;
            }
            let seq = &mut self.running[i];
            let len = seq.len() + lookahead;
            self.bm.grow(&mut seq.block_table, len)?;
            i += 1;
        }
        Ok(())
    }

    /// Preemption by recomputation: free the KV blocks and slot, requeue at the front.
    fn preempt(&mut self, mut seq: Sequence, st: &mut Stats) -> Result<()> {
        seq.drop_placeholder(); // its re-prefill samples that token again
        self.bm.free(&mut seq.block_table)?;
        seq.registered = 0;
        seq.chunk_end = None;
        if let Some(slot) = seq.slot.take() {
            self.free_request_slots.push(Reverse(slot));
        }
        seq.num_computed = 0;
        if let Some(sum) = seq.pooled.as_mut() {
            sum.iter_mut().for_each(|x| *x = 0.0); // its chunks are computed again
        }
        seq.status = Status::Waiting;
        seq.preemptions += 1;
        st.preemptions += 1;
        self.waiting.push_front(seq);
        Ok(())
    }

    /// Plan over `running[start..start + rows]`; marks the query tokens as computed (up to a
    /// row's `chunk_end`, if set). A verify row's query is its uncomputed token at position L-1
    /// followed by W placeholders (0) at L..L+W-1; the worker fills them with draft tokens and
    /// the commit decides how many became real.
    fn build_plan(
        &mut self,
        kind: StepKind,
        start: usize,
        rows: usize,
        st: &mut Stats,
    ) -> Result<Planned> {
        let lookahead = self.cfg.max_draft_tokens * usize::from(kind == StepKind::Verify);
        let rows = &mut self.running[start..start + rows];
        let width = rows.iter().map(|s| s.block_table.len()).max().unwrap_or(0);
        let t: usize = rows
            .iter()
            .map(|s| s.chunk_end.unwrap_or(s.len()) - s.num_computed + lookahead)
            .sum();
        let mut p = StepPlan::empty(kind, rows.len(), t, width);
        p.block_copies = std::mem::take(&mut self.block_copies);
        let prev_rows = pending_rows_by_slot(self.pending.front(), self.cfg.max_batch_size);
        let mut plan_rows = Vec::with_capacity(rows.len());
        for (r, seq) in rows.iter_mut().enumerate() {
            check_plan_row(kind, seq)?;
            let end = seq.chunk_end.take().unwrap_or(seq.len());
            push_plan_row(&mut p, r, seq, end, lookahead, &self.bm, self.seed);
            seq.state_restore = None; // taken by this plan's state_from
            push_end_ids(&mut p, seq, &self.eos);
            let slot = seq.slot.expect("running request has a slot");
            p.prev_rows.push(if seq.placeholder {
                prev_rows[slot as usize]
            } else {
                -1
            });
            plan_rows.push(PlanRow {
                run_id: seq.run_id,
                slot,
                samples: kind == StepKind::Verify || end == seq.len(),
            });
            if seq.prefilling() {
                st.prefill_tokens += (end - seq.num_computed) as u64;
            }
            // The worker writes K/V for every query token during this step (for a verify row,
            // `commit` settles how many of them hold accepted tokens).
            let from = std::mem::replace(&mut seq.num_computed, end);
            seq.prefill_pending &= end < seq.len();
            if kind != StepKind::Verify {
                register_computed(&mut self.bm, seq)?;
                push_state_saves(&mut p, r, seq, from, &mut self.bm);
            }
        }
        let samples = plan_rows.iter().map(|r| r.samples).collect();
        self.pending.push_back(PendingPlan {
            kind,
            rows: plan_rows,
        });
        Ok(Planned {
            plan: p,
            start,
            samples,
        })
    }

    /// Per row of `plan`, the index in `running` of its sequence, if it is still there (the
    /// same slot and run_id).
    pub fn locate(&self, plan: &PendingPlan) -> Vec<Option<usize>> {
        let mut by_slot = vec![usize::MAX; self.cfg.max_batch_size];
        for (i, seq) in self.running.iter().enumerate() {
            by_slot[seq.slot.expect("running request has a slot") as usize] = i;
        }
        plan.rows
            .iter()
            .map(|row| {
                let i = by_slot[row.slot as usize];
                (i != usize::MAX && self.running[i].run_id == row.run_id).then_some(i)
            })
            .collect()
    }

    /// Takes the oldest pending plan for its commit and frees the rows that finished while it
    /// was pending (overlap: the plan after them has run).
    pub fn take_pending(&mut self) -> Result<PendingPlan> {
        let plan = self
            .pending
            .pop_front()
            .ok_or_else(|| Error::internal("commit() without a plan from next_plan()"))?;
        self.free_drained()?;
        Ok(plan)
    }

    /// Takes the finished sequences out of `running` (the others stay, in their order) and
    /// frees their blocks and slots, or parks them while a pending plan holds the row.
    pub fn retire_finished(&mut self) -> Result<Vec<Sequence>> {
        if !self.running.iter().any(Sequence::is_finished) {
            return Ok(Vec::new());
        }
        let mut finished = Vec::new();
        for mut seq in std::mem::take(&mut self.running) {
            if !seq.is_finished() {
                self.running.push(seq);
                continue;
            }
            let (blocks, slot) = (std::mem::take(&mut seq.block_table), seq.slot.take());
            let in_flight = self.pending.iter().any(|p| p.holds(seq.run_id));
            match slot {
                Some(slot) if in_flight => self.draining.push((blocks, slot)),
                _ => self.free_row(blocks, slot)?,
            }
            finished.push(seq);
        }
        Ok(finished)
    }

    /// Gives a finished row's blocks and slot back.
    fn free_row(&mut self, mut blocks: Vec<u32>, slot: Option<u32>) -> Result<()> {
        self.bm.free(&mut blocks)?;
        if let Some(slot) = slot {
            self.free_request_slots.push(Reverse(slot));
        }
        Ok(())
    }

    /// Frees the rows that finished while the plan now committed was pending (overlap).
    fn free_drained(&mut self) -> Result<()> {
        for (blocks, slot) in std::mem::take(&mut self.draining) {
            self.free_row(blocks, Some(slot))?;
        }
        Ok(())
    }

    /// Drops every pending plan and every waiting or running sequence (an aborted run; their
    /// blocks are forgotten with the scheduler, no leak check).
    pub fn clear(&mut self) {
        self.pending.clear();
        self.waiting.clear();
        self.running.clear();
    }

    /// After the last commit: every KV block and request slot is free again.
    pub fn check_no_leak(&self) -> Result<()> {
        self.bm.check_no_leak()?;
        if self.free_request_slots.len() != self.cfg.max_batch_size {
            return Err(Error::internal(format!(
                "request slot leak: {} of {} free",
                self.free_request_slots.len(),
                self.cfg.max_batch_size
            )));
        }
        Ok(())
    }

    /// Prefix-cache blocks evicted so far.
    pub fn evictions(&self) -> u64 {
        self.bm.evictions
    }
}

mod admission;
#[cfg(test)]
mod admission_tests;
mod chunked;
mod overlap;
#[cfg(test)]
mod overlap_tests;
mod plan;
#[cfg(test)]
mod plan_tests;
#[cfg(test)]
mod prefix_cache_tests;
#[cfg(test)]
mod state_tests;
#[cfg(test)]
pub(crate) mod tests;

//! Structured output in the run (docs/structured-output.md): each sequence with a
//! `response_format` owns a `RowMatcher`, made at admission from the format's compiled grammar
//! (a format that does not compile is the row's error); the matcher consumes exactly the
//! committed tokens (`stop::append_tokens`).
//!
//! - Prefill and decode plans carry the token mask of each constrained row that samples
//!   (`StepPlan::mask_rows`, `token_masks`), computed when the plan is built, on rayon threads.
//! - Verify plans carry each constrained row's forced tokens (the grammar's only continuation,
//!   up to W) for the worker to draft; once the worker has its drafts, `draft_masks` validates
//!   them (how many leading drafts the grammar accepts) and returns one mask per verify
//!   position up to and including the first refused or missing draft (the bonus position);
//!   the matcher is rolled back, so it still stands where the commit left it.
//! - EOS: a mask allows every EOS id of the model where the grammar may end. A row whose
//!   grammar admits no more tokens finishes (`stop`) without one.
//! - Overlap plans no constrained row ahead (overlap.rs): its mask needs the token in flight.
//! - Reasoning (`output.reasoning`): a row that still reasons has no mask and no forced
//!   tokens; in a verify round its drafts up to and including the end tag are free, its grammar
//!   masks the positions after it.

use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;

use super::Run;
use crate::error::{Error, Result};
use crate::sampling_params::SamplingParams;
use crate::scheduler::StepPlan;
use crate::structured::{token_env, Grammars, RowMatcher};

impl Run {
    /// The grammar compiler over the tokenizer, built at the first constrained row.
    fn grammars(&mut self) -> Result<Arc<Grammars>> {
        if let Some(g) = &self.grammars {
            return Ok(g.clone());
        }
        let vocab = self
            .cfg
            .sampling
            .params
            .vocab_size
            .max(self.tokenizer.get_vocab_size(true));
        let env = token_env(&self.tokenizer, vocab, &self.criteria.eos)?;
        let g = Arc::new(Grammars::new(&env, vocab)?);
        self.grammars = Some(g.clone());
        Ok(g)
    }

    /// A fresh matcher for `sp`'s format (None: the row is not constrained); Err(message):
    /// the format does not compile, the row's error.
    pub(super) fn row_matcher(
        &mut self,
        sp: &SamplingParams,
    ) -> Result<Option<std::result::Result<RowMatcher, String>>> {
        let Some(format) = &sp.response_format else {
            return Ok(None);
        };
        let grammars = self.grammars()?;
        let before = grammars.compiled();
        let matcher = grammars.matcher(format);
        self.stats.grammar_compiles += (grammars.compiled() - before) as u64;
        Ok(Some(matcher))
    }

    /// Fills the plan's masks: one per constrained row of `running[start..]` that samples
    /// (`samples[r]`), at its next token.
    pub(super) fn push_masks(&mut self, p: &mut StepPlan, start: usize, samples: &[bool]) {
        let Some(grammars) = self.grammars.clone() else {
            return;
        };
        let rows = &mut self.sched.running_mut()[start..start + samples.len()];
        let mut matchers: Vec<&mut RowMatcher> = Vec::new();
        for (r, seq) in rows.iter_mut().enumerate() {
            if let (Some(m), true) = (&mut seq.matcher, samples[r] && !seq.thinking) {
                p.mask_rows[r] = matchers.len() as i32;
                matchers.push(m);
            }
        }
        if matchers.is_empty() {
            return;
        }
        let words = grammars.mask_words();
        let t0 = Instant::now();
        p.token_masks = vec![0u32; matchers.len() * words];
        let eos = &self.criteria.eos;
        p.token_masks
            .par_chunks_mut(words)
            .zip(matchers.par_iter_mut())
            .for_each(|(out, m)| fill(m, out, eos));
        self.stats.mask_seconds.push(t0.elapsed().as_secs_f64());
    }

    /// The verify plan's forced drafts: per row, the tokens its grammar forces next, at most
    /// W (none for unconstrained rows); `mask_rows` marks the constrained rows (their masks
    /// come from `draft_masks`).
    pub(super) fn push_forced(&mut self, p: &mut StepPlan, start: usize, rows: usize) {
        let w = self.cfg.policy.max_draft_tokens;
        let mut constrained = 0;
        for (r, seq) in self.sched.running_mut()[start..start + rows]
            .iter_mut()
            .enumerate()
        {
            if let Some(m) = &mut seq.matcher {
                p.mask_rows[r] = constrained; // draft_masks numbers them so
                constrained += 1;
                if seq.thinking {
                    p.cu_forced.push(p.forced_ids.len() as i32);
                    continue; // nothing is forced while the row reasons
                }
                let forced = m.forced();
                p.forced_ids
                    .extend(forced.iter().take(w).map(|&t| i64::from(t)));
            }
            p.cu_forced.push(p.forced_ids.len() as i32);
        }
    }

    /// Masked drafting (module doc): with `tokens` None, starts a session over the pending
    /// verify plan's constrained rows that do not reason and returns their masks at verify
    /// position 0; each later call consumes the drafts `tokens` [B] just chosen (the plan's
    /// rows) and returns the masks at the next position (everything allowed for a row whose
    /// grammar refused one of its drafts). `draft_masks` ends the session (rolled back).
    /// Returns (plan rows [R] ascending, masks [R * words]).
    pub fn draft_step_masks(&mut self, tokens: Option<&[i64]>) -> Result<(Vec<i32>, Vec<u32>)> {
        let Some(grammars) = self.grammars.clone() else {
            return Ok((Vec::new(), Vec::new()));
        };
        match tokens {
            None => self.start_session()?,
            Some(t) => self.session_consume(t)?,
        }
        let (words, eos) = (grammars.mask_words(), self.criteria.eos.clone());
        let t0 = Instant::now();
        let mut masks = vec![u32::MAX; self.session.len() * words];
        // the session's rows in `running` order (plans list running rows in order)
        let mut outs = self.session.iter().zip(masks.chunks_mut(words)).peekable();
        let mut pairs: Vec<(&mut [u32], &mut RowMatcher)> = Vec::new();
        for (i, seq) in self.sched.running_mut().iter_mut().enumerate() {
            let Some((d, _)) = outs.peek() else { break };
            if d.index != i {
                continue;
            }
            let (d, out) = outs.next().expect("peeked");
            if let (true, Some(m)) = (d.ok, seq.matcher.as_mut()) {
                pairs.push((out, m));
            }
        }
        pairs
            .into_par_iter()
            .for_each(|(out, m)| fill(m, out, &eos));
        self.stats.mask_seconds.push(t0.elapsed().as_secs_f64());
        Ok((self.session.iter().map(|d| d.row as i32).collect(), masks))
    }

    /// Opens a masked-drafting session over the pending plan's constrained rows.
    fn start_session(&mut self) -> Result<()> {
        self.end_session()?;
        let plan = self
            .sched
            .pending()
            .ok_or_else(|| Error::internal("draft_step_masks() without a pending plan"))?;
        for (row, i) in self.sched.locate(plan).into_iter().enumerate() {
            let Some(index) = i else { continue };
            let seq = &self.sched.running()[index];
            if seq.matcher.is_some() && !seq.thinking {
                let ok = true;
                self.session.push(DraftSession {
                    row,
                    index,
                    consumed: 0,
                    ok,
                });
            }
        }
        self.session.sort_by_key(|d| d.index);
        Ok(())
    }

    /// The session's rows consume the drafts just chosen (`tokens`: one per plan row).
    fn session_consume(&mut self, tokens: &[i64]) -> Result<()> {
        for d in self.session.iter_mut().filter(|d| d.ok) {
            let seq = &mut self.sched.running_mut()[d.index];
            let m = seq.matcher.as_mut().expect("session row");
            let t = tokens.get(d.row).and_then(|&t| u32::try_from(t).ok());
            match t {
                Some(t) if !m.is_stopped() && m.valid_prefix(&[t]) == 1 => {
                    d.ok = m.consume(&[t]).is_ok();
                    d.consumed += d.ok as usize;
                }
                _ => d.ok = false,
            }
        }
        Ok(())
    }

    /// Rolls the session's rows back to their committed tokens and closes it.
    pub(super) fn end_session(&mut self) -> Result<()> {
        for d in std::mem::take(&mut self.session) {
            if let Some(m) = self
                .sched
                .running_mut()
                .get_mut(d.index)
                .and_then(|s| s.matcher.as_mut())
            {
                m.rollback(d.consumed)?;
            }
        }
        Ok(())
    }

    /// For the pending verify plan, given the worker's drafts (`drafts` row-major [B, k]):
    /// the plan rows that are constrained (R, ascending), how many leading drafts each one's
    /// grammar accepts (a), and its masks at verify positions 0..=k ([R, k + 1, words];
    /// position j's mask follows drafts 1..j; positions past a allow everything: verification
    /// never reaches them, the draft at a + 1 being refused by the mask at a).
    pub fn draft_masks(&mut self, drafts: &[i64], k: usize) -> Result<DraftMasks> {
        let plan = self
            .sched
            .pending()
            .ok_or_else(|| Error::internal("draft_masks() without a pending plan"))?;
        if drafts.len() != plan.rows.len() * k {
            return Err(Error::internal(format!(
                "draft_masks(): {} drafts for {} rows of width {k}",
                drafts.len(),
                plan.rows.len()
            )));
        }
        self.end_session()?;
        let Some(grammars) = self.grammars.clone() else {
            return Ok(DraftMasks::default());
        };
        let (words, eos) = (grammars.mask_words(), self.criteria.eos.clone());
        let t0 = Instant::now();
        let mut jobs = self.draft_jobs(drafts, k);
        let mut masks = vec![u32::MAX; jobs.len() * (k + 1) * words];
        let valid: Vec<Result<i32>> = masks
            .par_chunks_mut((k + 1) * words)
            .zip(jobs.par_iter_mut())
            .map(|(out, (_, m, ids, free))| {
                let (free, ids) = (*free, &ids[..]);
                if free > ids.len() {
                    return Ok(ids.len() as i32); // still reasoning: nothing is masked
                }
                let grammar_out = &mut out[free * words..];
                Ok(free as i32 + row_masks(m, &ids[free..], grammar_out, words, &eos)?)
            })
            .collect();
        let rows = jobs.iter().map(|job| job.0 as i32).collect();
        drop(jobs);
        self.stats.mask_seconds.push(t0.elapsed().as_secs_f64());
        Ok(DraftMasks {
            rows,
            valid: valid.into_iter().collect::<Result<_>>()?,
            masks,
            words,
        })
    }
}

impl Run {
    /// The pending plan's constrained rows with their drafts, in plan order: (plan row, its
    /// matcher, its drafts as token ids, how many of them come before its grammar starts: a
    /// reasoning row's drafts up to its end tag, k + 1 when none is drafted).
    fn draft_jobs(&mut self, drafts: &[i64], k: usize) -> Vec<DraftJob<'_>> {
        let plan = self.sched.pending().expect("checked by draft_masks");
        let mut row_of = vec![None; self.sched.running().len()]; // running index -> plan row
        for (r, i) in self.sched.locate(plan).into_iter().enumerate() {
            if let Some(i) = i {
                row_of[i] = Some(r);
            }
        }
        let end_tag = self.criteria.reasoning.map(|(_, end)| end);
        let mut jobs = Vec::new();
        for (seq, r) in self.sched.running_mut().iter_mut().zip(row_of) {
            if let (Some(r), Some(m)) = (r, seq.matcher.as_mut()) {
                // a draft id that is no token (negative) ends the row's valid drafts
                let ids: Vec<u32> = drafts[r * k..(r + 1) * k]
                    .iter()
                    .map_while(|&t| u32::try_from(t).ok())
                    .collect();
                let free = match (seq.thinking, end_tag) {
                    (true, Some(end)) => {
                        ids.iter().position(|&t| t == end).map_or(k + 1, |e| e + 1)
                    }
                    _ => 0,
                };
                jobs.push((r, m, ids, free));
            }
        }
        jobs.sort_by_key(|job| job.0);
        jobs
    }
}

/// A row of a masked-drafting session: its plan row, its index in `running`, the drafts its
/// matcher consumed and whether all of them were valid so far.
#[derive(Debug)]
pub(super) struct DraftSession {
    row: usize,
    index: usize,
    consumed: usize,
    ok: bool,
}

/// A constrained row of a verify round: `Run::draft_jobs`.
type DraftJob<'a> = (usize, &'a mut RowMatcher, Vec<u32>, usize);

/// `Run::draft_masks`'s answer.
#[derive(Debug, Default)]
pub struct DraftMasks {
    pub rows: Vec<i32>,
    pub valid: Vec<i32>,
    pub masks: Vec<u32>,
    pub words: usize,
}

/// `m`'s mask into `out`, with every EOS id allowed where the grammar may end. A matcher that
/// fails allows nothing: the worker reports the row's token as none (`NO_TOKEN`) and the
/// commit makes it an error row naming the failure (`RowMatcher::failure`).
fn fill(m: &mut RowMatcher, out: &mut [u32], eos: &[u32]) {
    if m.fill_mask(out).is_err() {
        out.fill(0);
        return;
    }
    if eos.iter().any(|&t| get_bit(out, t)) {
        for &t in eos {
            set_bit(out, t);
        }
    }
}

/// One row's verify masks (`out`: a mask of `words` per draft and one more): consumes its
/// valid drafts to compute each position's mask, then rolls them back. Returns how many drafts
/// are valid.
fn row_masks(
    m: &mut RowMatcher,
    ids: &[u32],
    out: &mut [u32],
    words: usize,
    eos: &[u32],
) -> Result<i32> {
    let most = m.valid_prefix(ids);
    let mut valid = 0;
    loop {
        fill(m, &mut out[valid * words..(valid + 1) * words], eos);
        // nothing is consumed past a completed grammar (an EOS there ends the row)
        if valid == most || m.is_stopped() {
            break;
        }
        let failed = m.consume(&ids[valid..valid + 1]).is_err();
        valid += 1;
        if failed {
            // nothing is allowed after it: the row's error (`fill`)
            out[valid * words..(valid + 1) * words].fill(0);
            break;
        }
    }
    m.rollback(valid)?;
    Ok(valid as i32)
}

fn set_bit(words: &mut [u32], t: u32) {
    if let Some(w) = words.get_mut(t as usize / 32) {
        *w |= 1 << (t % 32);
    }
}

fn get_bit(words: &[u32], t: u32) -> bool {
    words
        .get(t as usize / 32)
        .is_some_and(|w| w >> (t % 32) & 1 == 1)
}

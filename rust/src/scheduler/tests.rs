//! The policy's test driver: a `Scheduler` over in-memory sequences (prompts tokenized by a
//! word-level tokenizer built in memory), committed by a fake model through the stop criteria
//! a run applies (stop.rs); finished sequences become rows in memory. No file, no thread.
//!
//! Its interface follows the run's (`next_plan`, `next_plan_ahead`, `commit`, `finish`), so
//! that a policy test reads like the end-to-end tests in run/.

use std::sync::Arc;
use std::time::Instant;

use arrow_array::Int64Array;
use tokenizers::Tokenizer;

use super::*;
use crate::config::RunConfig;
use crate::sampling_params::SamplingParams;
use crate::sequence::{FinishReason, Request, StopReason};
use crate::stop::{commit_tokens, StopCriteria};
use crate::testutil::word_level_tokenizer;

pub(crate) const VOCAB: usize = 64;

/// The tests' job settings: small sizes, EOS id 2, 8 new tokens (`RunConfig::new`'s
/// defaults otherwise).
pub(crate) fn test_config() -> RunConfig {
    // paths named, never opened: the policy reads no file
    let (input, tok, out) = ("in.parquet".into(), "tok.json".into(), "out".into());
    let mut cfg = RunConfig::new(vec![input], "prompt", tok, out);
    cfg.sampling.eos_token_ids = vec![2];
    cfg.sampling.params.max_new_tokens = 8;
    cfg.policy.num_blocks = 64;
    cfg.policy.block_size = 4;
    cfg.policy.max_batch_size = 4;
    cfg.policy.max_num_batched_tokens = 64;
    cfg.policy.max_model_len = 64;
    cfg.output.include_token_ids = true;
    cfg
}

/// A finished (or error) row, as the run would write it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Row {
    pub(crate) id: String,
    pub(crate) row_index: i64,
    pub(crate) sample_index: i32,
    pub(crate) text: String,
    pub(crate) reason: String,
    pub(crate) prompt_tokens: i32,
    pub(crate) output_tokens: i32,
    pub(crate) cached_tokens: i32,
    pub(crate) error: Option<String>,
    pub(crate) token_ids: Vec<i32>,
    /// (stop_reason, stop_token_id): the stop string or stop token id that ended the row.
    pub(crate) stop: (Option<String>, Option<i32>),
}

pub(crate) struct Driver {
    pub(crate) s: Scheduler,
    pub(crate) st: Stats,
    pub(crate) cfg: RunConfig,
    criteria: StopCriteria,
    tok: Tokenizer,
    rows: Vec<Row>,
}

impl Driver {
    /// A scheduler over `prompts` (word lists, "w5 w6"; None: a row without a prompt, an
    /// error row), each with the job's sampling parameters.
    pub(crate) fn new(cfg: &RunConfig, prompts: &[Option<&str>]) -> Self {
        let sp = Arc::new(cfg.sampling_params());
        let rows: Vec<_> = prompts.iter().map(|&p| (p, sp.clone())).collect();
        Self::with_rows(cfg, &rows)
    }

    /// `new`, each row with its own sampling parameters.
    pub(crate) fn with_rows(cfg: &RunConfig, rows: &[(Option<&str>, Arc<SamplingParams>)]) -> Self {
        cfg.validate().expect("a valid test config");
        let criteria = StopCriteria::new(cfg);
        let mut d = Driver {
            s: Scheduler::new(cfg.policy.clone(), criteria.eos.clone(), cfg.sampling.seed),
            st: Stats::new(0),
            cfg: cfg.clone(),
            criteria,
            tok: word_level_tokenizer(VOCAB),
            rows: Vec::new(),
        };
        for (i, (prompt, sp)) in rows.iter().enumerate() {
            d.add(i as i64, *prompt, sp.clone());
        }
        d
    }

    /// Queues a row's samples, or makes their error rows (as the run's `accept`).
    fn add(&mut self, row_index: i64, prompt: Option<&str>, sampling: Arc<SamplingParams>) {
        let prompt_ids = match prompt {
            Some(p) => self.tok.encode(p, true).unwrap().get_ids().to_vec(),
            None => Vec::new(),
        };
        let req = Request {
            row_index,
            id: Arc::new(Int64Array::from(vec![row_index])),
            prompt_ids,
            sampling,
            read_at: Instant::now(),
            error: prompt.is_none().then(|| "prompt is null".to_string()),
            endpoint: None,
            kept: Vec::new(),
            score_parts: Vec::new(),
            embed_line: None,
        };
        let error = req.error.clone().or_else(|| self.s.admission_error(&req));
        for s in 0..req.sampling.n as u32 {
            let mut seq = Sequence::new(req.clone(), s);
            seq.prompt_logprobs_k = self.cfg.output.prompt_logprobs;
            match &error {
                Some(e) => {
                    seq.error = Some(e.clone());
                    seq.finish(FinishReason::Error, Instant::now());
                    self.rows.push(self.row(seq));
                }
                None => self.s.enqueue(seq),
            }
        }
    }

    pub(crate) fn config(&self) -> &RunConfig {
        &self.cfg
    }

    pub(crate) fn num_free_blocks(&self) -> usize {
        self.s.num_free_blocks()
    }

    pub(crate) fn set_plain_steps(&mut self, on: bool) {
        self.s.set_plain_steps(on);
    }

    /// The next plan, or None once nothing waits or runs; an error while a plan is pending.
    pub(crate) fn next_plan(&mut self) -> Result<Option<StepPlan>> {
        if self.s.num_pending() > 0 {
            return Err(Error::internal("next_plan() before commit()"));
        }
        Ok(self.s.schedule(&mut self.st)?.map(|p| p.plan))
    }

    /// The plan after the pending one (the run's `next_plan_ahead`).
    pub(crate) fn next_plan_ahead(&mut self) -> Result<Option<StepPlan>> {
        if !self.cfg.policy.overlap || self.s.num_pending() != 1 {
            return Err(Error::internal("needs overlap and one pending plan"));
        }
        if self.s.ahead_blocked() {
            return Ok(None);
        }
        Ok(self.s.plan_ahead(&mut self.st)?.map(|p| p.plan))
    }

    /// Commits the oldest pending plan's tokens (the run's `commit` without logprobs).
    pub(crate) fn commit(
        &mut self,
        tokens: &[i32],
        num_tokens: &[i32],
        num_accepted: Option<&[i32]>,
    ) -> Result<()> {
        let plan = (self.s.pending()).ok_or_else(|| Error::internal("commit() without a plan"))?;
        let at = self.s.locate(plan);
        let most = self.cfg.policy.max_draft_tokens as i32 + 1;
        check_commit(plan, most, tokens, num_tokens, num_accepted)?;
        let plan = self.s.take_pending()?;
        let (now, mut offset) = (Instant::now(), 0usize);
        for (r, &n) in num_tokens.iter().enumerate() {
            let toks = &tokens[offset..offset + n as usize];
            offset += n as usize;
            let (Some(i), true) = (at[r], plan.rows[r].samples) else {
                continue;
            };
            let seq = &mut self.s.running_mut()[i];
            let verify = plan.kind == StepKind::Verify;
            let appended = commit_tokens(seq, toks, verify, now, &self.tok, &self.criteria);
            self.st.output_tokens += appended as u64;
            if let (Some(acc), true) = (num_accepted, verify) {
                *seq.spec_steps.get_or_insert(0) += 1;
                *seq.accepted_tokens.get_or_insert(0) += acc[r];
                self.st.spec_steps += 1;
                self.st.accepted_tokens += acc[r] as u64;
            }
        }
        for seq in self.s.retire_finished()? {
            let row = self.row(seq);
            self.rows.push(row);
        }
        Ok(())
    }

    /// A finished sequence's row: its text decoded from its text ids (as the writer does)
    /// unless a stop string cut it.
    fn row(&self, seq: Sequence) -> Row {
        let error = seq.error.is_some();
        let skip = seq.sampling.skip_special_tokens;
        let text = match (error, seq.stopped_on_string) {
            (true, _) => String::new(),
            (false, true) => seq.output_text.clone(),
            (false, false) => self.tok.decode(seq.text_ids(), skip).unwrap(),
        };
        let reason = match seq.finish_reason {
            Some(FinishReason::Stop) if !error => "stop",
            Some(FinishReason::Length) if !error => "length",
            _ => "error",
        };
        let stop = match &seq.stop_reason {
            Some(StopReason::Text(s)) => (Some(s.clone()), None),
            Some(StopReason::Token(t)) => (None, Some(*t as i32)),
            None => (None, None),
        };
        Row {
            id: format!("r{}", seq.row_index),
            row_index: seq.row_index,
            sample_index: seq.sample_index as i32,
            text,
            reason: reason.to_string(),
            prompt_tokens: token_count(seq.prompt_ids.len()),
            output_tokens: if error { 0 } else { seq.num_output() as i32 },
            cached_tokens: token_count(seq.cached_tokens),
            token_ids: match error {
                true => Vec::new(),
                false => seq.output_ids.iter().map(|&t| t as i32).collect(),
            },
            stop: if error { (None, None) } else { stop },
            error: seq.error,
        }
    }

    /// After the last commit: no block or slot leaked; the rows by (row, sample).
    pub(crate) fn finish(mut self) -> Result<Vec<Row>> {
        if !self.s.is_idle() || self.s.num_pending() > 0 {
            return Err(Error::internal("finish() before every row finished"));
        }
        self.s.check_no_leak()?;
        self.rows.sort_by_key(|r| (r.row_index, r.sample_index));
        Ok(self.rows)
    }
}

/// Runs the fake model (next token = last query token + 1 mod vocab) to the end; `k` tokens
/// per row per commit when > 1. Returns the steps.
pub(crate) fn drive(s: &mut Driver, k: usize) -> usize {
    let cfg = s.config().clone();
    let mut steps = 0;
    while let Some(p) = s.next_plan().unwrap() {
        check_plan(&p, &cfg);
        let mut tokens = Vec::new();
        for r in 0..p.num_seqs() {
            let last = p.input_ids[p.cu_seqlens_q[r + 1] as usize - 1];
            tokens.extend((1..=k).map(|j| ((last + j as i64) % VOCAB as i64) as i32));
        }
        s.commit(&tokens, &vec![k as i32; p.num_seqs()], None)
            .unwrap();
        steps += 1;
        assert!(steps < 100_000, "no progress");
    }
    steps
}

/// `drive` with speculative verify rounds: row r of step i accepts (i + r) % (W + 1) drafts.
pub(crate) fn drive_spec(s: &mut Driver) {
    drive_spec_with(s, |_| false);
}

/// `drive_spec`, asking for plain steps (`set_plain_steps`) before the steps where `plain`
/// says so: those are never verify rounds.
pub(crate) fn drive_spec_with(s: &mut Driver, plain: impl Fn(usize) -> bool) {
    let cfg = s.config().clone();
    let k = cfg.policy.max_draft_tokens;
    let mut step = 0usize;
    loop {
        s.set_plain_steps(plain(step));
        let Some(p) = s.next_plan().unwrap() else {
            break;
        };
        check_plan(&p, &cfg);
        assert!(!plain(step) || p.kind != StepKind::Verify, "step {step}");
        let (tokens, counts) = spec_tokens(&p, k, step);
        let accepted: Vec<i32> = counts.iter().map(|&c| c - 1).collect();
        s.commit(&tokens, &counts, Some(&accepted)).unwrap();
        step += 1;
        assert!(step < 10_000, "no progress");
    }
}

/// The fake model's tokens for a plan of `drive_spec` step `step`, and their counts per row.
fn spec_tokens(p: &StepPlan, k: usize, step: usize) -> (Vec<i32>, Vec<i32>) {
    let (mut tokens, mut counts) = (Vec::new(), Vec::new());
    for r in 0..p.num_seqs() {
        let (q0, q1) = (p.cu_seqlens_q[r] as usize, p.cu_seqlens_q[r + 1] as usize);
        let (n, last) = if p.kind == StepKind::Verify {
            assert_eq!(q1 - q0, k + 1);
            assert!(p.input_ids[q0 + 1..q1].iter().all(|&t| t == 0));
            (1 + (step + r) % (k + 1), p.input_ids[q0])
        } else {
            (1, p.input_ids[q1 - 1])
        };
        tokens.extend((1..=n).map(|j| ((last + j as i64) % VOCAB as i64) as i32));
        counts.push(n as i32);
    }
    (tokens, counts)
}

/// Checks a plan's internal consistency against the block tables.
pub(crate) fn check_plan(p: &StepPlan, cfg: &RunConfig) {
    let b = p.num_seqs();
    assert!(b >= 1);
    assert_eq!(p.cu_seqlens_q.len(), b + 1);
    assert_eq!(*p.cu_seqlens_q.last().unwrap() as usize, p.num_tokens());
    assert_eq!(p.positions.len(), p.num_tokens());
    assert_eq!(p.slot_mapping.len(), p.num_tokens());
    assert_eq!(p.block_tables.len(), b * p.block_table_width);
    let mut slots = p.request_slots.clone();
    slots.sort();
    slots.dedup();
    assert_eq!(slots.len(), b, "duplicate request slots");
    assert!(p
        .request_slots
        .iter()
        .all(|&s| (s as usize) < cfg.policy.max_batch_size));
    if p.kind == StepKind::Prefill {
        assert!(p.num_tokens() <= cfg.policy.max_num_batched_tokens || b == 1);
    }
    let mut kv_slots = std::collections::HashSet::new();
    for r in 0..b {
        check_plan_row(p, r, cfg, &mut kv_slots);
    }
}

/// `check_plan` for row `r`: its query follows its cached tokens and each query token writes
/// a KV slot of its own.
fn check_plan_row(
    p: &StepPlan,
    r: usize,
    cfg: &RunConfig,
    kv_slots: &mut std::collections::HashSet<i64>,
) {
    let (q0, q1) = (p.cu_seqlens_q[r] as usize, p.cu_seqlens_q[r + 1] as usize);
    let seq_len = p.seq_lens[r] as usize;
    assert!(q1 > q0);
    let prefix = (p.cu_prefix[r + 1] - p.cu_prefix[r]) as usize;
    if p.kind == StepKind::Prefill {
        // the query follows what is in the cache (prefix-cached blocks, a forked sample's
        // prompt less its last token, earlier chunks)
        assert_eq!(p.positions[q0] as usize, prefix);
    } else {
        assert!(prefix == 0 || prefix == p.positions[q0] as usize); // a chunk in a decode step
    }
    if p.kind != StepKind::Verify {
        assert_eq!(p.positions[q0] as usize + q1 - q0, seq_len);
    } else {
        assert_eq!(p.next_ids[r], -1);
    }
    assert_eq!(p.positions[q1 - 1] as usize, seq_len - 1);
    let table = &p.block_tables[r * p.block_table_width..(r + 1) * p.block_table_width];
    for t in q0..q1 {
        let pos = p.positions[t] as usize;
        let block = table[pos / cfg.policy.block_size] as i64;
        assert!((block as usize) < cfg.policy.num_blocks);
        assert_eq!(
            p.slot_mapping[t],
            block * cfg.policy.block_size as i64 + (pos % cfg.policy.block_size) as i64
        );
        assert!(
            kv_slots.insert(p.slot_mapping[t]),
            "two tokens write one KV slot"
        );
    }
}

pub(crate) fn words(ids: std::ops::Range<usize>) -> String {
    ids.map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ")
}

/// A job's settings and prompts (word lists; None: a row without a prompt).
pub(crate) struct Fixture {
    pub(crate) cfg: RunConfig,
    prompts: Vec<Option<String>>,
}

impl Fixture {
    /// The driver over the fixture's prompts with its settings.
    pub(crate) fn driver(&self) -> Driver {
        let prompts: Vec<Option<&str>> = self.prompts.iter().map(Option::as_deref).collect();
        Driver::new(&self.cfg, &prompts)
    }
}

/// `test_config()` over `prompts`.
pub(crate) fn fixture(prompts: &[Option<&str>]) -> Fixture {
    let prompts = prompts.iter().map(|p| p.map(str::to_string)).collect();
    Fixture {
        cfg: test_config(),
        prompts,
    }
}

#[test]
fn max_model_len_and_kv_footprint_errors() {
    let mut f = fixture(&[
        Some("w4 w5 w6 w7 w8 w9 w10 w11 w12 w13"),
        Some("w4 w5 w6 w7 w8"),
        Some("w4 w5"),
    ]);
    f.cfg.policy.max_model_len = 10;
    f.cfg.sampling.params.max_new_tokens = 100;
    let mut s = f.driver();
    drive(&mut s, 1);
    let rows = s.finish().unwrap();
    assert_eq!(rows[0].reason, "error");
    assert!(
        rows[0].error.as_deref().unwrap().contains("max_model_len"),
        "{:?}",
        rows[0].error
    );
    // The prompt was tokenized: its real length (with <bos>) is reported.
    assert_eq!(rows[0].prompt_tokens, 11);
    // 6 prompt tokens (with <bos>) + 4 generated = max_model_len.
    assert_eq!(rows[1].reason, "length");
    assert_eq!(rows[1].output_tokens, 4);
    assert_eq!(rows[2].output_tokens, 7);

    let mut f = fixture(&[
        Some("w4 w5 w6 w7 w8 w9 w10 w11 w12"),
        Some("w4"),
        Some("w4 w5"),
    ]);
    f.cfg.policy.num_blocks = 2; // capacity 8 tokens
    f.cfg.sampling.params.max_new_tokens = 6;
    let mut s = f.driver();
    drive(&mut s, 1);
    let rows = s.finish().unwrap();
    assert_eq!(rows[0].reason, "error");
    let e = rows[0].error.as_deref().unwrap();
    assert!(
        e.contains("prompt has 10 tokens and needs 3 KV blocks") && e.contains("num_blocks = 2"),
        "{e}"
    );
    assert_eq!(rows[0].prompt_tokens, 10);
    // 2 prompt tokens + 6 = 8 fits exactly: generated to the end, not cut by the capacity.
    assert_eq!(rows[1].reason, "length");
    assert_eq!(rows[1].output_tokens, 6);
    // 3 + 6 = 9 > 8: refused up front instead of being cut short.
    assert_eq!(rows[2].reason, "error");
    assert_eq!(
        rows[2].error.as_deref().unwrap(),
        "needs up to 9 tokens of KV cache (prompt 3 + max_new_tokens 6) but the cache holds 8 \
         tokens; raise engine.kv_cache_tokens or engine.kv_cache_memory_fraction, or lower \
         sampling.max_new_tokens"
    );
    assert_eq!((rows[2].prompt_tokens, rows[2].output_tokens), (3, 0));
}

/// Whatever the KV budget, a request that fits is generated exactly as with a large cache
/// (no cut by the capacity), and one that cannot fit is an error row saying why.
#[test]
fn outputs_do_not_depend_on_the_kv_budget() {
    // Prompts of 2..=7 tokens (with <bos>); the last needs 10 + 9 = 19 tokens (+ lookahead).
    let mut prompts: Vec<String> = (0..6).map(|i| words(4 + i * 7..5 + i * 8)).collect();
    prompts.push(words(50..59));
    let prompts: Vec<Option<&str>> = prompts.iter().map(|s| Some(s.as_str())).collect();
    for k in [0usize, 3] {
        // Largest fitting footprint: 7 prompt + 9 new + k lookahead tokens, in blocks of 2.
        let tight = (7 + 9 + k).div_ceil(2);
        let mut runs = Vec::new();
        for (tag, blocks) in [("big", 256), ("tight", tight)] {
            let mut f = fixture(&prompts);
            f.cfg.policy.num_blocks = blocks;
            f.cfg.policy.block_size = 2;
            f.cfg.sampling.params.max_new_tokens = 9;
            f.cfg.policy.max_draft_tokens = k;
            f.cfg.sampling.eos_token_ids = vec![];
            let mut s = f.driver();
            if k == 0 {
                drive(&mut s, 1);
            } else {
                drive_spec(&mut s);
            }
            let preemptions = s.st.preemptions;
            assert_eq!(preemptions > 0, blocks == tight, "{tag} k={k}");
            runs.push(s.finish().unwrap());
        }
        let (big, tight_rows) = (&runs[0], &runs[1]);
        assert_eq!(tight_rows.len(), 7);
        assert_eq!(&tight_rows[..6], &big[..6], "k={k}");
        assert!(big
            .iter()
            .all(|r| r.reason == "length" && r.output_tokens == 9));
        let e = tight_rows[6].error.as_deref().unwrap();
        let lookahead = if k > 0 {
            " + 3 speculative lookahead"
        } else {
            ""
        };
        let want = format!(
            "needs up to {} tokens of KV cache (prompt 10 + max_new_tokens 9{lookahead}) but the \
             cache holds {} tokens",
            19 + k,
            tight * 2
        );
        assert!(e.starts_with(&want), "{e}");
        assert_eq!(tight_rows[6].prompt_tokens, 10);
    }
}

#[test]
fn preemption_gives_same_outputs_as_a_large_cache() {
    let prompts: Vec<String> = (0..9)
        .map(|i| words(4 + i * 5..4 + i * 5 + 1 + i % 4))
        .collect();
    let prompts: Vec<Option<&str>> = prompts.iter().map(|s| Some(s.as_str())).collect();
    let mut outputs = Vec::new();
    for blocks in [256, 8] {
        let mut f = fixture(&prompts);
        f.cfg.policy.num_blocks = blocks;
        f.cfg.policy.block_size = 2;
        f.cfg.sampling.params.max_new_tokens = 9;
        f.cfg.sampling.eos_token_ids = vec![]; // run to the length limit
        let mut s = f.driver();
        drive(&mut s, 1);
        let preemptions = s.st.preemptions;
        if blocks == 8 {
            assert!(preemptions > 0, "expected preemptions with a tiny cache");
        } else {
            assert_eq!(preemptions, 0);
        }
        let rows = s.finish().unwrap();
        assert_eq!(rows.len(), 9);
        outputs.push(
            rows.into_iter()
                .map(|r| (r.id, r.text, r.token_ids, r.reason))
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(outputs[0], outputs[1]);
}

#[test]
fn admission_respects_batch_size_and_token_budget() {
    let prompts: Vec<Option<&str>> = vec![Some("w4 w5 w6 w7 w8 w9 w10"); 6];
    let mut f = fixture(&prompts);
    f.cfg.policy.prefix_caching = false; // identical prompts: with caching they would share
    f.cfg.policy.max_batch_size = 3;
    f.cfg.policy.max_num_batched_tokens = 17; // two 8-token prompts per prefill step
    f.cfg.sampling.params.max_new_tokens = 3;
    let mut s = f.driver();
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(p.kind, StepKind::Prefill);
    assert_eq!(p.num_seqs(), 2);
    assert_eq!(p.request_slots, vec![0, 1]);
    assert_eq!(p.num_tokens(), 16);
    assert_eq!(p.max_seqlen_q, 8);
    s.commit(&[11, 11], &[1, 1], None).unwrap();
    // Prefill is preferred: the third request is admitted before anyone decodes.
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(
        (p.kind, p.num_seqs(), p.request_slots.clone()),
        (StepKind::Prefill, 1, vec![2])
    );
    s.commit(&[11], &[1], None).unwrap();
    // Batch full: decode over all three, one query token each at position 8.
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(p.kind, StepKind::Decode);
    assert_eq!(p.request_slots, vec![0, 1, 2]);
    assert_eq!(p.input_ids, vec![11, 11, 11]);
    assert_eq!(p.positions, vec![8, 8, 8]);
    assert_eq!(p.seq_lens, vec![9, 9, 9]);
    assert_eq!(p.cu_seqlens_q, vec![0, 1, 2, 3]);
    assert_eq!(p.num_generated, vec![1, 1, 1]);
    assert_eq!(p.block_table_width, 3);
    assert_eq!(p.max_seqlen_k, 9);
    // Commit mismatches are errors and leave the plan pending.
    assert!(s.commit(&[1, 2], &[1, 1], None).is_err());
    assert!(s.commit(&[1, 2], &[1, 2], None).is_err());
    assert!(s.next_plan().is_err());
    s.commit(&[12, 12, 12], &[1, 1, 1], Some(&[0, 1, 0]))
        .unwrap();
    drive(&mut s, 1);
    assert_eq!(s.finish().unwrap().len(), 6);
}

/// Verify steps (W > 0): each row's query is its last token plus W placeholders, and a
/// commit of n tokens advances the sequence by n (accepted drafts + the target's token). A
/// fake speculative model accepts a varying number of drafts per row; outputs must equal
/// plain decoding, also under preemption with a tiny cache.
#[test]
fn verify_steps_with_partial_acceptance_equal_plain_decoding() {
    let prompts = [
        Some("w5 w6"),
        Some("w10"),
        Some("w60"),
        Some("w20 w21 w22"),
        Some("w30 w31"),
    ];
    let plain = fixture(&prompts);
    let mut s = plain.driver();
    drive(&mut s, 1);
    let want = s.finish().unwrap();

    for (tag, num_blocks) in [("sched-verify", 64), ("sched-verify-small", 7)] {
        let mut f = fixture(&prompts);
        f.cfg.policy.max_draft_tokens = 3;
        f.cfg.policy.num_blocks = num_blocks;
        let mut s = f.driver();
        drive_spec(&mut s);
        assert_eq!(s.finish().unwrap(), want, "{tag}");
    }
}

#[test]
fn verify_commit_with_too_many_tokens_is_an_error() {
    let mut f = fixture(&[Some("w5")]);
    f.cfg.policy.max_draft_tokens = 2;
    let mut s = f.driver();
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(p.kind, StepKind::Prefill);
    s.commit(&[6], &[1], None).unwrap();
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(p.kind, StepKind::Verify);
    assert_eq!(p.positions, vec![2, 3, 4]);
    assert_eq!(p.seq_lens, vec![5]);
    assert_eq!(p.input_ids, vec![6, 0, 0]);
    assert!(s.commit(&[7, 8, 9, 10], &[4], Some(&[3])).is_err());
}

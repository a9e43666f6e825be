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
//! - every request read from the input leaves through the writer exactly once (finished or
//!   error row); `next_plan` returns `None` only after the input is exhausted and nothing is
//!   waiting or running. Rows in `skip_rows` (written by an earlier run) are never read as
//!   requests, so a resumed job writes each input row once over all its runs;
//! - `abort` writes every row already handed to the writer and nothing else: requests still
//!   waiting or running are dropped unwritten (a resumed run generates them).
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
//! (admission.rs); a scored part (scheduler/scoring.rs) waits for a single such block, and
//! the requests behind it are admitted meanwhile.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, TryRecvError};
use tokenizers::Tokenizer;

use crate::block_manager::BlockManager;
use crate::chat_template::ChatTemplate;
use crate::config::SchedulerConfig;
use crate::error::{Error, Result};
use crate::logprobs::{self, PromptLogprobs, StepLogprobs};
use crate::openai_keys::Endpoint;
use crate::reader::{
    spawn_reader, validate_inputs, InputSpec, ReaderMsg, ReaderOptions, ScoreOptions, TextLimit,
};
use crate::sampling_params::{SamplingParams, MAX_SAMPLES};
use crate::score::Gather;
use crate::sequence::{FinishReason, Request, Sequence, Status, StopReason, Timing};
use crate::stats::{Stats, Summary, SummaryValue};
use crate::structured::{Grammars, RowMatcher};
use crate::writer::{OutputRow, Writer, WriterConfig, WriterSummary};
use admission::register_computed;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    Prefill,
    Decode,
    /// Speculative decoding: per row the last committed token plus W draft placeholders.
    Verify,
}

impl StepKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StepKind::Prefill => "prefill",
            StepKind::Decode => "decode",
            StepKind::Verify => "verify",
        }
    }
}

/// One forward step; B = rows, T = query tokens. See `_native.pyi` for the meaning of each
/// array. `block_tables` is row-major `[B, block_table_width]`, padded with 0.
#[derive(Debug, Clone)]
pub struct StepPlan {
    pub kind: StepKind,
    pub request_slots: Vec<i32>,
    pub input_ids: Vec<i64>,
    pub positions: Vec<i64>,
    pub cu_seqlens_q: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub block_tables: Vec<i32>,
    pub block_table_width: usize,
    pub slot_mapping: Vec<i64>,
    pub temperature: Vec<f32>,
    pub top_p: Vec<f32>,
    pub top_k: Vec<i32>,
    pub seeds: Vec<i64>,
    pub num_generated: Vec<i32>,
    /// Per row: EOS / stop ids masked while num_generated (+ j in a verify row) is below it.
    pub min_tokens: Vec<i32>,
    /// Rows below their min_tokens: the ids they mask (EOS unless the row ignores it, then its
    /// stop token ids; sorted, distinct), row i's `end_ids[cu_end_ids[i]..cu_end_ids[i + 1]]`;
    /// none for other rows.
    pub end_ids: Vec<i64>,
    pub cu_end_ids: Vec<i32>,
    /// Per row: vLLM's min-p (0 = off).
    pub min_p: Vec<f32>,
    pub repetition_penalty: Vec<f32>,
    pub frequency_penalty: Vec<f32>,
    pub presence_penalty: Vec<f32>,
    /// Top alternatives to report per sampled token (0 = no logprobs for the row).
    pub logprobs: Vec<i32>,
    /// Top alternatives per prompt token while the row still lacks some of its prompt
    /// logprobs (0 otherwise), and each row's prompt length.
    pub prompt_logprobs: Vec<i32>,
    pub prompt_lens: Vec<i32>,
    /// Per row: the first query position whose prompt logprob is wanted (0, or a scored
    /// part's first scored token - 1: score.rs); earlier positions' logits are not needed.
    pub prompt_logprobs_from: Vec<i32>,
    /// Rows with a penalty on: their known tokens (prompt then output, rows concatenated; row
    /// i's are `penalty_ids[cu_penalty[i]..cu_penalty[i + 1]]`, the first
    /// `penalty_prompt_lens[i]` of them prompt tokens); empty for other rows.
    pub penalty_ids: Vec<i64>,
    pub cu_penalty: Vec<i32>,
    pub penalty_prompt_lens: Vec<i32>,
    /// Rows computing their known tokens (a prefill, or a chunk of one): the tokens before the
    /// row's query (in the cache already), rows concatenated; row i's are
    /// `prefix_ids[cu_prefix[i]..cu_prefix[i + 1]]`. None for decode and verify rows.
    pub prefix_ids: Vec<i64>,
    pub cu_prefix: Vec<i32>,
    /// KV blocks to copy before the step, `[src, dst]` pairs (a sample forked from a sibling
    /// takes a copy of the prompt's partial last block): every layer, target and draft.
    pub block_copies: Vec<i32>,
    /// The token after each row's query, -1 where the query ends the row's known tokens (the
    /// step samples the next one); chunked prefill rows stop earlier.
    pub next_ids: Vec<i64>,
    /// Overlap: per row, the row of the pending plan whose sampled token is this row's last
    /// query token (its `input_ids` entry is -1 until the worker fills it in), else -1.
    pub prev_rows: Vec<i32>,
    /// Structured output (scheduler/structured.rs): per row, its mask's index in
    /// `token_masks` (-1: none; prefill and decode rows that sample only), and the masks,
    /// `[M, mask_words]` u32 (bit t % 32 of word t / 32: token t allowed).
    pub mask_rows: Vec<i32>,
    pub token_masks: Vec<u32>,
    pub mask_words: usize,
    /// Verify plans: each constrained row's forced tokens (at most W), row i's
    /// `forced_ids[cu_forced[i]..cu_forced[i + 1]]`.
    pub forced_ids: Vec<i64>,
    pub cu_forced: Vec<i32>,
    pub max_seqlen_q: usize,
    pub max_seqlen_k: usize,
}

impl StepPlan {
    pub fn num_seqs(&self) -> usize {
        self.request_slots.len()
    }

    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }
}

impl StepPlan {
    /// A plan with no rows yet, its vectors sized for `b` rows of `t` query tokens in all and
    /// block tables `width` wide (zero-padded).
    fn empty(kind: StepKind, b: usize, t: usize, width: usize) -> Self {
        StepPlan {
            kind,
            request_slots: Vec::with_capacity(b),
            input_ids: Vec::with_capacity(t),
            positions: Vec::with_capacity(t),
            cu_seqlens_q: {
                let mut cu = Vec::with_capacity(b + 1);
                cu.push(0);
                cu
            },
            seq_lens: Vec::with_capacity(b),
            block_tables: vec![0; b * width],
            block_table_width: width,
            slot_mapping: Vec::with_capacity(t),
            temperature: Vec::with_capacity(b),
            top_p: Vec::with_capacity(b),
            top_k: Vec::with_capacity(b),
            seeds: Vec::with_capacity(b),
            num_generated: Vec::with_capacity(b),
            min_tokens: Vec::with_capacity(b),
            end_ids: Vec::new(),
            cu_end_ids: vec![0],
            min_p: Vec::with_capacity(b),
            repetition_penalty: Vec::with_capacity(b),
            frequency_penalty: Vec::with_capacity(b),
            presence_penalty: Vec::with_capacity(b),
            logprobs: Vec::with_capacity(b),
            prompt_logprobs: Vec::with_capacity(b),
            prompt_lens: Vec::with_capacity(b),
            prompt_logprobs_from: Vec::with_capacity(b),
            penalty_ids: Vec::new(),
            cu_penalty: vec![0],
            penalty_prompt_lens: Vec::with_capacity(b),
            prefix_ids: Vec::new(),
            cu_prefix: vec![0],
            block_copies: Vec::new(),
            next_ids: Vec::with_capacity(b),
            prev_rows: Vec::with_capacity(b),
            mask_rows: vec![-1; b],
            token_masks: Vec::new(),
            mask_words: 0,
            forced_ids: Vec::new(),
            cu_forced: vec![0],
            max_seqlen_q: 0,
            max_seqlen_k: 0,
        }
    }
}

/// Per request slot, the row of `plan` holding it (-1: none); empty without a plan.
fn pending_rows_by_slot(plan: Option<&PendingPlan>, max_batch_size: usize) -> Vec<i32> {
    let Some(plan) = plan else {
        return Vec::new();
    };
    let mut rows = vec![-1; max_batch_size];
    for (r, row) in plan.rows.iter().enumerate() {
        rows[row.slot as usize] = r as i32;
    }
    rows
}

/// Checks that a running sequence can be row of a `kind` plan: it has uncomputed tokens; a
/// verify row has exactly one uncomputed token.
fn check_plan_row(kind: StepKind, seq: &Sequence) -> Result<()> {
    let q = seq.len() - seq.num_computed;
    if q == 0 {
        return Err(Error::internal(format!(
            "row {} has no new tokens to compute",
            seq.row_index
        )));
    }
    if kind == StepKind::Verify && q != 1 {
        return Err(Error::internal(
            "verify row with more than one uncomputed token",
        ));
    }
    Ok(())
}

/// Appends row `r` (`seq`) to the plan: its query tokens `num_computed..end + lookahead`
/// (placeholders 0 past `len`), their positions and KV slots, its block table and per-row
/// values. The sequence's blocks must already cover `end + lookahead` tokens.
fn push_plan_row(
    p: &mut StepPlan,
    r: usize,
    seq: &Sequence,
    end: usize,
    lookahead: usize,
    bm: &BlockManager,
    seed: i64,
) {
    let len = seq.len();
    let q = end - seq.num_computed;
    let stop = end + lookahead;
    debug_assert!(seq.block_table.len() >= bm.blocks_needed(stop));
    for pos in seq.num_computed..stop {
        let id = match pos {
            _ if pos >= len => 0,                         // a draft placeholder
            _ if seq.placeholder && pos + 1 == len => -1, // the pending plan's token
            _ => seq.token(pos) as i64,
        };
        p.input_ids.push(id);
        p.positions.push(pos as i64);
        p.slot_mapping.push(bm.slot(&seq.block_table, pos));
    }
    p.cu_seqlens_q.push(p.input_ids.len() as i32);
    p.seq_lens.push(stop as i32);
    let width = p.block_table_width;
    for (j, &blk) in seq.block_table.iter().enumerate() {
        p.block_tables[r * width + j] = blk as i32;
    }
    if seq.prefilling() {
        p.prefix_ids
            .extend((0..seq.num_computed).map(|pos| seq.token(pos) as i64));
    }
    p.cu_prefix.push(p.prefix_ids.len() as i32);
    p.next_ids
        .push(if end < len { seq.token(end) as i64 } else { -1 });
    p.request_slots
        .push(seq.slot.expect("running request has a slot") as i32);
    push_sampling(p, seq, seed);
    p.max_seqlen_q = p.max_seqlen_q.max(q + lookahead);
    p.max_seqlen_k = p.max_seqlen_k.max(stop);
}

/// Appends `seq`'s sampling parameters to the plan's per-row arrays (and, with a penalty on,
/// its known tokens).
fn push_sampling(p: &mut StepPlan, seq: &Sequence, seed: i64) {
    let sp = &seq.sampling;
    p.temperature.push(sp.temperature);
    p.top_p.push(sp.top_p);
    p.top_k.push(sp.top_k);
    let base = sp.seed.unwrap_or_else(|| request_seed(seed, seq.row_index));
    p.seeds.push(sample_seed(base, seq.sample_index));
    p.num_generated.push(seq.num_output() as i32);
    p.min_tokens.push(token_count(sp.min_new_tokens));
    p.min_p.push(sp.min_p);
    p.repetition_penalty.push(sp.repetition_penalty);
    p.frequency_penalty.push(sp.frequency_penalty);
    p.presence_penalty.push(sp.presence_penalty);
    p.logprobs.push(sp.logprobs as i32);
    p.prompt_logprobs.push(if seq.prompt_logprobs_missing() {
        seq.prompt_logprobs_k as i32
    } else {
        0
    });
    p.prompt_lens.push(token_count(seq.prompt_len()));
    p.prompt_logprobs_from
        .push(token_count(seq.prompt_logprobs_from()));
    let prompt_len = if sp.penalized() {
        p.penalty_ids
            .extend((0..seq.len()).map(|pos| seq.token(pos) as i64));
        seq.prompt_len()
    } else {
        0
    };
    p.cu_penalty.push(p.penalty_ids.len() as i32);
    p.penalty_prompt_lens.push(prompt_len as i32);
}

/// Appends the ids `seq` masks at this step: while it is below its min_new_tokens, its end ids
/// (the model's EOS `eos`, sorted, unless it ignores EOS, and its stop token ids).
fn push_end_ids(p: &mut StepPlan, seq: &Sequence, eos: &[u32]) {
    let sp = &seq.sampling;
    if seq.num_output() < sp.min_new_tokens {
        let mut ids: Vec<u32> = if sp.ignore_eos {
            Vec::new()
        } else {
            eos.to_vec()
        };
        ids.extend(&sp.stop_token_ids);
        ids.sort_unstable();
        ids.dedup();
        p.end_ids.extend(ids.into_iter().map(i64::from));
    }
    p.cu_end_ids.push(p.end_ids.len() as i32);
}

/// Checks a step result against its plan: one `num_tokens` (>= 1) and, if given, one
/// non-negative `num_accepted` per row; `num_tokens` sums to `tokens.len()`; a verify row
/// yields at most W accepted drafts plus one target token (`most_verify_tokens` = W + 1;
/// prefill and decode rows may yield several tokens, the next decode query then covers them
/// all); no token id is negative.
fn check_commit(
    plan: &PendingPlan,
    most_verify_tokens: i32,
    tokens: &[i32],
    num_tokens: &[i32],
    num_accepted: Option<&[i32]>,
) -> Result<()> {
    if num_tokens.len() != plan.rows.len() {
        return Err(Error::internal(format!(
            "commit() got {} rows but the plan has {}",
            num_tokens.len(),
            plan.rows.len()
        )));
    }
    if let Some(acc) = num_accepted {
        if acc.len() != plan.rows.len() {
            return Err(Error::internal(format!(
                "commit() got num_accepted for {} rows but the plan has {}",
                acc.len(),
                plan.rows.len()
            )));
        }
        if acc.iter().any(|&a| a < 0) {
            return Err(Error::internal("commit(): negative num_accepted"));
        }
    }
    if num_tokens.iter().any(|&n| n < 1) {
        return Err(Error::internal(
            "commit(): every row must produce at least one token",
        ));
    }
    let total: i64 = num_tokens.iter().map(|&n| n as i64).sum();
    if total != tokens.len() as i64 {
        return Err(Error::internal(format!(
            "commit(): num_tokens sums to {total} but {} tokens were given",
            tokens.len()
        )));
    }
    let most = most_verify_tokens;
    if plan.kind == StepKind::Verify {
        if let Some(n) = num_tokens.iter().find(|&&n| n > most) {
            return Err(Error::internal(format!(
                "commit(): a verify row produced {n} tokens; at most W + 1 = {most}"
            )));
        }
    }
    if let Some(t) = tokens.iter().find(|&&t| t < 0) {
        return Err(Error::internal(format!("commit(): negative token id {t}")));
    }
    Ok(())
}

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

/// A plan handed out and not yet committed: its kind and its rows, in plan order.
#[derive(Debug, Clone)]
struct PendingPlan {
    kind: StepKind,
    rows: Vec<PlanRow>,
}

impl PendingPlan {
    fn holds(&self, run_id: u64) -> bool {
        self.rows.iter().any(|r| r.run_id == run_id)
    }
}

/// A plan row: whose (`run_id`, `slot`) and whether the step samples the row's next token
/// (its query reaches its last known token; not a chunk short of the prompt's end).
#[derive(Debug, Clone, Copy)]
struct PlanRow {
    run_id: u64,
    slot: u32,
    samples: bool,
}

/// Stop conditions shared by all requests (stop strings and token ids, ignore_eos,
/// max_new_tokens and min_new_tokens are each request's own: `Sequence::sampling`).
struct StopCriteria {
    /// The model's EOS ids, sorted and distinct.
    eos: Vec<u32>,
    /// max_model_len: never the KV capacity, so an output does not depend on the budget.
    max_len: usize,
    /// Reasoning: the ids of the (start, end) tags.
    reasoning: Option<(u32, u32)>,
}

impl StopCriteria {
    fn new(cfg: &SchedulerConfig) -> Self {
        let mut eos = cfg.eos_token_ids.clone();
        eos.sort_unstable();
        eos.dedup();
        let reasoning = match cfg.reasoning_ids[..] {
            [start, end] => Some((start, end)),
            _ => None,
        };
        StopCriteria {
            eos,
            max_len: cfg.max_model_len,
            reasoning,
        }
    }

    /// Whether token `t` ends `sp`'s request: an EOS id (unless it ignores EOS) or one of its
    /// stop token ids.
    fn ends(&self, sp: &SamplingParams, t: u32) -> bool {
        self.is_eos(sp, t) || sp.stop_token_ids.contains(&t)
    }

    /// Whether `t` is an EOS id `sp`'s request stops at (vLLM: no `stop_reason` then).
    fn is_eos(&self, sp: &SamplingParams, t: u32) -> bool {
        !sp.ignore_eos && self.eos.binary_search(&t).is_ok()
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
fn compile_template(cfg: &SchedulerConfig) -> Result<Option<ChatTemplate>> {
    match (&cfg.chat_template, cfg.uses_chat_template()) {
        (Some(src), true) => ChatTemplate::new(src)
            .map(|t| Some(t.with_enable_thinking(cfg.enable_thinking)))
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
fn writer_config(
    cfg: &SchedulerConfig,
    spec: &InputSpec,
    tokenizer: Arc<Tokenizer>,
) -> WriterConfig {
    cfg.writer_config(spec.id_type.clone(), spec.kept.clone(), Some(tokenizer))
}

/// The reader thread's settings for this job.
fn reader_options(
    cfg: &SchedulerConfig,
    tokenizer: &Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    skip_rows: Vec<i64>,
) -> ReaderOptions {
    ReaderOptions {
        tokenizer: tokenizer.clone(),
        template,
        apply_chat_template: cfg.apply_chat_template,
        bos_token: cfg.bos_token.clone(),
        eos_token: cfg.eos_token.clone(),
        read_batch_rows: cfg.read_batch_rows,
        queue_rows: cfg.queue_rows,
        skip_rows,
        text_limit: TextLimit::new(tokenizer, cfg.max_model_len),
        sampling: Arc::new(cfg.sampling_params()),
        n: cfg.n,
        add_special_tokens: cfg.add_special_tokens,
        score: score_options(cfg, tokenizer),
    }
}

/// A scoring task's reader settings: the prefix token is BOS, else the first EOS id (lm-eval's
/// `prefix_token_id`), else 0.
fn score_options(cfg: &SchedulerConfig, tokenizer: &Tokenizer) -> Option<ScoreOptions> {
    let bos = cfg
        .bos_token
        .as_deref()
        .and_then(|t| tokenizer.token_to_id(t));
    Some(ScoreOptions {
        shape: cfg.score_shape()?,
        prefix_id: bos.or(cfg.eos_token_ids.first().copied()).unwrap_or(0),
        max_len: cfg.max_model_len,
    })
}

/// A token count as an output column value (int32).
fn token_count(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// The seed of sample `sample` of a row whose seed is `row` (its seed column's value, else
/// `request_seed(job seed, row_index)`): `row` itself for sample 0 (so n = 1 runs are
/// unchanged), mixed once more with the sample index for the others.
pub fn sample_seed(row: i64, sample: u32) -> i64 {
    if sample == 0 {
        row
    } else {
        request_seed(row, sample as i64)
    }
}

/// Resume's key of sample `s` of row `row` (py/eaglebatch/output/resume.py: the same).
fn sample_key(row: i64, s: u32) -> i64 {
    row * MAX_SAMPLES as i64 + s as i64
}

/// The keys of `cfg.skip_samples` (`sample_key`) that name a sample this run would generate:
/// of a row in `[start, end)` not skipped whole.
fn samples_to_skip(
    cfg: &SchedulerConfig,
    skip_rows: &[i64],
    (start, end): (u64, u64),
) -> HashSet<i64> {
    cfg.skip_samples
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

/// Per-request sampling seed: the job seed mixed with the row index (SplitMix64 finalizer),
/// kept non-negative so it fits any int64 seed API.
pub fn request_seed(seed: i64, row_index: i64) -> i64 {
    let mut z = (seed as u64) ^ (row_index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z & (i64::MAX as u64)) as i64
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    /// Chunked prefill with speculative decoding: whether the last step was a prefill chunk
    /// (the next one verifies the decoding rows first).
    last_step_prefill: bool,
    /// Speculative decoding: plan plain decode steps, not verify rounds (`set_plain_steps`).
    plain_steps: bool,
    /// `cfg.skip_samples` as a set (`sample_key`s).
    skip_samples: HashSet<i64>,
    /// The samples this run is to generate, as far as known: rows times the job's n, less
    /// the samples written before, corrected by each batch line's own n as it is read
    /// (`stats.requests_total` is this, at least 0).
    requests_expected: i64,
    /// Block copies of forked samples admitted this step, for the next plan.
    block_copies: Vec<i32>,
    tokenizer: Arc<Tokenizer>,
    input: Receiver<ReaderMsg>,
    input_done: bool,
    /// Set when the reader failed (message, whether a user error): every later `next_plan`
    /// and `finish` reports it again, with the same kind.
    input_failed: Option<(String, bool)>,
    _reader: JoinHandle<()>,
    writer: Writer,
    bm: BlockManager,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    free_request_slots: BinaryHeap<Reverse<u32>>,
    /// Plans handed out, oldest first: one, or two with overlap (`next_plan_ahead`).
    pending: VecDeque<PendingPlan>,
    /// Overlap: block tables and slots of rows that finished while a later plan holding them
    /// was pending; freed at the next commit (that plan has run by then).
    draining: Vec<(Vec<u32>, u32)>,
    /// The last `Sequence::run_id` given out.
    last_run_id: u64,
    criteria: StopCriteria,
    /// Blocks kept free when admitting next to running requests (vLLM's 1% watermark).
    watermark: usize,
    stats: Stats,
    finished: bool,
    /// Structured output's grammar compiler, built at the first constrained row.
    grammars: Option<Arc<Grammars>>,
    /// Masked drafting's rows in the pending verify plan (scheduler/structured.rs).
    session: Vec<structured::DraftSession>,
    /// Scoring tasks: the finished parts of rows whose other parts still run.
    gather: Gather,
}

impl Scheduler {
    /// Loads the tokenizer from `cfg.tokenizer_file`, then see `with_tokenizer`.
    pub fn new(cfg: SchedulerConfig) -> Result<Self> {
        cfg.validate()?;
        let path = &cfg.tokenizer_file;
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
    pub fn with_tokenizer(cfg: SchedulerConfig, tokenizer: Tokenizer) -> Result<Self> {
        cfg.validate()?;
        let tokenizer = untruncated(tokenizer)?;
        let template = compile_template(&cfg)?;
        let spec = validate_inputs(&cfg)?;
        let range = (spec.row_start, spec.row_end);
        let (skip_rows, skipped) = sorted_skip_rows(&cfg.skip_rows, range);
        let skip_samples = samples_to_skip(&cfg, &skip_rows, range);
        // signed: a batch line's own n may exceed the job's, its written samples too
        let expected =
            ((spec.range_rows() - skipped) * cfg.n as u64) as i64 - skip_samples.len() as i64;
        let mut stats = Stats::new(expected.max(0) as u64);
        stats.requests_skipped = skipped * cfg.n as u64 + skip_samples.len() as u64;
        let writer = Writer::start(writer_config(&cfg, &spec, tokenizer.clone()))?;
        let options = reader_options(&cfg, &tokenizer, template, skip_rows);
        let (input, reader) = spawn_reader(spec, options)?;
        Ok(Scheduler {
            last_step_prefill: false,
            plain_steps: false,
            skip_samples,
            requests_expected: expected,
            block_copies: Vec::new(),
            bm: BlockManager::new(cfg.num_blocks, cfg.block_size, cfg.prefix_caching),
            free_request_slots: (0..cfg.max_batch_size as u32).map(Reverse).collect(),
            watermark: cfg.num_blocks / 100,
            criteria: StopCriteria::new(&cfg),
            cfg,
            tokenizer,
            input,
            input_done: false,
            input_failed: None,
            _reader: reader,
            writer,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending: VecDeque::new(),
            draining: Vec::new(),
            last_run_id: 0,
            stats,
            finished: false,
            grammars: None,
            session: Vec::new(),
            gather: Gather::default(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    pub fn num_free_blocks(&self) -> usize {
        self.bm.num_free_blocks()
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
            ("running", self.running.len() as i64),
            ("waiting", self.waiting.len() as i64),
            ("prompt_tokens", s.prompt_tokens as i64),
            ("output_tokens", s.output_tokens as i64),
            ("preemptions", s.preemptions as i64),
            ("cached_tokens", s.cached_tokens as i64),
            ("prefill_tokens", s.prefill_tokens as i64),
            ("free_blocks", self.bm.num_free_blocks() as i64),
        ]
    }

    /// The next step, or `None` once every input row has been written. Blocks while waiting
    /// for input when nothing is runnable.
    pub fn next_plan(&mut self) -> Result<Option<StepPlan>> {
        if self.finished {
            return Err(Error::internal("next_plan() after finish()"));
        }
        if !self.pending.is_empty() {
            return Err(Error::internal(
                "next_plan() called again before commit() of the previous plan",
            ));
        }
        loop {
            self.pull_input(false)?;
            if let Some(plan) = self.schedule()? {
                return Ok(Some(plan));
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

    /// Moves requests from the reader into `waiting` (error rows straight to the writer) until
    /// `waiting` holds `max_batch_size` requests. With `block`, waits while nothing is
    /// runnable.
    fn pull_input(&mut self, block: bool) -> Result<()> {
        while !self.input_done && self.waiting.len() < self.cfg.max_batch_size {
            let idle = self.waiting.is_empty() && self.running.is_empty();
            let msg = if block && idle {
                match self.input.recv() {
                    Ok(m) => m,
                    Err(_) => {
                        self.input_done = true;
                        break;
                    }
                }
            } else {
                match self.input.try_recv() {
                    Ok(m) => m,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.input_done = true;
                        break;
                    }
                }
            };
            match msg {
                ReaderMsg::Request(req) => self.accept(req)?,
                ReaderMsg::Failed(e) => {
                    // The rows before it still run; next_plan reports it once they are done.
                    self.input_failed = Some((e.to_string(), matches!(e, Error::UserInput(_))));
                    self.input_done = true;
                }
            }
        }
        Ok(())
    }

    /// The error of the reader's failure, if it failed.
    fn input_failure(&self) -> Option<Error> {
        self.input_failed.as_ref().map(|(msg, user)| {
            if *user {
                Error::user(msg.clone())
            } else {
                Error::internal(format!("reading the input failed: {msg}"))
            }
        })
    }

    /// Queues the request's samples not written yet (one sequence each), or writes them as
    /// error rows when the request can never run.
    fn accept(&mut self, req: Request) -> Result<()> {
        if self.cfg.score_shape().is_some() {
            return self.accept_scored(req);
        }
        let n = req.sampling.n as u32;
        self.requests_expected += n as i64 - self.cfg.n as i64;
        self.stats.requests_total = self.requests_expected.max(0) as u64;
        let key = |s: u32| sample_key(req.row_index, s);
        let samples: Vec<u32> = (0..n)
            .filter(|&s| !self.skip_samples.contains(&key(s)))
            .collect();
        let mut error = self.admission_error(&req);
        self.stats.requests_read += samples.len() as u64;
        let mut matcher = None;
        if error.is_none() && !samples.is_empty() {
            match self.row_matcher(&req.sampling)? {
                Some(Err(msg)) => error = Some(msg),
                Some(Ok(m)) => matcher = Some(m),
                None => {}
            }
        }
        match error {
            Some(msg) => {
                for s in samples {
                    self.write_error_row(req.clone(), s, msg.clone())?;
                }
            }
            None => {
                self.stats.prompt_tokens_read += (req.prompt_ids.len() * samples.len()) as u64;
                for s in samples {
                    let mut seq = Sequence::new(req.clone(), s);
                    seq.prompt_logprobs_k = self.cfg.prompt_logprobs;
                    seq.matcher = matcher.as_ref().map(RowMatcher::fork);
                    seq.thinking = self
                        .criteria
                        .reasoning
                        .is_some_and(|tags| reasoning_open(&seq.prompt_ids, tags));
                    self.stats.structured_rows += seq.matcher.is_some() as u64;
                    self.queue(seq)?;
                }
            }
        }
        Ok(())
    }

    /// Queues an admitted sequence, or writes it finished (`stop`, no token) when its format
    /// allows only the empty text and it does not reason first: nothing is left to generate,
    /// whatever its min_new_tokens.
    fn queue(&mut self, mut seq: Sequence) -> Result<()> {
        let ends = seq.matcher.as_ref().is_some_and(RowMatcher::only_ends);
        if !ends || seq.thinking {
            self.waiting.push_back(seq);
            return Ok(());
        }
        seq.finish(FinishReason::Stop, Instant::now());
        let row = self.output_row(seq);
        self.writer.send(row)
    }

    /// Why a request can never run, if it cannot. Invariant of every admitted request: its
    /// worst case, min(prompt + max_new_tokens, max_model_len) tokens plus the W lookahead
    /// slots of a verify step, fits the whole cache, so alone it can always run to the end.
    fn admission_error(&self, req: &Request) -> Option<String> {
        if let Some(e) = &req.error {
            return Some(e.clone());
        }
        let cfg = &self.cfg;
        let (p, m, k) = (
            req.prompt_ids.len(),
            req.sampling.max_new_tokens,
            cfg.max_draft_tokens,
        );
        if p >= cfg.max_model_len {
            return Some(format!(
                "prompt has {p} tokens; it must be shorter than max_model_len ({})",
                cfg.max_model_len
            ));
        }
        let capacity = cfg.num_blocks * cfg.block_size;
        let need = p.saturating_add(m).min(cfg.max_model_len) + k;
        if need <= capacity {
            return None;
        }
        let advice = "raise engine.kv_cache_tokens or engine.kv_cache_memory_fraction";
        if self.bm.blocks_needed(p) > cfg.num_blocks {
            return Some(format!(
                "prompt has {p} tokens and needs {} KV blocks of {} tokens, but the cache has \
                 only num_blocks = {} ({capacity} tokens); {advice}",
                self.bm.blocks_needed(p),
                cfg.block_size,
                cfg.num_blocks
            ));
        }
        let capped = if p + m > cfg.max_model_len {
            format!(", at most max_model_len {}", cfg.max_model_len)
        } else {
            String::new()
        };
        let lookahead = if k > 0 {
            format!(" + {k} speculative lookahead")
        } else {
            String::new()
        };
        Some(format!(
            "needs up to {need} tokens of KV cache (prompt {p} + max_new_tokens {m}{capped}\
             {lookahead}) but the cache holds {capacity} tokens; {advice}, or lower \
             sampling.max_new_tokens"
        ))
    }

    fn write_error_row(&mut self, req: Request, sample: u32, msg: String) -> Result<()> {
        self.stats.requests_done += 1;
        self.stats.requests_error += 1;
        self.writer.send(OutputRow {
            id: req.id,
            row_index: req.row_index,
            sample_index: sample as i32,
            num_samples: req.sampling.n as i32,
            output_text: String::new(),
            finish_reason: FinishReason::Error,
            // The real count when the prompt was tokenized (e.g. too long), else 0.
            prompt_tokens: token_count(req.prompt_ids.len()),
            output_tokens: 0,
            cached_tokens: 0,
            queue_s: None,
            ttft_s: None,
            latency_s: None,
            tpot_s: None,
            error: Some(msg),
            spec_steps: None,
            accepted_tokens: None,
            accept_length: None,
            stop_reason: None,
            kept: req.kept,
            output_token_ids: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            text_ids: None,
            reasoning_ids: None,
            reasoning_text: None,
            structured: None,
            skip_special_tokens: true,
            endpoint: req.endpoint.map(Endpoint::url),
            score: None,
        })
    }

    /// Builds the next plan from `waiting` / `running`, or `None` if both are empty. A
    /// prefill step when something can be admitted, else a decode (verify) step over all
    /// running requests.
    fn schedule(&mut self) -> Result<Option<StepPlan>> {
        if self.cfg.chunked_prefill {
            return self.schedule_chunked();
        }
        let admitted = self.admit(Instant::now(), None)?;
        if admitted > 0 {
            let start = self.running.len() - admitted;
            return self
                .build_plan(StepKind::Prefill, start, admitted)
                .map(Some);
        }
        if self.running.is_empty() {
            return self.nothing_runnable();
        }
        let lookahead = self.lookahead();
        self.grow_running(lookahead, self.running.len())?;
        let kind = if lookahead > 0 {
            StepKind::Verify
        } else {
            StepKind::Decode
        };
        self.build_plan(kind, 0, self.running.len()).map(Some)
    }

    /// With nothing running: None when nothing waits either, else the internal error of a
    /// waiting request that does not fit an empty cache (admission refuses such requests).
    fn nothing_runnable(&self) -> Result<Option<StepPlan>> {
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
    /// frees: `next_plan_ahead` schedules only when running[0] fits beside them.
    fn grow_running(&mut self, lookahead: usize, rows: usize) -> Result<()> {
        let mut i = 0;
        while i < rows.min(self.running.len()) {
            let need = self.bm.blocks_to_grow(
                &self.running[i].block_table,
                self.running[i].len() + lookahead,
            );
            while need > self.bm.num_free_blocks() && self.running.len() > i + 1 {
                let victim = self.running.pop().expect("len > i + 1");
                self.preempt(victim)?;
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
                self.preempt(victim)?;
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
    fn preempt(&mut self, mut seq: Sequence) -> Result<()> {
        seq.drop_placeholder(); // its re-prefill samples that token again
        self.bm.free(&mut seq.block_table)?;
        seq.registered = 0;
        seq.chunk_end = None;
        if let Some(slot) = seq.slot.take() {
            self.free_request_slots.push(Reverse(slot));
        }
        seq.num_computed = 0;
        seq.status = Status::Waiting;
        seq.preemptions += 1;
        self.stats.preemptions += 1;
        self.waiting.push_front(seq);
        Ok(())
    }

    /// Plan over `running[start..start + rows]`; marks the query tokens as computed (up to a
    /// row's `chunk_end`, if set). A verify row's query is its uncomputed token at position L-1
    /// followed by W placeholders (0) at L..L+W-1; the worker fills them with draft tokens and
    /// the commit decides how many became real.
    fn build_plan(&mut self, kind: StepKind, start: usize, rows: usize) -> Result<StepPlan> {
        let lookahead = if kind == StepKind::Verify {
            self.cfg.max_draft_tokens
        } else {
            0
        };
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
            push_plan_row(&mut p, r, seq, end, lookahead, &self.bm, self.cfg.seed);
            push_end_ids(&mut p, seq, &self.criteria.eos);
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
                self.stats.prefill_tokens += (end - seq.num_computed) as u64;
            }
            // The worker writes K/V for every query token during this step (for a verify row,
            // `commit` settles how many of them hold accepted tokens).
            seq.num_computed = end;
            seq.prefill_pending &= end < seq.len();
            if kind != StepKind::Verify {
                register_computed(&mut self.bm, seq)?;
            }
        }
        if kind == StepKind::Verify {
            self.push_forced(&mut p, start, plan_rows.len());
        } else {
            let samples: Vec<bool> = plan_rows.iter().map(|r| r.samples).collect();
            self.push_masks(&mut p, start, &samples);
        }
        p.mask_words = self.grammars.as_ref().map_or(0, |g| g.mask_words());
        self.pending.push_back(PendingPlan {
            kind,
            rows: plan_rows,
        });
        Ok(p)
    }

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
        self.end_session()?; // masked drafting's matchers back where the last commit left them
        let plan = self
            .pending
            .front()
            .ok_or_else(|| Error::internal("commit() without a plan from next_plan()"))?;
        let at = self.locate(plan);
        self.check_prompt_logprobs(plan, prompt_logprobs)?;
        let most_verify_tokens = self.cfg.max_draft_tokens as i32 + 1;
        check_commit(plan, most_verify_tokens, tokens, num_tokens, num_accepted)?;
        self.check_logprobs(&at, tokens.len(), logprobs)?;
        let plan = self.pending.pop_front().expect("checked above");
        self.free_drained()?; // rows of this plan that finished at the previous commit
        if let Some(pl) = prompt_logprobs {
            self.record_prompt_logprobs(&at, pl);
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

    /// Per row of `plan`, the index in `running` of its sequence, if it is still there (the
    /// same slot and run_id).
    fn locate(&self, plan: &PendingPlan) -> Vec<Option<usize>> {
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
            let seq = &mut self.running[i];
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
        let rows = at.iter().flatten().map(|&i| &self.running[i]);
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

    /// Appends one row's tokens to `running[i]` (up to its stop condition) and updates the
    /// token counters. After a verify step K/V is valid for the query's real token and the
    /// accepted drafts: every appended token but the last (the target's own, computed next
    /// step). Speculative counters count verify rounds only (a prefill yields one target token).
    fn commit_row(
        &mut self,
        kind: StepKind,
        i: usize,
        toks: &[i32],
        accepted: Option<i32>,
        logprobs: Option<(&StepLogprobs, usize)>,
        now: Instant,
    ) {
        let seq = &mut self.running[i];
        if seq.score_from.is_some() {
            // a scored part generates nothing: its prompt's logprobs are recorded
            seq.timing.first_token.get_or_insert(now);
            seq.finish(FinishReason::Stop, now);
            return;
        }
        seq.drop_placeholder(); // overlap: these are the tokens it stood for
        let appended = append_tokens(seq, toks, now, &self.tokenizer, &self.criteria);
        let k = seq.sampling.logprobs as usize;
        if let (Some((lp, offset)), true) = (logprobs, k > 0) {
            seq.logprobs
                .extend((offset..offset + appended).map(|j| lp.entry(j, k)));
        }
        if kind == StepKind::Verify {
            seq.num_computed = seq.len() - 1;
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

    /// Frees the blocks and slots of finished requests and sends their output rows to the
    /// writer; the others stay in `running`, in their order.
    fn retire_finished(&mut self) -> Result<()> {
        if !self.running.iter().any(Sequence::is_finished) {
            return Ok(());
        }
        let running = std::mem::take(&mut self.running);
        for mut seq in running {
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
            let row = match seq.score_from {
                Some(_) => self.scored_row(seq),
                None => Some(self.output_row(seq)),
            };
            if let Some(row) = row {
                self.writer.send(row)?;
            }
        }
        Ok(())
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

    /// Turns a finished sequence into its output row (and records its statistics). An error
    /// row has no text, no output tokens and no timings; a row's text is decoded by the
    /// writer thread (`OutputRow::text_ids`), unless a stop string cut it.
    fn output_row(&mut self, mut seq: Sequence) -> OutputRow {
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
            prompt_logprobs: (!error && self.cfg.prompt_logprobs > 0).then(|| {
                let ids = seq.prompt_ids.get(1..).unwrap_or_default();
                logprobs::entries(&self.tokenizer, ids, &seq.prompt_logprobs)
            }),
            output_token_ids: if self.cfg.include_token_ids && !error {
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

    /// Waits for the writer, checks that no KV block or slot leaked and returns the summary.
    /// Calling it before `next_plan` returned `None` flushes the rows finished so far and then
    /// reports the unfinished work as an error.
    pub fn finish(&mut self) -> Result<Summary> {
        if self.finished {
            return Err(Error::internal("finish() called twice"));
        }
        self.finished = true;
        let unfinished = self.running.len() + self.waiting.len();
        let input_left = !self.input_done;
        let complete = self.input_failed.is_none()
            && unfinished == 0
            && !input_left
            && self.pending.is_empty();
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
                self.running.len(),
                self.waiting.len(),
                if input_left {
                    "not fully read"
                } else {
                    "fully read"
                }
            )));
        }
        self.bm.check_no_leak()?;
        self.stats.evictions = self.bm.evictions;
        if self.free_request_slots.len() != self.cfg.max_batch_size {
            return Err(Error::internal(format!(
                "request slot leak: {} of {} free",
                self.free_request_slots.len(),
                self.cfg.max_batch_size
            )));
        }
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
}

impl Scheduler {
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
        self.pending.clear();
        self.waiting.clear();
        self.running.clear();
        self.writer.abort()
    }
}

/// Appends `toks` to a running sequence, stopping at the first stop condition (EOS, stop
/// string, max_new_tokens, max length); tokens after it are dropped. Returns how many tokens
/// were appended.
fn append_tokens(
    seq: &mut Sequence,
    toks: &[i32],
    now: Instant,
    tokenizer: &Tokenizer,
    c: &StopCriteria,
) -> usize {
    let mut appended = 0;
    for &t in toks {
        if seq.is_finished() {
            break;
        }
        let Ok(t) = u32::try_from(t) else {
            // the worker found no token the row's processed logits allow (`NO_TOKEN`)
            seq.error = Some(no_token(seq));
            seq.finish(FinishReason::Error, now);
            break;
        };
        seq.output_ids.push(t);
        appended += 1;
        seq.timing.first_token.get_or_insert(now);
        // vLLM: no stop condition but the length ones before min_new_tokens outputs
        let may_stop = seq.num_output() >= seq.sampling.min_new_tokens;
        if may_stop && c.ends(&seq.sampling, t) {
            // vLLM: the EOS token counts as an output token but is not part of the text.
            seq.stopped_on_eos = true;
            seq.stop_reason = (!c.is_eos(&seq.sampling, t)).then_some(StopReason::Token(t));
            seq.finish(FinishReason::Stop, now);
            break;
        }
        if seq.thinking {
            if c.reasoning.is_some_and(|(_, end)| t == end) {
                seq.thinking = false;
                seq.reasoning_end = Some(seq.num_output() - 1);
                if seq.matcher.as_ref().is_some_and(RowMatcher::only_ends) {
                    seq.finish(FinishReason::Stop, now); // the answer's format allows only ""
                    break;
                }
            }
        } else if advance_grammar(seq, t, now) {
            break;
        }
        if extend_text(seq, tokenizer, may_stop, now) {
            break;
        }
        if seq.num_output() >= seq.sampling.max_new_tokens || seq.len() >= c.max_len {
            seq.finish(FinishReason::Length, now);
            break;
        }
    }
    appended
}

/// Whether a prompt leaves reasoning open: its last end tag does not follow its last start tag
/// (vLLM's rule: the output reasons until the end tag unless the prompt closed it, as Qwen 3's
/// template does with thinking off).
pub(super) fn reasoning_open(prompt: &[u32], (start, end): (u32, u32)) -> bool {
    let last = |t: u32| prompt.iter().rposition(|&x| x == t);
    match (last(start), last(end)) {
        (_, None) => true,
        (Some(s), Some(e)) => s > e,
        (None, Some(_)) => false,
    }
}

/// Why a row got no token: its matcher failed, or its settings masked every logit.
fn no_token(seq: &Sequence) -> String {
    seq.matcher
        .as_ref()
        .and_then(RowMatcher::failure)
        .unwrap_or_else(|| {
            "no token could be generated: every token's logit was -inf after the row's \
             min_new_tokens, response_format, penalties and min_p"
                .to_string()
        })
}

/// A constrained row's matcher consumes its new token `t`; returns whether the row finished:
/// its grammar admits nothing more (`stop`), or it refused `t` (an error row: the worker
/// sampled outside the row's mask).
fn advance_grammar(seq: &mut Sequence, t: u32, now: Instant) -> bool {
    let Some(m) = seq.matcher.as_mut() else {
        return false;
    };
    if let Err(e) = m.consume(&[t]) {
        let outside = || format!("token {t} is outside the row's response_format: {e}");
        seq.error = Some(m.failure().unwrap_or_else(outside));
        seq.finish(FinishReason::Error, now);
        return true;
    }
    if m.is_stopped() {
        seq.finish(FinishReason::Stop, now);
        return true;
    }
    false
}

/// Appends the text of a stop-string row's newest token and finishes the row when a stop
/// string ends in it (`may_stop`) or the text cannot be decoded; returns whether it finished.
/// The text so far only matters to stop strings: without any, the row's text is its one
/// decode when it finishes (`output_row`), not a decode window per token.
fn extend_text(seq: &mut Sequence, tokenizer: &Tokenizer, may_stop: bool, now: Instant) -> bool {
    if seq.sampling.stop.is_empty() {
        return false;
    }
    let skip = seq.sampling.skip_special_tokens;
    let delta = match seq.detok.step(tokenizer, &seq.output_ids, skip) {
        Ok(delta) => delta,
        Err(e) => {
            seq.error = Some(e.to_string());
            seq.finish(FinishReason::Error, now);
            return true;
        }
    };
    if delta.is_empty() {
        return false;
    }
    let old_len = seq.output_text.len();
    seq.output_text.push_str(&delta);
    let (stop, longest) = (&seq.sampling.stop, seq.sampling.max_stop_len());
    let found = find_stop(&seq.output_text, old_len, stop, longest);
    let Some((pos, which)) = found.filter(|_| may_stop) else {
        return false;
    };
    let matched = seq.sampling.stop[which].clone();
    let keep = seq.sampling.include_stop_str_in_output;
    seq.output_text
        .truncate(if keep { pos + matched.len() } else { pos });
    seq.stop_reason = Some(StopReason::Text(matched));
    seq.stopped_on_string = true;
    seq.finish(FinishReason::Stop, now);
    true
}

/// Earliest occurrence of a stop string that ends in the text appended after `old_len`, and
/// that string's index in `stop` (at one position, the first such string in `stop`). Only the
/// tail that could contain such a match is searched, so the cost is O(new text).
fn find_stop(
    text: &str,
    old_len: usize,
    stop: &[String],
    max_stop_len: usize,
) -> Option<(usize, usize)> {
    if stop.is_empty() {
        return None;
    }
    let mut start = old_len.saturating_sub(max_stop_len.saturating_sub(1));
    while !text.is_char_boundary(start) {
        start -= 1;
    }
    let tail = &text[start..];
    stop.iter()
        .enumerate()
        .filter_map(|(i, s)| tail.find(s.as_str()).map(|p| (start + p, i)))
        .min_by_key(|&(p, _)| p)
}

mod admission;
mod chunked;
#[cfg(test)]
mod kept_tests;
mod overlap;
mod scoring;
mod structured;
pub use structured::DraftMasks;
#[cfg(test)]
mod overlap_tests;
#[cfg(test)]
mod prefix_cache_tests;
#[cfg(test)]
mod sampling_tests;
#[cfg(test)]
mod scoring_tests;
#[cfg(test)]
mod structured_tests;
#[cfg(test)]
mod tests;

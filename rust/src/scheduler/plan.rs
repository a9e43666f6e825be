//! A step's plan: `StepPlan`, the arrays handed to the worker, and its builders (a row's query
//! tokens, block table and sampling values); the plans handed out and not yet committed
//! (`PendingPlan`); the per-row seeds.

use crate::block_manager::BlockManager;
use crate::error::{Error, Result};
use crate::sequence::Sequence;

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
    /// Structured output (run/structured.rs): per row, its mask's index in
    /// `token_masks` (-1: none; prefill and decode rows that sample only), and the masks,
    /// `[M, mask_words]` u32 (bit t % 32 of word t / 32: token t allowed).
    pub mask_rows: Vec<i32>,
    pub token_masks: Vec<u32>,
    pub mask_words: usize,
    /// Verify plans: each constrained row's forced tokens (at most W), row i's
    /// `forced_ids[cu_forced[i]..cu_forced[i + 1]]`.
    pub forced_ids: Vec<i64>,
    pub cu_forced: Vec<i32>,
    /// Hybrid models (state_checkpoints.rs): per row, where its recurrent state comes from
    /// before the query: STATE_CONTINUE (its slot holds the state after the tokens before the
    /// query), STATE_ZERO (the query starts at position 0) or a checkpoint to copy in first.
    pub state_from: Vec<i32>,
    /// Hybrid models: `[S, 3]` (row, query offset j, checkpoint c), flat: after the step,
    /// checkpoint c holds the row's state after its query token j. Restores come first.
    pub state_saves: Vec<i32>,
    pub max_seqlen_q: usize,
    pub max_seqlen_k: usize,
}

/// `StepPlan::state_from`: the row's slot holds its state already.
pub const STATE_CONTINUE: i32 = -1;
/// `StepPlan::state_from`: the row starts from a zero state (its query starts at position 0).
pub const STATE_ZERO: i32 = -2;

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
    pub(crate) fn empty(kind: StepKind, b: usize, t: usize, width: usize) -> Self {
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
            state_from: Vec::with_capacity(b),
            state_saves: Vec::new(),
            max_seqlen_q: 0,
            max_seqlen_k: 0,
        }
    }
}

/// Per request slot, the row of `plan` holding it (-1: none); empty without a plan.
pub(crate) fn pending_rows_by_slot(plan: Option<&PendingPlan>, max_batch_size: usize) -> Vec<i32> {
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
pub(crate) fn check_plan_row(kind: StepKind, seq: &Sequence) -> Result<()> {
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
pub(crate) fn push_plan_row(
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
    p.state_from.push(match seq.state_restore {
        _ if seq.num_computed == 0 => STATE_ZERO,
        Some(c) => c as i32,
        None => STATE_CONTINUE,
    });
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
pub(crate) fn push_end_ids(p: &mut StepPlan, seq: &Sequence, eos: &[u32]) {
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
pub fn check_commit(
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

/// A plan handed out and not yet committed: its kind and its rows, in plan order.
#[derive(Debug, Clone)]
pub struct PendingPlan {
    pub kind: StepKind,
    pub rows: Vec<PlanRow>,
}

impl PendingPlan {
    pub fn holds(&self, run_id: u64) -> bool {
        self.rows.iter().any(|r| r.run_id == run_id)
    }
}

/// A plan row: whose (`run_id`, `slot`) and whether the step samples the row's next token
/// (its query reaches its last known token; not a chunk short of the prompt's end).
#[derive(Debug, Clone, Copy)]
pub struct PlanRow {
    pub run_id: u64,
    pub slot: u32,
    pub samples: bool,
}

/// A token count as an output column value (int32).
pub fn token_count(n: usize) -> i32 {
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

/// Per-request sampling seed: the job seed mixed with the row index (SplitMix64 finalizer),
/// kept non-negative so it fits any int64 seed API.
pub fn request_seed(seed: i64, row_index: i64) -> i64 {
    let mut z = (seed as u64) ^ (row_index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z & (i64::MAX as u64)) as i64
}

/// Hybrid models: appends to `p.state_saves` row `r`'s checkpoints, the ends of the blocks
/// at checkpoint positions whose last token its query (from token `from` up to
/// `seq.num_computed`) computes, where no checkpoint holds that prefix yet. The blocks' hashes
/// must be known (`register_computed` ran).
pub(crate) fn push_state_saves(
    p: &mut StepPlan,
    r: usize,
    seq: &Sequence,
    from: usize,
    bm: &mut BlockManager,
) {
    if !bm.caching() || !bm.states.recurrent() {
        return;
    }
    let bs = bm.block_size();
    let full = seq.num_computed.min(seq.known_len()) / bs;
    for j in from / bs..full.min(seq.block_hashes.len()) {
        let end = (j + 1) * bs;
        if end <= from || !bm.states.at_boundary(end) {
            continue;
        }
        if let Some(c) = bm.states.assign(seq.block_hashes[j]) {
            p.state_saves
                .extend([r as i32, (end - 1 - from) as i32, c as i32]);
        }
    }
}

//! Per-request state: what the reader produced (`Request`) and what the scheduler tracks while
//! the request waits, runs and finishes (`Sequence`).
//!
//! Invariants:
//! - `tokens()` = prompt ids followed by output ids; `num_computed` of them have K/V in the
//!   cache (0 while waiting, including after a preemption);
//! - `slot` is `Some` and `block_table` holds `ceil(num_computed / block_size)` or more blocks
//!   exactly while `status == Running`;
//! - `output_text` only grows until the request finishes (then it is final);
//! - `block_hashes[j]` is the chain hash of full block j of `tokens()` (tokens never change
//!   once appended, so the hashes stay valid across preemptions).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use arrow_array::ArrayRef;

use crate::block_manager::{chain_hash, ROOT_HASH};
use crate::detokenizer::IncrementalDetokenizer;
use crate::logprobs::TokenLogprob;
use crate::openai_keys::Endpoint;
use crate::sampling_params::SamplingParams;
use crate::score::ScorePart;
use crate::structured::RowMatcher;

/// One input row after reading, templating and tokenization.
#[derive(Debug, Clone)]
pub struct Request {
    /// Global row number over all input files, in order (0-based).
    pub row_index: i64,
    /// The row's id as a length-1 Arrow array of the input id column's type (or the row index
    /// as int64 when there is no id column); concatenated by the writer.
    pub id: ArrayRef,
    pub prompt_ids: Vec<u32>,
    /// The job's sampling parameters, or the row's own (sampling columns).
    pub sampling: Arc<SamplingParams>,
    /// When the reader produced the request (start of `queue_s`).
    pub read_at: Instant,
    /// Set when the row cannot be generated (null prompt, template/tokenizer failure, ...):
    /// it is written as an error row and never scheduled.
    pub error: Option<String>,
    /// OpenAI Batch input: the endpoint the row's line asks (None: Parquet input, or a line
    /// without a url eaglebatch serves).
    pub endpoint: Option<Endpoint>,
    /// The kept input columns' values (`OutputConfig::keep_columns`), each a length-1
    /// array of the column's output type, copied out of the read batch.
    pub kept: Vec<ArrayRef>,
    /// A scoring task's parts (score.rs), each scored as its own sequence; empty when the row
    /// generates (then `prompt_ids` is its prompt).
    pub score_parts: Vec<ScorePart>,
    /// An OpenAI Batch `/v1/embeddings` line's options (its inputs are `score_parts`).
    pub embed_line: Option<crate::pooled::EmbedLine>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Waiting,
    Running,
    Finished,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS token or stop string.
    Stop,
    /// max_new_tokens or max_model_len reached (never the KV capacity: a request that could
    /// outgrow the cache is refused at admission).
    Length,
    Error,
}

/// What ended a row that stopped other than at an EOS id (vLLM's `stop_reason`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// The stop string found in the text.
    Text(String),
    /// One of the row's `stop_token_ids` (not an EOS id it stops at).
    Token(u32),
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Error => "error",
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Timing {
    pub read_at: Option<Instant>,
    pub first_scheduled: Option<Instant>,
    pub first_token: Option<Instant>,
    pub finished: Option<Instant>,
}

#[derive(Debug)]
pub struct Sequence {
    pub row_index: i64,
    /// Which of the row's n samples this is (0..n-1).
    pub sample_index: u32,
    pub id: ArrayRef,
    pub prompt_ids: Vec<u32>,
    pub sampling: Arc<SamplingParams>,
    /// The request's endpoint (`Request::endpoint`).
    pub endpoint: Option<Endpoint>,
    /// `Request::kept`.
    pub kept: Vec<ArrayRef>,
    /// Set with `finish_reason` Stop when a stop string or stop token id (not EOS) ended it.
    pub stop_reason: Option<StopReason>,
    /// Generated ids, including a final EOS token if generation stopped on one.
    pub output_ids: Vec<u32>,
    /// Number of tokens (prompt + output) whose K/V is in the cache.
    pub num_computed: usize,
    pub status: Status,
    /// Request slot in `[0, max_batch_size)` while running.
    pub slot: Option<u32>,
    pub block_table: Vec<u32>,
    pub timing: Timing,
    pub detok: IncrementalDetokenizer,
    /// Text of the output so far (final once finished).
    pub output_text: String,
    pub finish_reason: Option<FinishReason>,
    pub error: Option<String>,
    /// True once generation stopped on an EOS token (which stays in `output_ids`).
    pub stopped_on_eos: bool,
    /// True once a stop string truncated `output_text`.
    pub stopped_on_string: bool,
    /// Speculative-decoding counters: `Some` once a commit carried `num_accepted` for us.
    pub spec_steps: Option<i32>,
    pub accepted_tokens: Option<i32>,
    /// Tokens appended by verify rounds.
    pub spec_tokens: Option<i32>,
    /// Times this request was preempted (its K/V dropped and recomputed later).
    pub preemptions: u32,
    /// Per output token (aligned with `output_ids`) when the request asks for logprobs.
    pub logprobs: Vec<TokenLogprob>,
    /// Per prompt token after the first (entry i: prompt token i + 1), as far as computed,
    /// when the job asks for prompt logprobs.
    pub prompt_logprobs: Vec<TokenLogprob>,
    /// Prefix caching: chain hashes of the first full blocks, as far as computed.
    pub block_hashes: Vec<u64>,
    /// Blocks at the start of `block_table` already offered to the cache (found or registered).
    pub registered: usize,
    /// Prompt tokens whose K/V came from the prefix cache when the request was first admitted.
    pub cached_tokens: usize,
    /// Chunked prefill: where this step's query stops when it stops before `len()` (set by the
    /// scheduler for the next plan, taken by it).
    pub chunk_end: Option<usize>,
    /// Admitted and not yet planned up to its last known token (see `prefilling`).
    pub prefill_pending: bool,
    /// Hybrid models: the state checkpoint its first query starts from (a prefix-cache hit),
    /// set at admission, taken by the next plan (`StepPlan::state_from`).
    pub state_restore: Option<u32>,
    /// Prompt logprob alternatives the job asks for (`OutputConfig::prompt_logprobs`; 0 =
    /// none).
    pub prompt_logprobs_k: u32,
    /// Set at each admission, increasing: tells a plan's row from a later admission of the same
    /// request (after a preemption) or another request in its slot.
    pub run_id: u64,
    /// Overlap: the last output id stands for the token the oldest pending plan samples for
    /// this row (`PLACEHOLDER`), set by its commit (scheduler/overlap.rs).
    pub placeholder: bool,
    /// Structured output: where the row's output stands in its grammar (a response_format
    /// row), having consumed exactly its committed output tokens.
    pub matcher: Option<RowMatcher>,
    /// Reasoning (`output.reasoning`): the row is still reasoning (its end tag not yet in the
    /// prompt's last turn or the output): no response_format applies yet.
    pub thinking: bool,
    /// Where the output's end tag is (an index into `output_ids`), once generated.
    pub reasoning_end: Option<usize>,
    /// A scored part (score.rs): the index of its first scored prompt token (>= 1), and how
    /// many parts its row has (`sample_index` is the part's index). It generates nothing.
    pub score_from: Option<usize>,
    pub num_parts: usize,
    /// A pooled task's row (pooled.rs): the sum of the worker's contributions of the chunks
    /// computed since it last started (None: not a pooled row).
    pub pooled: Option<Vec<f32>>,
    /// `Request::embed_line`.
    pub embed_line: Option<crate::pooled::EmbedLine>,
}

/// The id of a placeholder output token (never a vocabulary id).
pub const PLACEHOLDER: u32 = u32::MAX;

impl Sequence {
    pub fn new(req: Request, sample_index: u32) -> Self {
        Sequence {
            row_index: req.row_index,
            sample_index,
            id: req.id,
            prompt_ids: req.prompt_ids,
            sampling: req.sampling,
            endpoint: req.endpoint,
            kept: req.kept,
            stop_reason: None,
            output_ids: Vec::new(),
            num_computed: 0,
            status: Status::Waiting,
            slot: None,
            block_table: Vec::new(),
            timing: Timing {
                read_at: Some(req.read_at),
                ..Timing::default()
            },
            detok: IncrementalDetokenizer::new(),
            output_text: String::new(),
            finish_reason: None,
            error: req.error,
            stopped_on_eos: false,
            stopped_on_string: false,
            spec_steps: None,
            accepted_tokens: None,
            spec_tokens: None,
            preemptions: 0,
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            block_hashes: Vec::new(),
            registered: 0,
            cached_tokens: 0,
            chunk_end: None,
            prefill_pending: false,
            state_restore: None,
            prompt_logprobs_k: 0,
            run_id: 0,
            placeholder: false,
            matcher: None,
            thinking: false,
            reasoning_end: None,
            score_from: None,
            num_parts: 1,
            pooled: None,
            embed_line: req.embed_line,
        }
    }

    /// The first prompt position whose logits' prompt logprob is recorded: entry t of
    /// `prompt_logprobs` is position `prompt_logprobs_from() + t` (it predicts the token after).
    pub fn prompt_logprobs_from(&self) -> usize {
        self.score_from.map_or(0, |f| f - 1)
    }

    /// Whether prompt logprobs are still to be computed for some position.
    pub fn prompt_logprobs_missing(&self) -> bool {
        self.prompt_logprobs_k > 0
            && self.prompt_logprobs_from() + self.prompt_logprobs.len() + 1 < self.prompt_len()
    }

    /// Mean tokens per verify round (accepted drafts + the target's token, after truncation).
    pub fn accept_length(&self) -> Option<f64> {
        match (self.spec_steps, self.spec_tokens) {
            (Some(steps), Some(toks)) if steps > 0 => Some(toks as f64 / steps as f64),
            _ => None,
        }
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt_ids.len()
    }

    pub fn num_output(&self) -> usize {
        self.output_ids.len()
    }

    /// Prompt + output length.
    pub fn len(&self) -> usize {
        self.prompt_ids.len() + self.output_ids.len()
    }

    /// Tokens whose ids are known: `len()` less a placeholder.
    pub fn known_len(&self) -> usize {
        self.len() - self.placeholder as usize
    }

    /// Removes the placeholder output token, if any.
    pub fn drop_placeholder(&mut self) {
        if self.placeholder {
            self.output_ids.pop();
            self.placeholder = false;
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Token at absolute position `pos` (prompt first, then output).
    pub fn token(&self, pos: usize) -> u32 {
        let p = self.prompt_ids.len();
        if pos < p {
            self.prompt_ids[pos]
        } else {
            self.output_ids[pos - p]
        }
    }

    /// The token ids of block j (positions j * bs .. (j + 1) * bs, all present).
    pub fn block_tokens(&self, j: usize, bs: usize) -> Cow<'_, [u32]> {
        let (start, end) = (j * bs, (j + 1) * bs);
        if end <= self.prompt_ids.len() {
            Cow::Borrowed(&self.prompt_ids[start..end])
        } else {
            Cow::Owned((start..end).map(|p| self.token(p)).collect())
        }
    }

    /// The chain hash of the block before block j.
    pub fn parent_hash(&self, j: usize) -> u64 {
        if j == 0 {
            ROOT_HASH
        } else {
            self.block_hashes[j - 1]
        }
    }

    /// Computes `block_hashes` up to the first `full_blocks` blocks.
    pub fn extend_block_hashes(&mut self, full_blocks: usize, bs: usize) {
        for j in self.block_hashes.len()..full_blocks {
            let h = chain_hash(self.parent_hash(j), &self.block_tokens(j, bs));
            self.block_hashes.push(h);
        }
    }

    /// Whether a running sequence is still computing its known tokens (its prompt, or prompt
    /// and outputs after a preemption, less what the cache held) rather than decoding: from
    /// its admission until a plan's query reaches its last known token.
    pub fn prefilling(&self) -> bool {
        self.prefill_pending
    }

    /// Output ids that make up the text (the trailing EOS, if any, excluded).
    pub fn text_ids(&self) -> &[u32] {
        if self.stopped_on_eos {
            &self.output_ids[..self.output_ids.len() - 1]
        } else {
            &self.output_ids
        }
    }

    /// Reasoning (`output.reasoning`, tags (start, end)): the text ids of the reasoning (a
    /// leading start tag dropped) and of the answer. A row that never closed its reasoning is
    /// all reasoning; one whose prompt closed it, all answer.
    pub fn reasoning_split(&self, (start, _): (u32, u32)) -> (&[u32], &[u32]) {
        let ids = self.text_ids();
        let (reasoning, answer) = match self.reasoning_end {
            Some(e) => (
                &ids[..e.min(ids.len())],
                ids.get(e + 1..).unwrap_or_default(),
            ),
            None if self.thinking => (ids, &ids[ids.len()..]),
            None => (&ids[..0], ids),
        };
        (
            reasoning.strip_prefix(&[start]).unwrap_or(reasoning),
            answer,
        )
    }

    pub fn is_finished(&self) -> bool {
        self.status == Status::Finished
    }

    /// Marks the sequence finished now (timing, status, reason).
    pub fn finish(&mut self, reason: FinishReason, now: Instant) {
        self.status = Status::Finished;
        self.finish_reason = Some(reason);
        self.timing.finished = Some(now);
    }
}

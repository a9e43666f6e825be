//! Admission: which waiting requests join the running batch, and what of their tokens is
//! already in the cache (prefix caching, block_manager.rs; forked samples; the scheduler's
//! module doc states the rules).

use std::cmp::Reverse;
use std::collections::HashSet;
use std::time::Instant;

use super::Scheduler;
use crate::block_manager::BlockManager;
use crate::error::Result;
use crate::score::ScorePart;
use crate::sequence::{Request, Sequence, Status};
use crate::stats::Stats;

impl Scheduler {
    /// PREFILL admission: moves waiting requests FIFO to the end of `running` while a slot,
    /// the token budget and the KV blocks allow; next to running requests `watermark` blocks
    /// stay free. The budget: `chunk_budget` None = `max_num_batched_tokens` of uncached
    /// tokens, always exceeded by the first request if need be; Some(b) = chunked prefill, b
    /// tokens in all, a request's first chunk cut to what is left (`chunk_end`). Each admitted
    /// request gets its cached prefix (module doc), blocks for all its tokens and the smallest
    /// free slot. Returns how many were admitted (they are `running[len - admitted..]`).
    /// A scored part that waits for a sibling's blocks (`entry`) lets the requests behind it
    /// by, and keeps its place at the front.
    pub(super) fn admit(
        &mut self,
        now: Instant,
        chunk_budget: Option<usize>,
        st: &mut Stats,
    ) -> Result<usize> {
        let mut held = Vec::new();
        let admitted = self.admit_fifo(now, chunk_budget, &mut held, st);
        for seq in held.into_iter().rev() {
            self.waiting.push_front(seq);
        }
        admitted
    }

    fn admit_fifo(
        &mut self,
        now: Instant,
        chunk_budget: Option<usize>,
        held: &mut Vec<Sequence>,
        st: &mut Stats,
    ) -> Result<usize> {
        let mut admitted = 0usize;
        let mut budget_used = 0usize;
        let speculative = self.cfg.max_draft_tokens > 0;
        let mut computing = self.blocks_being_computed(); // chain hashes of full blocks
        let mut rows_now = HashSet::new(); // rows whose prompt a sample admitted now computes
        while let Some(seq) = self.waiting.front_mut() {
            if self.running.len() >= self.cfg.max_batch_size || self.free_request_slots.is_empty() {
                break;
            }
            let Some(start) = entry(
                &self.bm,
                &self.running,
                seq,
                &rows_now,
                &computing,
                speculative,
            ) else {
                if seq.score_from.is_none() {
                    break; // admitted next step (see `entry`)
                }
                held.push(self.waiting.pop_front().expect("front exists"));
                continue;
            };
            let (n, cached) = (seq.len(), start.cached);
            let chunk = match chunk_budget {
                Some(b) if budget_used >= b => break,
                Some(b) => (n - cached).min(b - budget_used),
                None if admitted > 0
                    && budget_used + n - cached > self.cfg.max_num_batched_tokens =>
                {
                    break
                }
                None => n - cached,
            };
            let reserve = self.watermark * usize::from(!self.running.is_empty()); // none when alone
            if !self.bm.can_allocate(n, &start.prefix, reserve) {
                break;
            }
            let seq = self.waiting.pop_front().expect("front exists");
            let fresh = start.fresh;
            let seq = self.start_running(seq, start, cached + chunk, now, st)?;
            computing.extend(seq.block_hashes.iter().skip(seq.registered).copied());
            if fresh {
                rows_now.insert(seq.row_index); // its siblings fork from it next step
            }
            budget_used += chunk;
            admitted += 1;
        }
        Ok(admitted)
    }

    /// Moves an admitted sequence to the end of `running`: the blocks `start.prefix` (its
    /// first `start.cached` tokens), a copy of block `start.copy` into its next block (a forked
    /// sample), fresh blocks for the rest, the smallest free slot, and a first query up to
    /// `end` (from `start.restore`'s state checkpoint where it has one).
    fn start_running(
        &mut self,
        mut seq: Sequence,
        start: Entry,
        end: usize,
        now: Instant,
        st: &mut Stats,
    ) -> Result<&Sequence> {
        let (n, prefix, cached) = (seq.len(), &start.prefix, start.cached);
        self.bm.allocate(&mut seq.block_table, prefix, n)?;
        if let Some(src) = start.copy {
            let dst = seq.block_table[prefix.len()];
            self.block_copies.extend([src as i32, dst as i32]);
        }
        seq.state_restore = start.restore;
        if start.restore.is_some() {
            self.bm.states.touch(seq.block_hashes[prefix.len() - 1]);
        }
        let Reverse(slot) = self.free_request_slots.pop().expect("checked non-empty");
        seq.slot = Some(slot);
        self.last_run_id += 1;
        seq.run_id = self.last_run_id;
        seq.status = Status::Running;
        seq.num_computed = cached;
        seq.registered = prefix.len();
        seq.chunk_end = (end < n).then_some(end);
        seq.prefill_pending = true;
        if seq.timing.first_scheduled.is_none() {
            seq.timing.first_scheduled = Some(now);
            seq.cached_tokens = cached.min(seq.prompt_len());
            st.prompt_tokens += seq.prompt_len() as u64;
            st.cached_tokens += seq.cached_tokens as u64;
        }
        self.running.push(seq);
        Ok(self.running.last().expect("just pushed"))
    }

    /// Why a request can never run, if it cannot. Invariant of every admitted request: its
    /// worst case, min(prompt + max_new_tokens, max_model_len) tokens plus the W lookahead
    /// slots of a verify step, fits the whole cache, so alone it can always run to the end.
    pub fn admission_error(&self, req: &Request) -> Option<String> {
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

    /// Why a row's parts can never run: one needs more KV blocks than the cache has.
    pub fn score_error(&self, parts: &[ScorePart]) -> Option<String> {
        let cfg = &self.cfg;
        let p = parts.iter().map(|p| p.prompt_ids.len()).max()?;
        if self.bm.blocks_needed(p) <= cfg.num_blocks && p <= cfg.max_model_len {
            return None;
        }
        Some(format!(
            "a scored sequence of {p} tokens needs {} KV blocks of {} tokens, but the cache \
             has only num_blocks = {}; raise engine.kv_cache_tokens or \
             engine.kv_cache_memory_fraction",
            self.bm.blocks_needed(p),
            cfg.block_size,
            cfg.num_blocks
        ))
    }

    /// Chain hashes of the full blocks that running rows still computing their tokens (chunked
    /// prefill) have yet to compute: a request that would compute them too waits (`admit`).
    fn blocks_being_computed(&mut self) -> HashSet<u64> {
        let mut hashes = HashSet::new();
        if !self.bm.caching() {
            return hashes;
        }
        let bs = self.bm.block_size();
        for seq in self.running.iter_mut().filter(|s| s.prefilling()) {
            let full = seq.len() / bs;
            seq.extend_block_hashes(full, bs);
            hashes.extend(
                seq.block_hashes[seq.num_computed / bs..full]
                    .iter()
                    .copied(),
            );
        }
        hashes
    }
}

/// A request waits a step for blocks another request computes in this one only when that
/// saves at least this many tokens: a step's wait is not worth a block or two (a chat
/// template's system prompt) but is for a shared preamble or a duplicate prompt. A scored
/// part (score.rs), whose latency matters to nobody, waits for a single block.
const WAIT_FOR_TOKENS: usize = 64;

/// How an admitted sequence starts (`entry`).
struct Entry {
    /// The cached blocks it takes.
    prefix: Vec<u32>,
    /// A block to copy into its next one (a forked sample).
    copy: Option<u32>,
    /// Tokens computed already.
    cached: usize,
    /// Whether it computes its prompt itself (not forked from a sibling).
    fresh: bool,
    /// Hybrid models: the state checkpoint after `prefix` (state_checkpoints.rs).
    restore: Option<u32>,
}

/// How the front waiting sequence starts, or None when it waits a step: a sibling admitted
/// now computes their prompt, or requests admitted now compute its next `WAIT_FOR_TOKENS` or
/// more uncached tokens.
fn entry(
    bm: &BlockManager,
    running: &[Sequence],
    seq: &mut Sequence,
    rows_now: &HashSet<i64>,
    computing: &HashSet<u64>,
    speculative: bool,
) -> Option<Entry> {
    match sibling_start(running, seq, rows_now, bm.block_size()) {
        Start::Wait => None,
        // hybrid models: the sibling's recurrent state after its prompt has moved on since;
        // the sample finds the prompt in the prefix cache instead (checkpointed states)
        Start::Fork { .. } if bm.states.recurrent() => {
            fresh_entry(bm, seq, &HashSet::new(), 0, speculative)
        }
        Start::Fork { shared, partial } => Some(Entry {
            prefix: shared,
            copy: partial,
            cached: seq.len() - 1,
            fresh: false,
            restore: None,
        }),
        Start::Fresh => {
            // a scored part waits for any block: nobody waits on its first token
            let enough = match seq.score_from {
                Some(_) => 1,
                None => WAIT_FOR_TOKENS,
            };
            fresh_entry(bm, seq, computing, enough, speculative)
        }
    }
}

/// A sequence starting on its own from what the prefix cache holds, or None when requests
/// admitted now compute `enough` or more of its next uncached tokens (`entry`).
fn fresh_entry(
    bm: &BlockManager,
    seq: &mut Sequence,
    computing: &HashSet<u64>,
    enough: usize,
    speculative: bool,
) -> Option<Entry> {
    let (prefix, found) = cached_prefix(bm, seq, speculative);
    let bs = bm.block_size();
    let after = seq.block_hashes.get(found..).unwrap_or_default();
    let computed_now = after.iter().take_while(|h| computing.contains(h)).count();
    if enough > 0 && computed_now * bs >= enough {
        return None;
    }
    let (prefix, restore) = checkpointed(bm, seq, prefix);
    let cached = prefix.len() * bs;
    Some(Entry {
        prefix,
        copy: None,
        cached,
        fresh: true,
        restore,
    })
}

/// Hybrid models: `prefix` cut back to its deepest block whose end has a state checkpoint,
/// and that checkpoint (a cache hit needs the recurrent state after the cached tokens);
/// other models: `prefix` as it is.
fn checkpointed(
    bm: &BlockManager,
    seq: &Sequence,
    mut prefix: Vec<u32>,
) -> (Vec<u32>, Option<u32>) {
    if !bm.states.recurrent() {
        return (prefix, None);
    }
    let found = (1..=prefix.len())
        .rev()
        .find_map(|n| bm.states.get(seq.block_hashes[n - 1]).map(|c| (n, c)));
    let (keep, restore) = found.map_or((0, None), |(n, c)| (n, Some(c)));
    prefix.truncate(keep);
    (prefix, restore)
}

/// How a waiting sample of a row with n > 1 samples starts (`sibling_start`).
enum Start {
    /// On its own (prefix cache, or from scratch).
    Fresh,
    /// Next step: a sibling admitted in this one computes their prompt.
    Wait,
    /// From a running sibling that computed their prompt: its full blocks before the last
    /// token shared, a copy of the block holding the positions after them (`partial`, if any).
    /// Only the last prompt token is computed: its logits sample this sample's first token.
    Fork {
        shared: Vec<u32>,
        partial: Option<u32>,
    },
}

/// See `Start`. A sibling's prompt positions never change once computed, and its draft K/V
/// before the last prompt position depends on prompt tokens only, so both caches are exact.
fn sibling_start(
    running: &[Sequence],
    seq: &Sequence,
    rows_now: &HashSet<i64>,
    bs: usize,
) -> Start {
    if seq.num_output() > 0 || seq.score_from.is_some() {
        // resumed after a preemption: its own tokens; a scored part: its own prompt (parts
        // of a row share their context through the prefix cache)
        return Start::Fresh;
    }
    if rows_now.contains(&seq.row_index) {
        return Start::Wait;
    }
    let len = seq.len();
    let mut siblings = running.iter().filter(|o| o.row_index == seq.row_index);
    let Some(sibling) = siblings.clone().find(|o| o.num_computed >= len) else {
        return match siblings.next() {
            Some(_) => Start::Wait, // a sibling computes the prompt in chunks: fork after
            None => Start::Fresh,
        };
    };
    let full = (len - 1) / bs;
    Start::Fork {
        shared: sibling.block_table[..full].to_vec(),
        partial: (!(len - 1).is_multiple_of(bs)).then(|| sibling.block_table[full]),
    }
}

/// The cached blocks a waiting sequence starts from (the scheduler's module doc says which),
/// and how many of its full blocks were found in the cache.
fn cached_prefix(bm: &BlockManager, seq: &mut Sequence, speculative: bool) -> (Vec<u32>, usize) {
    // a prompt's logprobs need the logits at every position from the first one not yet
    // recorded: only the blocks before it may come from the cache
    // a pooled row (pooled.rs) needs the hidden states from its `score_from - 1` on
    let logits_from = match (seq.prompt_logprobs_k, &seq.pooled) {
        (0, None) => usize::MAX,
        _ => seq.prompt_logprobs_from() + seq.prompt_logprobs.len(),
    };
    if !bm.caching() || logits_from == 0 {
        return (Vec::new(), 0);
    }
    let bs = bm.block_size();
    let full = seq.len() / bs;
    seq.extend_block_hashes(full, bs);
    let mut prefix = Vec::new();
    for j in 0..full {
        let (parent, hash) = (seq.parent_hash(j), seq.block_hashes[j]);
        match bm.lookup(parent, hash, &seq.block_tokens(j, bs)) {
            Some(b) => prefix.push(b),
            None => break,
        }
    }
    let found = prefix.len();
    prefix.truncate(((seq.len() - 1) / bs).min(logits_from / bs));
    if speculative && prefix.len() == found && found > 0 {
        // the next block was not found: the draft's entry at this block's last position holds
        // for us only if the token after the block is the one it was computed from
        let next = seq.token(found * bs); // exists: found * bs <= len - 1
        if bm.next_token(prefix[found - 1]) != Some(next) {
            prefix.pop();
        }
    }
    (prefix, found)
}

/// Offers a running sequence's full blocks of computed positions to the prefix cache.
pub(super) fn register_computed(bm: &mut BlockManager, seq: &mut Sequence) -> Result<()> {
    if !bm.caching() {
        return Ok(());
    }
    let bs = bm.block_size();
    let known = seq.known_len(); // a placeholder's block waits for its token (overlap)
    let full = seq.num_computed.min(known) / bs;
    seq.extend_block_hashes(full, bs);
    for j in seq.registered..full {
        let (parent, hash) = (seq.parent_hash(j), seq.block_hashes[j]);
        let next = ((j + 1) * bs < known).then(|| seq.token((j + 1) * bs));
        bm.register(
            seq.block_table[j],
            parent,
            hash,
            &seq.block_tokens(j, bs),
            next,
        )?;
    }
    seq.registered = seq.registered.max(full);
    Ok(())
}

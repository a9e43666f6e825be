//! Stop criteria as functions of a sequence: a committed token ends a row at an EOS or stop
//! token id, a stop string, the end of its grammar, or a length limit; reasoning ends at its end
//! tag. `append_tokens` applies them to each row's new tokens at a commit.

use std::time::Instant;

use tokenizers::Tokenizer;

use crate::config::RunConfig;
use crate::sampling_params::SamplingParams;
use crate::sequence::{FinishReason, Sequence, StopReason};
use crate::structured::RowMatcher;

/// Stop conditions shared by all requests (stop strings and token ids, ignore_eos,
/// max_new_tokens and min_new_tokens are each request's own: `Sequence::sampling`).
pub struct StopCriteria {
    /// The model's EOS ids, sorted and distinct.
    pub eos: Vec<u32>,
    /// max_model_len: never the KV capacity, so an output does not depend on the budget.
    pub max_len: usize,
    /// Reasoning: the ids of the (start, end) tags.
    pub reasoning: Option<(u32, u32)>,
}

impl StopCriteria {
    pub fn new(cfg: &RunConfig) -> Self {
        let mut eos = cfg.sampling.eos_token_ids.clone();
        eos.sort_unstable();
        eos.dedup();
        let reasoning = match cfg.output.reasoning_ids[..] {
            [start, end] => Some((start, end)),
            _ => None,
        };
        StopCriteria {
            eos,
            max_len: cfg.policy.max_model_len,
            reasoning,
        }
    }

    /// Whether token `t` ends `sp`'s request: an EOS id (unless it ignores EOS) or one of its
    /// stop token ids.
    pub fn ends(&self, sp: &SamplingParams, t: u32) -> bool {
        self.is_eos(sp, t) || sp.stop_token_ids.contains(&t)
    }

    /// Whether `t` is an EOS id `sp`'s request stops at (vLLM: no `stop_reason` then).
    pub fn is_eos(&self, sp: &SamplingParams, t: u32) -> bool {
        !sp.ignore_eos && self.eos.binary_search(&t).is_ok()
    }
}

/// A plan row's tokens committed to its running sequence: the placeholder they stand for is
/// dropped (overlap), they are appended up to the first stop condition (`append_tokens`), and
/// after a verify step the K/V is valid for the query's real token and the accepted drafts:
/// every appended token but the last (the target's own, computed next step). Returns how many
/// tokens were appended.
pub fn commit_tokens(
    seq: &mut Sequence,
    toks: &[i32],
    verify: bool,
    now: Instant,
    tokenizer: &Tokenizer,
    c: &StopCriteria,
) -> usize {
    seq.drop_placeholder();
    let appended = append_tokens(seq, toks, now, tokenizer, c);
    if verify {
        seq.num_computed = seq.len() - 1;
    }
    appended
}

/// Appends `toks` to a running sequence, stopping at the first stop condition (EOS, stop
/// string, max_new_tokens, max length); tokens after it are dropped. Returns how many tokens
/// were appended.
pub fn append_tokens(
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
pub fn reasoning_open(prompt: &[u32], (start, end): (u32, u32)) -> bool {
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

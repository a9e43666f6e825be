//! Scoring tasks (`task: score`, `task: perplexity`): log-probabilities of given text instead
//! of generated text.
//!
//! A scored row becomes one or more *parts*, each a token sequence whose tokens from `from` on
//! are scored: the log-probability of each given the tokens before it, from the target's raw
//! logits (the prompt-logprob path of the worker, at positions `from - 1 ..`). A part generates
//! nothing: it finishes when its prompt is computed. Parts of one row share their context's
//! KV blocks through the prefix cache (positions before `from - 1` may come from it).
//!
//! - `score`, a continuation column: one part, lm-evaluation-harness's split (`pair`): trailing
//!   whitespace of the context moves to the continuation, the text is encoded whole and the
//!   continuation is what follows the context's own encoding; an empty context is the prefix
//!   token (BOS, else EOS). A part longer than `max_model_len` loses its first tokens (lm-eval
//!   keeps the last ones too).
//! - `score`, a choices column (`list<string>`): one such part per choice, one output row with
//!   list columns.
//! - `perplexity`: lm-eval's rolling windows (`rolling`, context length 1): disjoint windows of
//!   at most `max_model_len` tokens, each scoring the tokens the previous ones did not; the
//!   row's log-probability and token count are the sums over its windows.

use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::builder::{BooleanBuilder, Float64Builder, Int32Builder, ListBuilder};
use arrow_array::ArrayRef;
use arrow_schema::{DataType, Field};
use tokenizers::Tokenizer;

use crate::error::{Error, Result};

/// What a job computes per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    Generate,
    Score,
    Perplexity,
    /// Prefill-only rows with a head over their hidden states (pooled.rs).
    Embed,
    Classify,
    Reward,
}

impl Task {
    pub fn parse(name: &str) -> Result<Task> {
        match name {
            "generate" | "" => Ok(Task::Generate),
            "score" => Ok(Task::Score),
            "perplexity" => Ok(Task::Perplexity),
            "embed" => Ok(Task::Embed),
            "classify" => Ok(Task::Classify),
            "reward" => Ok(Task::Reward),
            other => Err(Error::user(format!(
                "task must be generate, score, perplexity, embed, classify or reward, got \
                 {other:?}"
            ))),
        }
    }

    /// A task whose rows end in a head over their hidden states (pooled.rs).
    pub fn pooled(self) -> bool {
        matches!(self, Task::Embed | Task::Classify | Task::Reward)
    }
}

/// How a scoring job's output columns are shaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoreShape {
    /// `logprob`, `num_tokens`, `is_greedy` scalars (a continuation column).
    Pair,
    /// The same three as lists, one entry per choice.
    Choices,
    /// `logprob`, `num_tokens` summed over a text's windows (perplexity).
    Rolling,
}

/// One scored sequence of a row: its tokens, of which those from index `from` (>= 1) on are
/// scored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScorePart {
    pub prompt_ids: Vec<u32>,
    pub from: usize,
}

/// A part's result: the summed log-probability of its scored tokens, how many there are, and
/// whether each is the argmax of the logits it was scored from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PartScore {
    pub logprob: f64,
    pub num_tokens: i32,
    pub is_greedy: bool,
}

impl PartScore {
    /// From the part's scored tokens and, per token, its log-probability and the logits'
    /// most likely id.
    pub fn of(tokens: &[u32], entries: impl Iterator<Item = (f32, Option<u32>)>) -> PartScore {
        let (mut logprob, mut greedy, mut n) = (0f64, true, 0i32);
        for (&t, (lp, top)) in tokens.iter().zip(entries) {
            logprob += f64::from(lp);
            greedy &= top == Some(t);
            n += 1;
        }
        PartScore {
            logprob,
            num_tokens: n,
            is_greedy: greedy && n == tokens.len() as i32,
        }
    }

    /// The sum of windows' scores (perplexity).
    fn sum(parts: &[PartScore]) -> PartScore {
        PartScore {
            logprob: parts.iter().map(|p| p.logprob).sum(),
            num_tokens: parts.iter().map(|p| p.num_tokens).sum(),
            is_greedy: parts.iter().all(|p| p.is_greedy),
        }
    }
}

/// Splits rows' texts into parts (module doc) with the job's tokenizer.
pub struct Splitter<'a> {
    pub tokenizer: &'a Tokenizer,
    /// Encode with the tokenizer's special tokens (`input.add_special_tokens`), unless the
    /// text starts with `bos_text` already (lm-eval's rule: a chat-templated context holds it).
    pub add_special: bool,
    pub bos_text: Option<&'a str>,
    /// The token standing for an empty context (BOS, else the first EOS id).
    pub prefix_id: u32,
    /// The longest part (`max_model_len`).
    pub max_len: usize,
}

type RowResult<T> = std::result::Result<T, String>;

impl Splitter<'_> {
    fn encode(&self, text: &str) -> RowResult<Vec<u32>> {
        let has_bos = self
            .bos_text
            .is_some_and(|b| !b.is_empty() && text.starts_with(b));
        self.encode_with(text, self.add_special && !has_bos)
    }

    fn encode_with(&self, text: &str, add_special: bool) -> RowResult<Vec<u32>> {
        (self.tokenizer.encode_fast(text, add_special))
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("tokenizer error: {e}"))
    }

    /// lm-eval's (context, continuation) split, left-truncated to `max_len` tokens.
    pub fn pair(&self, context: &str, continuation: &str) -> RowResult<ScorePart> {
        let (ctx_ids, cont_ids) = if context.is_empty() {
            // lm-eval: the continuation without special tokens after the prefix token, or its
            // own first token when that is the prefix token
            let mut cont = self.encode_with(continuation, false)?;
            match cont.first() {
                Some(&t) if t == self.prefix_id => (vec![cont.remove(0)], cont),
                _ => (vec![self.prefix_id], cont),
            }
        } else {
            // the context's trailing whitespace belongs to the continuation: `whole` encodes
            // both, the continuation is what follows the trimmed context's own encoding
            let ctx = context.trim_end();
            let whole = self.encode(&format!("{context}{continuation}"))?;
            match self.encode(ctx)? {
                ids if ids.is_empty() => (vec![self.prefix_id], whole),
                ids => {
                    let cont = whole.get(ids.len()..).unwrap_or_default().to_vec();
                    (ids, cont)
                }
            }
        };
        if cont_ids.is_empty() {
            return Err("the continuation is empty once tokenized".to_string());
        }
        if cont_ids.len() >= self.max_len {
            return Err(format!(
                "the continuation has {} tokens; it must be shorter than max_model_len ({})",
                cont_ids.len(),
                self.max_len
            ));
        }
        let mut ids = ctx_ids;
        ids.extend_from_slice(&cont_ids);
        let cut = ids.len().saturating_sub(self.max_len);
        let from = ids.len() - cont_ids.len() - cut;
        ids.drain(..cut);
        Ok(ScorePart {
            prompt_ids: ids,
            from,
        })
    }

    /// lm-eval's rolling windows (context length 1) over the text, made disjoint: each part
    /// scores the tokens after the previous part's, with as much of the text before them as
    /// fits `max_len` tokens.
    pub fn rolling(&self, text: &str) -> RowResult<Vec<ScorePart>> {
        let tokens = self.encode(text)?;
        if tokens.is_empty() {
            return Err("the text tokenized to 0 tokens".to_string());
        }
        if self.max_len < 2 {
            return Err("max_model_len must be at least 2 to score a text".to_string());
        }
        Ok(rolling_windows(&tokens, self.prefix_id, self.max_len - 1))
    }
}

/// lm-eval's `get_rolling_token_windows(tokens, prefix, max_seq_len, 1)` followed by
/// `make_disjoint_window`, each window as one sequence (context + predicted tokens).
pub fn rolling_windows(tokens: &[u32], prefix: u32, max_seq_len: usize) -> Vec<ScorePart> {
    let n = tokens.len();
    let first = max_seq_len.min(n);
    let mut ids = vec![prefix];
    ids.extend_from_slice(&tokens[..first]);
    let mut parts = vec![ScorePart {
        prompt_ids: ids,
        from: 1,
    }];
    let mut predicted = first;
    while predicted < n {
        let window = (n - predicted).min(max_seq_len);
        let end = predicted + window;
        let start = end - max_seq_len - 1; // end > max_seq_len: the first window was full
        parts.push(ScorePart {
            prompt_ids: tokens[start..end].to_vec(),
            from: end - window - start,
        });
        predicted = end;
    }
    parts
}

/// A scored row's value in the output (module doc).
#[derive(Debug, Clone, PartialEq)]
pub enum RowScore {
    One(PartScore),
    Choices(Vec<PartScore>),
    /// A pooled task's value (pooled.rs).
    Pooled(crate::pooled::Pooled),
}

impl RowScore {
    pub fn of(shape: ScoreShape, parts: Vec<PartScore>) -> RowScore {
        match shape {
            ScoreShape::Choices => RowScore::Choices(parts),
            ScoreShape::Rolling => RowScore::One(PartScore::sum(&parts)),
            ScoreShape::Pair => RowScore::One(parts[0]),
        }
    }
}

/// A finished part: its score (or its error) and its prompt and cached token counts.
pub type PartResult = (std::result::Result<PartScore, String>, usize, usize);

/// The finished parts of rows still scoring other parts, by row index.
#[derive(Debug, Default)]
pub struct Gather {
    rows: HashMap<i64, Vec<Option<PartResult>>>,
}

impl Gather {
    /// Records part `part` of `num_parts` of `row`; returns every part's result, in part
    /// order, once all are in.
    pub fn add(
        &mut self,
        row: i64,
        part: usize,
        num_parts: usize,
        result: PartResult,
    ) -> Option<Vec<PartResult>> {
        let slots = self
            .rows
            .entry(row)
            .or_insert_with(|| vec![None; num_parts]);
        slots[part] = Some(result);
        if slots.iter().any(Option::is_none) {
            return None;
        }
        let done = self.rows.remove(&row).expect("present");
        Some(done.into_iter().map(|s| s.expect("all in")).collect())
    }

    /// Rows with parts still to finish (an aborted run drops them unwritten).
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

/// The score columns' fields, in output order.
pub fn fields(shape: ScoreShape) -> Vec<Field> {
    let list = |t: DataType| DataType::List(Arc::new(Field::new("item", t, true)));
    let wrap = |t: DataType| match shape {
        ScoreShape::Choices => list(t),
        _ => t,
    };
    let mut f = vec![
        Field::new("logprob", wrap(DataType::Float64), true),
        Field::new("num_tokens", wrap(DataType::Int32), true),
    ];
    if shape != ScoreShape::Rolling {
        f.push(Field::new("is_greedy", wrap(DataType::Boolean), true));
    }
    f
}

/// The score columns of rows (None: an error row, null).
pub fn columns<'a>(
    shape: ScoreShape,
    scores: impl Iterator<Item = Option<&'a RowScore>> + Clone,
) -> Vec<ArrayRef> {
    let mut out: Vec<ArrayRef> = match shape {
        ScoreShape::Choices => choice_columns(scores.clone()),
        _ => {
            let one = |s: Option<&'a RowScore>| match s {
                Some(RowScore::One(p)) => Some(*p),
                _ => None,
            };
            let ones: Vec<Option<PartScore>> = scores.map(one).collect();
            let mut lp = Float64Builder::new();
            let mut n = Int32Builder::new();
            let mut g = BooleanBuilder::new();
            for p in &ones {
                lp.append_option(p.map(|p| p.logprob));
                n.append_option(p.map(|p| p.num_tokens));
                g.append_option(p.map(|p| p.is_greedy));
            }
            vec![
                Arc::new(lp.finish()),
                Arc::new(n.finish()),
                Arc::new(g.finish()),
            ]
        }
    };
    if shape == ScoreShape::Rolling {
        out.truncate(2);
    }
    out
}

fn choice_columns<'a>(scores: impl Iterator<Item = Option<&'a RowScore>>) -> Vec<ArrayRef> {
    let mut lp = ListBuilder::new(Float64Builder::new());
    let mut n = ListBuilder::new(Int32Builder::new());
    let mut g = ListBuilder::new(BooleanBuilder::new());
    for s in scores {
        let parts = match s {
            Some(RowScore::Choices(p)) => Some(p),
            _ => None,
        };
        for p in parts.into_iter().flatten() {
            lp.values().append_value(p.logprob);
            n.values().append_value(p.num_tokens);
            g.values().append_value(p.is_greedy);
        }
        lp.append(parts.is_some());
        n.append(parts.is_some());
        g.append(parts.is_some());
    }
    vec![
        Arc::new(lp.finish()),
        Arc::new(n.finish()),
        Arc::new(g.finish()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rolling_windows_follow_lm_eval() {
        // lm-eval: tokens 0..10, max_seq_len 4, context_len 1, prefix 99: windows
        // ([99,0,1,2],[0,1,2,3]) ([3,4,5,6],[4,5,6,7]) ([5,6,7,8],[8,9]), made disjoint
        // ([99],[0,1,2,3]) ([3],[4,5,6,7]) ([5,6,7],[8,9])
        let tokens: Vec<u32> = (0..10).collect();
        let parts = rolling_windows(&tokens, 99, 4);
        let got: Vec<(Vec<u32>, usize)> =
            parts.into_iter().map(|p| (p.prompt_ids, p.from)).collect();
        assert_eq!(
            got,
            vec![
                (vec![99, 0, 1, 2, 3], 1),
                (vec![3, 4, 5, 6, 7], 1),
                (vec![5, 6, 7, 8, 9], 3),
            ]
        );
        // every token scored exactly once
        let short = rolling_windows(&tokens[..3], 7, 4);
        assert_eq!(
            short,
            vec![ScorePart {
                prompt_ids: vec![7, 0, 1, 2],
                from: 1
            }]
        );
    }

    #[test]
    fn pairs_split_as_lm_eval_does() {
        let tok = crate::testutil::word_level_tokenizer(16); // adds <bos> = 1
        let s = Splitter {
            tokenizer: &tok,
            add_special: true,
            bos_text: Some("<bos>"),
            prefix_id: 1,
            max_len: 16,
        };
        let part = |c: &str, x: &str| s.pair(c, x).map(|p| (p.prompt_ids, p.from));
        // the context's trailing space moves to the continuation
        assert_eq!(part("w5 w6 ", "w7"), Ok((vec![1, 5, 6, 7], 3)));
        // an empty context: the prefix token, the continuation without special tokens
        assert_eq!(part("", "w7 w8"), Ok((vec![1, 7, 8], 1)));
        assert!(part("w5", "").is_err());
        // too long: the first tokens go
        let short = Splitter { max_len: 3, ..s };
        let p = short.pair("w5 w6 w8", " w7 w9").unwrap();
        assert_eq!((p.prompt_ids, p.from), (vec![8, 7, 9], 1));
        assert!(short.pair("w5", " w7 w8 w9").is_err());
        // a context that starts with the BOS text gets no second BOS
        assert_eq!(part("<bos> w5", " w6"), Ok((vec![1, 5, 6], 2)));
    }

    #[test]
    fn part_scores_sum_and_check_the_argmax() {
        let s = PartScore::of(&[5, 6], [(-1.0, Some(5)), (-0.5, Some(6))].into_iter());
        assert_eq!((s.logprob, s.num_tokens, s.is_greedy), (-1.5, 2, true));
        let s = PartScore::of(&[5, 6], [(-1.0, Some(5)), (-0.5, Some(7))].into_iter());
        assert!(!s.is_greedy);
        let mut g = Gather::default();
        assert!(g.add(3, 1, 2, (Ok(s), 4, 0)).is_none());
        assert_eq!(g.len(), 1);
        let all = g.add(3, 0, 2, (Err("x".into()), 5, 0)).unwrap();
        assert_eq!((all[0].1, all[1].1), (5, 4));
        assert!(g.is_empty());
    }
}

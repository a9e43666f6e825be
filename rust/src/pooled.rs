//! Prefill-only tasks with a head over the prompt's hidden states (`task: embed | classify |
//! reward`): a row is one sequence that generates nothing (like a scored part, score.rs); the
//! worker returns, per plan row, its chunk's contribution to the row's pooled vector (the sum
//! of the chunk's selected positions' final hidden states, or of the score head's logits over
//! them), the run sums the contributions of a row's chunks (`Sequence::pooled`) and turns the
//! sum into the row's value once its prompt is computed (`PoolHead::finish`).
//!
//! Which positions a row's contributions cover (`Pooling`): the last prompt token, every
//! prompt token (mean), or the first (CLS). Positions a row's pooling needs are never taken
//! from the prefix cache (`Pooling::needed_from`), so every needed position is computed by
//! the row's own plans; a preempted row's sum starts again (scheduler.rs `preempt`).

use std::sync::Arc;

use arrow_array::builder::{FixedSizeListBuilder, Float32Builder, ListBuilder, StringBuilder};
use arrow_array::ArrayRef;
use arrow_schema::{DataType, Field};

use crate::error::{Error, Result};

/// What a pooled row's value is: its embedding, its class (`task: classify`) or its score
/// (`task: reward`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head {
    Embed,
    Classify,
    Reward,
}

/// Which prompt positions a row's pooled vector is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    Last,
    Mean,
    First,
}

impl Pooling {
    pub fn parse(name: &str) -> Result<Pooling> {
        match name {
            "last" => Ok(Pooling::Last),
            "mean" => Ok(Pooling::Mean),
            "cls" | "first" => Ok(Pooling::First),
            other => Err(Error::user(format!(
                "embed.pooling must be last, mean or cls, got {other:?}"
            ))),
        }
    }

    /// The first prompt position whose hidden state a row of `len` tokens needs: the blocks
    /// before it may come from the prefix cache.
    pub fn needed_from(self, len: usize) -> usize {
        match self {
            Pooling::Last => len.saturating_sub(1),
            Pooling::Mean | Pooling::First => 0,
        }
    }
}

/// What a pooled row's prompt longer than max_model_len becomes (`embed.truncate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Truncate {
    /// Its first tokens go (the last max_model_len are kept).
    Start,
    /// Its last tokens go.
    End,
    /// It stays whole: an error row.
    Error,
}

impl Truncate {
    pub fn parse(name: &str) -> Result<Truncate> {
        match name {
            "start" => Ok(Truncate::Start),
            "end" => Ok(Truncate::End),
            "error" => Ok(Truncate::Error),
            other => Err(Error::user(format!(
                "embed.truncate must be start, end or error, got {other:?}"
            ))),
        }
    }

    /// The prompt's ids cut to `max_len` tokens as this says.
    pub fn apply(self, mut ids: Vec<u32>, max_len: usize) -> Vec<u32> {
        if ids.len() <= max_len {
            return ids;
        }
        match self {
            Truncate::Start => ids.drain(..ids.len() - max_len).for_each(drop),
            Truncate::End => ids.truncate(max_len),
            Truncate::Error => {}
        }
        ids
    }
}

/// An OpenAI Batch `/v1/embeddings` line's options: its Matryoshka cut (0: the job's) and
/// whether its results carry base64 vectors (the `encoding_format` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EmbedLine {
    pub dimensions: usize,
    pub base64: bool,
}

/// A pooled task's prompt settings for the reader.
#[derive(Debug, Clone)]
pub struct PoolInput {
    /// Put before each raw prompt (an instruction prompt; "" = none).
    pub prefix: String,
    pub truncate: Truncate,
    pub max_len: usize,
}

/// How a row's summed contributions become its output value.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolHead {
    pub task: Head,
    pub pooling: Pooling,
    /// The contributions' width: hidden_size (embed) or the score head's outputs.
    pub width: usize,
    /// embed: L2-normalise (after the Matryoshka cut).
    pub normalize: bool,
    /// embed: keep the first `dimensions` values (0: all).
    pub dimensions: usize,
    /// classify: the labels, by output index (`id2label`); multi-label: sigmoid, else softmax.
    pub labels: Vec<String>,
    pub multi_label: bool,
    /// OpenAI Batch input (`/v1/embeddings` lines): each line cuts its own dimensions, so
    /// `embedding` is a list of any length, and an `encoding_format` column tells the results
    /// file each line's encoding.
    pub lines: bool,
}

/// A finished row's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Pooled {
    Embedding(Vec<f32>),
    /// An embeddings line's input's embedding, and whether the line asked for base64.
    LineEmbedding(Vec<f32>, bool),
    Class {
        label: String,
        probs: Vec<f32>,
    },
    Reward(f32),
}

impl PoolHead {
    /// The output width of an embedding (after the cut).
    pub fn out_dim(&self) -> usize {
        match self.dimensions {
            0 => self.width,
            d => d.min(self.width),
        }
    }

    /// An embeddings line's input's value: cut to the line's dimensions (where it names them)
    /// and normalised as the job's are.
    pub fn finish_line(&self, sum: &[f32], len: usize, line: EmbedLine) -> Pooled {
        let Pooled::Embedding(mut v) = self.finish(sum, len) else {
            unreachable!("lines are embed rows")
        };
        if line.dimensions > 0 && line.dimensions < v.len() {
            v.truncate(line.dimensions);
            if self.normalize {
                normalize(&mut v);
            }
        }
        Pooled::LineEmbedding(v, line.base64)
    }

    /// A row's value from the sum of its contributions over a prompt of `len` tokens.
    pub fn finish(&self, sum: &[f32], len: usize) -> Pooled {
        match self.task {
            Head::Classify => classify(sum, &self.labels, self.multi_label),
            Head::Reward => Pooled::Reward(sum.first().copied().unwrap_or(f32::NAN)),
            _ => {
                let scale = match self.pooling {
                    Pooling::Mean => 1.0 / len.max(1) as f32,
                    _ => 1.0,
                };
                let mut v: Vec<f32> = sum[..self.out_dim()].iter().map(|x| x * scale).collect();
                if self.normalize {
                    normalize(&mut v);
                }
                Pooled::Embedding(v)
            }
        }
    }

    /// The task's output columns' fields, in output order.
    pub fn fields(&self) -> Vec<Field> {
        let f32_item = Arc::new(Field::new("item", DataType::Float32, true));
        match self.task {
            Head::Classify => vec![
                Field::new("label", DataType::Utf8, true),
                Field::new("probs", DataType::List(f32_item), true),
            ],
            Head::Reward => vec![Field::new("score", DataType::Float32, true)],
            _ if self.lines => vec![
                Field::new("embedding", DataType::List(f32_item), true),
                Field::new("encoding_format", DataType::Utf8, true),
            ],
            _ => vec![Field::new(
                "embedding",
                DataType::FixedSizeList(f32_item, self.out_dim() as i32),
                true,
            )],
        }
    }

    /// The output columns of rows (None: an error row, null).
    pub fn columns<'a>(&self, rows: impl Iterator<Item = Option<&'a Pooled>>) -> Vec<ArrayRef> {
        match self.task {
            Head::Classify => {
                let mut label = StringBuilder::new();
                let mut probs = ListBuilder::new(Float32Builder::new());
                for r in rows {
                    let Some(Pooled::Class { label: l, probs: p }) = r else {
                        label.append_null();
                        probs.append(false);
                        continue;
                    };
                    label.append_value(l);
                    probs.values().append_slice(p);
                    probs.append(true);
                }
                vec![Arc::new(label.finish()), Arc::new(probs.finish())]
            }
            Head::Reward => {
                let mut score = Float32Builder::new();
                for r in rows {
                    score.append_option(match r {
                        Some(Pooled::Reward(s)) => Some(*s),
                        _ => None,
                    });
                }
                vec![Arc::new(score.finish())]
            }
            _ if self.lines => line_columns(rows),
            _ => {
                let d = self.out_dim();
                let mut b = FixedSizeListBuilder::new(Float32Builder::new(), d as i32);
                for r in rows {
                    match r {
                        Some(Pooled::Embedding(v)) => {
                            b.values().append_slice(v);
                            b.append(true);
                        }
                        _ => {
                            b.values().append_nulls(d);
                            b.append(false);
                        }
                    }
                }
                vec![Arc::new(b.finish())]
            }
        }
    }
}

/// OpenAI Batch embeddings: `embedding` (list<float32>) and `encoding_format`.
fn line_columns<'a>(rows: impl Iterator<Item = Option<&'a Pooled>>) -> Vec<ArrayRef> {
    let mut values = ListBuilder::new(Float32Builder::new());
    let mut format = StringBuilder::new();
    for r in rows {
        match r {
            Some(Pooled::LineEmbedding(v, base64)) => {
                values.values().append_slice(v);
                values.append(true);
                format.append_value(if *base64 { "base64" } else { "float" });
            }
            _ => {
                values.append(false);
                format.append_null();
            }
        }
    }
    vec![Arc::new(values.finish()), Arc::new(format.finish())]
}

fn normalize(v: &mut [f32]) {
    let norm = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    // sentence-transformers' Normalize: divide by max(norm, 1e-12)
    let scale = 1.0 / norm.max(1e-12);
    v.iter_mut()
        .for_each(|x| *x = (f64::from(*x) * scale) as f32);
}

/// The label with the largest logit, and the probabilities: softmax over the labels, or each
/// label's sigmoid (multi-label).
fn classify(logits: &[f32], labels: &[String], multi_label: bool) -> Pooled {
    let probs: Vec<f32> = if multi_label {
        logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect()
    } else {
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f64> = logits.iter().map(|&x| f64::from(x - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| (x / s) as f32).collect()
    };
    let best = (0..logits.len())
        .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
        .unwrap_or(0);
    let label = labels
        .get(best)
        .cloned()
        .unwrap_or_else(|| best.to_string());
    Pooled::Class { label, probs }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(task: Head) -> PoolHead {
        PoolHead {
            task,
            pooling: Pooling::Mean,
            width: 4,
            normalize: true,
            dimensions: 2,
            labels: vec!["a".into(), "b".into()],
            multi_label: false,
            lines: false,
        }
    }

    #[test]
    fn embeddings_are_averaged_cut_and_normalised() {
        let v = head(Head::Embed).finish(&[6.0, 8.0, 100.0, 1.0], 2);
        assert_eq!(v, Pooled::Embedding(vec![0.6, 0.8]));
        let raw = PoolHead {
            normalize: false,
            dimensions: 0,
            pooling: Pooling::Last,
            ..head(Head::Embed)
        };
        assert_eq!(
            raw.finish(&[1.0, 2.0, 3.0, 4.0], 9),
            Pooled::Embedding(vec![1.0, 2.0, 3.0, 4.0])
        );
        assert_eq!(Pooling::Last.needed_from(5), 4);
        assert_eq!(Pooling::Mean.needed_from(5), 0);
        assert_eq!(Truncate::Start.apply(vec![1, 2, 3], 2), vec![2, 3]);
        assert_eq!(Truncate::End.apply(vec![1, 2, 3], 2), vec![1, 2]);
        assert_eq!(Truncate::Error.apply(vec![1, 2, 3], 2), vec![1, 2, 3]);
        let full = PoolHead {
            dimensions: 0,
            ..head(Head::Embed)
        };
        let line = EmbedLine {
            dimensions: 1,
            base64: true,
        };
        assert_eq!(
            full.finish_line(&[3.0, 4.0, 0.0, 0.0], 1, line),
            Pooled::LineEmbedding(vec![1.0], true)
        );
    }

    #[test]
    fn classes_take_softmax_or_sigmoid() {
        let Pooled::Class { label, probs } = head(Head::Classify).finish(&[0.0, 1.0], 3) else {
            panic!("a class")
        };
        assert_eq!(label, "b");
        assert!((probs[1] - 1.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
        let multi = PoolHead {
            multi_label: true,
            ..head(Head::Classify)
        };
        let Pooled::Class { probs, .. } = multi.finish(&[0.0, 0.0], 3) else {
            panic!("a class")
        };
        assert_eq!(probs, vec![0.5, 0.5]);
        assert_eq!(head(Head::Reward).finish(&[2.5], 3), Pooled::Reward(2.5));
    }
}

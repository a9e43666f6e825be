//! Log-probabilities of output tokens: what a step's result carries (`StepLogprobs`), what a
//! sequence keeps per output token (`TokenLogprob`), and the `logprobs` output column.
//!
//! The worker computes them (which distribution: the README's `output.logprobs_mode`); here
//! they are only kept aligned with `output_ids` (one entry per appended token, the EOS token's
//! included) and written. Column type, one entry per output token:
//! `list<struct<token_id: int32, token: string, logprob: float32,
//!              top_logprobs: list<struct<token_id: int32, token: string, logprob: float32>>>>`,
//! null for rows without logprobs and for error rows.

use std::sync::Arc;

use arrow_array::builder::{
    Float32Builder, Int32Builder, ListBuilder, StringBuilder, StructBuilder,
};
use arrow_array::ArrayRef;
use arrow_schema::{DataType, Field, Fields};
use tokenizers::Tokenizer;

use crate::error::{Error, Result};

/// Per token of a step's result (aligned with its `tokens`): the token's log-probability and
/// the top `k` alternatives, row-major `[T, k]`, most likely first.
#[derive(Debug, Clone, Default)]
pub struct StepLogprobs {
    pub chosen: Vec<f32>,
    pub top_ids: Vec<i32>,
    pub top_logprobs: Vec<f32>,
    pub k: usize,
}

impl StepLogprobs {
    /// Checks the shapes against the result's `t` tokens.
    pub fn check(&self, t: usize) -> Result<()> {
        if self.chosen.len() != t || self.top_ids.len() != t * self.k {
            return Err(Error::internal(format!(
                "commit(): logprobs for {} tokens with {} top ids (k = {}), but {t} tokens",
                self.chosen.len(),
                self.top_ids.len(),
                self.k
            )));
        }
        if self.top_logprobs.len() != self.top_ids.len() {
            return Err(Error::internal(
                "commit(): top_ids and top_logprobs differ in size",
            ));
        }
        if self.top_ids.iter().any(|&t| t < 0) {
            return Err(Error::internal("commit(): negative top token id"));
        }
        Ok(())
    }

    /// Token `j`'s entry with its first `k` alternatives (at most the step's).
    pub fn entry(&self, j: usize, k: usize) -> TokenLogprob {
        let base = j * self.k;
        let top = (base..base + k.min(self.k))
            .map(|i| (self.top_ids[i] as u32, self.top_logprobs[i]))
            .collect();
        TokenLogprob {
            logprob: self.chosen[j],
            top,
        }
    }
}

/// Prompt logprobs of a step's result: per row how many entries, per entry the position t
/// whose logits it comes from (it describes prompt token t + 1), and the entries.
#[derive(Debug, Clone, Default)]
pub struct PromptLogprobs {
    pub row_counts: Vec<i32>,
    pub positions: Vec<i32>,
    pub entries: StepLogprobs,
}

/// One output token's log-probability and top alternatives (id, log-probability).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// An entry as written: ids with their decoded text.
#[derive(Debug, Clone, PartialEq)]
pub struct LogprobEntry {
    pub token_id: u32,
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(u32, String, f32)>,
}

/// The text of one token id (`decode([id])`, special tokens kept: "" only if undecodable).
fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

/// The written entries of a sequence's output ids and their log-probabilities.
pub fn entries(tokenizer: &Tokenizer, ids: &[u32], lps: &[TokenLogprob]) -> Vec<LogprobEntry> {
    ids.iter()
        .zip(lps)
        .map(|(&id, lp)| LogprobEntry {
            token_id: id,
            token: token_text(tokenizer, id),
            logprob: lp.logprob,
            top: lp
                .top
                .iter()
                .map(|&(t, l)| (t, token_text(tokenizer, t), l))
                .collect(),
        })
        .collect()
}

fn token_fields() -> Vec<Field> {
    vec![
        Field::new("token_id", DataType::Int32, false),
        Field::new("token", DataType::Utf8, false),
        Field::new("logprob", DataType::Float32, false),
    ]
}

fn top_list_type() -> DataType {
    let item = Field::new("item", DataType::Struct(Fields::from(token_fields())), true);
    DataType::List(Arc::new(item))
}

fn entry_fields() -> Fields {
    let mut f = token_fields();
    f.push(Field::new("top_logprobs", top_list_type(), false));
    Fields::from(f)
}

/// The field of a logprobs column (`logprobs`, `prompt_logprobs`).
pub fn field(name: &str) -> Field {
    let item = Field::new("item", DataType::Struct(entry_fields()), true);
    Field::new(name, DataType::List(Arc::new(item)), true)
}

fn token_builder() -> StructBuilder {
    StructBuilder::from_fields(Fields::from(token_fields()), 0)
}

/// Appends (id, text, logprob) to a struct builder over `token_fields`.
fn append_token(b: &mut StructBuilder, id: u32, text: &str, lp: f32) {
    b.field_builder::<Int32Builder>(0)
        .expect("token_id")
        .append_value(id as i32);
    b.field_builder::<StringBuilder>(1)
        .expect("token")
        .append_value(text);
    b.field_builder::<Float32Builder>(2)
        .expect("logprob")
        .append_value(lp);
    b.append(true);
}

/// The column of `rows` (None: a null entry).
pub fn column<'a>(rows: impl Iterator<Item = Option<&'a [LogprobEntry]>>) -> ArrayRef {
    let top_item = Field::new("item", DataType::Struct(Fields::from(token_fields())), true);
    let top = ListBuilder::new(token_builder()).with_field(Arc::new(top_item));
    let entry = StructBuilder::new(
        entry_fields(),
        vec![
            Box::new(Int32Builder::new()),
            Box::new(StringBuilder::new()),
            Box::new(Float32Builder::new()),
            Box::new(top),
        ],
    );
    let item = Field::new("item", DataType::Struct(entry_fields()), true);
    let mut b = ListBuilder::new(entry).with_field(Arc::new(item));
    for row in rows {
        let Some(entries) = row else {
            b.append(false);
            continue;
        };
        for e in entries {
            append_entry(b.values(), e);
        }
        b.append(true);
    }
    Arc::new(b.finish())
}

fn append_entry(b: &mut StructBuilder, e: &LogprobEntry) {
    b.field_builder::<Int32Builder>(0)
        .expect("token_id")
        .append_value(e.token_id as i32);
    b.field_builder::<StringBuilder>(1)
        .expect("token")
        .append_value(&e.token);
    b.field_builder::<Float32Builder>(2)
        .expect("logprob")
        .append_value(e.logprob);
    let top = b
        .field_builder::<ListBuilder<StructBuilder>>(3)
        .expect("top_logprobs");
    for (id, text, lp) in &e.top {
        append_token(top.values(), *id, text, *lp);
    }
    top.append(true);
    b.append(true);
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Float32Type, Int32Type};
    use arrow_array::Array;

    #[test]
    fn entries_keep_the_first_k_alternatives_and_the_column_round_trips() {
        let step = StepLogprobs {
            chosen: vec![-0.5, -1.5],
            top_ids: vec![3, 4, 5, 6],
            top_logprobs: vec![-0.5, -1.0, -0.2, -1.5],
            k: 2,
        };
        step.check(2).unwrap();
        assert!(step.check(3).is_err());
        assert_eq!(step.entry(1, 1).top, vec![(5, -0.2)]);
        let e = LogprobEntry {
            token_id: 3,
            token: "a".into(),
            logprob: -0.5,
            top: vec![(3, "a".into(), -0.5), (4, "b".into(), -1.0)],
        };
        let col = column([Some(&[e][..]), None].into_iter());
        assert_eq!(col.data_type(), field("logprobs").data_type());
        let list = col.as_list::<i32>();
        assert!(list.is_valid(0) && list.is_null(1));
        let row = list.value(0);
        let s = row.as_struct();
        assert_eq!(s.column(0).as_primitive::<Int32Type>().value(0), 3);
        assert_eq!(s.column(2).as_primitive::<Float32Type>().value(0), -0.5);
        let top = s.column(3).as_list::<i32>().value(0);
        assert_eq!(top.len(), 2);
        assert_eq!(top.as_struct().column(1).as_string::<i32>().value(1), "b");
    }
}

//! Scoring tasks through a run (score.rs, run/scoring.rs): a fake model returns
//! prompt logprobs that encode the scored token, so each row's sums and argmax checks are
//! known; choices share their context's blocks, a part waiting for a sibling's blocks lets
//! other rows be admitted, and every row is written once with all its parts.

use std::sync::Arc;

use arrow_array::builder::{ListBuilder, StringBuilder};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, Int32Type, Int64Type};
use arrow_array::{Array, ArrayRef, StringArray};

use super::tests::wait_for_reader;
use super::*;
use crate::logprobs::{PromptLogprobs, StepLogprobs};
use crate::testutil::{read_parts, save_tokenizer, word_level_tokenizer, write_parquet, TempDir};

const VOCAB: usize = 64;

/// The fake model's log-probability of `token`, and whether it is its argmax (even tokens).
fn fake(token: i64) -> (f32, bool) {
    (-(token as f32) / 100.0, token % 2 == 0)
}

fn choices_input(dir: &TempDir, rows: &[(&str, &[&str])]) -> RunConfig {
    let input = dir.path().join("in.parquet");
    let mut choices = ListBuilder::new(StringBuilder::new());
    for (_, options) in rows {
        for o in options.iter() {
            choices.values().append_value(o);
        }
        choices.append(true);
    }
    let prompts: Vec<&str> = rows.iter().map(|r| r.0).collect();
    write_parquet(
        &input,
        vec![
            ("prompt", Arc::new(StringArray::from(prompts)) as ArrayRef),
            ("choices", Arc::new(choices.finish())),
        ],
        2,
    );
    let tok = save_tokenizer(&word_level_tokenizer(VOCAB), dir.path());
    let mut cfg = RunConfig::new(vec![input], "prompt", tok, dir.path().join("out"));
    (cfg.task, cfg.input.choices_column) = ("score".into(), Some("choices".into()));
    (
        cfg.sampling.eos_token_ids,
        cfg.policy.block_size,
        cfg.policy.num_blocks,
    ) = (vec![2], 4, 64);
    (
        cfg.policy.max_batch_size,
        cfg.policy.max_model_len,
        cfg.output.part_rows,
    ) = (8, 64, 2);
    cfg
}

/// Each plan's rows that owe prompt logprobs get the fake model's, at every position from
/// their `prompt_logprobs_from` whose next token is a prompt token. Returns each plan's row
/// count.
fn drive(s: &mut Run) -> Vec<usize> {
    wait_for_reader(s);
    let mut plans = Vec::new();
    while let Some(p) = s.next_plan().unwrap() {
        let (mut counts, mut positions, mut entries) = (vec![], vec![], StepLogprobs::default());
        entries.k = 1;
        for r in 0..p.num_seqs() {
            let (q0, q1) = (p.cu_seqlens_q[r] as usize, p.cu_seqlens_q[r + 1] as usize);
            let mut n = 0;
            for t in q0..q1 {
                let pos = p.positions[t];
                let wanted =
                    pos >= p.prompt_logprobs_from[r] as i64 && pos + 1 < p.prompt_lens[r] as i64;
                if p.prompt_logprobs[r] == 0 || !wanted {
                    continue;
                }
                let next = if t + 1 < q1 {
                    p.input_ids[t + 1]
                } else {
                    p.next_ids[r]
                };
                let (lp, top) = fake(next);
                entries.chosen.push(lp);
                entries.top_ids.push(if top { next as i32 } else { 3 });
                entries.top_logprobs.push(lp);
                positions.push(pos as i32);
                n += 1;
            }
            counts.push(n);
        }
        plans.push(p.num_seqs());
        let pl = PromptLogprobs {
            row_counts: counts,
            positions,
            entries,
        };
        let ones = vec![1; p.num_seqs()];
        s.commit(&vec![5; p.num_seqs()], &ones, None, None, Some(&pl))
            .unwrap();
    }
    plans
}

#[test]
fn choices_are_scored_once_each_sharing_their_context() {
    let dir = TempDir::new("score-choices");
    let ctx = "w10 w11 w12 w13 w14 w15 w16 w17 w18"; // <bos> + 9 words: two full blocks
    let rows: Vec<(&str, &[&str])> = vec![
        (ctx, &[" w20", " w21 w22", " w24"]),
        ("w30 w31 w32 w33 w34 w35 w36 w37 ", &["w40", "w42 w44"]), // the space moves over
        ("w5", &[" w6"]),
    ];
    let cfg = choices_input(&dir, &rows);
    let mut s = Run::with_tokenizer(cfg.clone(), word_level_tokenizer(VOCAB)).unwrap();
    let plans = drive(&mut s);
    s.finish().unwrap();
    let batches = read_parts(&cfg.output.output_dir);
    let errors: Vec<_> = (batches.iter())
        .flat_map(|b| b.column_by_name("error").unwrap().as_string::<i32>().iter())
        .flatten()
        .map(str::to_string)
        .collect();
    assert!(errors.is_empty(), "{errors:?}");
    // the first prefill holds a part of each row: the waiting siblings let the others by
    assert_eq!(plans[0], 3, "{plans:?}");
    let mut got = Vec::new();
    for b in &batches {
        let col = |n: &str| b.column_by_name(n).unwrap().clone();
        for i in 0..b.num_rows() {
            let lp = col("logprob").as_list::<i32>().value(i);
            let n = col("num_tokens").as_list::<i32>().value(i);
            let g = col("is_greedy").as_list::<i32>().value(i);
            let row = col("row_index").as_primitive::<Int64Type>().value(i);
            let cached = col("cached_tokens").as_primitive::<Int32Type>().value(i);
            let lps: Vec<f64> = lp.as_primitive::<Float64Type>().values().to_vec();
            let ns: Vec<i32> = n.as_primitive::<Int32Type>().values().to_vec();
            let gs: Vec<bool> = (0..g.len()).map(|j| g.as_boolean().value(j)).collect();
            got.push((row, lps, ns, gs, cached));
        }
    }
    got.sort_by_key(|g| g.0);
    assert_eq!(got.len(), 3, "each row once");
    for ((_, options), (_, lps, ns, gs, _)) in rows.iter().zip(&got) {
        for (j, option) in options.iter().enumerate() {
            let ids: Vec<i64> = (option.split_whitespace())
                .map(|w| w[1..].parse().unwrap())
                .collect();
            let want: f64 = ids.iter().map(|&t| f64::from(fake(t).0)).sum();
            assert!(
                (lps[j] - want).abs() < 1e-6,
                "{option}: {} vs {want}",
                lps[j]
            );
            assert_eq!(ns[j] as usize, ids.len());
            assert_eq!(gs[j], ids.iter().all(|&t| fake(t).1));
        }
    }
    // the other choices of the first two rows found their context's full blocks cached
    assert_eq!(got[0].4, 2 * 8);
    assert_eq!(got[1].4, 8);
}

#[test]
fn rolling_windows_sum_into_one_row() {
    let dir = TempDir::new("score-rolling");
    let text: Vec<String> = (4..30).map(|i| format!("w{i}")).collect();
    let mut cfg = choices_input(&dir, &[(&text.join(" "), &["w5"])]);
    (cfg.task, cfg.input.choices_column, cfg.policy.max_model_len) = ("perplexity".into(), None, 8);
    let mut s = Run::with_tokenizer(cfg.clone(), word_level_tokenizer(VOCAB)).unwrap();
    drive(&mut s);
    s.finish().unwrap();
    let b = &read_parts(&cfg.output.output_dir)[0];
    assert_eq!(b.num_rows(), 1);
    assert!(b.column_by_name("is_greedy").is_none());
    let lp = b
        .column_by_name("logprob")
        .unwrap()
        .as_primitive::<Float64Type>()
        .value(0);
    let n = b
        .column_by_name("num_tokens")
        .unwrap()
        .as_primitive::<Int32Type>()
        .value(0);
    // <bos> w4 .. w29: every token after the prefix <bos> scored once
    assert_eq!(n, 27);
    let want: f64 = std::iter::once(1)
        .chain(4..30)
        .map(|t| f64::from(fake(t).0))
        .sum();
    assert!((lp - want).abs() < 1e-6, "{lp} vs {want}");
}

//! Structured output through the scheduler, over the byte-level test tokenizer: a plan carries
//! each constrained row's mask (none for free rows), a committed token advances the row's
//! grammar, a completed grammar ends the row (`stop`, `complete`) and max_new_tokens mid-way
//! ends it `length`, `incomplete`; a verify plan's drafts are cut at the first refused one
//! (also the first draft), with one mask per position up to the bonus one and the matcher
//! rolled back; forced tokens come with the verify plan; a format that does not compile is its
//! row's error.

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, StringArray};

use super::tests::wait_for_reader;
use super::*;
use crate::stop::reasoning_open;
use crate::testutil::{byte_level_tokenizer, read_parts, save_tokenizer, write_parquet, TempDir};

const EOT: u32 = 257; // byte_level_tokenizer's <|eot|>
const VOCAB: usize = 260; // the model's: 2 ids past the tokenizer's

struct Setup {
    _dir: TempDir,
    cfg: RunConfig,
    tok: Tokenizer,
}

/// One row per format (None: a free row), prompt "x".
fn setup(tag: &str, formats: &[Option<&str>], w: usize) -> Setup {
    let dir = TempDir::new(tag);
    let input = dir.path().join("in.parquet");
    let n = formats.len();
    write_parquet(
        &input,
        vec![
            (
                "prompt",
                Arc::new(StringArray::from(vec!["x"; n])) as ArrayRef,
            ),
            ("rf", Arc::new(StringArray::from(formats.to_vec()))),
        ],
        4,
    );
    let tok = byte_level_tokenizer();
    let path = save_tokenizer(&tok, dir.path());
    let mut cfg = RunConfig::new(vec![input], "prompt", path, dir.path().join("out"));
    cfg.input.sampling_columns = [("response_format".to_string(), "rf".to_string())].into();
    cfg.sampling.eos_token_ids = vec![EOT];
    cfg.sampling.params.vocab_size = VOCAB;
    cfg.sampling.params.max_new_tokens = 6;
    cfg.policy.max_batch_size = 8;
    cfg.policy.max_draft_tokens = w;
    cfg.output.include_token_ids = true;
    Setup {
        _dir: dir,
        cfg,
        tok,
    }
}

fn id(s: &Setup, b: u8) -> u32 {
    (0..256u32)
        .find(|&t| s.tok.decode(&[t], false).unwrap().as_bytes() == [b])
        .unwrap()
}

fn allowed(mask: &[u32]) -> Vec<u32> {
    (0..mask.len() as u32 * 32)
        .filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1)
        .collect()
}

/// The plan's mask of row `r` (None: the row has none).
fn row_mask(p: &StepPlan, r: usize) -> Option<Vec<u32>> {
    let m = usize::try_from(p.mask_rows[r]).ok()?;
    Some(allowed(
        &p.token_masks[m * p.mask_words..(m + 1) * p.mask_words],
    ))
}

/// (output_text, finish_reason, structured) of every row, by row index.
fn outputs(s: &Setup) -> Vec<(String, String, Option<String>)> {
    let mut rows = Vec::new();
    for b in read_parts(&s.cfg.output.output_dir) {
        let col = |n: &str| b.column_by_name(n).unwrap().clone();
        for i in 0..b.num_rows() {
            let idx = col("row_index")
                .as_primitive::<arrow_array::types::Int64Type>()
                .value(i);
            let st = col("structured");
            let st = st.as_string::<i32>();
            rows.push((
                idx,
                col("output_text").as_string::<i32>().value(i).to_string(),
                col("finish_reason").as_string::<i32>().value(i).to_string(),
                (!st.is_null(i)).then(|| st.value(i).to_string()),
            ));
        }
    }
    rows.sort_by_key(|r| r.0);
    rows.into_iter().map(|(_, a, b, c)| (a, b, c)).collect()
}

#[test]
fn plain_steps_mask_constrained_rows_and_their_grammars_end_them() {
    let formats = [
        Some(r#"{"type": "regex", "pattern": "ab"}"#),
        None,
        Some(r#"{"type": "choice", "choices": ["abcdefgh"]}"#),
        Some(r#"{"type": "regex", "pattern": "(unclosed"}"#),
    ];
    let s = setup("structured-plain", &formats, 0);
    let (a, b, z) = (id(&s, b'a'), id(&s, b'b'), id(&s, b'z'));
    let mut sch = Run::new(s.cfg.clone()).unwrap();
    wait_for_reader(&sch);
    let mut steps = 0;
    while let Some(p) = sch.next_plan().unwrap() {
        let b_rows = p.num_seqs();
        assert!(b_rows <= 3, "the bad format's row never runs");
        let mut tokens = Vec::new();
        for r in 0..b_rows {
            tokens.push(match row_mask(&p, r) {
                None => z as i32, // the free row
                Some(m) => m[0] as i32,
            });
        }
        if steps == 0 {
            assert_eq!(row_mask(&p, 0), Some(vec![a]));
            assert_eq!(row_mask(&p, 1), None);
        }
        if steps == 1 {
            assert_eq!(row_mask(&p, 0), Some(vec![b]));
        }
        sch.commit(&tokens, &vec![1; b_rows], None, None, None)
            .unwrap();
        steps += 1;
    }
    let summary = sch.finish().unwrap();
    assert_eq!(summary["errors"], SummaryValue::Int(1));
    assert_eq!(summary["structured_rows"], SummaryValue::Int(2));
    let out = outputs(&s);
    assert_eq!(
        out[0],
        ("ab".into(), "stop".into(), Some("complete".into()))
    );
    assert_eq!(out[1], ("zzzzzz".into(), "length".into(), None));
    assert_eq!(
        out[2],
        ("abcdef".into(), "length".into(), Some("incomplete".into()))
    );
    assert_eq!(out[3].1, "error");
}

#[test]
fn verify_drafts_are_cut_at_the_first_refused_one_with_a_mask_per_position() {
    let formats = [
        Some(r#"{"type": "regex", "pattern": "a[bc]d"}"#),
        None,
        Some(r#"{"type": "choice", "choices": ["abcd"]}"#),
    ];
    let s = setup("structured-verify", &formats, 3);
    let t = |b: u8| id(&s, b) as i64;
    let mut sch = Run::new(s.cfg.clone()).unwrap();
    wait_for_reader(&sch);
    let p = sch.next_plan().unwrap().unwrap(); // the prefill
    assert_eq!(p.kind, StepKind::Prefill);
    let first = [row_mask(&p, 0).unwrap()[0], t(b'q') as u32, id(&s, b'a')];
    let tokens: Vec<i32> = first.iter().map(|&x| x as i32).collect();
    sch.commit(&tokens, &[1, 1, 1], None, None, None).unwrap();
    let p = sch.next_plan().unwrap().unwrap();
    assert_eq!(p.kind, StepKind::Verify);
    assert_eq!(p.mask_rows, vec![0, -1, 1]);
    // row 2's grammar forces "bcd" (the rest of its only choice), at most W = 3 of it
    assert_eq!(p.cu_forced, vec![0, 0, 0, 3]);
    assert_eq!(p.forced_ids, vec![t(b'b'), t(b'c'), t(b'd')]);
    // row 0 drafts "b", "d" (valid), then "x" (refused); row 2 a refused first draft
    let drafts: Vec<i64> = "bdx"
        .bytes()
        .map(t)
        .chain([0; 3])
        .chain("zcd".bytes().map(t))
        .collect();
    let m = sch.draft_masks(&drafts, 3).unwrap();
    assert_eq!((m.rows.clone(), m.valid.clone()), (vec![0, 2], vec![2, 0]));
    let mask = |row: usize, j: usize| {
        let at = (row * 4 + j) * m.words;
        allowed(&m.masks[at..at + m.words])
    };
    assert_eq!(mask(0, 0), vec![id(&s, b'b'), id(&s, b'c')]);
    assert_eq!(mask(0, 1), vec![id(&s, b'd')]);
    assert_eq!(mask(0, 2), vec![EOT]); // the grammar completed inside the round: EOS only
    assert_eq!(mask(1, 0), vec![id(&s, b'b')]); // the bonus position of a cut-at-once row
    let again = sch.draft_masks(&drafts, 3).unwrap(); // the matchers were rolled back
    assert_eq!((again.valid, again.masks), (m.valid, m.masks));
    // commit row 0: "b", "d" accepted, then the target's EOS; row 2: its bonus "b"
    sch.commit(
        &[
            t(b'b') as i32,
            t(b'd') as i32,
            EOT as i32,
            5,
            t(b'b') as i32,
        ],
        &[3, 1, 1],
        Some(&[2, 0, 0]),
        None,
        None,
    )
    .unwrap();
    let p = sch.next_plan().unwrap().unwrap();
    // row 0 finished when its grammar completed at "d" (the EOS after it dropped)
    assert_eq!(p.num_seqs(), 2);
    assert_eq!(p.forced_ids, vec![t(b'c'), t(b'd')]);
}

#[test]
fn a_reasoning_rows_grammar_starts_after_its_end_tag_even_inside_a_round() {
    let mut s = setup(
        "structured-reasoning",
        &[Some(r#"{"type": "regex", "pattern": "ab"}"#)],
        3,
    );
    let (open, close) = (id(&s, b'<'), id(&s, b'>'));
    s.cfg.output.reasoning_ids = vec![open, close];
    let t = |b: u8| id(&s, b) as i64;
    assert!(reasoning_open(&[1, 2], (open, close)));
    assert!(!reasoning_open(&[open, 1, close, 2], (open, close)));
    assert!(reasoning_open(&[close, open, 1], (open, close)));
    let mut sch = Run::new(s.cfg.clone()).unwrap();
    wait_for_reader(&sch);
    let p = sch.next_plan().unwrap().unwrap();
    assert_eq!(p.mask_rows, vec![-1]); // reasoning: no mask
    sch.commit(&[t(b'q') as i32], &[1], None, None, None)
        .unwrap();
    let p = sch.next_plan().unwrap().unwrap();
    assert_eq!(
        (p.mask_rows.clone(), p.cu_forced.clone()),
        (vec![0], vec![0, 0])
    );
    let m = sch.draft_masks(&[t(b'r'), t(b'>'), t(b'a')], 3).unwrap();
    assert_eq!(m.valid, vec![3]); // two free drafts, then "a" under the grammar
    let mask = |j: usize| allowed(&m.masks[j * m.words..(j + 1) * m.words]);
    assert_eq!(mask(0).len(), m.words * 32); // still reasoning: everything allowed
    assert_eq!(mask(1).len(), m.words * 32);
    assert_eq!((mask(2), mask(3)), (vec![id(&s, b'a')], vec![id(&s, b'b')]));
    let toks: Vec<i32> = [b'r', b'>', b'a', b'b'].map(|b| id(&s, b) as i32).to_vec();
    sch.commit(&toks, &[4], Some(&[3]), None, None).unwrap();
    assert!(sch.next_plan().unwrap().is_none());
    sch.finish().unwrap();
    let b = &read_parts(&s.cfg.output.output_dir)[0];
    let col = |n: &str| {
        b.column_by_name(n)
            .unwrap()
            .as_string::<i32>()
            .value(0)
            .to_string()
    };
    assert_eq!(
        (col("reasoning_text"), col("output_text")),
        ("qr".into(), "ab".into())
    );
    assert_eq!(
        (col("finish_reason"), col("structured")),
        ("stop".into(), "complete".into())
    );
}

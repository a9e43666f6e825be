//! Per-request parameters through the scheduler: sampling columns reach the plan's per-row
//! arrays (and penalised rows' tokens), per-row max_new_tokens, min_new_tokens and end ids
//! decide where rows stop, per-row text rules shape output_text, logprobs stay aligned with the
//! output tokens they describe, and batch lines keep their own endpoints.

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Int32Type};
use arrow_array::{Array, ArrayRef, Float64Array, Int64Array, StringArray};

use super::tests::{fixture, read_output, wait_for_reader, Fixture};
use super::*;
use crate::logprobs::{PromptLogprobs, StepLogprobs};
use crate::openai_batch::{CHAT_URL, COMPLETIONS_URL};
use crate::testutil::{read_parts, write_parquet};

/// The fixture with its input rewritten with extra columns.
fn with_columns(tag: &str, prompts: &[&str], extra: Vec<(&str, ArrayRef)>) -> Fixture {
    let f = fixture(tag, &[]);
    let ids: Vec<String> = (0..prompts.len()).map(|i| format!("r{i}")).collect();
    let mut cols: Vec<(&str, ArrayRef)> = vec![
        ("prompt", Arc::new(StringArray::from(prompts.to_vec()))),
        ("id", Arc::new(StringArray::from(ids))),
    ];
    cols.extend(extra);
    write_parquet(&f.cfg.input.input_files[0], cols, 3);
    f
}

/// Commits `token` for every row of every plan until the end; with `lp`, logprobs too (the
/// chosen token's logprob -(output index), alternatives k).
fn drive_constant(s: &mut Run, token: i32, k: usize) -> Vec<StepPlan> {
    let mut plans = Vec::new();
    while let Some(p) = s.next_plan().unwrap() {
        let b = p.num_seqs();
        let tokens = vec![token; b];
        let lp = StepLogprobs {
            chosen: p.num_generated.iter().map(|&g| -(g as f32)).collect(),
            top_ids: vec![token; b * k],
            top_logprobs: (0..b * k).map(|i| -((i % k.max(1)) as f32)).collect(),
            k,
        };
        s.commit(&tokens, &vec![1; b], None, (k > 0).then_some(&lp), None)
            .unwrap();
        plans.push(p);
    }
    plans
}

#[test]
fn sampling_columns_reach_the_plan_and_decide_where_rows_stop() {
    let mut f = with_columns(
        "samp-cols",
        &["w5 w6", "w7", "w8 w9"],
        vec![
            (
                "mt",
                Arc::new(Int64Array::from(vec![Some(2), None, Some(-1)])) as ArrayRef,
            ),
            (
                "t",
                Arc::new(Float64Array::from(vec![Some(0.5), None, None])),
            ),
            (
                "rp",
                Arc::new(Float64Array::from(vec![None, Some(1.3), None])),
            ),
        ],
    );
    let map = [
        ("max_new_tokens", "mt"),
        ("temperature", "t"),
        ("repetition_penalty", "rp"),
    ];
    f.cfg.input.sampling_columns = map
        .iter()
        .map(|(k, c)| (k.to_string(), c.to_string()))
        .collect();
    f.cfg.input.queue_rows = 16; // the reader queues every row: one first plan for both good rows
    let mut s = Run::new(f.cfg.clone()).unwrap();
    wait_for_reader(&s);
    let plans = drive_constant(&mut s, 11, 0);
    s.finish().unwrap();
    let first = &plans[0];
    assert_eq!(first.temperature, vec![0.5, 0.0]);
    assert_eq!(first.repetition_penalty, vec![1.0, 1.3]);
    // only the penalised row carries its tokens: its prompt, then its outputs
    let prompt = first.penalty_ids.clone();
    assert!(!prompt.is_empty());
    assert_eq!(first.cu_penalty, vec![0, 0, prompt.len() as i32]);
    assert_eq!(first.penalty_prompt_lens, vec![0, prompt.len() as i32]);
    let later = plans
        .iter()
        .find(|p| p.num_generated == vec![1, 1])
        .unwrap();
    assert_eq!(later.penalty_ids, [prompt, vec![11]].concat());
    let rows = read_output(&f.cfg.output.output_dir);
    assert_eq!(rows[0].output_tokens, 2);
    assert_eq!(
        rows[1].output_tokens,
        f.cfg.sampling.params.max_new_tokens as i32
    );
    assert_eq!(rows[2].reason, "error");
    assert!(rows[2].error.as_ref().unwrap().contains("'mt'"));
}

#[test]
fn no_stop_before_min_new_tokens() {
    let mut f = fixture("samp-min", &[Some("w5"), Some("w6")]);
    f.cfg.sampling.params.min_new_tokens = 3;
    let mut s = Run::new(f.cfg.clone()).unwrap();
    let plans = drive_constant(&mut s, 2, 0); // the EOS id every step
    s.finish().unwrap();
    assert!(plans.iter().all(|p| p.min_tokens.iter().all(|&m| m == 3)));
    for r in read_output(&f.cfg.output.output_dir) {
        assert_eq!((r.output_tokens, r.reason.as_str()), (3, "stop"));
    }
}

#[test]
fn logprobs_are_kept_per_output_token_and_written() {
    let mut f = fixture("samp-lp", &[Some("w5"), Some("w6"), None]);
    f.cfg.sampling.params.logprobs = 2;
    f.cfg.sampling.params.max_new_tokens = 4;
    let mut s = Run::new(f.cfg.clone()).unwrap();
    let p = s.next_plan().unwrap().unwrap();
    let b = p.num_seqs();
    assert!(
        s.commit(&vec![9; b], &vec![1; b], None, None, None)
            .is_err(),
        "logprobs are required"
    );
    let short = StepLogprobs {
        chosen: vec![0.0; b],
        top_ids: vec![9; b],
        top_logprobs: vec![0.0; b],
        k: 1,
    };
    assert!(
        s.commit(&vec![9; b], &vec![1; b], None, Some(&short), None)
            .is_err(),
        "k below 2"
    );
    let lp = StepLogprobs {
        chosen: vec![-0.0; b],
        top_ids: vec![9; 2 * b],
        top_logprobs: [0.0, -1.0].repeat(b),
        k: 2,
    };
    s.commit(&vec![9; b], &vec![1; b], None, Some(&lp), None)
        .unwrap();
    drive_constant(&mut s, 9, 3);
    s.finish().unwrap();
    let rows = read_logprobs(&f.cfg.output.output_dir, "logprobs");
    assert_eq!(rows.len(), 3);
    for (reason, entries) in rows {
        let Some(entries) = entries else {
            assert_eq!(reason, "error");
            continue;
        };
        let s = entries.as_struct();
        assert_eq!(s.len(), 4, "one entry per output token");
        let lps = s.column(2).as_primitive::<Float32Type>();
        assert_eq!(lps.values().to_vec(), vec![0.0, -1.0, -2.0, -3.0]);
        let ids = s.column(0).as_primitive::<Int32Type>();
        assert!(ids.values().iter().all(|&t| t == 9));
        let top = s.column(3).as_list::<i32>();
        assert!(
            (0..4).all(|j| top.value(j).len() == 2),
            "the row's k, not the step's"
        );
    }
}

/// Every output row's finish reason and its entries in logprobs column `name` (None when null).
fn read_logprobs(dir: &std::path::Path, name: &str) -> Vec<(String, Option<ArrayRef>)> {
    let mut out = Vec::new();
    for batch in read_parts(dir) {
        let col = batch.column_by_name(name).unwrap().as_list::<i32>().clone();
        let reasons = batch.column_by_name("finish_reason").unwrap();
        for i in 0..batch.num_rows() {
            let reason = reasons.as_string::<i32>().value(i).to_string();
            out.push((reason, col.is_valid(i).then(|| col.value(i))));
        }
    }
    out
}

#[test]
fn prompt_logprobs_are_recorded_once_per_position() {
    let mut f = fixture("samp-plp", &[Some("w5 w6 w7 w8 w9")]);
    f.cfg.output.prompt_logprobs = 1;
    f.cfg.sampling.params.max_new_tokens = 2;
    let mut s = Run::new(f.cfg.clone()).unwrap();
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(p.prompt_logprobs, vec![1]);
    let plen = p.prompt_lens[0] as usize;
    assert_eq!(
        p.num_tokens(),
        plen,
        "computed whole: nothing from the cache"
    );
    // positions 0..plen-1 predict prompt tokens 1..plen; position 1 is sent twice (a
    // recomputation) and is kept once
    let mut positions: Vec<i32> = (0..plen as i32 - 1).collect();
    positions.insert(2, 1);
    let n = positions.len();
    let pl = PromptLogprobs {
        row_counts: vec![n as i32],
        positions,
        entries: StepLogprobs {
            chosen: (0..n).map(|i| -(i as f32)).collect(),
            top_ids: vec![3; n],
            top_logprobs: vec![0.0; n],
            k: 1,
        },
    };
    s.commit(&[9], &[1], None, None, Some(&pl)).unwrap();
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(p.prompt_logprobs, vec![0], "complete: not asked again");
    s.commit(&[9], &[1], None, None, None).unwrap();
    assert!(s.next_plan().unwrap().is_none());
    s.finish().unwrap();
    let rows: Vec<Vec<f32>> = read_logprobs(&f.cfg.output.output_dir, "prompt_logprobs")
        .into_iter()
        .map(|(_, entries)| {
            let entries = entries.expect("a generated row has prompt logprobs");
            let lps = entries
                .as_struct()
                .column(2)
                .as_primitive::<Float32Type>()
                .clone();
            lps.values().to_vec()
        })
        .collect();
    let want: Vec<f32> = (0..n as i32)
        .filter(|&i| i != 2)
        .map(|i| -(i as f32))
        .collect();
    assert_eq!(rows, vec![want]);
}

/// `(key, column)` pairs as a sampling_columns map.
fn columns_map(pairs: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, c)| (k.to_string(), c.to_string()))
        .collect()
}

fn id_lists(rows: &[Option<&[i64]>]) -> ArrayRef {
    use arrow_array::builder::{Int64Builder, ListBuilder};
    let mut b = ListBuilder::new(Int64Builder::new());
    for r in rows {
        match r {
            Some(ids) => {
                b.values().append_slice(ids);
                b.append(true);
            }
            None => b.append(false),
        }
    }
    Arc::new(b.finish())
}

/// Each row stops on its own ids: the model's EOS unless it ignores it, and its own stop token
/// ids; a row below its min_new_tokens masks exactly those (the plan's end_ids).
#[test]
fn rows_stop_on_their_own_end_ids() {
    use arrow_array::BooleanArray;
    let mut f = with_columns(
        "samp-ends",
        &["w5", "w6", "w7", "w8"],
        vec![
            (
                "ie",
                Arc::new(BooleanArray::from(vec![None, None, Some(true), Some(true)])),
            ),
            ("st", id_lists(&[None, Some(&[7]), Some(&[7, 9]), None])),
            (
                "mn",
                Arc::new(Int64Array::from(vec![None, None, Some(3), Some(2)])),
            ),
        ],
    );
    let map = [
        ("ignore_eos", "ie"),
        ("stop_token_ids", "st"),
        ("min_new_tokens", "mn"),
    ];
    f.cfg.input.sampling_columns = columns_map(&map);
    f.cfg.input.queue_rows = 16;
    let mut s = Run::new(f.cfg.clone()).unwrap();
    wait_for_reader(&s);
    let plans = drive_constant(&mut s, 7, 0);
    s.finish().unwrap();
    // rows 2 and 3 mask while below 3 and 2 outputs: row 2 its stop ids only (it ignores EOS),
    // row 3 nothing (no stop id, EOS ignored); rows 0 and 1 never mask
    let first = &plans[0];
    assert_eq!(first.end_ids, vec![7, 9]);
    assert_eq!(first.cu_end_ids, vec![0, 0, 0, 2, 2]);
    let rows = read_output(&f.cfg.output.output_dir);
    let got: Vec<(i32, &str)> = rows
        .iter()
        .map(|r| (r.output_tokens, r.reason.as_str()))
        .collect();
    assert_eq!(
        got,
        vec![(8, "length"), (1, "stop"), (3, "stop"), (8, "length")]
    );
    assert_eq!(rows[1].text, "", "a stop token id is not in the text");
    // vLLM's stop_reason: the stop token id that ended the row; none for a length
    let stops: Vec<_> = rows.iter().map(|r| r.stop.clone()).collect();
    assert_eq!(
        stops,
        vec![(None, None), (None, Some(7)), (None, Some(7)), (None, None)]
    );
}

/// The EOS id ends a row unless the row ignores EOS.
#[test]
fn ignore_eos_is_a_rows_own() {
    use arrow_array::BooleanArray;
    let mut f = with_columns(
        "samp-ends-eos",
        &["w5", "w6"],
        vec![("ie", Arc::new(BooleanArray::from(vec![None, Some(true)])))],
    );
    f.cfg.input.sampling_columns = columns_map(&[("ignore_eos", "ie")]);
    let mut s = Run::new(f.cfg.clone()).unwrap();
    drive_constant(&mut s, 2, 0);
    s.finish().unwrap();
    let rows = read_output(&f.cfg.output.output_dir);
    assert_eq!(
        (rows[0].output_tokens, rows[0].reason.as_str()),
        (1, "stop")
    );
    assert_eq!(
        (rows[1].output_tokens, rows[1].reason.as_str()),
        (8, "length")
    );
    // an EOS id is no stop_reason (vLLM: None)
    assert!(rows.iter().all(|r| r.stop == (None, None)));
}

/// include_stop_str_in_output keeps the stop string; skip_special_tokens false keeps special
/// tokens in the text, on both paths (the incremental one of rows with stop strings, and the
/// writer's decode of the others).
#[test]
fn stop_strings_kept_and_special_tokens_shown_per_row() {
    use arrow_array::BooleanArray;
    let texts = |tag: &str, token: i32, cols: Vec<(&str, ArrayRef)>, keys: &[(&str, &str)]| {
        let mut f = with_columns(tag, &["w5", "w6", "w7"], cols);
        f.cfg.input.sampling_columns = columns_map(keys);
        f.cfg.sampling.params.max_new_tokens = 2;
        let mut s = Run::new(f.cfg.clone()).unwrap();
        drive_constant(&mut s, token, 0);
        s.finish().unwrap();
        let rows = read_output(&f.cfg.output.output_dir);
        rows.into_iter()
            .map(|r| (r.text, r.stop.0))
            .collect::<Vec<_>>()
    };
    let inc = Arc::new(BooleanArray::from(vec![Some(true), None, Some(false)]));
    let stop = Arc::new(StringArray::from(vec!["w9", "w9", "w9"]));
    let keys = [("include_stop_str_in_output", "inc"), ("stop", "stop")];
    let got = texts("samp-inc", 9, vec![("inc", inc), ("stop", stop)], &keys);
    // the stop string is the row's stop_reason, whether the text keeps it or not
    let w9 = Some("w9".to_string());
    let want = [("w9", w9.clone()), ("", w9.clone()), ("", w9)];
    assert_eq!(got, want.map(|(t, s)| (t.to_string(), s)));
    // token 3 is <pad>, a special token: shown only where skip_special_tokens is false
    let sk = Arc::new(BooleanArray::from(vec![Some(false), Some(false), None]));
    let stop = Arc::new(StringArray::from(vec![Some("zz"), None, None]));
    let keys = [("skip_special_tokens", "sk"), ("stop", "stop")];
    let got = texts("samp-special", 3, vec![("sk", sk), ("stop", stop)], &keys);
    let got: Vec<_> = got.into_iter().map(|(t, _)| t).collect();
    assert_eq!(got, vec!["<pad> <pad>", "<pad> <pad>", ""]);
}

/// One OpenAI Batch file may mix endpoints: each row's `endpoint` column is its line's url
/// (null where the line names none eaglebatch serves, an error row).
#[test]
fn batch_lines_keep_their_own_endpoints() {
    let mut f = fixture("batch-mixed", &[]);
    let input = f.dir.path().join("in.jsonl");
    let line = |id: &str, url: &str, body: &str| {
        format!(r#"{{"custom_id": "{id}", "method": "POST", "url": "{url}", "body": {body}}}"#)
    };
    let lines = [
        line(
            "c",
            CHAT_URL,
            r#"{"messages": [{"role": "user", "content": "w5 w6"}]}"#,
        ),
        line("p", COMPLETIONS_URL, r#"{"prompt": "w7"}"#),
        String::new(),
        line("e", "/v1/responses", r#"{"input": "w8"}"#),
    ];
    std::fs::write(&input, lines.join("\n")).unwrap();
    f.cfg.input.input_files = vec![input];
    f.cfg.input.input_format = "openai-batch".into();
    (f.cfg.input.prompt_column, f.cfg.input.id_column) = (None, None);
    f.cfg.input.chat_template = Some("{% for m in messages %}{{ m.content }} {% endfor %}".into());
    let mut s = Run::new(f.cfg.clone()).unwrap();
    drive_constant(&mut s, 2, 0);
    s.finish().unwrap();
    let batches = read_parts(&f.cfg.output.output_dir);
    let mut got: Vec<(String, Option<String>)> = Vec::new();
    for b in &batches {
        let (ids, urls) = (
            b.column_by_name("id").unwrap(),
            b.column_by_name("endpoint").unwrap(),
        );
        for i in 0..b.num_rows() {
            let url = urls
                .is_valid(i)
                .then(|| urls.as_string::<i32>().value(i).to_string());
            got.push((ids.as_string::<i32>().value(i).to_string(), url));
        }
    }
    got.sort();
    let want = [
        ("c", Some(CHAT_URL)),
        ("e", None),
        ("p", Some(COMPLETIONS_URL)),
    ];
    let want: Vec<_> = want
        .iter()
        .map(|(i, u)| (i.to_string(), u.map(str::to_string)))
        .collect();
    assert_eq!(got, want);
    // a Parquet job has no endpoint column
    let f = fixture("batch-none", &[Some("w5")]);
    let mut s = Run::new(f.cfg.clone()).unwrap();
    drive_constant(&mut s, 2, 0);
    s.finish().unwrap();
    assert!(read_parts(&f.cfg.output.output_dir)[0]
        .column_by_name("endpoint")
        .is_none());
}

/// A batch line's own n: its samples (the parts' `n` column), resumed by the stride keys even
/// where the written samples outnumber the job's n per row; the progress total follows.
#[test]
fn batch_lines_bring_their_own_n() {
    let mut f = fixture("batch-n", &[]);
    let input = f.dir.path().join("in.jsonl");
    let line = |id: &str, extra: &str| {
        format!(
            r#"{{"custom_id": "{id}", "url": "{COMPLETIONS_URL}", "body": {{"prompt": "w5 w6", "temperature": 1{extra}}}}}"#
        )
    };
    let lines = [line("a", r#", "n": 3"#), line("b", "")];
    std::fs::write(&input, lines.join("\n")).unwrap();
    f.cfg.input.input_files = vec![input];
    f.cfg.input.input_format = "openai-batch".into();
    (f.cfg.input.prompt_column, f.cfg.input.id_column) = (None, None);
    // line a's samples 0 and 2 were written, and line b's one: more than rows x the job's n
    f.cfg.input.skip_samples = vec![0, 2, 4096];
    let mut s = Run::new(f.cfg.clone()).unwrap();
    wait_for_reader(&s);
    drive_constant(&mut s, 9, 0);
    assert_eq!(s.progress()[0], ("requests_total", 1), "a's sample 1");
    s.finish().unwrap();
    let mut got: Vec<(i64, i32, i32)> = Vec::new();
    for b in read_parts(&f.cfg.output.output_dir) {
        let col = |n: &str| b.column_by_name(n).unwrap().clone();
        for i in 0..b.num_rows() {
            got.push((
                col("row_index")
                    .as_primitive::<arrow_array::types::Int64Type>()
                    .value(i),
                col("sample_index").as_primitive::<Int32Type>().value(i),
                col("n").as_primitive::<Int32Type>().value(i),
            ));
        }
    }
    got.sort();
    assert_eq!(got, vec![(0, 1, 3)]);
}

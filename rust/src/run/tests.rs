//! Run tests: a fake "model" drives a run end to end (next token = last query token + 1 mod
//! vocab) over Parquet written in a temp dir; outputs are read back. The policy alone is tested
//! in memory (scheduler/tests.rs).

use std::collections::BTreeMap;

use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type};
use arrow_array::{Array, ArrayRef, StringArray};

use super::*;
use crate::scheduler::request_seed;
pub(super) use crate::scheduler::tests::check_plan;
use crate::stats::SummaryValue;
use crate::testutil::{
    corrupt_row_group, read_parts, save_tokenizer, word_level_tokenizer, write_parquet, TempDir,
};

pub(super) const VOCAB: usize = 64;

pub(super) struct Fixture {
    pub(super) dir: TempDir,
    pub(super) cfg: RunConfig,
}

/// Prompts as word lists ("w5 w6"); `None` = null prompt.
pub(super) fn fixture(tag: &str, prompts: &[Option<&str>]) -> Fixture {
    let dir = TempDir::new(tag);
    let input = dir.path().join("in.parquet");
    let ids: Vec<String> = (0..prompts.len()).map(|i| format!("r{i}")).collect();
    write_parquet(
        &input,
        vec![
            (
                "prompt",
                std::sync::Arc::new(StringArray::from(prompts.to_vec())) as ArrayRef,
            ),
            ("id", std::sync::Arc::new(StringArray::from(ids))),
        ],
        3,
    );
    let tok = save_tokenizer(&word_level_tokenizer(VOCAB), dir.path());
    let mut cfg = RunConfig::new(vec![input], "prompt", tok, dir.path().join("out"));
    cfg.input.id_column = Some("id".into());
    cfg.sampling.eos_token_ids = vec![2];
    cfg.sampling.params.max_new_tokens = 8;
    cfg.policy.num_blocks = 64;
    cfg.policy.block_size = 4;
    cfg.policy.max_batch_size = 4;
    cfg.policy.max_num_batched_tokens = 64;
    cfg.policy.max_model_len = 64;
    cfg.input.read_batch_rows = 2;
    cfg.input.queue_rows = 2;
    cfg.output.part_rows = 3;
    cfg.output.include_token_ids = true;
    Fixture { dir, cfg }
}

/// Waits until the reader thread has queued everything (makes admission deterministic).
pub(super) fn wait_for_reader(s: &Run) {
    while !s._reader.is_finished() {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Runs the fake model to the end; `k` tokens per row per commit (speculative-style) when > 1.
pub(super) fn drive(s: &mut Run, k: usize) -> usize {
    let cfg = s.config().clone();
    let mut steps = 0;
    while let Some(p) = s.next_plan().unwrap() {
        check_plan(&p, &cfg);
        let mut tokens = Vec::new();
        let mut counts = Vec::new();
        for r in 0..p.num_seqs() {
            let last = p.input_ids[p.cu_seqlens_q[r + 1] as usize - 1];
            for j in 1..=k {
                tokens.push(((last + j as i64) % VOCAB as i64) as i32);
            }
            counts.push(k as i32);
        }
        s.commit(&tokens, &counts, None, None, None).unwrap();
        steps += 1;
        assert!(steps < 100_000, "no progress");
    }
    steps
}

/// A written row, read back from the output (the driver's rows are the same type).
pub(super) use crate::scheduler::tests::Row;

pub(super) fn read_output(dir: &std::path::Path) -> Vec<Row> {
    let mut rows = Vec::new();
    for b in read_parts(dir) {
        for i in 0..b.num_rows() {
            let col = |n: &str| b.column_by_name(n).unwrap().clone();
            rows.push(Row {
                id: col("id").as_string::<i32>().value(i).to_string(),
                row_index: col("row_index").as_primitive::<Int64Type>().value(i),
                sample_index: col("sample_index").as_primitive::<Int32Type>().value(i),
                text: col("output_text").as_string::<i32>().value(i).to_string(),
                reason: col("finish_reason").as_string::<i32>().value(i).to_string(),
                prompt_tokens: col("prompt_tokens").as_primitive::<Int32Type>().value(i),
                output_tokens: col("output_tokens").as_primitive::<Int32Type>().value(i),
                cached_tokens: col("cached_tokens").as_primitive::<Int32Type>().value(i),
                error: {
                    let e = col("error");
                    e.is_valid(i)
                        .then(|| e.as_string::<i32>().value(i).to_string())
                },
                token_ids: col("output_token_ids")
                    .as_list::<i32>()
                    .value(i)
                    .as_primitive::<Int32Type>()
                    .values()
                    .to_vec(),
                stop: {
                    let (s, t) = (col("stop_reason"), col("stop_token_id"));
                    (
                        s.is_valid(i)
                            .then(|| s.as_string::<i32>().value(i).to_string()),
                        t.is_valid(i)
                            .then(|| t.as_primitive::<Int32Type>().value(i)),
                    )
                },
            });
        }
    }
    rows.sort_by_key(|r| (r.row_index, r.sample_index));
    rows
}

pub(super) fn words(ids: std::ops::Range<usize>) -> String {
    ids.map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ")
}

#[test]
fn every_row_written_once_with_expected_outputs() {
    let f = fixture(
        "sched-basic",
        &[
            Some("w5 w6"),
            None,
            Some("w10"),
            Some(""),
            Some("w60"),
            Some("w20 w21 w22"),
        ],
    );
    let mut s = Run::new(f.cfg.clone()).unwrap();
    drive(&mut s, 1);
    let summary = s.finish().unwrap();
    assert_eq!(summary["requests"], SummaryValue::Int(6));
    assert_eq!(summary["errors"], SummaryValue::Int(2));
    let rows = read_output(&f.cfg.output.output_dir);
    assert_eq!(rows.len(), 6);
    assert_eq!(
        rows.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        ["r0", "r1", "r2", "r3", "r4", "r5"]
    );
    // Prompt "<bos> w5 w6": continues w7.. for max_new_tokens = 8.
    assert_eq!(rows[0].text, words(7..15));
    assert_eq!(rows[0].reason, "length");
    assert_eq!(rows[0].prompt_tokens, 3);
    assert_eq!(rows[0].output_tokens, 8);
    assert_eq!(rows[0].token_ids, (7..15).collect::<Vec<i32>>());
    assert_eq!(rows[1].reason, "error");
    assert!(rows[1].error.as_deref().unwrap().contains("null"));
    assert_eq!(rows[1].output_tokens, 0);
    assert!(rows[3].error.as_deref().unwrap().contains("empty"));
    // "w60" -> w61 w62 w63 <unk>(0, special) <bos>(1, special) <eos>(2): stop on EOS. The EOS
    // token is counted but not in the text; special tokens are skipped in the text.
    assert_eq!(rows[4].reason, "stop");
    assert_eq!(rows[4].text, "w61 w62 w63");
    assert_eq!(rows[4].output_tokens, 6);
    assert_eq!(rows[4].token_ids, vec![61, 62, 63, 0, 1, 2]);
    assert!(rows[4].error.is_none());
}

#[test]
fn stop_strings_truncate_and_drop_later_tokens_of_the_same_commit() {
    let mut f = fixture("sched-stop", &[Some("w5"), Some("w30")]);
    f.cfg.sampling.params.stop = vec!["w9".into(), "w33 w3".into()];
    f.cfg.sampling.params.max_new_tokens = 20;
    let mut s = Run::new(f.cfg.clone()).unwrap();
    drive(&mut s, 3); // three tokens per row per commit
    let summary = s.finish().unwrap();
    let rows = read_output(&f.cfg.output.output_dir);
    // w6 w7 w8 w9 -> cut before "w9"; the commit that produced w9 also gave w10 (dropped).
    assert_eq!(rows[0].text, "w6 w7 w8 ");
    assert_eq!(rows[0].reason, "stop");
    assert_eq!(rows[0].output_tokens, 4);
    // "w31 w32 w33 w34": "w33 w3" matches inside "w33 w34".
    assert_eq!(rows[1].text, "w31 w32 ");
    assert_eq!(rows[1].output_tokens, 4);
    assert_eq!(summary["output_tokens"], SummaryValue::Int(8));
}

/// Drives verify steps like a speculative worker: row r of step n accepts (n + r) % (k + 1)
/// drafts of the fake model; the outputs must equal plain decoding.
#[test]
fn commit_without_plan_and_early_finish_are_errors() {
    let f = fixture("sched-misuse", &[Some("w5")]);
    let mut s = Run::new(f.cfg.clone()).unwrap();
    assert!(s.commit(&[1], &[1], None, None, None).is_err());
    let _ = s.next_plan().unwrap().unwrap();
    let err = s.finish().unwrap_err();
    assert!(err.to_string().contains("next_plan"), "{err}");
}

#[test]
fn spec_counters_and_seeds() {
    let mut f = fixture("sched-spec", &[Some("w5")]);
    f.cfg.sampling.params.max_new_tokens = 4;
    f.cfg.sampling.seed = 7;
    f.cfg.policy.max_draft_tokens = 2;
    let mut s = Run::new(f.cfg.clone()).unwrap();
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(p.seeds, vec![request_seed(7, 0)]);
    assert!(p.seeds[0] >= 0);
    s.commit(&[6], &[1], Some(&[0]), None, None).unwrap();
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(p.kind, StepKind::Verify);
    s.commit(&[7, 8, 9], &[3], Some(&[2]), None, None).unwrap();
    assert!(s.next_plan().unwrap().is_none());
    s.finish().unwrap();
    let out = f.cfg.output.output_dir.clone();
    let b = read_parts(&out).swap_remove(0);
    assert_eq!(
        b.column_by_name("spec_steps")
            .unwrap()
            .as_primitive::<Int32Type>()
            .value(0),
        1
    );
    assert_eq!(
        b.column_by_name("accepted_tokens")
            .unwrap()
            .as_primitive::<Int32Type>()
            .value(0),
        2
    );
    let al = b
        .column_by_name("accept_length")
        .unwrap()
        .as_primitive::<arrow_array::types::Float64Type>()
        .value(0);
    // One verify round that produced 3 tokens (the prefill's token is not a verify round).
    assert_eq!(al, 3.0);
    assert_ne!(request_seed(7, 0), request_seed(7, 1));
    assert_ne!(request_seed(7, 0), request_seed(8, 0));
}

#[test]
fn empty_input_finishes_with_a_readable_empty_part() {
    let f = fixture("sched-empty", &[]);
    let mut s = Run::new(f.cfg.clone()).unwrap();
    assert!(s.next_plan().unwrap().is_none());
    let summary = s.finish().unwrap();
    match &summary["part_files"] {
        SummaryValue::Paths(p) => assert_eq!(p.len(), 1),
        other => panic!("{other:?}"),
    }
    assert!(read_output(&f.cfg.output.output_dir).is_empty());
}

#[test]
fn progress_counts() {
    let f = fixture("sched-progress", &[Some("w5"), None]);
    let mut s = Run::new(f.cfg.clone()).unwrap();
    let prog: BTreeMap<_, _> = s.progress().into_iter().collect();
    assert_eq!(prog["requests_total"], 2);
    assert_eq!(prog["free_blocks"], 64);
    drive(&mut s, 1);
    let prog: BTreeMap<_, _> = s.progress().into_iter().collect();
    assert_eq!(prog["requests_done"], 2);
    assert_eq!(prog["requests_error"], 1);
    assert_eq!(prog["prompt_tokens"], 2);
    assert_eq!(prog["output_tokens"], 8);
    assert_eq!(prog["running"] + prog["waiting"], 0);
    // both rows read, the error row's prompt not queued; the other ran to max_new_tokens
    assert_eq!(prog["requests_read"], 2);
    assert_eq!(prog["prompt_tokens_read"], 2);
    assert_eq!(prog["finished_output_tokens"], 8);
    assert_eq!(prog["requests_stopped"], 0);
    s.finish().unwrap();
}

#[test]
fn progress_counts_rows_that_stop() {
    let f = fixture("sched-progress-stop", &[Some("w5 w6"), Some("w7")]);
    let mut cfg = f.cfg.clone();
    cfg.sampling.eos_token_ids = (0..VOCAB as u32).collect(); // every first token ends its row
    let mut s = Run::new(cfg).unwrap();
    drive(&mut s, 1);
    let prog: BTreeMap<_, _> = s.progress().into_iter().collect();
    assert_eq!(prog["requests_read"], 2);
    assert_eq!(prog["prompt_tokens_read"], prog["prompt_tokens"]);
    assert_eq!(prog["requests_stopped"], 2);
    assert_eq!(prog["finished_output_tokens"], 2);
    s.finish().unwrap();
}

/// The names of the files in `dir`, sorted.
fn file_names(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Drives the fake model until `next_plan` fails; returns the error.
fn drive_to_error(s: &mut Run) -> Error {
    for _ in 0..1000 {
        match s.next_plan() {
            Ok(Some(p)) => {
                let toks: Vec<i32> = (0..p.num_seqs())
                    .map(|r| (p.input_ids[p.cu_seqlens_q[r + 1] as usize - 1] + 1) as i32)
                    .collect();
                s.commit(&toks, &vec![1; p.num_seqs()], None, None, None)
                    .unwrap();
            }
            Ok(None) => panic!("the corrupt input must surface as an error"),
            Err(e) => return e,
        }
    }
    panic!("no progress");
}

#[test]
fn corrupt_data_page_is_reported_not_silently_truncated() {
    let f = fixture("sched-corrupt", &[Some("w5 w6 w7"); 12]);
    let path = f.cfg.input.input_files[0].clone();
    let mut bytes = std::fs::read(&path).unwrap();
    // Footer intact (validation passes), data pages garbage.
    let footer_len =
        u32::from_le_bytes(bytes[bytes.len() - 8..bytes.len() - 4].try_into().unwrap());
    let data_end = bytes.len() - 8 - footer_len as usize;
    for b in &mut bytes[4..data_end] {
        *b = 0xA5;
    }
    std::fs::write(&path, bytes).unwrap();
    let mut s = Run::new(f.cfg.clone()).unwrap();
    let e = drive_to_error(&mut s);
    let msg = e.to_string();
    assert!(matches!(e, Error::UserInput(_)), "{e:?}");
    assert!(
        msg.contains("in.parquet, row group 0") && msg.contains("corrupt or unreadable"),
        "{msg}"
    );
    // Reported again, as the same kind of error, by every later call.
    assert!(matches!(s.next_plan(), Err(Error::UserInput(m)) if m == msg));
    assert!(matches!(s.finish(), Err(Error::UserInput(m)) if m == msg));
    // No row was finished: the failed run leaves no part file, not even an empty one.
    assert!(file_names(&f.cfg.output.output_dir).is_empty());
}

/// Every row read before a corrupt row group is generated before the failure is reported, and
/// `abort` writes them into a complete part; the rows after it are not, and nothing else is
/// left in the output directory.
#[test]
fn rows_before_a_corrupt_row_group_are_generated_then_the_failure_is_reported() {
    let prompts: Vec<String> = (0..12).map(|i| words(5 + i..6 + i)).collect();
    let prompts: Vec<Option<&str>> = prompts.iter().map(|s| Some(s.as_str())).collect();
    let mut f = fixture("sched-corrupt-late", &prompts);
    f.cfg.sampling.params.max_new_tokens = 1;
    f.cfg.input.queue_rows = 64;
    corrupt_row_group(&f.cfg.input.input_files[0], 2); // rows 6..9
    let mut s = Run::new(f.cfg.clone()).unwrap();
    // Rows 0..6 and the failure queued: all six rows run before next_plan reports it.
    wait_for_reader(&s);
    let e = drive_to_error(&mut s);
    assert!(
        e.to_string()
            .contains("in.parquet, row group 2: the input file is corrupt"),
        "{e}"
    );
    let written = s.abort().unwrap();
    let rows = read_output(&f.cfg.output.output_dir);
    assert_eq!(written.rows_written, 6);
    let mut done: Vec<i64> = rows.iter().map(|r| r.row_index).collect();
    done.sort_unstable();
    assert_eq!(done, [0, 1, 2, 3, 4, 5]);
    for r in &rows {
        let first = 6 + r.row_index as usize;
        assert_eq!(r.text, words(first..first + 1));
    }
    let names = file_names(&f.cfg.output.output_dir);
    assert!(
        names
            .iter()
            .all(|n| n.starts_with("part-") && n.ends_with(".parquet")),
        "{names:?}"
    );
}

/// Dropping a scheduler whose run failed (no `finish`, no `abort`) writes no empty part.
#[test]
fn a_dropped_failed_run_writes_no_empty_part() {
    let f = fixture("sched-corrupt-drop", &[Some("w5"); 6]);
    corrupt_row_group(&f.cfg.input.input_files[0], 0);
    let mut s = Run::new(f.cfg.clone()).unwrap();
    drive_to_error(&mut s);
    drop(s);
    assert!(file_names(&f.cfg.output.output_dir).is_empty());
}

#[test]
fn skip_rows_resume_writes_only_the_rest() {
    let prompts: Vec<Option<&str>> = vec![Some("w5"), Some("w6"), None, Some("w8"), Some("w9")];
    let full = fixture("sched-skip-full", &prompts);
    let mut s = Run::new(full.cfg.clone()).unwrap();
    drive(&mut s, 1);
    s.finish().unwrap();
    let want = read_output(&full.cfg.output.output_dir);

    let mut f = fixture("sched-skip", &prompts);
    f.cfg.input.skip_rows = vec![3, 0, 3, 2, 99];
    let mut s = Run::new(f.cfg.clone()).unwrap();
    let prog: BTreeMap<_, _> = s.progress().into_iter().collect();
    assert_eq!(prog["requests_total"], 2);
    assert_eq!(prog["requests_skipped"], 3);
    drive(&mut s, 1);
    let summary = s.finish().unwrap();
    assert_eq!(summary["requests"], SummaryValue::Int(2));
    assert_eq!(summary["skipped"], SummaryValue::Int(3));
    let rows = read_output(&f.cfg.output.output_dir);
    assert_eq!(rows.iter().map(|r| r.row_index).collect::<Vec<_>>(), [1, 4]);
    assert_eq!(rows[0], want[1]);
    assert_eq!(rows[1], want[4]);
}

#[test]
fn abort_writes_finished_rows_and_drops_the_rest() {
    let prompts: Vec<Option<&str>> = vec![Some("w5"), None, Some("w7 w8"), Some("w9")];
    let mut f = fixture("sched-abort", &prompts);
    f.cfg.sampling.params.max_new_tokens = 3;
    f.cfg.policy.max_batch_size = 1;
    let mut s = Run::new(f.cfg.clone()).unwrap();
    // Finish row 0 (prefill + 2 decodes); row 1 (null) is written as an error when read.
    for _ in 0..3 {
        let p = s.next_plan().unwrap().unwrap();
        let last = *p.input_ids.last().unwrap() as i32;
        s.commit(&[(last + 1) % VOCAB as i32], &[1], None, None, None)
            .unwrap();
    }
    // Row 2 is planned but never committed.
    let _ = s.next_plan().unwrap().unwrap();
    let written = s.abort().unwrap();
    let rows = read_output(&f.cfg.output.output_dir);
    assert_eq!(written.rows_written as usize, rows.len());
    let idx: Vec<i64> = rows.iter().map(|r| r.row_index).collect();
    assert!(
        idx.starts_with(&[0]) && !idx.contains(&2) && !idx.contains(&3),
        "{idx:?}"
    );
    assert_eq!(rows[0].text, "w6 w7 w8");
    assert!(s.finish().is_err());
    assert!(s.abort().is_err());
}

#[test]
fn resume_skips_written_samples_and_counts_the_rest() {
    let mut f = fixture("n-resume", &[Some("w4 w5"), Some("w6"), Some("w7 w8")]);
    (f.cfg.sampling.params.n, f.cfg.sampling.params.temperature) = (2, 1.0);
    f.cfg.input.skip_rows = vec![1];
    // keys row * 4096 + sample: (2, 1), (1, 0) skipped whole, a row past the input
    f.cfg.input.skip_samples = vec![2 * 4096 + 1, 4096, 99 * 4096];
    let mut s = Run::new(f.cfg.clone()).unwrap();
    assert_eq!(s.progress()[0], ("requests_total", 3));
    drive(&mut s, 1);
    s.finish().unwrap();
    let keys: Vec<(i64, i32)> = read_output(&f.cfg.output.output_dir)
        .iter()
        .map(|r| (r.row_index, r.sample_index))
        .collect();
    assert_eq!(keys.len(), 3);
    for k in [(0, 0), (0, 1), (2, 0)] {
        assert!(keys.contains(&k), "{keys:?}");
    }
}

//! Overlap: plans built ahead of the pending plan's commit (`next_plan_ahead`) give the outputs
//! of plans built one at a time, whatever finishes when (EOS, stop strings, length limits),
//! with chunked prefill, prefix caching, preemption and n samples.

use super::tests::{check_plan, drive, fixture, read_output, wait_for_reader, words, Row, VOCAB};
use super::*;
use crate::stats::SummaryValue;

/// The tests' fake model over a plan (next token = last query token + 1 mod vocab); a
/// placeholder (-1, `prev_rows`) is the pending plan's token for the row, from `prev`.
fn fake_step(p: &StepPlan, prev: &[i32]) -> Vec<i32> {
    (0..p.num_seqs())
        .map(|r| {
            let last = p.input_ids[p.cu_seqlens_q[r + 1] as usize - 1];
            let last = match p.prev_rows[r] {
                -1 => last,
                i => {
                    assert_eq!(last, -1, "a placeholder row's last query token");
                    prev[i as usize] as i64
                }
            };
            assert!(last >= 0);
            ((last + 1) % VOCAB as i64) as i32
        })
        .collect()
}

/// Runs to the end, each plan built before the previous one's commit whenever the scheduler
/// can; returns (steps, steps planned ahead).
fn drive_overlapped(s: &mut Scheduler) -> (usize, usize) {
    let cfg = s.config().clone();
    let mut pending: Option<(usize, Vec<i32>)> = None; // (rows, sampled tokens)
    let (mut steps, mut ahead) = (0, 0);
    loop {
        let plan = match pending {
            Some(_) => s.next_plan_ahead().unwrap(),
            None => s.next_plan().unwrap(),
        };
        let commit = |s: &mut Scheduler, (rows, toks): (usize, Vec<i32>)| {
            s.commit(&toks, &vec![1; rows], None, None, None).unwrap()
        };
        let Some(plan) = plan else {
            match pending.take() {
                Some(p) => commit(s, p),
                None => break,
            }
            continue;
        };
        check_plan(&plan, &cfg);
        let prev = pending.as_ref().map(|(_, t)| t.as_slice()).unwrap_or(&[]);
        let toks = fake_step(&plan, prev);
        ahead += plan.prev_rows.iter().any(|&r| r >= 0) as usize;
        if let Some(p) = pending.take() {
            commit(s, p);
        }
        pending = Some((plan.num_seqs(), toks));
        steps += 1;
        assert!(steps < 100_000, "no progress");
    }
    (steps, ahead)
}

fn prompts() -> Vec<String> {
    (0..14)
        .map(|i| {
            let start = 3 + (i * 17) % 50;
            words(start..start + 1 + (i * 7) % 9)
        })
        .collect()
}

/// One run over `prompts()` with `setup` applied, overlapped or not -> (rows, steps planned
/// ahead, whether a row was preempted).
fn run(tag: &str, overlap: bool, setup: impl Fn(&mut SchedulerConfig)) -> (Vec<Row>, usize, bool) {
    let prompts = prompts();
    let prompts: Vec<Option<&str>> = prompts.iter().map(|p| Some(p.as_str())).collect();
    let mut f = fixture(tag, &prompts);
    setup(&mut f.cfg);
    (f.cfg.overlap, f.cfg.queue_rows) = (overlap, prompts.len());
    let mut s = Scheduler::new(f.cfg.clone()).unwrap();
    wait_for_reader(&s); // every prompt there from the first plan: admission does not race it
    let ahead = if overlap {
        drive_overlapped(&mut s).1
    } else {
        drive(&mut s, 1);
        0
    };
    let summary = s.finish().unwrap(); // no block or slot leaked
    let preempted = summary["preemptions"] != SummaryValue::Int(0);
    let mut rows = read_output(&f.cfg.output_dir);
    rows.sort_by_key(|r| (r.row_index, r.sample_index));
    assert_eq!(rows.len(), prompts.len() * f.cfg.n, "{tag}");
    (rows, ahead, preempted)
}

#[test]
fn overlapped_plans_give_the_outputs_of_plans_one_at_a_time() {
    type Setup = fn(&mut SchedulerConfig);
    let setups: [(&str, Setup); 6] = [
        ("plain", |_| {}),
        ("chunked", |c| {
            (c.chunked_prefill, c.max_num_batched_tokens) = (true, 5);
        }),
        ("small-cache", |c| c.num_blocks = 8), // preemptions
        ("stop-strings", |c| {
            c.stop = vec!["w30".into(), "w9 w10".into()];
            c.max_new_tokens = 12;
        }),
        ("one-token", |c| c.max_new_tokens = 1),
        ("samples", |c| {
            (c.n, c.max_batch_size, c.temperature) = (3, 5, 0.8); // forked prompt blocks
        }),
    ];
    for (name, setup) in setups {
        let (want, _, _) = run(&format!("ov-ref-{name}"), false, setup);
        let (got, ahead, preempted) = run(&format!("ov-{name}"), true, setup);
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.token_ids, w.token_ids, "{name} row {}", w.row_index);
            assert_eq!((&g.text, &g.reason), (&w.text, &w.reason), "{name}");
        }
        if name != "one-token" {
            assert!(ahead > 0, "{name}: nothing planned ahead");
        }
        assert_eq!(preempted, name == "small-cache", "{name}");
    }
}

/// A row that finishes at the pending plan's commit was decoded once more by the plan after
/// it: that token is dropped and its blocks stay allocated until that plan is committed.
#[test]
fn a_row_finishing_under_a_plan_ahead_keeps_its_blocks_until_that_plan_commits() {
    // "w60": 61 62 63 0 1 2 (EOS) - six output tokens, the last an EOS
    let mut f = fixture("ov-drain", &[Some("w60")]);
    f.cfg.overlap = true;
    let mut s = Scheduler::new(f.cfg.clone()).unwrap();
    wait_for_reader(&s);
    let free = s.num_free_blocks();
    let mut p = s.next_plan().unwrap().unwrap();
    let mut prev = fake_step(&p, &[]);
    let mut ahead = 0;
    while let Some(next) = s.next_plan_ahead().unwrap() {
        let toks = fake_step(&next, &prev);
        s.commit(&prev, &[1], None, None, None).unwrap();
        ahead += 1;
        (p, prev) = (next, toks);
    }
    assert_eq!(p.prev_rows, vec![0]);
    assert_eq!(ahead, 6); // prefill, then 5 decodes to the EOS, planned ahead, one past it
    assert!(s.num_free_blocks() < free); // the row finished, the plan after it is pending
    s.commit(&prev, &[1], None, None, None).unwrap();
    assert_eq!(s.num_free_blocks(), free);
    assert!(s.next_plan().unwrap().is_none());
    s.finish().unwrap();
    let rows = read_output(&f.cfg.output_dir);
    assert_eq!(rows[0].token_ids, vec![61, 62, 63, 0, 1, 2]);
    assert_eq!(rows[0].reason, "stop");
}

#[test]
fn no_plan_ahead_for_penalized_rows_and_none_without_overlap() {
    let mut f = fixture("ov-penalty", &[Some("w5 w6")]);
    f.cfg.overlap = true;
    f.cfg.repetition_penalty = 1.2;
    let mut s = Scheduler::new(f.cfg.clone()).unwrap();
    let _ = s.next_plan().unwrap().unwrap();
    assert!(s.next_plan_ahead().unwrap().is_none());
    s.abort().unwrap();

    let f = fixture("ov-off", &[Some("w5 w6")]);
    let mut s = Scheduler::new(f.cfg.clone()).unwrap();
    let _ = s.next_plan().unwrap().unwrap();
    assert!(s.next_plan_ahead().is_err());
    s.abort().unwrap();

    let mut f = fixture("ov-spec", &[Some("w5 w6")]);
    (f.cfg.overlap, f.cfg.max_draft_tokens) = (true, 2);
    assert!(Scheduler::new(f.cfg.clone()).is_err());
}

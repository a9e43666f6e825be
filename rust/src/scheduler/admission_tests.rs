//! Admission and preemption over in-memory sequences (scheduler/tests.rs's driver): the token
//! budget, request slots, the watermark, and preemption by recomputation.

use std::sync::Arc;

use super::tests::{drive, test_config, words, Driver};
use super::*;
use crate::config::RunConfig;

/// The driver over `prompts`, row i with at most `max_new[i]` new tokens.
fn with_max_new(cfg: &RunConfig, prompts: &[&str], max_new: &[usize]) -> Driver {
    let rows: Vec<_> = prompts
        .iter()
        .zip(max_new)
        .map(|(&p, &m)| {
            let mut sp = cfg.sampling_params();
            sp.max_new_tokens = m;
            (Some(p), Arc::new(sp))
        })
        .collect();
    Driver::with_rows(cfg, &rows)
}

/// The one token per row of a plan's fake model.
fn next_tokens(p: &StepPlan) -> Vec<i32> {
    (0..p.num_seqs())
        .map(|r| 4 + (p.input_ids[p.cu_seqlens_q[r + 1] as usize - 1] as i32 % 50))
        .collect()
}

/// Plans and commits one step; returns the plan.
fn step(s: &mut Driver) -> StepPlan {
    let p = s.next_plan().unwrap().unwrap();
    s.commit(&next_tokens(&p), &vec![1; p.num_seqs()], None)
        .unwrap();
    p
}

#[test]
fn the_first_request_is_admitted_past_the_token_budget_and_alone() {
    let mut cfg = test_config();
    cfg.policy.max_num_batched_tokens = 4;
    let mut s = Driver::new(&cfg, &[Some(&words(4..11)), Some("w20")]);
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(
        (p.kind, p.num_seqs(), p.num_tokens()),
        (StepKind::Prefill, 1, 8)
    );
}

#[test]
fn a_finished_rows_slot_is_reused_smallest_first() {
    let mut cfg = test_config();
    cfg.policy.max_batch_size = 3;
    let prompts = ["w4", "w10", "w20", "w30"];
    let mut s = with_max_new(&cfg, &prompts, &[5, 1, 5, 5]);
    let p = step(&mut s); // row 1 ends with its first token
    assert_eq!(p.request_slots, vec![0, 1, 2]);
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(
        (p.kind, p.request_slots.clone()),
        (StepKind::Prefill, vec![1])
    );
    let rows: Vec<i64> = s.s.running().iter().map(|q| q.row_index).collect();
    assert_eq!(rows, vec![0, 2, 3]);
}

#[test]
fn the_watermark_stays_free_when_admitting_beside_running_requests() {
    // 100 blocks of 1 token: 1 block of watermark; the first request takes 50
    for (second, admitted) in [(49, 2), (50, 1)] {
        let mut cfg = test_config();
        (
            cfg.policy.num_blocks,
            cfg.policy.block_size,
            cfg.policy.prefix_caching,
        ) = (100, 1, false);
        cfg.policy.max_num_batched_tokens = 256;
        let prompts = [words(4..53), words(10..10 + second - 1)]; // with <bos>: 50, `second`
        let mut s = Driver::new(&cfg, &[Some(&prompts[0]), Some(&prompts[1])]);
        let p = s.next_plan().unwrap().unwrap();
        assert_eq!(p.num_seqs(), admitted, "second prompt of {second} tokens");
    }
}

#[test]
fn a_preempted_request_returns_to_the_front_and_recomputes_its_tokens() {
    // 6 blocks of 2 tokens; two rows of 3 prompt tokens each need 4 blocks at length 7
    let mut cfg = test_config();
    (
        cfg.policy.num_blocks,
        cfg.policy.block_size,
        cfg.sampling.eos_token_ids,
    ) = (6, 2, vec![]);
    cfg.policy.prefix_caching = false; // its blocks are not found again: all recomputed
    let mut s = Driver::new(&cfg, &[Some("w4 w5"), Some("w10 w11")]);
    while s.st.preemptions == 0 {
        step(&mut s);
    }
    // the most recently admitted row went back, keeping its output tokens
    let running: Vec<i64> = s.s.running().iter().map(|q| q.row_index).collect();
    assert_eq!((running, s.s.waiting_len()), (vec![0], 1));
    let back = s.s.waiting.front().unwrap();
    let want: Vec<u32> = (0..back.len()).map(|i| back.token(i)).collect();
    assert!(want.len() > 3);
    let p = loop {
        let p = step(&mut s);
        if p.kind == StepKind::Prefill {
            break p;
        }
    };
    // its next prefill covers its prompt and the tokens it had generated
    assert_eq!(
        p.input_ids,
        want.iter().map(|&t| t as i64).collect::<Vec<_>>()
    );
    assert_eq!(p.positions[0], 0);
    drive(&mut s, 1);
    let rows = s.finish().unwrap();
    assert!(rows.iter().all(|r| r.output_tokens == 8));
}

#[test]
fn the_oldest_running_request_is_never_preempted() {
    let mut cfg = test_config();
    (
        cfg.policy.num_blocks,
        cfg.policy.block_size,
        cfg.sampling.eos_token_ids,
    ) = (6, 2, vec![]);
    let mut s = Driver::new(&cfg, &[Some("w4 w5"), Some("w10 w11"), Some("w20 w21")]);
    let mut first = None;
    while let Some(p) = s.next_plan().unwrap() {
        s.commit(&next_tokens(&p), &vec![1; p.num_seqs()], None)
            .unwrap();
        let oldest = s.s.running().first().map(|q| q.run_id);
        if let (Some(f), Some(o)) = (first, oldest) {
            // the oldest row keeps running until it finishes
            assert!(o == f || s.s.running().iter().all(|q| q.run_id != f));
        }
        first = oldest;
    }
    assert!(s.st.preemptions > 0);
    assert_eq!(s.finish().unwrap().len(), 3);
}

#[test]
fn a_row_that_finishes_frees_its_blocks_and_slot_at_once() {
    let cfg = test_config();
    let mut s = with_max_new(&cfg, &["w4 w5 w6 w7 w8"], &[1]);
    let free = s.num_free_blocks();
    let p = s.next_plan().unwrap().unwrap();
    assert!(s.num_free_blocks() < free);
    s.commit(&next_tokens(&p), &[1], None).unwrap();
    assert_eq!((s.num_free_blocks(), s.s.running().len()), (free, 0));
    assert!(s.next_plan().unwrap().is_none());
    assert_eq!(s.finish().unwrap()[0].output_tokens, 1);
}

#[test]
fn a_leak_check_before_the_end_and_a_commit_without_a_plan_are_errors() {
    let mut s = Driver::new(&test_config(), &[Some("w5")]);
    assert!(s.s.take_pending().is_err());
    let _ = s.next_plan().unwrap().unwrap();
    assert!(s.next_plan().is_err()); // the driver's check: commit first
    let err = s.s.check_no_leak().unwrap_err().to_string();
    assert!(err.contains("leak"), "{err}");
}

#[test]
fn without_prefix_caching_identical_prompts_share_nothing() {
    let mut cfg = test_config();
    (cfg.policy.prefix_caching, cfg.policy.max_num_batched_tokens) = (false, 128);
    let long = words(4..40); // 37 tokens: a wait for cached blocks would pay with caching
    let mut s = Driver::new(&cfg, &[Some(&long), Some(&long)]);
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!((p.num_seqs(), p.cu_prefix.clone()), (2, vec![0, 0, 0]));
    let tables: Vec<&[i32]> = p.block_tables.chunks(p.block_table_width).collect();
    assert!(tables[0].iter().all(|b| !tables[1].contains(b)));
}

//! Plans over in-memory sequences (scheduler/tests.rs's driver): per-row values, verify and
//! plain decode steps, prefill chunks.

use std::sync::Arc;

use super::tests::{test_config, words, Driver};
use super::*;
use crate::config::RunConfig;
use crate::sampling_params::SamplingParams;

/// The driver over one row with the job's sampling parameters changed by `set`.
fn one_row(cfg: &RunConfig, prompt: &str, set: impl Fn(&mut SamplingParams)) -> Driver {
    let mut sp = cfg.sampling_params();
    set(&mut sp);
    Driver::with_rows(cfg, &[(Some(prompt), Arc::new(sp))])
}

#[test]
fn rows_below_min_new_tokens_mask_their_end_ids() {
    let cfg = test_config(); // EOS 2
    let mut s = one_row(&cfg, "w5", |sp| {
        (sp.min_new_tokens, sp.stop_token_ids) = (2, vec![7, 5, 7]);
    });
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(
        (p.end_ids.clone(), p.cu_end_ids.clone()),
        (vec![2, 5, 7], vec![0, 3])
    );
    assert_eq!(p.min_tokens, vec![2]);
    s.commit(&[9], &[1], None).unwrap();
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(p.end_ids, vec![2, 5, 7]); // 1 output token: still below 2
    s.commit(&[10], &[1], None).unwrap();
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(
        (p.end_ids.clone(), p.cu_end_ids.clone()),
        (vec![], vec![0, 0])
    );

    let mut s = one_row(&cfg, "w5", |sp| {
        (sp.min_new_tokens, sp.ignore_eos, sp.stop_token_ids) = (1, true, vec![7]);
    });
    assert_eq!(s.next_plan().unwrap().unwrap().end_ids, vec![7]); // no EOS: it is ignored
}

#[test]
fn samples_of_a_row_get_their_own_seeds_and_sample_zero_the_rows() {
    let mut cfg = test_config();
    (
        cfg.sampling.seed,
        cfg.sampling.params.n,
        cfg.sampling.params.temperature,
    ) = (7, 2, 1.0);
    let mut s = Driver::new(&cfg, &[Some("w5 w6"), Some("w9")]);
    // a row's sample 1 waits for sample 0 to compute their prompt; the row seed is sample 0's
    let p = s.next_plan().unwrap().unwrap();
    let row_seeds = [request_seed(7, 0), request_seed(7, 1)];
    assert_eq!(p.seeds, vec![row_seeds[0]]);
    let mut seeds = p.seeds.clone();
    s.commit(&[9], &[1], None).unwrap();
    while let Some(p) = s.next_plan().unwrap() {
        if p.kind == StepKind::Prefill {
            seeds.extend(&p.seeds);
        }
        s.commit(&vec![9; p.num_seqs()], &vec![1; p.num_seqs()], None)
            .unwrap();
    }
    let mut want: Vec<i64> = row_seeds
        .iter()
        .flat_map(|&r| [r, sample_seed(r, 1)])
        .collect();
    seeds.sort();
    want.sort();
    assert_eq!(seeds, want);
    want.dedup();
    assert_eq!(want.len(), 4);
}

#[test]
fn penalized_rows_carry_their_known_tokens() {
    let cfg = test_config();
    let mut s = one_row(&cfg, "w5 w6", |sp| sp.repetition_penalty = 1.2);
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(p.penalty_ids, vec![1, 5, 6]);
    assert_eq!(
        (p.cu_penalty.clone(), p.penalty_prompt_lens.clone()),
        (vec![0, 3], vec![3])
    );
    s.commit(&[9], &[1], None).unwrap();
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(p.penalty_ids, vec![1, 5, 6, 9]);

    let mut s = Driver::new(&cfg, &[Some("w5 w6")]); // no penalty: no tokens
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!((p.penalty_ids.len(), p.cu_penalty.clone()), (0, vec![0, 0]));
}

#[test]
fn a_verify_plan_holds_each_rows_token_and_room_for_w_drafts() {
    let mut cfg = test_config();
    (cfg.policy.max_draft_tokens, cfg.policy.block_size) = (3, 4);
    let mut s = Driver::new(&cfg, &[Some("w5 w6"), Some("w20")]);
    let p = s.next_plan().unwrap().unwrap();
    s.commit(&[9, 21], &[1, 1], Some(&[0, 0])).unwrap();
    assert_eq!(p.kind, StepKind::Prefill);
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(p.kind, StepKind::Verify);
    assert_eq!(p.input_ids, vec![9, 0, 0, 0, 21, 0, 0, 0]);
    assert_eq!(p.positions, vec![3, 4, 5, 6, 2, 3, 4, 5]);
    assert_eq!((p.seq_lens.clone(), p.max_seqlen_q), (vec![7, 6], 4));
    // a row's blocks hold its W lookahead slots: 7 tokens in blocks of 4
    assert_eq!(s.s.running()[0].block_table.len(), 2);
}

#[test]
fn plain_steps_in_a_speculative_job_decode_without_lookahead() {
    let mut cfg = test_config();
    cfg.policy.max_draft_tokens = 3;
    let mut s = Driver::new(&cfg, &[Some("w5 w6")]);
    let p = s.next_plan().unwrap().unwrap();
    s.commit(&[9], &[1], Some(&[0])).unwrap();
    assert_eq!(p.kind, StepKind::Prefill);
    s.set_plain_steps(true);
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!((p.kind, p.input_ids.clone()), (StepKind::Decode, vec![9]));
    s.commit(&[10], &[1], None).unwrap();
    s.set_plain_steps(false);
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(
        (p.kind, p.input_ids.clone()),
        (StepKind::Verify, vec![10, 0, 0, 0])
    );
}

#[test]
fn a_chunk_short_of_the_prompts_end_samples_nothing() {
    let mut cfg = test_config();
    (
        cfg.policy.chunked_prefill,
        cfg.policy.max_num_batched_tokens,
    ) = (true, 4);
    let mut s = Driver::new(&cfg, &[Some(&words(4..13))]); // 10 tokens with <bos>
    let mut chunks = Vec::new();
    for _ in 0..3 {
        let p = s.next_plan().unwrap().unwrap();
        let prefix = (p.cu_prefix[1] - p.cu_prefix[0]) as usize;
        chunks.push((p.num_tokens(), prefix, p.next_ids[0]));
        s.commit(&[40], &[1], None).unwrap();
    }
    // the first two chunks' tokens are dropped: the row's query stopped before its end
    assert_eq!(chunks, vec![(4, 0, 7), (4, 4, 11), (2, 8, -1)]);
    assert_eq!(s.s.running()[0].output_ids, vec![40]);
}

//! Overlap: plans built ahead of the pending plan's commit (`plan_ahead`) give the outputs
//! of plans built one at a time, whatever finishes when (EOS, stop strings, length limits),
//! with chunked prefill, prefix caching, preemption and n samples.

use std::sync::Arc;

use super::tests::{check_plan, drive, test_config, words, Driver, Row, VOCAB};
use super::*;
use crate::config::RunConfig;
use crate::sampling_params::SamplingParams;

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
fn drive_overlapped(s: &mut Driver) -> (usize, usize) {
    try_drive_overlapped(s).unwrap()
}

/// `drive_overlapped`, the scheduler's first error returned instead of a panic.
fn try_drive_overlapped(s: &mut Driver) -> Result<(usize, usize)> {
    let cfg = s.config().clone();
    let mut pending: Option<(usize, Vec<i32>)> = None; // (rows, sampled tokens)
    let (mut steps, mut ahead) = (0, 0);
    loop {
        let plan = match pending {
            Some(_) => s.next_plan_ahead()?,
            None => s.next_plan()?,
        };
        let commit =
            |s: &mut Driver, (rows, toks): (usize, Vec<i32>)| s.commit(&toks, &vec![1; rows], None);
        let Some(plan) = plan else {
            match pending.take() {
                Some(p) => commit(s, p)?,
                None => break,
            }
            continue;
        };
        check_plan(&plan, &cfg);
        let prev = pending.as_ref().map(|(_, t)| t.as_slice()).unwrap_or(&[]);
        let toks = fake_step(&plan, prev);
        ahead += plan.prev_rows.iter().any(|&r| r >= 0) as usize;
        if let Some(p) = pending.take() {
            commit(s, p)?;
        }
        pending = Some((plan.num_seqs(), toks));
        steps += 1;
        assert!(steps < 100_000, "no progress");
    }
    Ok((steps, ahead))
}

/// `drive(s, 1)` (plans one at a time), the scheduler's first error returned instead of a
/// panic.
fn try_drive(s: &mut Driver) -> Result<usize> {
    let cfg = s.config().clone();
    let mut steps = 0;
    while let Some(p) = s.next_plan()? {
        check_plan(&p, &cfg);
        let toks = fake_step(&p, &[]);
        s.commit(&toks, &vec![1; p.num_seqs()], None)?;
        steps += 1;
        assert!(steps < 100_000, "no progress");
    }
    Ok(steps)
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
fn run(tag: &str, overlap: bool, setup: impl Fn(&mut RunConfig)) -> (Vec<Row>, usize, bool) {
    run_over(tag, &prompts(), overlap, setup)
}

/// `run` over `prompts`.
fn run_over(
    tag: &str,
    prompts: &[String],
    overlap: bool,
    setup: impl Fn(&mut RunConfig),
) -> (Vec<Row>, usize, bool) {
    let prompts: Vec<Option<&str>> = prompts.iter().map(|p| Some(p.as_str())).collect();
    let mut cfg = test_config();
    setup(&mut cfg);
    cfg.policy.overlap = overlap;
    let mut s = Driver::new(&cfg, &prompts);
    let ahead = if overlap {
        drive_overlapped(&mut s).1
    } else {
        drive(&mut s, 1);
        0
    };
    let preempted = s.st.preemptions != 0;
    let rows = s.finish().unwrap(); // no block or slot leaked
    assert_eq!(rows.len(), prompts.len() * cfg.sampling.params.n, "{tag}");
    (rows, ahead, preempted)
}

#[test]
fn overlapped_plans_give_the_outputs_of_plans_one_at_a_time() {
    type Setup = fn(&mut RunConfig);
    let setups: [(&str, Setup); 6] = [
        ("plain", |_| {}),
        ("chunked", |c| {
            (c.policy.chunked_prefill, c.policy.max_num_batched_tokens) = (true, 5);
        }),
        ("small-cache", |c| c.policy.num_blocks = 8), // preemptions
        ("stop-strings", |c| {
            c.sampling.params.stop = vec!["w30".into(), "w9 w10".into()];
            c.sampling.params.max_new_tokens = 12;
        }),
        ("one-token", |c| c.sampling.params.max_new_tokens = 1),
        ("samples", |c| {
            (
                c.sampling.params.n,
                c.policy.max_batch_size,
                c.sampling.params.temperature,
            ) = (3, 5, 0.8); // forked prompt blocks
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

/// Regression: running[0] needs a block while the only ones it could get are held by a row
/// out of `running` that `grow_running` cannot preempt: parked (its token in the pending plan
/// ends it by max_model_len) or draining (it ended with EOS at the last commit, and the
/// pending plan still holds it). The plan ahead failed with "row 0 alone does not fit the KV
/// cache, though admitted"; now that step is planned after the commit, preempting no one.
#[test]
fn no_plan_ahead_while_the_first_row_fits_only_after_the_pending_plan() {
    type Setup = fn(&mut RunConfig);
    // "w4".."w15" (13 tokens with BOS: 4 blocks of 5) is parked at length 15 of max_model_len
    // 16 when "w30" (2 tokens, 1 block) wants its second block
    let parked: Setup = |c| {
        (
            c.policy.num_blocks,
            c.policy.max_model_len,
            c.sampling.params.max_new_tokens,
        ) = (5, 16, 40)
    };
    // "w4".."w15" (4 blocks of 6) ends with EOS 18, its third token, at the commit before the
    // one where "w30".."w33" (5 tokens, 2 blocks) wants its third block
    let draining: Setup = |c| {
        (
            c.policy.num_blocks,
            c.sampling.eos_token_ids,
            c.sampling.params.max_new_tokens,
        ) = (6, vec![18], 7)
    };
    let cases = [
        ("parked", [words(30..31), words(4..16)], parked),
        ("draining", [words(30..34), words(4..16)], draining),
    ];
    for (name, prompts, setup) in cases {
        let (want, _, _) = run_over(&format!("ov-fit-ref-{name}"), &prompts, false, setup);
        let (got, ahead, preempted) = run_over(&format!("ov-fit-{name}"), &prompts, true, setup);
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(
                (&g.token_ids, &g.reason),
                (&w.token_ids, &w.reason),
                "{name}"
            );
        }
        assert_eq!(want[1].token_ids, vec![16, 17, 18], "{name}");
        assert!(ahead > 0, "{name}: nothing planned ahead");
        assert!(!preempted, "{name}: a row was preempted");
    }
}

/// A row that finishes at the pending plan's commit was decoded once more by the plan after
/// it: that token is dropped and its blocks stay allocated until that plan is committed.
#[test]
fn a_row_finishing_under_a_plan_ahead_keeps_its_blocks_until_that_plan_commits() {
    // "w60": 61 62 63 0 1 2 (EOS) - six output tokens, the last an EOS
    let mut cfg = test_config();
    cfg.policy.overlap = true;
    let mut s = Driver::new(&cfg, &[Some("w60")]);
    let free = s.num_free_blocks();
    let mut p = s.next_plan().unwrap().unwrap();
    let mut prev = fake_step(&p, &[]);
    let mut ahead = 0;
    while let Some(next) = s.next_plan_ahead().unwrap() {
        let toks = fake_step(&next, &prev);
        s.commit(&prev, &[1], None).unwrap();
        ahead += 1;
        (p, prev) = (next, toks);
    }
    assert_eq!(p.prev_rows, vec![0]);
    assert_eq!(ahead, 6); // prefill, then 5 decodes to the EOS, planned ahead, one past it
    assert!(s.num_free_blocks() < free); // the row finished, the plan after it is pending
    s.commit(&prev, &[1], None).unwrap();
    assert_eq!(s.num_free_blocks(), free);
    assert!(s.next_plan().unwrap().is_none());
    let rows = s.finish().unwrap();
    assert_eq!(rows[0].token_ids, vec![61, 62, 63, 0, 1, 2]);
    assert_eq!(rows[0].reason, "stop");
}

#[test]
fn no_plan_ahead_for_penalized_rows_and_none_without_overlap() {
    let mut cfg = test_config();
    cfg.policy.overlap = true;
    cfg.sampling.params.repetition_penalty = 1.2;
    let mut s = Driver::new(&cfg, &[Some("w5 w6")]);
    let _ = s.next_plan().unwrap().unwrap();
    assert!(s.next_plan_ahead().unwrap().is_none());

    let mut s = Driver::new(&test_config(), &[Some("w5 w6")]);
    let _ = s.next_plan().unwrap().unwrap();
    assert!(s.next_plan_ahead().is_err());

    let mut cfg = test_config();
    (cfg.policy.overlap, cfg.policy.max_draft_tokens) = (true, 2);
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("overlap needs plain decoding"), "{err}");
}

/// SplitMix64: the randomized test's seeded source of cases.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }

    /// True with probability 1 / `n`.
    fn one_in(&mut self, n: usize) -> bool {
        self.range(1, n) == 1
    }
}

/// One random job of the randomized test, printed when it fails.
#[derive(Debug)]
struct Case {
    index: usize,
    prompts: Vec<String>,
    /// Per-row max_new_tokens (a sampling column; None: the job's).
    row_max_new: Vec<Option<i64>>,
    max_new_tokens: usize,
    eos: Vec<u32>,
    stop: Vec<String>,
    n: usize,
    block_size: usize,
    num_blocks: usize,
    max_batch_size: usize,
    max_model_len: usize,
    /// Chunked prefill's token budget, or None: whole prompts.
    chunk: Option<usize>,
    prefix_caching: bool,
}

/// Random prompts, several starting alike (prefix cache hits), and their per-row
/// max_new_tokens.
fn random_prompts(rng: &mut SplitMix) -> (Vec<String>, Vec<Option<i64>>) {
    let rows = rng.range(1, 8);
    let base = rng.range(4, 40);
    let prompts = (0..rows)
        .map(|_| {
            let start = if rng.one_in(2) {
                base
            } else {
                rng.range(4, 62)
            };
            words(start..start + rng.range(1, (64 - start).min(20)))
        })
        .collect();
    let max_new = (0..rows)
        .map(|_| rng.one_in(3).then(|| rng.range(1, 40) as i64))
        .collect();
    (prompts, max_new)
}

/// KV blocks for rows needing `needs` tokens each at worst, `n` samples per row: the longest
/// row's worst case exactly, a few blocks more, or up to everyone's worst case at once.
fn random_budget(rng: &mut SplitMix, needs: &[usize], block_size: usize, n: usize) -> usize {
    let blocks = |t: usize| t.div_ceil(block_size);
    let least = blocks(needs.iter().copied().max().unwrap_or(0)).max(1);
    let all: usize = needs.iter().map(|&t| blocks(t) * n).sum();
    match rng.range(0, 2) {
        0 => least,
        1 => rng.range(least, least + 3),
        _ => rng.range(least, all.max(least)),
    }
}

/// A random case; its KV budget from just the longest row's worst case (each row must fit
/// alone) to roomy.
fn random_case(index: usize, rng: &mut SplitMix) -> Case {
    let (prompts, row_max_new) = random_prompts(rng);
    let max_new_tokens = rng.range(1, 40);
    let max_model_len = if rng.one_in(3) { rng.range(8, 64) } else { 64 };
    let block_size = [1, 2, 3, 4, 8][rng.range(0, 4)];
    let n = if rng.one_in(3) { 3 } else { 1 };
    // each row's worst case in tokens (a prompt too long for max_model_len is an error row)
    let needs: Vec<usize> = prompts
        .iter()
        .zip(&row_max_new)
        .map(|(p, m)| {
            let len = p.split(' ').count() + 1; // and BOS
            let m = m.map_or(max_new_tokens, |m| m as usize);
            if len < max_model_len {
                (len + m).min(max_model_len)
            } else {
                0
            }
        })
        .collect();
    let num_blocks = random_budget(rng, &needs, block_size, n);
    let mut eos = vec![2];
    if rng.one_in(2) {
        eos.push(rng.range(4, 63) as u32);
    }
    let stop = (0..rng.range(0, 2))
        .map(|_| match rng.range(4, 62) {
            k if rng.one_in(2) => format!("w{k}"),
            k => format!("w{k} w{}", k + 1),
        })
        .collect();
    Case {
        index,
        prompts,
        row_max_new,
        max_new_tokens,
        eos,
        stop,
        n,
        block_size,
        num_blocks,
        max_batch_size: rng.range(1, 8),
        max_model_len,
        chunk: rng.one_in(3).then(|| rng.range(1, 16)),
        prefix_caching: rng.one_in(2),
    }
}

/// The settings of `case`.
fn case_config(case: &Case) -> RunConfig {
    let mut c = test_config();
    (c.sampling.params.max_new_tokens, c.policy.max_model_len) =
        (case.max_new_tokens, case.max_model_len);
    (c.sampling.eos_token_ids, c.sampling.params.stop) = (case.eos.clone(), case.stop.clone());
    (c.sampling.params.n, c.sampling.params.temperature) =
        (case.n, if case.n > 1 { 0.8 } else { 0.0 });
    (c.policy.block_size, c.policy.num_blocks) = (case.block_size, case.num_blocks);
    (c.policy.max_batch_size, c.policy.prefix_caching) = (case.max_batch_size, case.prefix_caching);
    if let Some(budget) = case.chunk {
        (c.policy.chunked_prefill, c.policy.max_num_batched_tokens) = (true, budget);
    }
    c
}

/// One run of `case`, overlapped or not -> its rows, or the scheduler's error.
fn run_case(case: &Case, overlap: bool) -> Result<Vec<Row>> {
    let mut cfg = case_config(case);
    cfg.policy.overlap = overlap;
    let job = cfg.sampling_params();
    let rows: Vec<(Option<&str>, Arc<SamplingParams>)> = (case.prompts.iter())
        .zip(&case.row_max_new)
        .map(|(p, m)| {
            let mut sp = job.clone();
            sp.max_new_tokens = m.map_or(sp.max_new_tokens, |m| m as usize);
            (Some(p.as_str()), Arc::new(sp))
        })
        .collect();
    let mut s = Driver::with_rows(&cfg, &rows);
    if overlap {
        try_drive_overlapped(&mut s)?;
    } else {
        try_drive(&mut s)?;
    }
    s.finish() // no block or slot leaked
}

/// Random jobs (KV budgets from just the longest row's worst case to roomy, block sizes,
/// prompts, length limits, EOS ids and stop strings, n = 1 and 3, chunked prefill and prefix
/// caching on and off): overlapped or not, the same rows, and no error.
#[test]
fn random_jobs_give_the_same_outputs_overlapped_or_not() {
    let mut rng = SplitMix(0x0E7E_5EED);
    for i in 0..200 {
        check_case(&random_case(i, &mut rng));
    }
}

/// `case` overlapped gives the rows it gives with plans built one at a time; neither fails.
fn check_case(case: &Case) {
    let want = run_case(case, false).unwrap_or_else(|e| panic!("{e}, one at a time: {case:?}"));
    let got = run_case(case, true).unwrap_or_else(|e| panic!("{e}, overlapped: {case:?}"));
    assert_eq!(
        got.len(),
        case.prompts.len() * case.n,
        "case {}: {case:?}",
        case.index
    );
    assert_eq!(want.len(), got.len(), "{case:?}");
    for (g, w) in got.iter().zip(&want) {
        let key = |r: &Row| {
            (
                r.row_index,
                r.sample_index,
                r.token_ids.clone(),
                r.reason.clone(),
            )
        };
        assert_eq!(key(g), key(w), "{case:?}");
        assert_eq!((&g.text, &g.error), (&w.text, &w.error), "{case:?}");
    }
}

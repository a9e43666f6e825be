//! Hybrid models' recurrent state through the policy (state_checkpoints.rs): a fake model
//! whose state per request slot is a hash of every token the row consumed, and whose next token
//! is a function of that state, checks that each query starts from the row's own state (zero,
//! its slot's, or a checkpoint's) and that outputs equal a run without the prefix cache,
//! whatever the budget (eviction, preemption), with chunked prefill, samples and verify rounds.

use std::collections::HashMap;

use super::tests::{check_plan, test_config, words, Driver, VOCAB};
use super::*;

const ZERO: u64 = 0xcbf2_9ce4_8422_2325;

fn mix(h: u64, token: i64) -> u64 {
    (h ^ token as u64).wrapping_mul(0x0100_0000_01b3)
}

fn token_of(h: u64, seed: i64) -> i64 {
    3 + ((h ^ seed as u64) % (VOCAB as u64 - 3)) as i64 // never <eos>: rows run to length
}

/// (state, tokens it consumed) per request slot and per checkpoint.
#[derive(Default)]
struct StateModel {
    slots: HashMap<i32, (u64, usize)>,
    checkpoints: HashMap<i32, (u64, usize)>,
}

impl StateModel {
    /// One step: (tokens, per-row counts, accepted drafts per row for a verify plan).
    fn step(&mut self, p: &StepPlan, draft_tokens: usize) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
        for r in 0..p.num_seqs() {
            self.restore(p, r);
        }
        let mut after = Vec::new(); // per row, the state after each query token
        let (mut tokens, mut counts, mut accepted) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..p.num_seqs() {
            let (q0, q1) = (p.cu_seqlens_q[r] as usize, p.cu_seqlens_q[r + 1] as usize);
            let start = p.positions[q0] as usize;
            let slot = p.request_slots[r];
            let (mut h, n) = self.slots[&slot];
            assert_eq!(
                n, start,
                "row {r}: a state of {n} tokens for a query at {start}"
            );
            let seed = p.seeds[r];
            if p.kind == StepKind::Verify {
                // drafts follow the state, so a plain run makes the same tokens; row-dependent
                // acceptance gives rounds with none, some and all drafts accepted
                h = mix(h, p.input_ids[q0]);
                let mut chain = vec![h];
                let mut row_tokens = Vec::new();
                for _ in 0..draft_tokens {
                    let d = token_of(h, seed);
                    row_tokens.push(d as i32);
                    h = mix(h, d);
                    chain.push(h);
                }
                let a = (chain[0] % (draft_tokens as u64 + 1)) as usize;
                let mut row = row_tokens[..a].to_vec();
                row.push(token_of(chain[a], seed) as i32);
                self.slots.insert(slot, (chain[a], start + 1 + a));
                counts.push(row.len() as i32);
                accepted.push(a as i32);
                tokens.extend(row);
                after.push(chain);
                continue;
            }
            let mut states = Vec::new();
            for t in q0..q1 {
                h = mix(h, p.input_ids[t]);
                states.push(h);
            }
            self.slots.insert(slot, (h, start + q1 - q0));
            tokens.push(token_of(h, seed) as i32);
            counts.push(1);
            accepted.push(0);
            after.push(states);
        }
        for save in p.state_saves.chunks_exact(3) {
            let (r, j, c) = (save[0] as usize, save[1] as usize, save[2]);
            assert_ne!(p.kind, StepKind::Verify, "a verify row's state saved");
            let at = p.positions[p.cu_seqlens_q[r] as usize] as usize + j + 1;
            self.checkpoints.insert(c, (after[r][j], at));
        }
        (tokens, counts, accepted)
    }

    /// Sets row `r`'s slot state as the plan's `state_from` says, and checks a prefill row's
    /// state is that of its tokens before the query.
    fn restore(&mut self, p: &StepPlan, r: usize) {
        let slot = p.request_slots[r];
        match p.state_from[r] {
            STATE_CONTINUE => assert!(self.slots.contains_key(&slot), "continued from nothing"),
            STATE_ZERO => {
                self.slots.insert(slot, (ZERO, 0));
            }
            c => {
                let saved = *self
                    .checkpoints
                    .get(&c)
                    .expect("restored an unsaved checkpoint");
                self.slots.insert(slot, saved);
            }
        }
        let (c0, c1) = (p.cu_prefix[r] as usize, p.cu_prefix[r + 1] as usize);
        let start = p.positions[p.cu_seqlens_q[r] as usize] as usize;
        if c1 - c0 == start && p.kind != StepKind::Verify {
            let want = p.prefix_ids[c0..c1].iter().fold(ZERO, |h, &t| mix(h, t));
            assert_eq!(
                self.slots[&slot],
                (want, start),
                "row {r}: another prefix's state"
            );
        }
    }
}

fn drive_states(s: &mut Driver) {
    let cfg = s.config().clone();
    let mut model = StateModel::default();
    let mut steps = 0;
    while let Some(p) = s.next_plan().unwrap() {
        check_plan(&p, &cfg);
        assert!(p.block_copies.is_empty(), "a hybrid sample forked");
        let (tokens, counts, accepted) = model.step(&p, cfg.policy.max_draft_tokens);
        let verify = p.kind == StepKind::Verify;
        s.commit(&tokens, &counts, verify.then_some(&accepted[..]))
            .unwrap();
        steps += 1;
        assert!(steps < 100_000, "no progress");
    }
}

/// Prompts sharing long and short prefixes (block 4, checkpoints every 8 tokens).
fn prompts() -> Vec<String> {
    let base = words(4..24);
    vec![
        format!("{base} w30 w31"),
        format!("{base} w40"),
        format!("{} w50", words(4..12)),
        base.clone(),
        base.clone(),
        "w60 w61".into(),
        format!("{base} {}", words(25..34)),
        format!("{base} w30 w32"),
        format!("{} w51 w52", words(4..15)),
        base,
    ]
}

struct Setup {
    caching: bool,
    checkpoints: usize,
    num_blocks: usize,
    chunk: Option<usize>,
    drafts: usize,
    n: usize,
}

/// (output ids per row and sample, cached_tokens per row, preemptions) of a run.
fn run(s: &Setup) -> (Vec<Vec<i32>>, Vec<i32>, u64) {
    let prompts = prompts();
    let prompts: Vec<Option<&str>> = prompts.iter().map(|p| Some(p.as_str())).collect();
    let mut cfg = test_config();
    cfg.policy.prefix_caching = s.caching;
    cfg.policy.num_blocks = s.num_blocks;
    cfg.policy.state_checkpoint_interval = 8;
    cfg.policy.state_checkpoints = s.checkpoints;
    cfg.policy.max_draft_tokens = s.drafts;
    cfg.sampling.params.max_new_tokens = 9;
    if s.n > 1 {
        (cfg.sampling.params.n, cfg.sampling.params.temperature) = (s.n, 1.0);
    }
    if let Some(budget) = s.chunk {
        cfg.policy.chunked_prefill = true;
        cfg.policy.max_num_batched_tokens = budget;
    }
    let mut d = Driver::new(&cfg, &prompts);
    drive_states(&mut d);
    let preemptions = d.st.preemptions;
    let rows = d.finish().unwrap(); // checks that no block leaked
    assert!(rows.iter().all(|r| r.error.is_none()));
    let ids = rows.iter().map(|r| r.token_ids.clone()).collect();
    (
        ids,
        rows.iter().map(|r| r.cached_tokens).collect(),
        preemptions,
    )
}

fn setup() -> Setup {
    Setup {
        caching: true,
        checkpoints: 16,
        num_blocks: 64,
        chunk: None,
        drafts: 0,
        n: 1,
    }
}

#[test]
fn hybrid_hits_start_at_checkpoints_and_change_no_output() {
    for (chunk, drafts) in [(None, 0), (Some(6), 0), (None, 3), (Some(5), 3)] {
        let on = run(&Setup {
            chunk,
            drafts,
            ..setup()
        });
        let off = run(&Setup {
            caching: false,
            chunk,
            drafts,
            ..setup()
        });
        let plain = run(&Setup {
            caching: false,
            chunk,
            ..setup()
        });
        assert_eq!(on.0, off.0, "chunk {chunk:?} drafts {drafts}");
        assert_eq!(off.0, plain.0, "verify rounds' states rolled back");
        assert!(on.1.iter().any(|&c| c > 0), "no hit");
        assert!(
            on.1.iter().all(|&c| c % 8 == 0),
            "a hit between checkpoints"
        );
        assert!(off.1.iter().all(|&c| c == 0));
    }
}

#[test]
fn hybrid_states_survive_eviction_and_preemption() {
    let alone = run(&Setup {
        caching: false,
        ..setup()
    });
    for (blocks, checkpoints) in [(14, 16), (20, 2), (64, 1)] {
        let tight = run(&Setup {
            num_blocks: blocks,
            checkpoints,
            chunk: Some(7),
            ..setup()
        });
        assert_eq!(
            tight.0, alone.0,
            "{blocks} blocks, {checkpoints} checkpoints"
        );
        if blocks == 14 {
            assert!(tight.2 > 0, "no preemption at {blocks} blocks");
        }
    }
}

#[test]
fn without_checkpoints_a_hybrid_never_hits() {
    let (ids, cached, _) = run(&Setup {
        checkpoints: 0,
        ..setup()
    });
    assert!(cached.iter().all(|&c| c == 0));
    assert_eq!(
        ids,
        run(&Setup {
            caching: false,
            ..setup()
        })
        .0
    );
}

#[test]
fn hybrid_samples_start_from_the_cache_not_a_fork() {
    let on = run(&Setup { n: 3, ..setup() });
    let off = run(&Setup {
        n: 3,
        caching: false,
        ..setup()
    });
    assert_eq!(on.0, off.0);
    assert!(on.1.iter().any(|&c| c > 0));
}

//! Prefix caching, n samples and chunked prefill through the scheduling policy: a fake model
//! with a real KV cache checks that every position a row reads holds that row's own token, and
//! outputs equal a run without the feature whatever the budget (eviction, preemption).

use std::collections::{BTreeMap, HashMap};

use super::tests::{check_plan, drive_spec_with, test_config, words, Driver, VOCAB};
use super::*;
use crate::config::RunConfig;

/// A run's counters by their summary names.
type Summary = HashMap<&'static str, i64>;

/// The counters of `s` that these tests read.
fn summary(s: &Driver) -> Summary {
    let st = &s.st;
    HashMap::from([
        ("cached_tokens", st.cached_tokens as i64),
        ("prefill_tokens", st.prefill_tokens as i64),
        ("preemptions", st.preemptions as i64),
        ("evictions", s.s.evictions() as i64),
        ("spec_steps", st.spec_steps as i64),
    ])
}

/// A fake model with a KV cache of (token, position) per slot. A step first writes every query
/// token's pair into its slot (as a model's layers write before they attend), then each row
/// reads positions 0..seq_len through its block table: every pair must be the row's own token
/// at that position, and the row's next token hashes all of them, so a block shared or kept
/// with the wrong contents fails here or changes the outputs.
struct KvModel {
    kv: Vec<Option<(i64, i64)>>,
    /// Request slot -> the tokens of the sequence running there.
    history: HashMap<i32, Vec<i64>>,
}

impl KvModel {
    fn new(cfg: &RunConfig) -> Self {
        KvModel {
            kv: vec![None; cfg.policy.num_blocks * cfg.policy.block_size],
            history: HashMap::new(),
        }
    }

    fn step(&mut self, p: &StepPlan, bs: usize) -> Vec<i32> {
        for pair in p.block_copies.chunks_exact(2) {
            let (src, dst) = (pair[0] as usize * bs, pair[1] as usize * bs);
            for i in 0..bs {
                self.kv[dst + i] = self.kv[src + i];
            }
        }
        for t in 0..p.num_tokens() {
            self.kv[p.slot_mapping[t] as usize] = Some((p.input_ids[t], p.positions[t]));
        }
        (0..p.num_seqs()).map(|r| self.row(p, r, bs)).collect()
    }

    fn row(&mut self, p: &StepPlan, r: usize, bs: usize) -> i32 {
        let (q0, q1) = (p.cu_seqlens_q[r] as usize, p.cu_seqlens_q[r + 1] as usize);
        let slot = p.request_slots[r];
        let start = p.positions[q0] as usize;
        let (c0, c1) = (p.cu_prefix[r] as usize, p.cu_prefix[r + 1] as usize);
        if c1 - c0 == start {
            // a row computing its known tokens (a prefill, or a chunk of one): all before its
            // query are in the plan
            let tokens = [&p.prefix_ids[c0..c1], &p.input_ids[q0..q1]].concat();
            self.history.insert(slot, tokens);
        }
        let history = &self.history[&slot];
        assert_eq!(history[start..], p.input_ids[q0..q1], "query tokens");
        let table = &p.block_tables[r * p.block_table_width..];
        let mut h = 17 + p.seeds[r] % 1_000_003; // samples of a row differ by their seed
        for pos in 0..p.seq_lens[r] as usize {
            let s = table[pos / bs] as usize * bs + pos % bs;
            let (tok, at) = self.kv[s].expect("a position read before it was written");
            assert_eq!(
                (tok, at),
                (history[pos], pos as i64),
                "slot {s} holds another token"
            );
            h = (h * 31 + tok * (pos as i64 + 7)) % 1_000_003;
        }
        3 + (h % (VOCAB as i64 - 3)) as i32 // never <eos> (2): every row runs to its length
    }
}

fn drive_kv(s: &mut Driver) {
    let cfg = s.config().clone();
    let mut model = KvModel::new(&cfg);
    let mut steps = 0;
    while let Some(p) = s.next_plan().unwrap() {
        check_plan(&p, &cfg);
        let tokens = model.step(&p, cfg.policy.block_size);
        for (r, &t) in tokens.iter().enumerate() {
            if p.next_ids[r] < 0 {
                // (a chunk short of its row's end: the scheduler drops its token)
                let history = model.history.get_mut(&p.request_slots[r]).unwrap();
                history.push(t as i64);
            }
        }
        s.commit(&tokens, &vec![1; tokens.len()], None).unwrap();
        steps += 1;
        assert!(steps < 100_000, "no progress");
    }
}

/// Prompts sharing every kind of prefix (block size 4, <bos> first): 17 tokens of a preamble
/// plus more, a whole preamble, a duplicate, part of one block, two blocks and a partial one,
/// one differing at the first word, and none.
fn shared_prompts() -> Vec<String> {
    let base = words(4..20);
    vec![
        format!("{base} w30 w31"),
        format!("{base} w40"),
        format!("{} w50", words(4..12)),
        words(4..6),
        base.clone(),
        base.clone(),
        "w60 w61".into(),
        format!("{base} {}", words(21..30)),
        words(5..20),
        format!("{base} w30 w32"),
        format!("{} w51 w52", words(4..12)),
        base,
    ]
}

/// (output token ids per row, cached_tokens per row, summary) of a run.
fn run(
    tag: &str,
    caching: bool,
    num_blocks: usize,
    spec: bool,
) -> (Vec<Vec<i32>>, Vec<i32>, Summary) {
    run_with(tag, caching, num_blocks, spec, None)
}

/// `run`, with chunked prefill of `chunk` tokens per step when given.
fn run_with(
    tag: &str,
    caching: bool,
    num_blocks: usize,
    spec: bool,
    chunk: Option<usize>,
) -> (Vec<Vec<i32>>, Vec<i32>, Summary) {
    run_plain_at(tag, caching, num_blocks, spec, chunk, |_| false)
}

/// `run_with`, speculative runs asking for plain steps where `plain` says so.
fn run_plain_at(
    tag: &str,
    caching: bool,
    num_blocks: usize,
    spec: bool,
    chunk: Option<usize>,
    plain: impl Fn(usize) -> bool,
) -> (Vec<Vec<i32>>, Vec<i32>, Summary) {
    let prompts = shared_prompts();
    let prompts: Vec<Option<&str>> = prompts.iter().map(|p| Some(p.as_str())).collect();
    let mut cfg = test_config();
    cfg.policy.prefix_caching = caching;
    cfg.policy.num_blocks = num_blocks;
    cfg.sampling.params.max_new_tokens = 9;
    if spec {
        cfg.policy.max_draft_tokens = 3;
    }
    if let Some(budget) = chunk {
        (
            cfg.policy.chunked_prefill,
            cfg.policy.max_num_batched_tokens,
        ) = (true, budget);
    }
    let mut s = Driver::new(&cfg, &prompts);
    if spec {
        drive_spec_with(&mut s, plain);
    } else {
        drive_kv(&mut s);
    }
    let summary = summary(&s);
    let rows = s.finish().unwrap(); // checks that no block leaked
    assert_eq!(rows.len(), prompts.len(), "{tag}");
    assert!(rows.iter().all(|r| r.error.is_none()));
    let ids = rows.iter().map(|r| r.token_ids.clone()).collect();
    (ids, rows.iter().map(|r| r.cached_tokens).collect(), summary)
}

fn int(s: &Summary, key: &str) -> i64 {
    s[key]
}

#[test]
fn cached_prefixes_hold_each_rows_own_tokens_and_change_no_output() {
    let (want, none, off) = run("pc-off", false, 64, false);
    assert!(none.iter().all(|&c| c == 0));
    assert_eq!(int(&off, "cached_tokens"), 0);
    // a large cache, then one so small that cached blocks are evicted and requests preempted
    for (tag, blocks) in [("pc-on", 64), ("pc-small", 9)] {
        let (got, cached, summary) = run(tag, true, blocks, false);
        assert_eq!(got, want, "{tag}");
        assert_eq!(
            int(&summary, "cached_tokens"),
            cached.iter().map(|&c| c as i64).sum::<i64>()
        );
        assert!(int(&summary, "prefill_tokens") < int(&off, "prefill_tokens") || blocks < 64);
        if blocks == 64 {
            // row 4 (the preamble alone, 17 tokens) finds 4 blocks of row 0's; its last
            // block is dropped only if it holds the last token: 16 cached
            assert_eq!(cached[4], 16);
            // row 6 shares nothing; row 3, "<bos> w4 w5", not one whole block
            assert_eq!((cached[6], cached[3]), (0, 0));
            // rows 0-3 fill the first step (the batch holds 4), so rows 1 and 2 find nothing
            // cached yet; every later row sharing a whole block of row 0's finds it
            assert_eq!(cached, [0, 0, 0, 0, 16, 16, 0, 16, 0, 16, 8, 16]);
        } else {
            assert!(int(&summary, "preemptions") > 0 && int(&summary, "evictions") > 0);
        }
    }
}

#[test]
fn speculative_runs_with_caching_equal_runs_without() {
    let (want, _, _) = run("pcs-off", false, 64, true);
    for (tag, blocks) in [("pcs-on", 64), ("pcs-small", 12)] {
        let (got, cached, _) = run(tag, true, blocks, true);
        assert_eq!(got, want, "{tag}");
        if blocks == 64 {
            // 17 tokens: 4 blocks found, none past them, but the token after them (w19) is
            // the one row 0 had there: kept, 16 cached
            assert_eq!(cached[4], 16);
            // row 10, "<bos> w4 .. w11 w51 w52" (always admitted after rows 0 and 2: the
            // batch holds 4, whereas row 2 may share row 0's first step, then nothing is
            // cached yet): 2 blocks found, then w11 as in row 0: both kept
            assert_eq!(cached[10], 8, "{cached:?}");
        }
    }
}

/// Two requests with one prompt: the second waits one step (instead of computing the same
/// blocks in the same step), then starts from the first one's cached blocks; unless what it
/// would wait for is under 64 tokens, then both compute it in the first step.
#[test]
fn an_identical_prompt_waits_one_step_then_shares_the_blocks() {
    let long = format!("{} {}", words(4..64), words(4..64)); // + <bos>: 121 tokens
    let (short7, short8) = (words(4..11), words(4..12)); // 8 and 9 tokens
                                                         // (spec, prompt, cached): 121 tokens: 30 blocks found, the block holding the last token
                                                         // recomputed; with a draft the token after the 30 blocks is the first one's 121st, known
                                                         // when it registered them, so the last found block is kept
    for (spec, prompt, cached) in [(false, &long, 120), (true, &long, 120)] {
        let mut cfg = test_config();
        cfg.policy.max_draft_tokens = if spec { 2 } else { 0 };
        cfg.policy.max_model_len = 256;
        let mut s = Driver::new(&cfg, &[Some(prompt), Some(prompt)]);
        let p = s.next_plan().unwrap().unwrap();
        assert_eq!((p.kind, p.num_seqs()), (StepKind::Prefill, 1));
        s.commit(&[9], &[1], spec.then_some(&[0][..])).unwrap();
        let p = s.next_plan().unwrap().unwrap();
        assert_eq!((p.kind, p.num_seqs()), (StepKind::Prefill, 1));
        assert_eq!(p.cu_prefix, vec![0, cached as i32], "spec {spec}");
        assert_eq!(p.positions[0], cached as i64);
        let first: Vec<i32> = s.s.running()[0]
            .block_table
            .iter()
            .map(|&b| b as i32)
            .collect();
        assert_eq!(p.block_tables[..cached / 4], first[..cached / 4]);
    }
    for prompt in [&short7, &short8] {
        let mut s = Driver::new(&test_config(), &[Some(prompt), Some(prompt)]);
        let p = s.next_plan().unwrap().unwrap();
        assert_eq!(
            (p.kind, p.num_seqs(), p.cu_prefix.clone()),
            (StepKind::Prefill, 2, vec![0, 0, 0])
        );
    }
}

/// (row, sample) -> output token ids, and the summary, of a run with n samples per row.
fn run_samples(
    tag: &str,
    n: usize,
    batch: usize,
    caching: bool,
) -> (BTreeMap<(i64, i32), Vec<i32>>, Summary) {
    let prompts = shared_prompts();
    let mut prompts: Vec<Option<&str>> = prompts.iter().map(|p| Some(p.as_str())).collect();
    prompts.push(None); // an error row: n of them
    let mut cfg = test_config();
    cfg.sampling.params.n = n;
    cfg.sampling.params.temperature = 0.8;
    cfg.policy.max_batch_size = batch;
    cfg.policy.prefix_caching = caching;
    let mut s = Driver::new(&cfg, &prompts);
    drive_kv(&mut s);
    let summary = summary(&s);
    let rows = s.finish().unwrap();
    assert_eq!(rows.len(), prompts.len() * n, "{tag}");
    let errors = rows.iter().filter(|r| r.error.is_some()).count();
    assert_eq!(errors, n);
    let out = rows
        .into_iter()
        .map(|r| ((r.row_index, r.sample_index), r.token_ids))
        .collect();
    (out, summary)
}

#[test]
fn samples_fork_from_their_sibling_and_equal_samples_computed_alone() {
    // batch 1: every sample runs alone, after its sibling finished (no fork); batch 6: the
    // samples of a row fork from the first (shared blocks, a copied partial block)
    let (alone, s1) = run_samples("n-alone", 3, 1, false);
    for (tag, batch, caching) in [("n-fork", 6, false), ("n-fork-pc", 6, true)] {
        let (forked, s) = run_samples(tag, 3, batch, caching);
        assert_eq!(forked, alone, "{tag}");
        assert!(
            int(&s, "prefill_tokens") < int(&s1, "prefill_tokens"),
            "{tag}"
        );
    }
    let rows = shared_prompts().len() as i64;
    for row in 0..rows {
        let samples: Vec<&Vec<i32>> = (0..3).map(|i| &alone[&(row, i)]).collect();
        assert!(
            samples[0] != samples[1] && samples[1] != samples[2],
            "row {row}: {samples:?}"
        );
    }
    // sample 0 keeps the n = 1 seed: its output is the n = 1 run's
    let (one, _) = run_samples("n-one", 1, 6, true);
    for row in 0..rows {
        assert_eq!(one[&(row, 0)], alone[&(row, 0)]);
    }
}

#[test]
fn a_forked_sample_computes_only_its_last_prompt_token() {
    let prompt = words(4..14); // + <bos>: 11 tokens, 2 full blocks and 3 tokens
    let mut cfg = test_config();
    (
        cfg.sampling.params.n,
        cfg.sampling.params.temperature,
        cfg.policy.prefix_caching,
    ) = (3, 1.0, false);
    let mut s = Driver::new(&cfg, &[Some(&prompt)]);
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!((p.num_seqs(), p.num_tokens()), (1, 11)); // the siblings wait a step
    assert!(p.block_copies.is_empty());
    s.commit(&[9], &[1], None).unwrap();
    let p = s.next_plan().unwrap().unwrap();
    assert_eq!(
        (p.kind, p.num_seqs(), p.num_tokens()),
        (StepKind::Prefill, 2, 2)
    );
    assert_eq!(p.positions, vec![10, 10]);
    assert_eq!(p.cu_prefix, vec![0, 10, 20]);
    let first: Vec<i32> = s.s.running()[0]
        .block_table
        .iter()
        .map(|&b| b as i32)
        .collect();
    for r in 0..2 {
        let table = &p.block_tables[r * p.block_table_width..][..3];
        assert_eq!(table[..2], first[..2]); // shared
        assert_eq!(p.block_copies[2 * r..2 * r + 2], [first[2], table[2]]); // copied
    }
    assert_ne!(p.seeds[0], p.seeds[1]);
}

#[test]
fn chunked_prefill_equals_whole_prefills_plain_and_speculative() {
    for spec in [false, true] {
        let (want, _, _) = run_with("ch-ref", false, 64, spec, None);
        for (budget, caching, blocks) in
            [(3, false, 64), (7, true, 64), (5, true, 12), (64, true, 64)]
        {
            let tag = format!("ch-{spec}-{budget}-{caching}-{blocks}");
            let (got, _, summary) = run_with(&tag, caching, blocks, spec, Some(budget));
            assert_eq!(got, want, "{tag}");
            if !caching {
                // every prompt token computed once, chunks or not
                let prompts: i64 = shared_prompts()
                    .iter()
                    .map(|p| p.split(' ').count() as i64 + 1)
                    .sum();
                assert_eq!(int(&summary, "prefill_tokens"), prompts, "{tag}");
            }
        }
    }
}

/// Plain steps asked for in the middle of a speculative run (`set_plain_steps`: decode plans
/// without lookahead, carrying prompt chunks) change no output, switched on and off at any step.
#[test]
fn plain_steps_in_a_speculative_run_change_no_output() {
    let (want, _, _) = run_with("ps-ref", false, 64, true, None);
    for (chunk, caching, blocks) in [(None, true, 64), (Some(3), false, 64), (Some(5), true, 12)] {
        let tag = format!("ps-{chunk:?}-{caching}-{blocks}");
        let (got, _, summary) =
            run_plain_at(&tag, caching, blocks, true, chunk, |step| step % 5 >= 2);
        assert_eq!(got, want, "{tag}");
        assert!(int(&summary, "spec_steps") > 0, "{tag}");
    }
}

/// A 17-token prompt arrives while another row decodes: with a budget of 4 tokens it is
/// computed over several steps, and the decoding row takes a step in every one (plain) or in
/// every other one (speculative: chunks and verify rounds alternate; in every one with plain
/// steps asked for).
#[test]
fn a_long_prompt_in_chunks_never_stops_the_decoding_rows() {
    for (spec, plain) in [(false, false), (true, false), (true, true)] {
        let mut cfg = test_config();
        (
            cfg.policy.chunked_prefill,
            cfg.policy.max_num_batched_tokens,
        ) = (true, 4);
        (
            cfg.policy.max_batch_size,
            cfg.sampling.params.max_new_tokens,
        ) = (1, 30); // row 1 waits for row 0's slot
        cfg.policy.max_batch_size = 2;
        cfg.policy.max_draft_tokens = if spec { 2 } else { 0 };
        let mut s = Driver::new(&cfg, &[Some("w4"), Some(&words(4..20))]);
        s.set_plain_steps(plain);
        let mut kinds = Vec::new();
        let mut chunks = Vec::new();
        while let Some(p) = s.next_plan().unwrap() {
            check_plan(&p, &cfg);
            let long = (0..p.num_seqs()).find(|&r| {
                p.input_ids[p.cu_seqlens_q[r] as usize] != 0
                    && p.seq_lens[r] > 3
                    && p.next_ids[r] >= 0
            });
            if let Some(r) = long {
                chunks.push(p.cu_seqlens_q[r + 1] - p.cu_seqlens_q[r]);
            }
            kinds.push((p.kind, p.num_seqs()));
            let n = p.num_seqs();
            let counts = vec![1; n];
            let toks: Vec<i32> = (0..n)
                .map(|r| 5 + (p.input_ids[p.cu_seqlens_q[r + 1] as usize - 1] as i32 % 50))
                .collect();
            if p.kind == StepKind::Verify {
                s.commit(&toks, &counts, Some(&vec![0; n])).unwrap();
            } else {
                s.commit(&toks, &counts, spec.then_some(&vec![0; n][..]))
                    .unwrap();
            }
            if kinds.len() > 12 {
                break;
            }
        }
        assert!(
            chunks.len() >= 3 && chunks.iter().all(|&c| c <= 4),
            "{spec}: {chunks:?}"
        );
        // from the second step on, the first row decodes at least every other step
        let decodes: Vec<bool> = kinds[1..8]
            .iter()
            .map(|&(k, n)| k == StepKind::Verify || (k == StepKind::Decode && n == 2))
            .collect();
        if spec && !plain {
            assert!(decodes.windows(2).all(|w| w[0] || w[1]), "{kinds:?}");
        } else {
            assert!(decodes.iter().all(|&d| d), "{kinds:?}");
        }
    }
}

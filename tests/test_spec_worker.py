"""SpecWorker end to end with a fake scheduler: speculative greedy == plain greedy for both draft
formats, several K and batch sizes, EOS / length stops, preemption; perfect and noisy drafts;
the draft state against a recomputation from scratch; no vocabulary softmax when greedy; the
sampled distribution; adaptive draft length."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eaglebatch.attention import allocate_kv_cache
from eaglebatch.speculative import (
    TREE_UNSUPPORTED,
    AdaptiveDraftLength,
    SpecWorker,
    chain_expected_tokens,
    expected_tokens,
    load_draft,
)
from paged_kv import PagedSequences
from support.fake_scheduler import FakeRequest, FakeScheduler
from support.spec_models import make_draft_dir, make_target_dir, target_worker
from test_verify import chi2_critical_001, chi_square

KINDS = ["eagle1", "eagle3"]
VOCAB = 320
MAX_LEN = 128


@dataclass(frozen=True)
class Req:
    prompt: tuple[int, ...]
    max_new: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


def fake_requests(reqs: list[Req], extra_new: int = 0) -> list[FakeRequest]:
    return [
        FakeRequest(list(r.prompt), r.max_new + extra_new, r.temperature, r.top_p, r.top_k, r.seed)
        for r in reqs
    ]


def run(worker, reqs, *, k=0, max_batch=8, num_blocks=512, eos=(), preempt_at=None, extra=0):
    sched = FakeScheduler(
        fake_requests(reqs, extra),
        num_blocks=num_blocks,
        block_size=4,
        max_batch_size=max_batch,
        max_model_len=MAX_LEN,
        eos_token_ids=eos,
        max_draft_tokens=k,
        preempt_at=preempt_at,
    )
    return sched.run(worker), sched


def hooked_scheduler(reqs, k) -> FakeScheduler:
    """A scheduler for tests that hook the worker with it before running (oracles)."""
    return FakeScheduler(
        fake_requests(reqs), num_blocks=512, block_size=4, max_batch_size=8,
        max_model_len=MAX_LEN, max_draft_tokens=k,
    )  # fmt: skip


def spec_worker(
    env, kind, k, *, max_batch=8, num_blocks=512, adaptive=False, draft=None, prompt_lookup=None,
    lookup_tokens=None,
):
    target = target_worker(env.target, num_blocks=num_blocks, max_model_len=MAX_LEN)
    return SpecWorker.from_target(
        target,
        draft or env.drafts[kind],
        num_steps=k,
        max_batch_size=max_batch,
        adaptive=adaptive,
        prompt_lookup=prompt_lookup,
        lookup_tokens=lookup_tokens,
    )


@dataclass
class Env:
    target: object
    drafts: dict
    reqs: list[Req]
    eos: tuple[int, ...]
    plain: list[list[int]]  # plain greedy with EOS
    finishes: Counter


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    root = tmp_path_factory.mktemp("spec")
    target = make_target_dir(root / "target")
    drafts = {kind: make_draft_dir(root / kind, target, kind) for kind in KINDS}
    gen = torch.Generator().manual_seed(0)
    reqs = []
    for _ in range(32):
        n = int(torch.randint(1, 41, (1,), generator=gen))
        prompt = tuple(torch.randint(VOCAB, (n,), generator=gen).tolist())
        reqs.append(Req(prompt, int(torch.randint(1, 25, (1,), generator=gen))))
    no_eos, _ = run(target_worker(target), reqs)
    # EOS: the most frequent token generated after the first one, so that some requests stop
    eos = Counter(t for out in no_eos for t in out[1:]).most_common(1)[0][0]
    plain, sched = run(target_worker(target), reqs, eos=(eos,))
    finishes = Counter(r.finish for r in sched.requests)
    assert finishes["stop"] >= 2 and finishes["length"] >= 2
    return Env(target, drafts, reqs, (eos,), plain, finishes)


# ---- lossless greedy ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_plain(env, kind, k) -> None:
    worker = spec_worker(env, kind, k)
    out, sched = run(worker, env.reqs[:16], k=k, eos=env.eos)
    assert out == env.plain[:16]
    assert sched.verify_plans == worker.stats.verify_rounds > 0
    assert worker.stats.drafted == k * sum(len(a) for a in sched.accept_log)


@pytest.mark.parametrize(
    "max_batch,kind,k", [(1, "eagle3", 3), (32, "eagle1", 2), (32, "eagle3", 4)]
)
def test_greedy_equals_plain_across_batch_sizes(env, max_batch, kind, k) -> None:
    worker = spec_worker(env, kind, k, max_batch=max_batch)
    out, sched = run(worker, env.reqs, k=k, max_batch=max_batch, eos=env.eos)
    assert out == env.plain
    if max_batch == 32:
        assert max(len(a) for a in sched.accept_log) >= 28  # (max_new == 1 ends at prefill)


def test_preemption_and_reprefill_in_another_slot(env) -> None:
    worker = spec_worker(env, "eagle3", 2, num_blocks=40)
    out, sched = run(worker, env.reqs, k=2, num_blocks=40, eos=env.eos, preempt_at={0: 3, 4: 1})
    assert out == env.plain
    assert sum(r.preemptions for r in sched.requests) >= 3  # 2 forced + block shortage
    moved = [r for r in sched.requests if len(set(r.slots_used)) > 1]
    assert moved and all(r.outputs == env.plain[i] for i, r in enumerate(sched.requests))


def test_both_workers_declare_their_target_and_what_they_take_of_the_scheduler(env) -> None:
    """The run tells the workers apart by no attribute test: each has `target` (the Worker of
    the target model) and `bind` (the plain Worker takes nothing; a SpecWorker its grammar
    hook: the scheduler's draft_masks and draft_step_masks)."""
    plain = target_worker(env.target)
    sched = SimpleNamespace(draft_masks=object(), draft_step_masks=object())
    before = dict(vars(plain))
    plain.bind(sched)
    assert plain.target is plain and vars(plain) == before
    spec = spec_worker(env, "eagle3", 2)
    spec.bind(sched)
    assert spec.target is not spec and spec.target.target is spec.target
    assert spec.grammar.masks is sched.draft_masks
    assert spec.grammar.step_masks is sched.draft_step_masks


def test_decode_plans_run_as_plain_steps(env) -> None:
    worker = spec_worker(env, "eagle1", 2)
    out, _ = run(worker, env.reqs[:8], k=0, eos=env.eos)  # plain "decode" plans
    assert out == env.plain[:8] and worker.stats.drafted == worker.stats.verify_rounds == 0
    assert worker.stats.plain_steps > 0


def test_adaptive_draft_length_is_lossless(env) -> None:
    worker = spec_worker(env, "eagle3", 4, adaptive=True)
    out, sched = run(worker, env.reqs, k=4, eos=env.eos)
    assert out == env.plain
    ks = {k for b in worker.policy.buckets.values() for k in b.t_round}
    assert {0, 1} <= ks  # the sweep measured rounds without and with drafts: the same tokens
    worker = spec_worker(env, "eagle3", 4, adaptive=True)
    widths = itertools.cycle(range(5))  # every width in turn, whatever the policy would pick
    worker.policy.choose = lambda b, drafting=None: next(widths)
    out, _ = run(worker, env.reqs, k=4, eos=env.eos)
    assert out == env.plain


def test_rows_joining_where_drafting_cannot_pay_skip_the_head(env) -> None:
    """Rows prefilled where the policy finds drafting cannot pay start stale: the head never runs
    for them (neither at their prefill nor after) and the output is plain greedy's."""
    worker = spec_worker(env, "eagle3", 3, adaptive=True)
    worker.policy.drafting_cannot_pay = lambda batch_size: True
    calls = []
    real = worker._draft_forward
    worker._draft_forward = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    out, _ = run(worker, env.reqs, k=3, eos=env.eos)
    assert out == env.plain
    assert calls == [] and worker.stats.plain_prefills == len(env.reqs)
    assert worker.stats.drafted == 0


@pytest.mark.parametrize("kind,max_batch", [("eagle1", 8), ("eagle3", 8), ("eagle3", 2)])
def test_deferred_extends_catch_up_to_the_same_draft_state(env, kind, max_batch) -> None:
    """Rounds the policy runs with k = 0 defer their draft extend; the next round with drafts
    first extends over all of them, after which every row's chain equals a fresh one from the
    recomputed state. Past MAX_DEFERRED deferred rounds a row leaves the head (stale): its
    drafts are never made or accepted, and the output stays plain greedy. At batch size 2 rows
    join while others have rounds deferred (catch-ups of different lengths per row)."""
    from eaglebatch.speculative.slots import MAX_DEFERRED

    k = 3
    reqs = env.reqs[:4]
    worker = spec_worker(env, kind, k, adaptive=True, max_batch=max_batch)
    script = [0, 0, 3, 0, 2, 0, 0, 0, 3, 1] + [0] * (MAX_DEFERRED + 1)
    choices = itertools.chain(script, itertools.cycle([0, 0, 0, 3]))  # rows join mid-cycle
    worker.policy.choose = lambda b, drafting=None: next(choices)
    sched = FakeScheduler(
        fake_requests(reqs, 40), num_blocks=512, block_size=4, max_batch_size=max_batch,
        max_model_len=MAX_LEN, max_draft_tokens=k,
    )  # fmt: skip  (40 more tokens each: long enough to go stale)
    model, draft = worker.model, worker.draft
    real = draft.argmax_tokens
    recorded: list[torch.Tensor] = []
    draft.argmax_tokens = lambda h: recorded.append(real(h)) or recorded[-1]
    verify = worker._verify
    checked = [0]

    def hooked(plan):
        stale = worker.slots.stale[plan.request_slots].copy()
        seqs = [next(r.seq for r in sched.requests if r.slot == int(s)) for s in plan.request_slots]
        expected = [None if stale[i] else recompute(model, draft, real, seq, k)[1]
                    for i, seq in enumerate(seqs)]  # fmt: skip
        recorded.clear()
        out = verify(plan)
        if recorded:  # the head ran: after the catch-up, from the recomputed state
            got = torch.stack(recorded, dim=1)  # [B, k_head]
            for i, chain in enumerate(expected):
                if chain is not None:
                    assert got[i].tolist() == chain[: got.shape[1]]
                    checked[0] += 1
        return out

    worker._verify = hooked
    out = sched.run(worker)
    plain, _ = run(target_worker(env.target), reqs, extra=40)
    assert out == plain
    assert checked[0] >= 8
    assert worker.stats.deferred_extends > 0 and worker.stats.stale_rows > 0


def test_rows_that_left_the_head_are_not_counted_as_drafting(env) -> None:
    """After MAX_DEFERRED rounds of k = 0 the rows leave the head. The policy is then asked with
    the number of rows that can still draft (not stale; no prompt lookup here), so a batch of
    stale rows decodes with k = 0 instead of verifying k + 1 tokens a row for nothing; rows
    that join later draft again. Output stays plain greedy."""
    from eaglebatch.speculative.slots import MAX_DEFERRED

    reqs = env.reqs[:12]
    worker = spec_worker(env, "eagle3", 3, adaptive=True, max_batch=4)
    real = worker.policy.choose
    forced = itertools.chain([0] * (MAX_DEFERRED + 1))
    asked: list[tuple[int, int, int, int]] = []  # (rows, drafting, not stale, k)

    def choose(b, drafting=None):
        k = next(forced, None)
        if k is None:
            k = real(b, drafting=drafting)
            asked.append((b, drafting, int((~worker.slots.stale[current[0]]).sum()), k))
        return k

    current = [np.zeros(0, dtype=np.int64)]
    verify = worker._verify

    def hooked(plan):
        current[0] = plan.request_slots
        return verify(plan)

    record = worker.policy.record

    def fixed_record(b, k, draft_s, verify_s, *rest):  # fixed costs: choices not load's
        return record(b, k, None if draft_s is None else 1e-3, 1e-2 + 1e-3 * k, *rest)

    worker.policy.choose = choose
    worker.policy.record = fixed_record
    worker._verify = hooked
    out, _ = run(worker, reqs, k=3, max_batch=4, eos=env.eos, extra=30)
    plain, _ = run(target_worker(env.target), reqs, eos=env.eos, extra=30)
    assert out == plain
    assert worker.stats.stale_rows > 0
    assert all(drafting == not_stale for _, drafting, not_stale, _ in asked)
    none_can = [k for _, drafting, _, k in asked if drafting == 0]
    assert none_can and set(none_can) == {0}  # a batch of stale rows: plain decoding
    assert any(drafting > 0 for _, drafting, _, _ in asked)  # rows that joined later


# ---- prompt lookup ------------------------------------------------------------------------------


@pytest.mark.parametrize("max_batch,adaptive", [(1, False), (1, True), (8, False)])
def test_prompt_lookup_is_lossless(env, max_batch, adaptive) -> None:
    # min_n 1: the tiny random model repeats itself, so lookups fire often, right or wrong
    worker = spec_worker(env, "eagle3", 3, max_batch=max_batch, adaptive=adaptive,
                         prompt_lookup=(1, 3))
    out, sched = run(worker, env.reqs, k=3, max_batch=max_batch, eos=env.eos)
    assert out == env.plain
    st = worker.stats
    assert 0 < st.lookup_rows and st.lookup_accepted < st.lookup_drafted
    if max_batch == 1:
        assert st.lookup_accepted > 0
    assert st.accepted == sum(sum(a) for a in sched.accept_log)


@pytest.mark.parametrize("max_batch,adaptive", [(1, False), (1, True), (8, False), (8, True)])
def test_long_lookup_drafts_are_lossless(env, max_batch, adaptive) -> None:
    # rounds where every row drafts by lookup may be up to 7 wide (K = 3): rows draft their own
    # n_i <= 7 copied tokens, shorter rows are padded; plans carry 7 placeholders
    worker = spec_worker(env, "eagle3", 3, max_batch=max_batch, adaptive=adaptive,
                         prompt_lookup=(1, 3), lookup_tokens=7)
    assert worker.max_draft_tokens == 7
    out, sched = run(worker, env.reqs, k=7, max_batch=max_batch, eos=env.eos)
    assert out == env.plain
    st = worker.stats
    assert st.accepted == sum(sum(a) for a in sched.accept_log)
    if not adaptive:  # without the policy a lookup row drafts its whole proposal (up to 7)
        assert st.lookup_drafted > 3 * st.lookup_rows > 0


def test_prompt_lookup_survives_preemption(env) -> None:
    # a preempted sequence is prefilled again (often in another slot): its history restarts
    worker = spec_worker(env, "eagle1", 2, num_blocks=40, prompt_lookup=(1, 4))
    out, sched = run(worker, env.reqs, k=2, num_blocks=40, eos=env.eos, preempt_at={0: 3, 4: 1})
    assert out == env.plain
    assert sum(r.preemptions for r in sched.requests) >= 3 and worker.stats.lookup_rows > 0


def test_prompt_lookup_history_is_the_committed_sequence(env) -> None:
    worker = spec_worker(env, "eagle3", 3, max_batch=4, prompt_lookup=(2, 4))
    reqs = [Req(r.prompt, r.max_new) for r in env.reqs[:4]]  # no EOS: every token is kept
    out, sched = run(worker, reqs, k=3, max_batch=4)
    for r, tokens in zip(sched.requests, out):
        slot = r.slots_used[-1]
        n = int(worker.lookup.lengths[slot])
        # the last round may emit past max_new; what was kept is a prefix of what was seen
        assert n >= len(r.prompt) + len(tokens)
        assert worker.lookup.tokens[slot, : len(r.prompt) + len(tokens)].tolist() == list(
            r.prompt) + tokens


# ---- oracle drafts: full and partial acceptance ------------------------------------------------


def wrong(i: int, n: int, error_rate: float) -> bool:
    """Whether an oracle's token n of request i is made wrong: fixed, pseudo-random."""
    return (i * 7919 + n * 104729) % 1000 < 1000 * error_rate


class Oracle:
    """Replaces the draft's argmax with the plain-greedy continuation of each request, wrong
    (token + 1) at fixed pseudo-random positions with probability `error_rate`."""

    def __init__(self, worker: SpecWorker, sched: FakeScheduler, continuation, error_rate=0.0):
        self.sched, self.continuation, self.error_rate = sched, continuation, error_rate
        self.rows: list[tuple[int, int]] = []
        self.j = 0
        verify = worker._verify

        def hooked(plan):
            by_slot = {r.slot: i for i, r in enumerate(sched.requests) if r.slot is not None}
            pairs = zip(plan.request_slots, plan.num_generated, strict=True)
            self.rows = [(by_slot[int(s)], int(g)) for s, g in pairs]
            self.j = 0
            return verify(plan)

        worker._verify = hooked
        worker.draft.argmax_tokens = self.argmax_tokens

    def argmax_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        out = []
        for i, g in self.rows:
            t = self.continuation[i][g + self.j]
            out.append((t + 1) % VOCAB if wrong(i, g + self.j, self.error_rate) else t)
        self.j += 1
        return torch.tensor(out, dtype=torch.long)


@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_oracle_drafts(env, error_rate) -> None:
    k = 3
    reqs = env.reqs[:12]
    long, _ = run(target_worker(env.target), reqs, extra=k + 1)  # greedy continuation, no EOS
    plain, plain_sched = run(target_worker(env.target), reqs)
    worker = spec_worker(env, "eagle1", k)
    sched = hooked_scheduler(reqs, k)
    Oracle(worker, sched, long, error_rate)
    assert sched.run(worker) == plain
    accepted = np.concatenate(sched.accept_log)
    decode_steps = plain_sched.plan_kinds["decode"]  # target forwards of plain decoding
    if error_rate == 0:
        assert bool((accepted == k).all())  # every draft of every round accepted
        # a request needs ceil(n / (k+1)) rounds where plain decoding needs n steps
        assert worker.stats.verify_rounds * 2 < decode_steps
    else:
        assert set(np.unique(accepted).tolist()) == set(range(k + 1))
        assert worker.stats.verify_rounds < decode_steps


class LookupOracle:
    """Replaces prompt lookup's proposals with the plain-greedy continuation of each request:
    a pseudo-random 0..7 tokens per (request, position), so that the rows of a round differ in
    width and some draft by the head, wrong (token + 1) with probability `error_rate`."""

    def __init__(self, worker: SpecWorker, sched: FakeScheduler, continuation, error_rate=0.0):
        self.sched, self.continuation, self.error_rate = sched, continuation, error_rate
        worker.lookup.propose = self.propose

    def propose(self, slot: int, k: int) -> np.ndarray:
        i, req = next((i, r) for i, r in enumerate(self.sched.requests) if r.slot == slot)
        g = len(req.outputs)  # tokens committed so far: the continuation starts there
        out = []
        for j in range(min(k, (i * 31 + g * 17) % 8)):
            t = self.continuation[i][g + j]
            out.append((t + 1) % VOCAB if wrong(i, g + j, self.error_rate) else t)
        return np.array(out, dtype=np.int32)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_lookup_oracle_rounds_of_mixed_width(env, adaptive, error_rate) -> None:
    k, width = 3, 7
    reqs = env.reqs[:12]
    long, _ = run(target_worker(env.target), reqs, extra=width + 1)  # no EOS
    plain, _ = run(target_worker(env.target), reqs)
    worker = spec_worker(env, "eagle3", k, adaptive=adaptive, prompt_lookup=(1, 3),
                         lookup_tokens=width)
    sched = hooked_scheduler(reqs, width)
    LookupOracle(worker, sched, long, error_rate)
    assert sched.run(worker) == plain
    st = worker.stats
    assert st.lookup_rows > 0 and st.accepted == sum(sum(a) for a in sched.accept_log)
    if error_rate > 0:
        assert 0 < st.lookup_accepted < st.lookup_drafted
    else:
        assert st.lookup_accepted == st.lookup_drafted  # every copied token was right
        if not adaptive:  # rows draft their whole proposal: runs past K
            assert max(max(a) for a in sched.accept_log if len(a)) > k


# ---- the draft state against a recomputation from scratch --------------------------------------


@pytest.mark.parametrize("oracle", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_draft_state_matches_recomputation(env, kind, oracle) -> None:
    """Before every round, each row's slot state h^d_{L-2} equals a fresh draft pass over the
    whole committed sequence with the target's features ((f_p, x_{p+1}) for p = 0..L-2); without
    the oracle, the round's drafts equal a fresh autoregressive chain from that state."""
    k = 3
    reqs = env.reqs[:3]
    worker = spec_worker(env, kind, k)
    sched = hooked_scheduler(reqs, k)
    model, draft = worker.model, worker.draft
    real = draft.argmax_tokens
    recorded: list[torch.Tensor] = []
    if oracle:
        long, _ = run(target_worker(env.target), reqs, extra=k + 1)
        Oracle(worker, sched, long, error_rate=0.4)
    else:
        draft.argmax_tokens = lambda h: recorded.append(real(h)) or recorded[-1]
    verify = worker._verify
    checked = [0]

    def hooked(plan):
        expected_chains = []
        for slot in plan.request_slots:
            seq = next(r.seq for r in sched.requests if r.slot == int(slot))
            h, chain = recompute(model, draft, real, seq, k)
            torch.testing.assert_close(worker.slots.hidden[int(slot)], h, atol=1e-4, rtol=1e-4)
            expected_chains.append(chain)
            checked[0] += 1
        recorded.clear()
        out = verify(plan)
        if not oracle:
            got = torch.stack(recorded, dim=1)  # [B, k]
            assert got.tolist() == expected_chains
        return out

    worker._verify = hooked
    sched.run(worker)
    assert checked[0] > 10


@torch.inference_mode()
def recompute(model, draft, argmax, seq: list[int], k: int) -> tuple[torch.Tensor, list[int]]:
    """(h^d_{L-2}, the k-token draft chain from it) from scratch for x_0..x_{L-1} = seq."""
    length = len(seq)
    pages = PagedSequences(64, 4, seed=1)
    kv_t = allocate_kv_cache(model.config, 64, 4, model.dtype, "cpu")
    kv_d = draft.allocate_kv_cache(64, 4)
    ids, pos, meta = pages.step([(0, seq[: length - 1])])  # target over x_0..x_{L-2}
    model.backend.prepare(meta)
    _, captured = model(ids, pos, meta, kv_t, capture_layers=draft.capture_layers)
    dmeta = dataclasses.replace(meta, backend_state=None)
    draft.backend.prepare(dmeta)
    h = draft(torch.tensor(seq[1:]), draft.target_features(captured), pos, dmeta, kv_d)[-1:]
    state = h[0].clone()
    chain = [int(argmax(h))]
    for _ in range(k - 1):  # draft steps at L-1, L, ...
        ids, pos, meta = pages.step([(0, [chain[-1]])])
        draft.backend.prepare(meta)
        h = draft(ids, h, pos, meta, kv_d)
        chain.append(int(argmax(h)))
    return state, chain


# ---- greedy computes no softmax over the vocabulary --------------------------------------------


def vocab_softmaxes(prof, vocab_sizes) -> list:
    return [
        (e.name, e.input_shapes)
        for e in prof.events()
        if "softmax" in e.name and e.input_shapes and e.input_shapes[0]
        and e.input_shapes[0][-1] in vocab_sizes
    ]  # fmt: skip


def test_greedy_run_computes_no_vocabulary_softmax(env, tmp_path) -> None:
    draft_dir = make_draft_dir(tmp_path, env.target, "eagle3", draft_vocab_size=200)
    sizes = (VOCAB, 200)  # attention softmaxes are over <= MAX_LEN keys: no clash

    def profile():
        cpu = [torch.profiler.ProfilerActivity.CPU]
        return torch.profiler.profile(activities=cpu, record_shapes=True)

    worker = spec_worker(env, "eagle3", 3, draft=draft_dir)
    with profile() as prof:
        out, _ = run(worker, env.reqs[:3], k=3, eos=env.eos)
    assert out == env.plain[:3]
    assert vocab_softmaxes(prof, sizes) == []
    # the probe sees vocabulary-wide ops: the draft head [200, 64] and the target head [320, 64]
    shapes = {tuple(s) for e in prof.events() for s in (e.input_shapes or []) if s}
    assert (200, 64) in shapes and (VOCAB, 64) in shapes
    # and a sampled run does show a vocabulary softmax
    sampled = [dataclasses.replace(r, temperature=1.0, seed=i) for i, r in enumerate(env.reqs[:2])]
    worker = spec_worker(env, "eagle3", 3, draft=draft_dir)
    with profile() as prof:
        run(worker, sampled, k=3)
    assert vocab_softmaxes(prof, sizes)


# ---- sampling ----------------------------------------------------------------------------------


def reference_distribution(logits: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    """The target's own sampling distribution, written out plainly (one row)."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(float(probs[i]) for i in kept)
    out, acc = torch.zeros_like(probs), 0.0
    for rank, i in enumerate(kept):
        if rank > 0 and acc >= top_p * mass:
            break
        out[i] = probs[i]
        acc += float(probs[i])
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.3, 6, 0.9)])
def test_sampled_tokens_follow_the_target_distribution(tmp_path, temperature, top_k, top_p):
    """Thousands of rows with different seeds: the joint distribution of the first three output
    tokens (prefill token, then the first verify round's) is the target's own."""
    import transformers

    vocab, n, k, prompt = 8, 3000, 2, [1, 5, 2]
    target = make_target_dir(tmp_path / "t", num_layers=2, hidden=32, vocab=vocab, max_positions=64)
    draft = make_draft_dir(tmp_path / "d", target, "eagle1")
    blocks = 2 * n + 8
    worker = SpecWorker.from_target(
        target_worker(target, num_blocks=blocks, max_model_len=32),
        draft,
        num_steps=k,
        max_batch_size=n,
        adaptive=False,
    )
    reqs = [FakeRequest(list(prompt), 3, temperature, top_p, top_k, seed) for seed in range(n)]
    sched = FakeScheduler(
        reqs, num_blocks=blocks, block_size=4, max_batch_size=n, max_model_len=32,
        max_draft_tokens=k, max_prefill_tokens=10**6,
    )  # fmt: skip
    out = torch.tensor(sched.run(worker))  # [n, 3]
    accepted = np.concatenate(sched.accept_log)
    assert 0 < accepted.sum() and (accepted < k).any()  # both outcomes occur

    hf = transformers.LlamaForCausalLM.from_pretrained(target).eval()
    with torch.inference_mode():

        def dist(prefixes: list[list[int]]) -> torch.Tensor:  # [len, V]
            logits = hf(torch.tensor(prefixes)).logits[:, -1].float()
            return torch.stack([reference_distribution(x, temperature, top_k, top_p)
                                for x in logits])  # fmt: skip

        p1 = dist([prompt])[0]  # [V]
        p2 = dist([prompt + [a] for a in range(vocab)])  # [V, V]
        p3 = dist([prompt + [a, b] for a in range(vocab) for b in range(vocab)]).view(
            vocab, vocab, -1
        )
    joint = (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)
    cells = out[:, 0] * vocab * vocab + out[:, 1] * vocab + out[:, 2]
    stat, dof = chi_square(torch.bincount(cells, minlength=vocab**3), joint)
    assert dof >= 10 and stat < chi2_critical_001(dof), (stat, dof)


@pytest.mark.parametrize("lookup,lookup_tokens", [(None, None), ((1, 3), None), ((1, 3), 6)])
def test_sampled_outputs_do_not_depend_on_the_batch(env, lookup, lookup_tokens) -> None:
    # with prompt lookup a row drafts by lookup or by the head from its own sequence only, and
    # (without the adaptive policy) as many tokens as its own proposal has, up to lookup_tokens
    reqs = [
        dataclasses.replace(r, temperature=0.9, top_p=0.95, seed=100 + i)
        for i, r in enumerate(env.reqs[:5])
    ]
    worker = spec_worker(env, "eagle3", 3, prompt_lookup=lookup, lookup_tokens=lookup_tokens)
    k = worker.max_draft_tokens
    together, _ = run(worker, reqs, k=k)
    alone = [run(worker, [r], k=k)[0][0] for r in reqs[::-1]][::-1]  # one by one, slot 0
    assert together == alone
    if lookup is not None:
        assert worker.stats.lookup_rows > 0


# ---- construction and the adaptive policy ------------------------------------------------------


def test_tree_drafting_is_refused(env) -> None:
    with pytest.raises(ValueError, match=r"speculative.topk > 1 \(tree drafting\)"):
        SpecWorker.from_target(
            target_worker(env.target), env.drafts["eagle1"], num_steps=2,
            max_batch_size=4, topk=4,
        )  # fmt: skip
    assert "not supported yet" in TREE_UNSUPPORTED


def test_rope_tables_cover_max_model_len_plus_k(env) -> None:
    worker = spec_worker(env, "eagle1", 4)
    assert worker.model.model.rotary_emb.cos_table.shape[0] >= MAX_LEN + 4
    assert worker.draft.rotary_emb.cos_table.shape[0] >= MAX_LEN + 4
    target = target_worker(env.target)
    draft = load_draft(env.drafts["eagle3"], target.model.config, target.model)
    assert draft.rotary_emb.max_positions == MAX_LEN


def test_adaptive_policy_choices() -> None:
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 3) == 4.0
    assert chain_expected_tokens([0.8, 0.5, 0.25], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert chain_expected_tokens([0.8, 0.5], 0) == 1.0
    policy = AdaptiveDraftLength(4)
    sweep = []
    for _ in range(5):  # a new bucket measures k = 0, 1, ... while the next one could win
        k = policy.choose(7)
        sweep.append(k)
        policy.record(8, k, 0.001 if k else None, 0.008 + 0.0005 * k, [k] * 8)
    assert sweep == [0, 1, 2, 3, 4]
    assert policy.acceptance > 0.95 and min(policy.rates()) > 0.9
    assert policy.choose(8) == 4  # drafts nearly always accepted: draft all K
    assert policy.cost(8, 2) == pytest.approx(2 * 0.001 + 0.008 + 0.0005 * 2)
    assert policy.cost(16, 2) is None  # another bucket: nothing measured yet
    assert AdaptiveDraftLength(4).choose(100) == 0 and AdaptiveDraftLength.bucket_of(100) == 128


def _swept(policy: AdaptiveDraftLength, round_seconds, accepted) -> None:
    """Runs the sweep of bucket 1 with the given round time per k and accepted drafts per k."""
    for _ in range(policy.max_k + 1):
        k = policy.choose(1)
        policy.record(1, k, 0.001 if k else None, round_seconds[k] - 0.001 * k, [accepted(k)])


def test_adaptive_policy_never_drafts_what_is_never_accepted() -> None:
    low = AdaptiveDraftLength(4)
    cost = [0.008, 0.0105, 0.011, 0.012, 0.013]
    sweep = []
    for _ in range(4):
        sweep.append(low.choose(1))
        low.record(1, sweep[-1], 0.001 if sweep[-1] else None, cost[sweep[-1]] - 0.001 * sweep[-1],
                   [0])
    # k = 3 priced at k = 2's cost with what two rejections taught cannot beat plain decoding:
    # the sweep stops there and plain decoding is chosen
    assert sweep == [0, 1, 2, 0] and 3 not in low.buckets[1].t_round
    assert low.acceptance < 0.3 and low.rates()[0] < 0.3
    probes = []
    for i in range(16 + 32 + 64 + 1):
        k = low.choose(1)
        if k:
            probes.append(i)
        low.record(1, k, 0.001 if k else None, cost[k] - 0.001 * k, [0])
    # a probe of k + 1 (no k - 1 below 0) 16 rounds after the sweep, 16 rounds later, then
    # at doubling intervals while the choice stays the same
    assert probes == [15, 31, 63]


def test_adaptive_policy_tries_no_wider_rounds_where_widening_costs_what_it_emits() -> None:
    """Batch 64 on a CPU: each query token a row adds costs about a decode row, drafts pass 60%
    of the time. k = 1 is measured once; 2 and 3 never are, and plain decoding is chosen."""
    policy = AdaptiveDraftLength(3)
    rng = np.random.default_rng(0)
    chosen = []
    for _ in range(200):
        k = policy.choose(64)
        chosen.append(k)
        accepted = [int(x) for x in rng.binomial(1, 0.6, size=64) * (k > 0)]
        policy.record(64, k, 0.002 if k else None, 0.1 * (k + 1), accepted)
    assert chosen[:3] == [0, 1, 0] and max(chosen) == 1
    # k = 1: the sweep's, then the probes 16, 16, 32 and 64 rounds apart
    assert [i for i, k in enumerate(chosen) if k] == [1, 18, 34, 66, 130]
    assert policy.drafting_cannot_pay(64) and not policy.drafting_cannot_pay(8)  # k = 1: 2x k = 0
    cheap = AdaptiveDraftLength(3)  # k = 1 costs 1.5x: never accepted, but it could pay
    for _ in range(40):
        k = cheap.choose(64)
        cheap.record(64, k, 0.002 if k else None, 0.1 * (1 + 0.5 * k), [0] * 64 if k else [])
    assert cheap.choose(64) == 0 and not cheap.drafting_cannot_pay(64)


def test_adaptive_policy_follows_a_step_in_verify_cost() -> None:
    """A CPU GEMM's cost jumps between 3 and 4 query tokens (k = 2 -> 3). With every draft
    accepted, a line fitted through the per-k costs would price k = 3 too cheaply and pick it;
    the measured per-k costs pick k = 2."""
    policy = AdaptiveDraftLength(3)
    cost = [0.035, 0.036, 0.037, 0.060]  # seconds per round, k = 0..3
    _swept(policy, cost, lambda k: k)
    assert policy.choose(1) == 2
    assert policy.cost(1, 3) == pytest.approx(0.060)


def test_adaptive_policy_prices_each_draft_position() -> None:
    """Drafts 1 and 2 always pass, draft 3 never: the chain estimate stops paying for k = 3
    where a single pooled rate (25 passes in 36 tries) would still pick k = 3."""
    policy = AdaptiveDraftLength(3)
    cost = [0.035, 0.036, 0.037, 0.040]
    _swept(policy, cost, lambda k: min(k, 2))
    for _ in range(10):
        policy.record(1, 3, 0.001, cost[3] - 0.003, [2])
    rates = policy.rates()
    assert rates[0] > 0.9 and rates[1] > 0.9 and rates[2] < 0.2
    assert policy.choose(1) == 2


def test_adaptive_policy_counts_each_rows_own_drafts() -> None:
    """A row that drafted n < k tokens and passed all n tried positions 1..n only: it says
    nothing about position n + 1 (prompt-lookup rounds of mixed width)."""
    policy = AdaptiveDraftLength(4)
    policy.record(2, 4, None, 0.03, accepted=[2, 1], drafted=[2, 4])
    assert policy.tried == [2.0, 2.0, 0.0, 0.0]  # row 0 tried 1..2 (all it had), row 1 1..2
    assert policy.passed == [2.0, 1.0, 0.0, 0.0]


def test_adaptive_policy_counts_only_the_rows_that_can_draft() -> None:
    """Batch 64 on a CPU: each query token a row adds to a round costs about what a decode
    row does. Every draft is accepted: with all 64 rows drafting, k = 3 pays; with 8 of them
    (the rest left the head), widening all 64 rows for their drafts does not: k = 0. No row
    that can draft: k = 0, before any sweep."""
    assert AdaptiveDraftLength(3).choose(64, drafting=0) == 0
    policy = AdaptiveDraftLength(3)
    cost = [0.35, 0.50, 0.65, 0.80]
    for _ in range(4):
        k = policy.choose(64)
        policy.record(64, k, None, cost[k], [k] * 64)
    assert policy.choose(64) == 3 and policy.choose(64, drafting=64) == 3
    assert policy.choose(64, drafting=8) == 0
    # a round of width 2 in which the head drafted nothing: its cost counts, the rates stay
    tried, rounds = list(policy.tried), policy.buckets[64].rounds
    policy.record(64, 2, None, 0.95, [])
    assert policy.tried == tried and policy.buckets[64].rounds == rounds + 1
    assert policy.cost(64, 2) == pytest.approx(0.8 * 0.65 + 0.2 * 0.95)

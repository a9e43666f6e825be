"""Automatic prefix caching end to end: greedy outputs with caching equal those without and
transformers' (tiny random Llama; byte tokens, blocks of 16), plain and speculative (a random
EAGLE-3 head, and prompt lookup, whose history must include the cached prefix), under a KV
budget that forces eviction and preemption; the `cached_tokens` column and the summary's
counters; and the default model on prompts sharing an instruction preamble."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import build_worker, run_prepared
from eaglebatch.speculative import init_random_draft
from support.spies import ReaderWaitSpy
from support.tiny import write_prompts
from test_runner import hf_greedy, run_job

pytest.importorskip("eaglebatch._native")

PREAMBLE = "You label sentences. Answer with one word only. " * 2  # 96 byte tokens: 6 blocks


def shared_prompts() -> list[str]:
    """Prompts sharing every kind of prefix with each other: none, part of a block, whole
    blocks, a whole prompt (twice), and long shared runs that part at various offsets."""
    return [
        PREAMBLE + "the cat sat on the mat",
        PREAMBLE + "the cat sat on a hat",
        PREAMBLE,
        PREAMBLE,
        PREAMBLE[:40] + "and then something else entirely",
        PREAMBLE[:5] + "short",
        "a prompt that shares nothing with the others",
        PREAMBLE[:32],  # exactly two blocks (a <bos>-less byte tokenizer)
        PREAMBLE + "the cat sat on the mat and purred",
        PREAMBLE[:64] + "q",
    ]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    return [hf_greedy(hf, p) for p in shared_prompts()]


def tokens(table) -> list[list[int]]:
    return table.column("output_token_ids").to_pylist()


@pytest.mark.parametrize("batch", [1, 8])
def test_outputs_equal_transformers_with_and_without_caching(tmp_path, tiny_model_dir,
                                                             reference, batch):  # fmt: skip
    runs = {}
    for caching in (True, False):
        table, res = run_job(tmp_path, tiny_model_dir, shared_prompts(), name=f"c{caching}",
                             overrides=[f"engine.prefix_caching={str(caching).lower()}",
                                        f"engine.max_batch_size={batch}"])  # fmt: skip
        assert tokens(table) == reference
        runs[caching] = (table, res.stats)
    (on, s_on), (off, s_off) = runs[True], runs[False]
    cached = on.column("cached_tokens").to_pylist()
    assert off.column("cached_tokens").to_pylist() == [0] * len(cached)
    # the whole preamble; the preamble alone less its last block (its last token is computed);
    # two blocks exactly, less the second; nothing for what shares less than a block
    assert (cached[1], cached[2], cached[7]) == (96, 80, 16)
    assert cached[5] == cached[6] == 0
    assert s_on["cached_tokens"] == sum(cached)
    assert s_on["prefill_tokens"] == s_off["prefill_tokens"] - sum(cached)
    assert s_on["prefix_hit_rate"] == pytest.approx(sum(cached) / s_on["prompt_tokens"])


def test_eviction_and_preemption_keep_the_outputs(tmp_path, tiny_model_dir, reference):
    # 12 blocks of 16: a few sequences at a time, cached blocks evicted to make room
    table, res = run_job(tmp_path, tiny_model_dir, shared_prompts(),
                         overrides=["engine.kv_cache_tokens=192", "engine.max_batch_size=4"],
                         wrap=ReaderWaitSpy)
    assert tokens(table) == reference
    assert res.stats["preemptions"] > 0 and res.stats["evictions"] > 0
    assert res.stats["cached_tokens"] > 0


@pytest.mark.parametrize("lookup", [False, True])
def test_speculative_outputs_equal_transformers_with_caching(tmp_path, tiny_model_dir,
                                                             reference, lookup):  # fmt: skip
    """The draft's K/V of cached blocks is reused too: a wrong entry (one computed from another
    next token) would lower acceptance, not outputs, so acceptance is compared as well."""
    head = init_random_draft(tmp_path / "head", tiny_model_dir, kind="eagle3", seed=5,
                             aux_layer_ids=(0, 1, 2))
    extra = [] if lookup else ["speculative.prompt_lookup_min=0"]  # lookup is on by default
    runs = {}
    for caching in (True, False):
        table, res = run_job(tmp_path, tiny_model_dir, shared_prompts(), name=f"s{caching}",
                             overrides=[f"draft={head}", "speculative.adaptive=false",
                                        f"engine.prefix_caching={str(caching).lower()}",
                                        "engine.max_batch_size=4", *extra])  # fmt: skip
        assert tokens(table) == reference
        runs[caching] = table
    on, off = runs[True], runs[False]
    assert sum(on.column("cached_tokens").to_pylist()) > 0
    # the same drafts were proposed and accepted row by row: the reused draft K/V is exact
    assert on.column("accepted_tokens").to_pylist() == off.column("accepted_tokens").to_pylist()


class DraftKvSpy:
    """Wraps a SpecWorker: after every prefill step, keeps each row's draft K/V at all of its
    positions (read through its block table), keyed by the row's tokens."""

    def __init__(self, worker) -> None:
        self.worker, self.kv = worker, {}

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def step(self, plan):
        out = self.worker.step(plan)
        if plan.kind == "prefill":
            bs = self.worker.budget.block_size
            cu, cp = plan.cu_seqlens_q, plan.cu_prefix
            for i in np.flatnonzero(plan.next_ids < 0):  # rows whose prompt is now complete
                ids = [*plan.prefix_ids[cp[i] : cp[i + 1]], *plan.input_ids[cu[i] : cu[i + 1]]]
                pos = np.arange(len(ids))
                blocks = plan.block_tables[i, pos // bs]
                self.kv[tuple(ids)] = self.worker.draft_kv[:, blocks, pos % bs].clone()
        return out


@pytest.mark.parametrize("chunk", [None, 9])
def test_reused_draft_kv_equals_the_draft_kv_computed_without_caching(tmp_path, tiny_model_dir,
                                                                      chunk):  # fmt: skip
    """Prompts that part exactly at a block boundary: the draft's entry at the last position
    of the shared part depends on the first token after it, so the scheduler must not reuse
    that block (the one whose successor it could not match) for the draft's cache. The random
    head accepts next to nothing, so outputs alone would not show a wrong entry. With chunked
    prefill (`chunk` tokens a step) each chunk's last entry depends on the next chunk's first
    token (the plan's next_ids): the same comparison checks it."""
    head = init_random_draft(tmp_path / "head", tiny_model_dir, kind="eagle3", seed=6,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    shared = PREAMBLE[:80]  # five blocks (enough to wait a step for), then the prompts part
    prompts = [shared + "xyz and more", shared + "abc and more", shared[:64] + "qq" + "r" * 20]
    inp = write_prompts(tmp_path / "in.parquet", prompts)
    kv = {}
    for caching in (True, False):
        # the reference: no caching, whole prefills; the other: caching (and chunks)
        engine = [f"prefix_caching: {str(caching).lower()}", "kv_cache_tokens: 2048",
                  f"chunked_prefill: {str(caching and chunk is not None).lower()}",
                  f"max_num_batched_tokens: {chunk or 4096}", "device: cpu"]  # fmt: skip
        job_file = tmp_path / f"kv{caching}.yaml"
        job_file.write_text(
            f"model: {tiny_model_dir}\ndraft: {head}\ninput:\n  path: {inp}\noutput:\n"
            f"  path: {tmp_path / f'kv{caching}'}\nsampling:\n  max_new_tokens: 4\n"
            "speculative:\n  adaptive: false\nengine:\n" + "".join(f"  {e}\n" for e in engine)
        )
        prep = prepare(load_job(job_file))
        spy = DraftKvSpy(build_worker(prep))
        res = run_prepared(prep, worker=spy)
        assert (res.stats["cached_tokens"] > 0) == caching
        kv[caching] = spy.kv
    assert kv[True].keys() == kv[False].keys() and len(kv[True]) == len(prompts)
    for ids, want in kv[False].items():
        torch.testing.assert_close(kv[True][ids], want, atol=1e-5, rtol=1e-5)


# ---- chunked prefill -------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [7, 40])
def test_chunked_prefill_equals_transformers(tmp_path, tiny_model_dir, reference, budget):
    """A step budget below the longest prompt (~130 tokens): prompts in chunks of at most
    `budget` tokens, sharing steps with the decoding rows."""
    table, res = run_job(tmp_path, tiny_model_dir, shared_prompts(),
                         overrides=["engine.chunked_prefill=true", "engine.max_batch_size=4",
                                    f"engine.max_num_batched_tokens={budget}"])  # fmt: skip
    assert tokens(table) == reference


@pytest.mark.parametrize("caching", ["true", "false"])
def test_chunked_prefill_with_speculative_decoding(tmp_path, tiny_model_dir, reference, caching):
    head = init_random_draft(tmp_path / "head", tiny_model_dir, kind="eagle3", seed=5,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    runs = {}
    for chunked in ("true", "false"):
        table, _ = run_job(tmp_path, tiny_model_dir, shared_prompts(), name=f"c{chunked}",
                           overrides=[f"draft={head}", "speculative.adaptive=false",
                                      f"engine.chunked_prefill={chunked}",
                                      f"engine.prefix_caching={caching}",
                                      "engine.max_num_batched_tokens=24",
                                      "engine.max_batch_size=4"])  # fmt: skip
        assert tokens(table) == reference
        runs[chunked] = table
    # the chunks' draft K/V (each chunk's last entry from the plan's next token) is exact:
    # prompt lookup and the head propose the same drafts row by row
    assert (runs["true"].column("accepted_tokens").to_pylist()
            == runs["false"].column("accepted_tokens").to_pylist())  # fmt: skip


class LookupHistorySpy:
    """Wraps a SpecWorker whose policy finds drafting cannot pay from batch 3 on (so it asks for
    plain steps while the batch is full); before every step, checks that each decoding row's
    prompt-lookup history holds its whole sequence (length L, last token x_{L-1})."""

    def __init__(self, worker) -> None:
        self.worker, self.kinds = worker, []
        worker.policy.drafting_cannot_pay = lambda batch_size: batch_size >= 3

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def step(self, plan):
        self.kinds.append((plan.kind, plan.num_tokens > plan.num_seqs))
        lookup, cu = self.worker.lookup, plan.cu_seqlens_q
        if plan.kind != "prefill":
            for i, slot in enumerate(plan.request_slots):
                at = int(plan.positions[cu[i]])  # a decoding row's query starts at L - 1
                if plan.kind == "verify" or plan.next_ids[i] < 0 and cu[i + 1] - cu[i] == 1 \
                        and not self.worker.slots.prefilling[slot] and at > 0:
                    assert lookup.lengths[slot] == at + 1, (plan.kind, i)
                    assert lookup.tokens[slot, at] == plan.input_ids[cu[i]], (plan.kind, i)
        return self.worker.step(plan)


@pytest.mark.parametrize("chunked", ["true", "false"])
def test_plain_steps_where_drafting_cannot_pay(tmp_path, tiny_model_dir, reference, chunked):
    """Where the policy finds drafting cannot pay, the worker asks the scheduler for plain steps
    (with chunked prefill, prompt chunks ride in them) and verify rounds resume when the batch
    shrinks: outputs stay transformers' greedy, and prompt lookup's histories follow."""
    head = init_random_draft(tmp_path / "head", tiny_model_dir, kind="eagle3", seed=5,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    spies = []

    def wrap(worker):  # rows side by side from the first step: batches of 3 and more
        spies.append(LookupHistorySpy(worker))
        return ReaderWaitSpy(spies[0])

    table, res = run_job(tmp_path, tiny_model_dir, shared_prompts(),
                         overrides=[f"draft={head}", f"engine.chunked_prefill={chunked}",
                                    "engine.max_num_batched_tokens=24", "engine.max_batch_size=4"],
                         wrap=wrap)  # fmt: skip
    assert tokens(table) == reference
    spy, stats = spies[0], spies[0].worker.stats
    assert stats.plain_steps > 0 and stats.verify_rounds > 0 and stats.stale_rows > 0
    assert (("decode", True) in spy.kinds) == (chunked == "true")  # prompt chunks rode along
    assert ("mixed" in res.stats["step_seconds"]) == (chunked == "true")


# ---- the default model ------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_outputs_equal_with_and_without_caching_and_chunks(tmp_path):
    """SmolLM2-135M-Instruct and its builtin EAGLE head on 8 ShareGPT prompts after a shared
    instruction (a system message far longer than a block): greedy tokens equal without
    caching, with caching, and with chunked prefill of 48 tokens a step."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eaglebatch.job import builtin

    rows = pq.ParquetFile(builtin.sharegpt_parquet()).read_row_group(0).to_pylist()
    rows = [r for r in rows if 20 <= len(r["prompt"]) <= 300][:8]
    system = "You are a careful assistant. Answer in two short sentences, plainly. " * 4
    msgs = [[{"role": "system", "content": system}, {"role": "user", "content": r["prompt"]}]
            for r in rows]  # fmt: skip
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"messages": msgs}), inp)
    settings = {"plain": "false", "cached": "true"}
    got = {}
    for draft in (None, "smollm2-135m-instruct-eagle"):
        for name, caching in settings.items():
            for chunk in (None, 48):
                tag = f"{draft is not None}-{name}-{chunk}"
                job = tmp_path / f"{tag}.yaml"
                job.write_text(
                    f"model: smollm2-135m-instruct\ninput:\n  path: {inp}\n"
                    f"  messages_column: messages\noutput:\n  path: {tmp_path / tag}\n"
                    "  include_token_ids: true\nsampling:\n  max_new_tokens: 24\n"
                    f"engine:\n  device: cpu\n  kv_cache_tokens: 8192\n  max_batch_size: 8\n"
                    f"  prefix_caching: {caching}\n  chunked_prefill: {str(bool(chunk)).lower()}\n"
                    f"  max_num_batched_tokens: {chunk or 4096}\n"
                    + (f"draft: {draft}\n" if draft else "")
                )
                res = run_prepared(prepare(load_job(job)))
                table = pq.read_table(tmp_path / tag).sort_by("row_index")
                got[tag] = tokens(table)
                assert (res.stats["cached_tokens"] > 0) == (caching == "true"), tag
    want = got["False-plain-None"]
    assert all(v == want for v in got.values()), [k for k, v in got.items() if v != want]

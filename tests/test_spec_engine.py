"""Speculative decoding end to end through the Rust scheduler's verify plans: outputs equal
plain greedy decoding token for token, for both draft head formats, several K, batch sizes and a
KV budget small enough to preempt; the speculative output columns are filled in."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from eaglebatch.errors import JobError
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import build_worker, run_prepared
from support.spies import ReaderWaitSpy
from support.tiny import write_prompts
from test_runner import random_prompts

pytest.importorskip("eaglebatch._native")

MAX_NEW = 20


def run(tmp, model_dir, prompts, name, overrides=(), wrap=None):
    inp = write_prompts(tmp / "in.parquet", prompts)
    job_file = tmp / f"{name}.yaml"
    job_file.write_text(
        f"model: {model_dir}\ninput:\n  path: {inp}\noutput:\n  path: {tmp / name}\n"
        f"  include_token_ids: true\nsampling:\n  max_new_tokens: {MAX_NEW}\n"
        "engine:\n  device: cpu\n  kv_cache_tokens: 4096\n"
    )
    prep = prepare(load_job(job_file, list(overrides)))
    res = run_prepared(prep, worker=None if wrap is None else wrap(build_worker(prep)))
    return pq.read_table(tmp / name).sort_by("row_index").to_pylist(), res


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(10, seed=5)


@pytest.fixture(scope="module")
def plain(tiny_model_dir, prompts, tmp_path_factory):
    rows, _ = run(tmp_path_factory.mktemp("plain"), tiny_model_dir, prompts, "plain")
    return rows


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("k, batch", [(1, 8), (3, 1), (3, 8), (5, 4)])
def test_greedy_speculative_equals_plain(tmp_path, tiny_model_dir, drafts, prompts, plain, kind,
                                         k, batch):
    rows, res = run(
        tmp_path, tiny_model_dir, prompts, "spec",
        [f"draft={drafts[kind]}", f"speculative.num_steps={k}",
         f"engine.max_batch_size={batch}", "speculative.adaptive=false"],
    )
    assert [r["output_token_ids"] for r in rows] == [r["output_token_ids"] for r in plain]
    assert [r["output_text"] for r in rows] == [r["output_text"] for r in plain]
    assert [r["finish_reason"] for r in rows] == [r["finish_reason"] for r in plain]
    for r in rows:
        if r["output_tokens"] > 1:
            assert r["spec_steps"] >= 1
            assert 0 <= r["accepted_tokens"] <= k * r["spec_steps"]
            assert 1.0 <= r["accept_length"] <= k + 1
    assert res.stats["spec_steps"] > 0


def test_preemption_with_lookahead_keeps_outputs(tmp_path, tiny_model_dir, drafts, prompts,
                                                 plain):
    rows, res = run(
        tmp_path, tiny_model_dir, prompts, "spec",
        [f"draft={drafts['eagle1']}", "speculative.num_steps=3", "engine.max_batch_size=8",
         "engine.kv_cache_tokens=192"],
        wrap=ReaderWaitSpy,
    )
    assert res.stats["preemptions"] > 0
    assert [r["output_token_ids"] for r in rows] == [r["output_token_ids"] for r in plain]


def test_adaptive_draft_length_is_still_lossless(tmp_path, tiny_model_dir, drafts, prompts, plain):
    rows, _ = run(
        tmp_path, tiny_model_dir, prompts, "spec",
        [f"draft={drafts['eagle3']}", "speculative.num_steps=4", "engine.max_batch_size=4"],
    )
    assert [r["output_token_ids"] for r in rows] == [r["output_token_ids"] for r in plain]


@pytest.mark.parametrize("batch", [1, 4])
def test_prompt_lookup_is_lossless_and_counted(tmp_path, tiny_model_dir, drafts, prompts, plain,
                                               batch):
    rows, res = run(
        tmp_path, tiny_model_dir, prompts, "spec",
        [f"draft={drafts['eagle3']}", "speculative.num_steps=3", f"engine.max_batch_size={batch}",
         "speculative.prompt_lookup_min=1", "speculative.adaptive=false"],
    )
    assert [r["output_token_ids"] for r in rows] == [r["output_token_ids"] for r in plain]
    drafts_stats = res.stats["drafts"]
    assert drafts_stats["lookup_rows"] > 0  # (right or wrong: this model is random)
    assert drafts_stats["accepted"] == sum(r["accepted_tokens"] for r in rows)


def test_prompt_lookup_off(tmp_path, tiny_model_dir, drafts, prompts, plain):
    rows, res = run(
        tmp_path, tiny_model_dir, prompts, "spec",
        [f"draft={drafts['eagle3']}", "engine.max_batch_size=1", "speculative.prompt_lookup_min=0"],
    )
    assert [r["output_token_ids"] for r in rows] == [r["output_token_ids"] for r in plain]
    assert res.stats["drafts"]["lookup_rows"] == 0


def test_sampling_reproducible_across_batch_sizes(tmp_path, tiny_model_dir, drafts, prompts):
    common = [f"draft={drafts['eagle1']}", "speculative.num_steps=2", "speculative.adaptive=false",
              "sampling.temperature=0.9", "sampling.seed=3"]
    a, _ = run(tmp_path, tiny_model_dir, prompts, "a", [*common, "engine.max_batch_size=1"])
    b, _ = run(tmp_path, tiny_model_dir, prompts, "b", [*common, "engine.max_batch_size=8"])
    assert [r["output_token_ids"] for r in a] == [r["output_token_ids"] for r in b]


def test_tree_drafting_is_refused_with_the_key(tmp_path, tiny_model_dir, drafts, prompts):
    with pytest.raises(JobError, match=r"speculative\.topk"):
        run(tmp_path, tiny_model_dir, prompts, "t", [f"draft={drafts['eagle1']}",
                                                     "speculative.topk=4"])


def test_bad_draft_folder_is_a_job_error(tmp_path, tiny_model_dir, prompts):
    (tmp_path / "nodraft").mkdir()
    with pytest.raises(JobError, match="draft"):
        run(tmp_path, tiny_model_dir, prompts, "t", [f"draft={tmp_path / 'nodraft'}"])

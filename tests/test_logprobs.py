"""`output.logprobs`: per output token its log-probability and the top-K alternatives, checked
against transformers' logits on the same prefix (raw mode) and against transformers' own
temperature / top-k warpers (processed mode); speculative decoding reports plain decoding's
values; a job without logprobs has no column."""

from __future__ import annotations

import math

import pytest
import torch

from eaglebatch.speculative import init_random_draft
from support.spies import ReaderWaitSpy
from support.tiny import byte_tokenizer
from test_runner import MAX_NEW, hf_model, random_prompts, run_job  # noqa: F401 (fixture)

pytest.importorskip("eaglebatch._native")

K = 5


def hf_logprobs(model, prompt: str, output: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits predicting each output token: [len(output), V]."""
    ids = byte_tokenizer().encode(prompt).ids
    with torch.inference_mode():
        logits = model(torch.tensor([ids + output])).logits[0].float()
    return torch.log_softmax(logits[len(ids) - 1 : len(ids) - 1 + len(output)], dim=-1)


def check_against(ref: torch.Tensor, row: dict, tol: float = 1e-4) -> None:
    entries = row["logprobs"]
    assert len(entries) == row["output_tokens"] == len(row["output_token_ids"])
    for j, (e, tok) in enumerate(zip(entries, row["output_token_ids"], strict=True)):
        assert e["token_id"] == tok
        assert e["token"] == byte_tokenizer().decode([tok], skip_special_tokens=False)
        assert abs(e["logprob"] - ref[j, tok].item()) < tol, (j, e["logprob"], ref[j, tok])
        top = e["top_logprobs"]
        assert len(top) == K
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True)
        want = ref[j].topk(K).values
        assert max(abs(a - b) for a, b in zip(values, want.tolist(), strict=True)) < tol
        for t in top:
            assert abs(t["logprob"] - ref[j, t["token_id"]].item()) < tol


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(9, seed=11)


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_model_dir, prompts):
    tmp = tmp_path_factory.mktemp("plain")
    table, _ = run_job(tmp, tiny_model_dir, prompts, overrides=[f"output.logprobs={K}"])
    return table.to_pylist()


def test_greedy_logprobs_equal_transformers(plain, prompts, hf_model):  # noqa: F811
    for row, prompt in zip(plain, prompts, strict=True):
        ref = hf_logprobs(hf_model, prompt, row["output_token_ids"])
        check_against(ref, row)
        # greedy: the chosen token is the most likely one
        assert all(e["top_logprobs"][0]["token_id"] == e["token_id"] for e in row["logprobs"])


def test_speculative_logprobs_equal_plain(tmp_path, tiny_model_dir, prompts, plain):
    head = init_random_draft(tmp_path / "head", tiny_model_dir, kind="eagle3", seed=2,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    over = [f"output.logprobs={K}", f"draft={head}", "speculative.adaptive=false",
            "speculative.prompt_lookup_min=1", "engine.max_batch_size=4"]  # fmt: skip
    table, res = run_job(tmp_path, tiny_model_dir, prompts, overrides=over, name="spec")
    assert res.stats["spec_steps"] > 0
    for s, p in zip(table.to_pylist(), plain, strict=True):
        assert s["output_token_ids"] == p["output_token_ids"]
        for a, b in zip(s["logprobs"], p["logprobs"], strict=True):
            assert a["token_id"] == b["token_id"]
            assert abs(a["logprob"] - b["logprob"]) < 1e-4
            assert [t["token_id"] for t in a["top_logprobs"]] == [
                t["token_id"] for t in b["top_logprobs"]
            ]


def test_processed_logprobs_are_the_sampling_distribution(tmp_path, tiny_model_dir, prompts,
                                                          hf_model):  # noqa: F811
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
    )

    over = [f"output.logprobs={K}", "output.logprobs_mode=processed",
            "sampling.temperature=0.7", "sampling.top_k=3", "sampling.seed=4"]  # fmt: skip
    table, _ = run_job(tmp_path, tiny_model_dir, prompts[:4], overrides=over, name="proc")
    for row, prompt in zip(table.to_pylist(), prompts, strict=False):
        ids = byte_tokenizer().encode(prompt).ids
        out = row["output_token_ids"]
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids + out])).logits[0].float()
        scores = logits[len(ids) - 1 : len(ids) - 1 + len(out)]
        scores = TopKLogitsWarper(3)(None, TemperatureLogitsWarper(0.7)(None, scores))
        ref = torch.log_softmax(scores, dim=-1)
        for j, e in enumerate(row["logprobs"]):
            assert abs(e["logprob"] - ref[j, e["token_id"]].item()) < 1e-4
            top = e["top_logprobs"]
            assert [t["token_id"] for t in top[:3]] == ref[j].topk(3).indices.tolist()
            assert all(t["logprob"] == -math.inf for t in top[3:])  # cut by top-k


def test_no_logprobs_no_column_and_error_rows_are_null(tmp_path, tiny_model_dir):
    table, _ = run_job(tmp_path, tiny_model_dir, ["hello"], name="off")
    assert "logprobs" not in table.column_names
    table, _ = run_job(tmp_path, tiny_model_dir, ["hello", None], name="err",
                       overrides=["output.logprobs=2"])  # fmt: skip
    rows = table.to_pylist()
    assert rows[1]["finish_reason"] == "error" and rows[1]["logprobs"] is None
    assert len(rows[0]["logprobs"]) == rows[0]["output_tokens"] <= MAX_NEW


PROMPT_CASES = {
    "whole": ["engine.chunked_prefill=false"],
    "chunks": ["engine.max_num_batched_tokens=16"],
    "preempting": ["engine.kv_cache_tokens=192", "engine.max_batch_size=8"],
    "speculative": ["speculative.adaptive=false"],
}


@pytest.mark.parametrize("case", sorted(PROMPT_CASES))
def test_prompt_logprobs_equal_transformers(tmp_path, tiny_model_dir, prompts, case,
                                            hf_model):  # noqa: F811
    """Prompts sharing a prefix (which the cache would serve) computed whole, in chunks,
    recomputed after preemptions and with a draft: every prompt token's entry equals
    log_softmax of transformers' logits at the position before it."""
    shared = ["the cat sat on the mat " * 2 + p for p in prompts[:5]]
    over = [*PROMPT_CASES[case], "output.prompt_logprobs=3"]
    if case == "speculative":
        head = init_random_draft(tmp_path / "head", tiny_model_dir, kind="eagle3", seed=2,
                                 aux_layer_ids=(0, 1, 2))  # fmt: skip
        over.append(f"draft={head}")
    wrap = ReaderWaitSpy if case == "preempting" else None
    table, res = run_job(tmp_path, tiny_model_dir, shared, overrides=over, name=case, wrap=wrap)
    if case == "preempting":
        assert res.stats["preemptions"] > 0
    tok = byte_tokenizer()
    for row, prompt in zip(table.to_pylist(), shared, strict=True):
        ids = tok.encode(prompt).ids
        assert row["cached_tokens"] == 0  # computed whole: its logits are needed
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        entries = row["prompt_logprobs"]
        assert len(entries) == len(ids) - 1
        for j, e in enumerate(entries):
            assert e["token_id"] == ids[j + 1]
            assert abs(e["logprob"] - ref[j, ids[j + 1]].item()) < 1e-4
            top = [t["token_id"] for t in e["top_logprobs"]]
            assert top == ref[j].topk(3).indices.tolist()

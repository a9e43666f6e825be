"""Scoring tasks (`task: score`, `task: perplexity`) on the tiny model against transformers:
each continuation's summed log-probability equals transformers' log_softmax sum over the same
tokens (1e-4, fp32), `is_greedy` its argmax check; the token split is lm-eval's, written out
here independently of the Rust splitter; perplexity windows follow lm-eval's rolling rule.
Choices share their context's blocks (cached_tokens); chunked prefill, preemption, a draft
head, shards and resume leave the scores unchanged; bad rows are error rows."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import eaglebatch
from support.tiny import byte_tokenizer
from test_runner import hf_model, random_prompts  # noqa: F401 (fixture)

pytest.importorskip("eaglebatch._native")

PREFIX = 257  # the tiny model's BOS id: an empty context's stand-in
CONTEXTS = ["the cat sat on ", "hello", "", "naïve über — code " * 6, "   ", "42\n"]
CONTINUATIONS = ["the mat", " world", "abc", "x y", "lead", " 43"]


def split(context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's (context, continuation) token split with the byte tokenizer."""
    tok = byte_tokenizer()
    if context == "":
        cont = tok.encode(continuation, add_special_tokens=False).ids
        return ([PREFIX], cont) if cont[0] != PREFIX else (cont[:1], cont[1:])
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    if context == "":  # all whitespace: the prefix token stands for the context
        return [PREFIX], tok.encode(continuation).ids
    whole = tok.encode(context + continuation).ids
    ctx = tok.encode(context).ids
    return ctx, whole[len(ctx) :]


def hf_score(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].float(), dim=-1)
    pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
    target = torch.tensor(cont)
    return lp[pos, target].sum().item(), bool((lp[pos].argmax(-1) == target).all())


def hf_rolling(model, text: str, max_len: int) -> tuple[float, int]:
    """lm-eval's rolling windows (context length 1, input at most max_len - 1 tokens)."""
    tokens, seq_len = byte_tokenizer().encode(text).ids, max_len - 1
    total, predicted = 0.0, 0
    first = min(seq_len, len(tokens))
    windows = [([PREFIX] + tokens[: first - 1], tokens[:first])]
    predicted = first
    while predicted < len(tokens):
        n = min(len(tokens) - predicted, seq_len)
        end = predicted + n
        windows.append((tokens[end - seq_len - 1 : end - 1], tokens[end - n : end]))
        predicted = end
    for inp, pred in windows:
        ctx = inp[: len(inp) - (len(pred) - 1)]
        total += hf_score(model, ctx, pred)[0]
    return total, len(tokens)


def greedy_continuation(model, context: str) -> str:
    """A one-byte continuation that is the model's argmax after `context` (printable ASCII)."""
    ctx = byte_tokenizer().encode(context).ids
    with torch.inference_mode():
        order = model(torch.tensor([ctx])).logits[0, -1].argsort(descending=True).tolist()
    tok = byte_tokenizer()
    for t in order[:1]:
        text = tok.decode([t])
        if len(text) == 1 and text.isprintable() and not text.isspace():
            return text
    return ""


def write_job(tmp: Path, model: Path, table: pa.Table, task: str, *extra: str) -> Path:
    pq.write_table(table, tmp / "in.parquet")
    lines = [f"model: {model}", f"task: {task}", "input:", f"  path: {tmp / 'in.parquet'}",
             *[e for e in extra if e.startswith("  ")], "output:", f"  path: {tmp / 'out'}",
             "  part_rows: 2", "engine:", "  device: cpu", "  kv_cache_tokens: 4096"]  # fmt: skip
    (tmp / "job.yaml").write_text("\n".join(lines) + "\n")
    return tmp / "job.yaml"


def run(job: Path, *overrides: str, **kw) -> list[dict]:
    eaglebatch.run(job, list(overrides), **kw)
    return pq.read_table(job.parent / "out").sort_by("row_index").to_pylist()


@pytest.fixture(scope="module")
def pairs(hf_model):  # noqa: F811
    contexts, continuations = list(CONTEXTS), list(CONTINUATIONS)
    found = 0
    for ctx in random_prompts(200, seed=3):  # rows whose continuation is the argmax
        if found < 2 and (greedy := greedy_continuation(hf_model, ctx)):
            contexts.append(ctx)
            continuations.append(greedy)
            found += 1
    return contexts, continuations


def test_continuation_scores_equal_transformers(tmp_path, tiny_model_dir, hf_model, pairs):  # noqa: F811
    contexts, continuations = pairs
    table = pa.table({"prompt": contexts, "cont": continuations})
    job = write_job(tmp_path, tiny_model_dir, table, "score", "  continuation_column: cont")
    rows = run(job)
    assert len(rows) == len(contexts)
    greedy_rows = 0
    for ctx, cont, row in zip(contexts, continuations, rows, strict=True):
        c, x = split(ctx, cont)
        want, greedy = hf_score(hf_model, c, x)
        assert row["error"] is None
        assert row["num_tokens"] == len(x)
        assert abs(row["logprob"] - want) < 1e-4, (ctx, cont, row["logprob"], want)
        assert row["is_greedy"] == greedy
        assert row["prompt_tokens"] == len(c) + len(x) and row["output_tokens"] == 0
        greedy_rows += greedy
    assert greedy_rows >= 1  # the argmax check is exercised both ways


@pytest.mark.parametrize("case", ["plain", "chunked", "preempted", "draft", "no-cache"])
def test_choices_share_their_context_and_equal_the_pairs(
    tmp_path, tiny_model_dir, hf_model, case, drafts  # noqa: F811
):
    long_ctx = "the cat sat on the mat and " * 8  # > 64 tokens: choices wait to share it
    contexts = [long_ctx, "hello ", ""]
    choices = [["the dog", "a", "the mat again"], ["world", "there", "x"], ["abc", "d"]]
    table = pa.table({"prompt": contexts, "choices": choices})
    job = write_job(tmp_path, tiny_model_dir, table, "score", "  choices_column: choices")
    over = {"plain": [], "no-cache": ["engine.prefix_caching=false"],
            "chunked": ["engine.chunked_prefill=true", "engine.max_num_batched_tokens=48"],
            "preempted": ["engine.kv_cache_tokens=320", "engine.max_batch_size=8"],
            "draft": [f"draft={drafts['eagle3']}"]}[case]  # fmt: skip
    rows = run(job, *over)
    for ctx, options, row in zip(contexts, choices, rows, strict=True):
        assert row["error"] is None and len(row["logprob"]) == len(options)
        for j, option in enumerate(options):
            c, x = split(ctx, option)
            want, greedy = hf_score(hf_model, c, x)
            assert abs(row["logprob"][j] - want) < 1e-4, (case, ctx[:20], option)
            assert row["num_tokens"][j] == len(x) and row["is_greedy"][j] == greedy
    if case in ("plain", "draft"):
        assert rows[0]["cached_tokens"] >= 2 * 64  # the long context computed once
    if case == "no-cache":
        assert all(r["cached_tokens"] == 0 for r in rows)


def test_perplexity_windows_equal_lm_eval_rule(tmp_path, tiny_model_dir, hf_model):  # noqa: F811
    texts = ["the cat sat on the mat. " * 9, "short", "über naïve — " * 20]
    table = pa.table({"prompt": texts})
    job = write_job(tmp_path, tiny_model_dir, table, "perplexity")
    rows = run(job, "engine.max_model_len=64")
    assert {"logprob", "num_tokens"} <= set(rows[0]) and "is_greedy" not in rows[0]
    for text, row in zip(texts, rows, strict=True):
        want, n = hf_rolling(hf_model, text, 64)
        assert row["num_tokens"] == n
        assert math.isclose(row["logprob"], want, rel_tol=1e-6, abs_tol=1e-4), (text[:10],)
    assert rows[0]["num_tokens"] > 64  # several windows


def test_bad_rows_are_error_rows_and_the_rest_are_scored(tmp_path, tiny_model_dir):
    table = pa.table({
        "prompt": ["a", None, "b", "c", "d"],
        "choices": [["x"], ["y"], None, [], ["z", None]],
    })  # fmt: skip
    job = write_job(tmp_path, tiny_model_dir, table, "score", "  choices_column: choices")
    rows = run(job)
    assert rows[0]["error"] is None and rows[0]["logprob"][0] < 0
    assert "prompt column 'prompt' is null" in rows[1]["error"]
    assert "column 'choices' is null" in rows[2]["error"]
    assert "no choice" in rows[3]["error"]
    assert "null choice" in rows[4]["error"]
    assert all(r["logprob"] is None and r["finish_reason"] == "error" for r in rows[1:])


def test_a_continuation_too_long_is_an_error_row(tmp_path, tiny_model_dir):
    table = pa.table({"prompt": ["a", "b"], "cont": ["x" * 80, "y"]})
    job = write_job(tmp_path, tiny_model_dir, table, "score", "  continuation_column: cont")
    rows = run(job, "engine.max_model_len=64")
    assert "must be shorter than max_model_len (64)" in rows[0]["error"]
    assert rows[1]["error"] is None


@pytest.mark.parametrize(("extra", "message"), [
    ((), "exactly one of input.continuation_column and input.choices_column"),
    (("  continuation_column: cont", "  choices_column: cont"), "exactly one of"),
    (("  continuation_column: missing",), "missing"),
    (("  choices_column: cont",), "input.choices_column: column 'cont' in .* has type"),
])  # fmt: skip
def test_bad_scoring_jobs_are_refused_before_any_work(tmp_path, tiny_model_dir, extra, message):
    table = pa.table({"prompt": ["a"], "cont": ["b"]})
    job = write_job(tmp_path, tiny_model_dir, table, "score", *extra)
    with pytest.raises(eaglebatch.JobError, match=message):
        eaglebatch.run(job)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("part-*"))


def test_generation_keys_are_refused_with_a_scoring_task(tmp_path, tiny_model_dir):
    table = pa.table({"prompt": ["a"], "cont": ["b"]})
    job = write_job(tmp_path, tiny_model_dir, table, "perplexity")
    with pytest.raises(eaglebatch.JobError, match="sampling.n"):
        eaglebatch.run(job, ["sampling.n=2", "sampling.temperature=1.0"])
    with pytest.raises(eaglebatch.JobError, match="only for task: score"):
        eaglebatch.run(job, ["input.continuation_column=cont"])


def test_shards_and_resume_write_each_scored_row_once(tmp_path, tiny_model_dir):
    texts = [f"row {i} " * (1 + i % 5) for i in range(12)]
    table = pa.table({"prompt": texts, "cont": [f" next {i}" for i in range(12)]})
    job = write_job(tmp_path, tiny_model_dir, table, "score", "  continuation_column: cont")
    whole = {r["row_index"]: r["logprob"] for r in run(job)}
    out = tmp_path / "out"
    for part in sorted(out.glob("part-*.parquet"))[::2]:  # lose half the parts
        part.unlink()
    assert run(job) and len(pq.read_table(out)) == 12  # the rerun fills the gaps only
    sharded = [f"output.path={tmp_path / 'sharded'}"]
    eaglebatch.run(job, sharded, shard="0/2")
    eaglebatch.run(job, sharded, shard="1/2")
    rows = pq.read_table(tmp_path / "sharded").to_pylist()
    assert sorted(r["row_index"] for r in rows) == list(range(12))
    # a row's prefill runs in another batch here (torch's GEMM blocks other row counts
    # otherwise: float rounding, seen up to past 1e-6 on a sum of token logprobs in CI); a row
    # scored twice or another row's score would be off by far more
    assert all(abs(r["logprob"] - whole[r["row_index"]]) < 1e-4 for r in rows)


def test_a_scoring_job_on_ray_equals_one_process(tmp_path, tiny_model_dir):
    pytest.importorskip("ray")
    texts = [f"ray row {i} " * (1 + i % 4) for i in range(10)]
    table = pa.table({"prompt": texts, "choices": [[" a", f" b {i}"] for i in range(10)]})
    job = write_job(tmp_path, tiny_model_dir, table, "score", "  choices_column: choices")
    whole = {r["row_index"]: r["logprob"] for r in run(job)}
    over = [f"output.path={tmp_path / 'ray'}", "engine.executor=ray", "ray.actors=1",
            "ray.cpus_per_actor=1", "ray.unit_rows=4"]  # fmt: skip
    eaglebatch.run(job, over)
    rows = pq.read_table(tmp_path / "ray").to_pylist()
    assert sorted(r["row_index"] for r in rows) == list(range(10))
    for r in rows:
        diffs = [abs(a - b) for a, b in zip(r["logprob"], whole[r["row_index"]], strict=True)]
        assert max(diffs) < 1e-4, diffs  # 1 thread there, 2 here: float sums differ


@pytest.mark.parametrize(("extra", "message"), [
    ("  continuation_column: cont", "input.continuation_column: column 'cont'"),
    ("  choices_column: cont", "input.choices_column: column 'cont'"),
])  # fmt: skip
def test_validate_refuses_a_scoring_column_of_the_wrong_type_as_run_does(
    tmp_path, tiny_model_dir, extra, message
):
    from click.testing import CliRunner

    from eaglebatch.cli import main

    table = pa.table({"prompt": ["a"], "cont": pa.array([[1]] if "cont" in extra and
                                                        "continuation" in extra else [3])})
    job = write_job(tmp_path, tiny_model_dir, table, "score", extra)
    for cmd in ("validate", "run"):
        r = CliRunner().invoke(main, [cmd, str(job)])
        assert r.exit_code == 2 and message in r.output and "has type" in r.output, r.output
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("part-*"))

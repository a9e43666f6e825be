"""End to end on a tiny random Llama: Parquet in -> Rust scheduler -> torch worker -> Parquet out,
compared token for token with Hugging Face transformers' greedy `generate` on the same weights."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import build_worker, run_prepared
from support.spies import ReaderWaitSpy
from support.tiny import byte_tokenizer, write_prompts

pytest.importorskip("eaglebatch._native")

EOS = 258
MAX_NEW = 24


def random_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "über", "naïve", "42", "\n", "—", "code"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 25))) for _ in range(n)]


def run_job(tmp: Path, model_dir: Path, prompts, *, overrides=(), ids=None, name="out",
            wrap=None, columns=None):  # fmt: skip
    """The job over `prompts` (and the input `columns` beside them) -> (output table by
    row_index, RunSummary); `wrap`: a function of the job's worker returning the worker to
    run (a spy)."""
    inp = write_prompts(tmp / f"{name}-in.parquet", prompts, ids=ids, extra=columns)
    job_file = tmp / f"{name}.yaml"
    lines = [
        f"model: {model_dir}",
        "input:",
        f"  path: {inp}",
        *(["  id_column: id"] if ids is not None else []),
        "output:",
        f"  path: {tmp / name}",
        "  include_token_ids: true",
        "  part_rows: 4",
        "sampling:",
        f"  max_new_tokens: {MAX_NEW}",
        "engine:",
        "  device: cpu",
        "  kv_cache_tokens: 4096",
    ]
    job_file.write_text("\n".join(lines) + "\n")
    prep = prepare(load_job(job_file, list(overrides)))
    res = run_prepared(prep, worker=None if wrap is None else wrap(build_worker(prep)))
    table = pq.read_table(tmp / name).sort_by("row_index")
    return table, res


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def hf_greedy(model, prompt: str, max_new: int = MAX_NEW) -> list[int]:
    ids = byte_tokenizer().encode(prompt).ids
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
    new = out[0, len(ids) :].tolist()
    return new[: new.index(EOS) + 1] if EOS in new else new


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(12)


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    return [hf_greedy(hf_model, p) for p in prompts]


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_equals_transformers(tmp_path, tiny_model_dir, prompts, reference, batch_size):
    table, res = run_job(
        tmp_path, tiny_model_dir, prompts, overrides=[f"engine.max_batch_size={batch_size}"]
    )
    assert table.num_rows == len(prompts)
    got = table.column("output_token_ids").to_pylist()
    for i, (g, want) in enumerate(zip(got, reference, strict=False)):
        assert g == want, f"prompt {i}: {g} != {want}"
    tok = byte_tokenizer()
    for row, want in zip(table.to_pylist(), reference, strict=False):
        stopped = bool(want) and want[-1] == EOS
        assert row["finish_reason"] == ("stop" if stopped else "length")
        assert row["output_tokens"] == len(want)
        assert row["output_text"] == tok.decode([t for t in want if t != EOS])
        assert row["error"] is None
    assert res.stats["requests"] == len(prompts)
    seconds = res.stats["step_seconds"]  # per plan kind, together at most the run's wall time
    assert {"prefill", "decode"} <= set(seconds) <= {"prefill", "mixed", "decode"}
    assert all(v > 0 for v in seconds.values())
    assert sum(seconds.values()) <= res.wall_s


def test_small_kv_budget_preempts_and_keeps_outputs(tmp_path, tiny_model_dir, prompts, reference):
    # 12 blocks of 16 tokens for up to 8 concurrent sequences of up to ~100 tokens each.
    table, res = run_job(
        tmp_path,
        tiny_model_dir,
        prompts,
        overrides=["engine.max_batch_size=8", "engine.kv_cache_tokens=192"],
        wrap=ReaderWaitSpy,
    )
    assert res.stats["preemptions"] > 0
    assert table.column("output_token_ids").to_pylist() == reference


def test_columns_ids_and_metadata(tmp_path, tiny_model_dir):
    ps = random_prompts(5, seed=3)
    ids = [f"req-{i}" for i in range(5)]
    table, _ = run_job(tmp_path, tiny_model_dir, ps, ids=ids)
    assert table.schema.field("id").type == pa.string()
    assert table.column("id").to_pylist() == ids
    for col in ("output_text", "finish_reason", "prompt_tokens", "output_tokens", "queue_s",
                "ttft_s", "latency_s", "tpot_s", "error"):
        assert col in table.schema.names, col
    for row in table.to_pylist():
        assert row["queue_s"] >= 0 and row["ttft_s"] >= 0
        assert row["latency_s"] >= row["ttft_s"]
        assert row["prompt_tokens"] == len(byte_tokenizer().encode(ps[row["row_index"]]).ids)
    meta = pq.read_metadata(next(Path(tmp_path / "out").glob("part-*.parquet"))).metadata
    job = json.loads(meta[b"eaglebatch.job"])
    assert job["sampling"]["max_new_tokens"] == MAX_NEW


def test_int_ids_keep_their_type(tmp_path, tiny_model_dir):
    ids = pa.array([10, 20, 30], pa.int32())
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ids, "prompt": ["a", "b", "c"]}), inp)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        f"model: {tiny_model_dir}\ninput:\n  path: {inp}\n  id_column: id\n"
        f"output:\n  path: {tmp_path / 'o'}\nsampling:\n  max_new_tokens: 3\n"
        "engine:\n  device: cpu\n  kv_cache_tokens: 1024\n"
    )
    run_prepared(prepare(load_job(job_file)))
    table = pq.read_table(tmp_path / "o").sort_by("row_index")
    assert table.schema.field("id").type == pa.int32()
    assert table.column("id").to_pylist() == [10, 20, 30]


def test_bad_rows_become_error_rows(tmp_path, tiny_model_dir, hf_model):
    long = "x" * 600  # 600 byte tokens > the model's 512 positions
    ps = ["hello there", None, "", long, "the cat"]
    table, res = run_job(tmp_path, tiny_model_dir, ps)
    rows = table.to_pylist()
    assert [r["finish_reason"] == "error" for r in rows] == [False, True, True, True, False]
    for r in rows:
        if r["finish_reason"] == "error":
            assert r["error"] and r["output_tokens"] == 0
        else:
            assert r["error"] is None
    assert rows[0]["output_token_ids"] == hf_greedy(hf_model, "hello there")
    assert res.stats["errors"] == 3


def test_stop_string_cuts_text(tmp_path, tiny_model_dir, prompts, reference):
    tok = byte_tokenizer()
    # Pick a stop string from the middle of a reference output so it certainly occurs.
    i, want = next((i, w) for i, w in enumerate(reference) if len([t for t in w if t != EOS]) > 6)
    text = tok.decode([t for t in want if t != EOS])
    stop = text[3:5]
    if not stop.strip():
        pytest.skip("degenerate stop string")
    table, _ = run_job(
        tmp_path, tiny_model_dir, [prompts[i]], overrides=[f"sampling.stop={json.dumps([stop])}"]
    )
    row = table.to_pylist()[0]
    assert row["finish_reason"] == "stop"
    assert row["output_text"] == text[: text.index(stop)]


def test_sampling_is_reproducible_across_batch_sizes(tmp_path, tiny_model_dir, prompts):
    sampled = ["sampling.temperature=0.8", "sampling.top_p=0.9", "sampling.seed=7"]
    a, _ = run_job(tmp_path, tiny_model_dir, prompts, overrides=[*sampled,
                   "engine.max_batch_size=1"], name="a")
    b, _ = run_job(tmp_path, tiny_model_dir, prompts, overrides=[*sampled,
                   "engine.max_batch_size=8"], name="b")
    assert a.column("output_token_ids").to_pylist() == b.column("output_token_ids").to_pylist()

"""`eaglebatch bench` on the tiny model: plain and speculative rows side by side, and the greedy
speculative run checked token for token against the plain one."""

from __future__ import annotations

import json

import pytest

from eaglebatch.bench import _same_tokens, _token_digests, run_bench
from eaglebatch.config import load_job
from eaglebatch.speculative import init_random_draft
from support.tiny import write_prompts
from test_engine import random_prompts

pytest.importorskip("eaglebatch._native")


def _job(tmp_path, model_dir, overrides=()):
    draft = init_random_draft(tmp_path / "draft", model_dir, kind="eagle3", draft_vocab_size=200,
                              seed=3, aux_layer_ids=(0, 1, 2))
    inp = write_prompts(tmp_path / "in.parquet", random_prompts(6, seed=11))
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        f"model: {model_dir}\ndraft: {draft}\ninput:\n  path: {inp}\noutput:\n"
        f"  path: {tmp_path / 'out'}\nsampling:\n  max_new_tokens: 12\n"
        "speculative:\n  num_steps: 2\nengine:\n  device: cpu\n  kv_cache_tokens: 4096\n"
    )
    return load_job(job_file, list(overrides))


def test_bench_compares_speculative_with_plain(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "bench.json"
    result = run_bench(_job(tmp_path, tiny_model_dir), [1, 4], [], str(out))
    engines = [(r["engine"], r["batch_size"]) for r in result["rows"]]
    assert engines == [("eaglebatch", 1), ("eaglebatch+eagle", 1), ("eaglebatch", 4),
                       ("eaglebatch+eagle", 4)]
    for r in result["rows"]:
        assert r["requests"] == 6 and r["output_tokens"] > 0 and r["output_tok_s"] > 0
        assert "digests" not in r
    spec = [r for r in result["rows"] if r["engine"] == "eaglebatch+eagle"]
    assert all(r["identical_requests"] == 6 and r["accept_length"] >= 1.0 for r in spec)
    assert json.loads(out.read_text())["spec"]["identical_requests"] == 6
    printed = capsys.readouterr().out
    assert "output tokens identical to plain decoding: 6/6 requests" in printed
    assert "identical output tokens in 6/6 requests" in printed


def test_bench_does_not_compare_sampled_tokens(tmp_path, tiny_model_dir):
    job = _job(tmp_path, tiny_model_dir, ["sampling.temperature=0.8"])
    result = run_bench(job, [2], [], None)
    assert all("identical_requests" not in r for r in result["rows"])


def test_token_digests_tell_runs_apart(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(name, ids):
        d = tmp_path / name
        d.mkdir()
        pq.write_table(pa.table({"row_index": list(range(len(ids))), "output_token_ids": ids}),
                       d / "part-00000.parquet")
        return _token_digests(d)

    a = write("a", [[1, 2, 3], [4, 5], []])
    b = write("b", [[1, 2, 3], [4, 6], []])
    c = write("c", [[1, 2, 3]])
    assert _same_tokens(a, a) == 3 and _same_tokens(a, b) == 2
    assert _same_tokens(a, c) == 1  # a request missing from the other run is not the same


def test_bench_repeat_alternates_runs_and_takes_the_median_pair(tmp_path, tiny_model_dir,
                                                                 capsys):
    result = run_bench(_job(tmp_path, tiny_model_dir), [2], [], None, repeat=3)
    printed = capsys.readouterr().out
    order = [line.split(",")[1].strip() for line in printed.splitlines()
             if line.startswith("eaglebatch,") and "(run " in line]
    assert order == ["plain decoding", "EAGLE (K=2)"] * 3  # alternating
    pairs = result["pair_speedups"]
    assert len(pairs) == 3 and result["speedup"] == sorted(pairs)[1]
    plain, spec = result["plain"], result["spec"]
    assert len(plain["runs_tok_s"]) == 3 and len(spec["runs_tok_s"]) == 3
    assert plain["output_tok_s"] == sorted(plain["runs_tok_s"])[1]  # the median run
    assert spec["identical_requests"] == 6
    assert "median of the pairs" in printed
    with pytest.raises(ValueError, match="repeat"):
        run_bench(_job(tmp_path, tiny_model_dir), [2], [], None, repeat=0)

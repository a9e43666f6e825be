"""`eaglebatch bench` on the tiny model: plain and speculative rows side by side, and the greedy
speculative run checked token for token against the plain one."""

from __future__ import annotations

import json

import pytest

from eaglebatch.commands.bench import _same_tokens, _token_digests, run_bench
from eaglebatch.job.config import load_job
from eaglebatch.speculative import init_random_draft
from support.tiny import write_prompts
from test_runner import random_prompts

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
        assert 0 < r["generation_s"] < r["wall_s"]  # the prefills are left out
        assert r["generation_tok_s"] == pytest.approx(r["output_tokens"] / r["generation_s"])
        assert "digests" not in r
    spec = [r for r in result["rows"] if r["engine"] == "eaglebatch+eagle"]
    assert all(r["identical_requests"] == 6 and r["accept_length"] >= 1.0 for r in spec)
    assert json.loads(out.read_text())["spec"]["identical_requests"] == 6
    printed = capsys.readouterr().out
    assert "output tokens identical to plain decoding: 6/6 requests" in printed
    assert "identical output tokens in 6/6 requests" in printed


def test_bench_does_not_compare_sampled_tokens(tmp_path, tiny_model_dir):
    job = _job(tmp_path, tiny_model_dir, ["sampling.temperature=0.8"])
    result = run_bench(job, [1, 2], [], None)  # batch 1: request by request, nothing to compare
    assert all("identical_requests" not in r for r in result["rows"])
    assert [r["requests"] for r in result["rows"]] == [6, 6, 6, 6]


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


def test_batch_one_alternates_the_engines_request_by_request(tmp_path, tiny_model_dir, capsys,
                                                             monkeypatch):
    import eaglebatch.commands.bench as bench

    calls = []
    real = bench._eaglebatch_row

    def recording(job, batch_size, worker, tmp, spec, compare, only_row=None):
        calls.append((only_row, spec))
        return real(job, batch_size, worker, tmp, spec, compare, only_row=only_row)

    monkeypatch.setattr(bench, "_eaglebatch_row", recording)
    job = _job(tmp_path, tiny_model_dir)
    result = run_bench(job, [1], [], None, repeat=2)
    one_pass = [(i, spec) for i in range(6)
                for spec in ((False, True) if i % 2 == 0 else (True, False))]
    assert calls == one_pass * 2  # every request alone, each engine first on every other one
    plain, spec = result["plain"], result["spec"]
    assert plain["requests"] == spec["requests"] == 6
    assert spec["identical_requests"] == 6 and spec["accept_length"] >= 1.0
    assert len(result["pair_speedups"]) == 2
    printed = capsys.readouterr().out
    assert printed.count("alternating request by request") == 2
    # the same tokens as one plain run over all six prompts
    calls.clear()
    whole = run_bench(_job(tmp_path, tiny_model_dir, ["draft=null"]), [1], [], None)
    assert calls == [(None, False)]
    assert whole["plain"]["output_tokens"] == plain["output_tokens"]


def test_merged_runs_sum_tokens_and_time_and_take_percentiles_over_requests():
    from eaglebatch.commands.bench import _merge_runs

    def run(tokens, wall, latency, steps, spec_tokens, tpot):
        return {"digests": {tokens: b"x"}, "engine": "eaglebatch+eagle", "batch_size": 1,
                "drafts": {"verify_rounds": steps}, "requests": 1, "output_tokens": tokens,
                "wall_s": wall, "latency_p50": latency, "ttft_p50": latency / 10,
                "tpot_p50": tpot, "spec_steps": steps, "spec_tokens": spec_tokens,
                "prefill_tokens": 2 * tokens, "cached_tokens": tokens, "generation_s": wall / 2}

    row = _merge_runs([run(10, 1.0, 1.0, 4, 9, 0.1), run(30, 2.0, 3.0, 10, 29, None),
                       run(20, 1.0, 2.0, 6, 19, 0.3)])
    assert row["output_tokens"] == 60 and row["wall_s"] == 4.0 and row["output_tok_s"] == 15.0
    assert row["generation_s"] == 2.0 and row["generation_tok_s"] == 30.0
    assert row["accept_length"] == 57 / 20 and row["requests"] == 3
    assert (row["prefill_tokens"], row["cached_tokens"]) == (120, 60)
    assert row["latency_p50"] == 2.0 and row["latency_p99"] == pytest.approx(2.98)
    assert row["ttft_p50"] == pytest.approx(0.2)
    assert row["tpot_p50"] == pytest.approx(0.2)  # requests without a TPOT are left out
    assert row["drafts"] == {"verify_rounds": 6}  # the worker's counts after the last request
    assert set(row["digests"]) == {10, 30, 20}

"""`sampling.stop_token_ids` and `sampling.ignore_eos` against plain greedy runs of the same
model: a stop id ends a row right after its first occurrence (the id counted, not in the text),
speculative decoding stops at the same place, and ignore_eos runs past the model's EOS."""

from __future__ import annotations

import pytest

from eaglebatch.errors import JobError
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.speculative import init_random_draft
from support.tiny import byte_tokenizer, write_prompts
from test_runner import EOS, MAX_NEW, random_prompts, run_job

pytest.importorskip("eaglebatch._native")

def run(tmp, model, prompts, name, overrides=()):
    table, _ = run_job(tmp, model, prompts, overrides=overrides, name=name)
    return table.to_pylist()


def cut_at(tokens: list[int], stop: set[int]) -> list[int]:
    n = next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))
    return tokens[:n]


def test_stop_token_ids_and_ignore_eos(tmp_path, tiny_model_dir):
    prompts = random_prompts(10, seed=3)
    ref = run(tmp_path, tiny_model_dir, prompts, "ref", ["sampling.ignore_eos=true"])
    assert all(len(r["output_token_ids"]) == MAX_NEW for r in ref)  # never stopped at EOS
    plain = run(tmp_path, tiny_model_dir, prompts, "plain")
    for r, p in zip(ref, plain, strict=True):  # what the model's EOS cuts off
        assert p["output_token_ids"] == cut_at(r["output_token_ids"], {EOS})
        assert (p["stop_reason"], p["stop_token_id"]) == (None, None)  # EOS: vLLM's None
    # a token that occurs mid-output in some rows, not as their first token
    counts: dict[int, int] = {}
    for r in ref:
        for t in set(r["output_token_ids"][1:12]) - {EOS}:
            counts[t] = counts.get(t, 0) + 1
    stop = max(counts, key=counts.get)
    head = init_random_draft(tmp_path / "head", tiny_model_dir, kind="eagle3", seed=2,
                             aux_layer_ids=(0, 1, 2))  # fmt: skip
    for name, extra in (("stop", []), ("spec", [f"draft={head}", "speculative.adaptive=false"])):
        over = [f"sampling.stop_token_ids=[{stop}]", "sampling.ignore_eos=true", *extra]
        got = run(tmp_path, tiny_model_dir, prompts, name, over)
        for r, g in zip(ref, got, strict=True):
            want = cut_at(r["output_token_ids"], {stop})
            assert g["output_token_ids"] == want
            if want[-1] == stop:
                assert g["finish_reason"] == "stop"
                assert g["output_text"] == byte_tokenizer().decode(want[:-1])
            ended = stop if want[-1] == stop else None
            assert (g["stop_reason"], g["stop_token_id"]) == (None, ended)
    assert sum(r["finish_reason"] == "stop" for r in got) >= 2


def test_the_stop_string_that_ended_a_row_is_its_stop_reason(tmp_path, tiny_model_dir):
    prompts = random_prompts(10, seed=5)
    ref = run(tmp_path, tiny_model_dir, prompts, "ref", ["sampling.ignore_eos=true"])
    texts = [r["output_text"] for r in ref]
    # two 2-character strings from inside the outputs: each row stops at the earlier one
    found = [t[3:5] for t in texts if len(t) >= 8]
    stops = sorted(set(found), key=found.count)[-2:]
    over = ["sampling.ignore_eos=true", f"sampling.stop={stops}".replace("'", '"')]
    got = run(tmp_path, tiny_model_dir, prompts, "stopped", over)
    for text, g in zip(texts, got, strict=True):
        hits = [(text.find(s), k) for k, s in enumerate(stops) if s in text]
        if not hits:
            assert (g["finish_reason"], g["stop_reason"]) == ("length", None)
            continue
        at, k = min(hits)
        assert g["output_text"] == text[:at]
        assert (g["finish_reason"], g["stop_reason"], g["stop_token_id"]) == ("stop", stops[k],
                                                                            None)  # fmt: skip
    assert sum(g["stop_reason"] is not None for g in got) >= 2


def test_a_stop_token_id_outside_the_vocabulary_is_a_job_error(tmp_path, tiny_model_dir):
    with pytest.raises(JobError, match=r"sampling.stop_token_ids: \[100000\] are not ids"):
        run(tmp_path, tiny_model_dir, ["hi"], "x", ["sampling.stop_token_ids=[100000]"])


def test_the_new_keys_leave_an_earlier_jobs_identity_alone(tmp_path, tiny_model_dir):
    """Outputs written before stop_token_ids / ignore_eos existed resume unchanged: the keys
    enter the identity only when set."""
    inp = write_prompts(tmp_path / "in.parquet", ["hi"])
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {tiny_model_dir}\ninput:\n  path: {inp}\noutput:\n  path: "
                   f"{tmp_path / 'out'}\nengine:\n  device: cpu\n")  # fmt: skip
    sampling = prepare(load_job(job)).identity["sampling"]
    assert "stop_token_ids" not in sampling and "ignore_eos" not in sampling
    changed = prepare(load_job(job, ["sampling.ignore_eos=true"])).identity["sampling"]
    assert changed["ignore_eos"] is True

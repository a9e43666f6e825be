"""The embedded default model (SmolLM2-135M-Instruct) against transformers on the same weights:
greedy outputs on real ShareGPT prompts, token for token, and the chat template rendered by
the Rust side equals transformers' rendering."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from eaglebatch.job import builtin
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared

pytest.importorskip("eaglebatch._native")
pytestmark = pytest.mark.slow

NUM_PROMPTS = 8
MAX_NEW = 128


@pytest.fixture(scope="module")
def model_dir():
    return builtin.builtin_reference_dir()  # transformers' float32 conversion


@pytest.fixture(scope="module")
def sharegpt_messages():
    table = pq.ParquetFile(builtin.sharegpt_parquet()).read_row_group(0)
    rows = table.slice(0, 64).to_pylist()
    # Eight prompts of varied length, short enough that HF batch-1 generate stays quick.
    rows = [r for r in rows if len(r["prompt"]) < 1500][:NUM_PROMPTS]
    assert len(rows) == NUM_PROMPTS
    return rows


def test_chat_template_matches_transformers(model_dir, sharegpt_messages):
    from transformers import AutoTokenizer

    from eaglebatch._native import render_chat_template
    from eaglebatch.job.model_files import check_model_dir

    mf = check_model_dir(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    convs = [r["messages"] for r in sharegpt_messages] + [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    ]
    for msgs in convs:
        for gen in (True, False):
            want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            got = render_chat_template(mf.chat_template, msgs, gen, mf.bos_token, mf.eos_token)
            assert got == want


def test_greedy_equals_transformers_on_sharegpt(tmp_path, model_dir, sharegpt_messages):
    import pyarrow as pa
    from transformers import AutoModelForCausalLM, AutoTokenizer

    inp = tmp_path / "in.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{"id": r["id"], "messages": r["messages"]} for r in sharegpt_messages]
        ),
        inp,
    )
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        f"model: smollm2-135m-instruct\ninput:\n  path: {inp}\n  messages_column: messages\n"
        f"  id_column: id\noutput:\n  path: {tmp_path / 'out'}\n  include_token_ids: true\n"
        f"sampling:\n  max_new_tokens: {MAX_NEW}\nengine:\n  device: cpu\n"
        "  kv_cache_tokens: 16384\n  max_batch_size: 8\n"
    )
    run_prepared(prepare(load_job(job_file)))
    got = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    eos = tok.eos_token_id
    for r in sharegpt_messages:
        ids = tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        ids = torch.tensor([list(ids)])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                              do_sample=False, eos_token_id=eos, pad_token_id=eos)
        want = out[0, ids.shape[1]:].tolist()
        want = want[: want.index(eos) + 1] if eos in want else want
        row = got[r["id"]]
        assert row["prompt_tokens"] == ids.shape[1]
        assert row["output_token_ids"] == want, r["id"]
        assert row["output_text"] == tok.decode([t for t in want if t != eos],
                                                skip_special_tokens=True)


def test_speculative_with_random_eagle1_head_is_lossless(tmp_path, model_dir, sharegpt_messages):
    """The default model with a randomly initialised head in the published EAGLE-1 folder format:
    speculative greedy output equals plain greedy output token for token."""
    import pyarrow as pa

    from eaglebatch.speculative import init_random_draft

    head = init_random_draft(tmp_path / "eagle1", model_dir, kind="eagle1", seed=0)
    inp = tmp_path / "in.parquet"
    rows = [{"id": r["id"], "messages": r["messages"]} for r in sharegpt_messages[:4]]
    pq.write_table(pa.Table.from_pylist(rows), inp)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        f"model: smollm2-135m-instruct\ninput:\n  path: {inp}\n  messages_column: messages\n"
        f"  id_column: id\noutput:\n  path: {tmp_path / 'plain'}\n  include_token_ids: true\n"
        "sampling:\n  max_new_tokens: 48\nengine:\n  device: cpu\n  kv_cache_tokens: 8192\n"
    )
    run_prepared(prepare(load_job(job_file)))
    run_prepared(prepare(load_job(job_file, [f"draft={head}", f"output.path={tmp_path / 'spec'}",
                                             "speculative.num_steps=3"])))
    plain = pq.read_table(tmp_path / "plain").sort_by("row_index").to_pylist()
    spec = pq.read_table(tmp_path / "spec").sort_by("row_index").to_pylist()
    assert [r["output_token_ids"] for r in spec] == [r["output_token_ids"] for r in plain]
    assert all(r["spec_steps"] >= 1 for r in spec)


def test_builtin_trained_head_is_lossless_and_accepts(tmp_path, model_dir):
    """The shipped head on held-out prompts (rows 0-199 of builtin:sharegpt are never trained
    on): greedy speculative output equals plain greedy output, and the head is trained, not
    random (a random head's acceptance length is ~1.0; the shipped one measures ~1.5 at K = 3)."""
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "model: smollm2-135m-instruct\ninput:\n  path: builtin:sharegpt\n"
        "  messages_column: messages\n  id_column: id\n  limit: 6\n"
        f"output:\n  path: {tmp_path / 'plain'}\n  include_token_ids: true\n"
        "sampling:\n  max_new_tokens: 64\nengine:\n  device: cpu\n  kv_cache_tokens: 16384\n"
    )
    run_prepared(prepare(load_job(job_file)))
    res = run_prepared(prepare(load_job(job_file, [
        "draft=smollm2-135m-instruct-eagle", f"output.path={tmp_path / 'spec'}",
        "speculative.num_steps=3", "speculative.adaptive=false"])))
    plain = pq.read_table(tmp_path / "plain").sort_by("row_index").to_pylist()
    spec = pq.read_table(tmp_path / "spec").sort_by("row_index").to_pylist()
    assert [r["output_token_ids"] for r in spec] == [r["output_token_ids"] for r in plain]
    assert res.stats["spec_tokens"] / res.stats["spec_steps"] > 1.25

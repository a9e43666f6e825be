"""Structured output on the embedded default model (SmolLM2-135M-Instruct): 60 JSON schemas over
200 ShareGPT prompts, every `complete` row parses and validates with the `jsonschema` package;
greedy constrained outputs equal a reference loop over transformers' logits masked by the
`llguidance` Python package; constrained speculative decoding with the builtin EAGLE head (with
and without prompt lookup, batch 1 and 16) equals constrained plain decoding token for token."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eaglebatch.job import builtin
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared
from support.schemas import schemas
from test_structured import with_default_whitespace

pytest.importorskip("eaglebatch._native")
llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow


def sharegpt_prompts(n: int) -> list[str]:
    table = pq.ParquetFile(builtin.sharegpt_parquet()).read_row_group(0)
    return [r["prompt"][:300] for r in table.slice(0, n).to_pylist()]


def write_input(path, prompts: list[str], formats: list[dict]):
    msgs = [[{"role": "system", "content": "Reply with one JSON object matching this schema: "
              + json.dumps(f["json_schema"]["schema"])}, {"role": "user", "content": p}]
            for p, f in zip(prompts, formats, strict=True)]  # fmt: skip
    pq.write_table(pa.table({"messages": msgs, "rf": [json.dumps(f) for f in formats]}), path)
    return path


def run(tmp, inp, name: str, max_new: int, extra: str = "", batch: int = 64) -> list[dict]:
    job = tmp / f"{name}.yaml"
    job.write_text(
        f"model: smollm2-135m-instruct\n{extra}input:\n  path: {inp}\n  messages_column: messages\n"
        "  sampling_columns:\n    response_format: rf\n"
        f"output:\n  path: {tmp / name}\n  include_token_ids: true\n"
        f"sampling:\n  max_new_tokens: {max_new}\nengine:\n  max_batch_size: {batch}\n"
    )
    run_prepared(prepare(load_job(job, [])))
    return pq.read_table(tmp / name).sort_by("row_index").to_pylist()


def formats_of(all_schemas: list[dict], n: int) -> list[dict]:
    return [{"type": "json_schema", "json_schema": {"name": f"s{i % len(all_schemas)}",
             "schema": all_schemas[i % len(all_schemas)]}} for i in range(n)]  # fmt: skip


def test_sixty_schemas_two_hundred_prompts_complete_rows_validate(tmp_path):
    all_schemas = schemas()
    assert len(all_schemas) == 60
    formats = formats_of(all_schemas, 200)
    inp = write_input(tmp_path / "in.parquet", sharegpt_prompts(200), formats)
    rows = run(tmp_path, inp, "out", max_new=160)
    complete = [r for r in rows if r["structured"] == "complete"]
    assert len(complete) >= 150, f"{len(complete)} of 200 complete"
    for r in complete:
        schema = formats[r["row_index"]]["json_schema"]["schema"]
        jsonschema.validate(json.loads(r["output_text"]), schema)
    for r in rows:
        assert (r["finish_reason"] == "stop") == (r["structured"] == "complete"), r


def reference(model, tok, lltok, text: str, fmt: dict, max_new: int) -> list[int]:
    """Greedy over transformers' logits (KV cache reused) masked by llguidance's matcher."""
    import llguidance.torch as llt

    schema = with_default_whitespace(fmt["json_schema"]["schema"])
    grammar = llguidance.grammar_from("json_schema", json.dumps(schema))
    matcher = llguidance.LLMatcher(lltok, grammar)
    mask = llt.allocate_token_bitmask(1, lltok.vocab_size)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    past, out = None, []
    while len(out) < max_new:
        with torch.no_grad():
            res = model(ids, past_key_values=past, use_cache=True)
        past, logits = res.past_key_values, res.logits[0, -1].float()
        llt.fill_next_token_bitmask(matcher, mask, 0)
        llt.apply_token_bitmask_inplace(logits, mask)
        t = int(logits.argmax())
        out.append(t)
        if t == tok.eos_token_id or not matcher.consume_token(t) or matcher.is_stopped():
            break
        ids = torch.tensor([[t]])
    return out


def test_greedy_constrained_equals_transformers_with_llguidance(tmp_path):
    import llguidance.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = builtin.builtin_reference_dir()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=model.config.vocab_size)
    all_schemas = schemas()
    formats = [formats_of(all_schemas, 60)[i] for i in (0, 5, 6, 7, 11, 14)]
    prompts = sharegpt_prompts(len(formats))
    inp = write_input(tmp_path / "in.parquet", prompts, formats)
    rows = run(tmp_path, inp, "out", max_new=64)
    msgs = pq.read_table(inp).column("messages").to_pylist()
    for r, m, f in zip(rows, msgs, formats, strict=True):
        text = tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        assert r["output_token_ids"] == reference(model, tok, lltok, text, f, 64), r["row_index"]


@pytest.mark.parametrize("batch, lookup", [(1, False), (16, False), (16, True)])
def test_speculative_equals_plain_with_the_builtin_head(tmp_path_factory, batch, lookup):
    tmp = tmp_path_factory.mktemp("spec")
    formats = formats_of(schemas(), 16)
    inp = write_input(tmp / "in.parquet", sharegpt_prompts(16), formats)
    plain = run(tmp, inp, "plain", max_new=96, batch=16)
    draft = ("draft: smollm2-135m-instruct-eagle\nspeculative:\n"
             f"  prompt_lookup_min: {2 if lookup else 0}\n")  # fmt: skip
    spec = run(tmp, inp, "spec", max_new=96, extra=draft, batch=batch)
    for a, b in zip(spec, plain, strict=True):
        assert a["output_token_ids"] == b["output_token_ids"], a["row_index"]

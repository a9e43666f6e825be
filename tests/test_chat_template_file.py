"""`model_chat_template`: a job's own template file, for a model without one (a base model's
GGUF) or with a wrong one. It renders in Rust exactly as transformers' apply_chat_template with
the same template string, runs a messages job, and is part of the job identity."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglebatch.config import JobError, load_job
from eaglebatch.engine import prepare, run_prepared

pytest.importorskip("eaglebatch._native")

# Gemma's turn format, the kind of template a user writes for a base model
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Über?"}],
]


def test_a_template_file_renders_as_transformers(tiny_model_dir):
    from transformers import AutoTokenizer

    from eaglebatch._native import render_chat_template

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for msgs in CONVERSATIONS:
        for gen in (True, False):
            want = tok.apply_chat_template(msgs, chat_template=TEMPLATE, tokenize=False,
                                           add_generation_prompt=gen)  # fmt: skip
            got = render_chat_template(TEMPLATE, msgs, gen, tok.bos_token, tok.eos_token)
            assert got == want


def test_a_messages_job_with_a_template_file(tmp_path, tiny_model_dir):
    import shutil

    model = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink()  # a model without a chat template
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"messages": CONVERSATIONS}), inp)
    job = tmp_path / "job.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {inp}\n  messages_column: messages\n"
        f"output:\n  path: {tmp_path / 'out'}\nsampling:\n  max_new_tokens: 4\n"
        "engine:\n  device: cpu\n  kv_cache_tokens: 1024\n"
    )
    with pytest.raises(JobError, match=r"has none; name a template file with model_chat_templ"):
        prepare(load_job(job))
    (tmp_path / "turns.jinja").write_text(TEMPLATE)
    prep = prepare(load_job(job, ["model_chat_template=turns.jinja"]))  # relative to the job
    assert prep.model.chat_template == TEMPLATE and "chat_template" in prep.identity
    res = run_prepared(prep)
    assert res.stats["requests"] == 2 and res.stats["errors"] == 0
    (tmp_path / "turns.jinja").write_text(TEMPLATE.replace("model", "assistant"))
    with pytest.raises(JobError, match=r"different job .*chat_template"):
        run_prepared(prepare(load_job(job, ["model_chat_template=turns.jinja"])))
    with pytest.raises(JobError, match=r"model_chat_template: cannot read .*missing.jinja"):
        prepare(load_job(job, ["model_chat_template=missing.jinja"]))

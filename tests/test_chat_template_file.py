"""`model_chat_template`: a job's own template file, for a model without one (a base model's
GGUF) or with a wrong one. It renders in Rust exactly as transformers' apply_chat_template with
the same template string, runs a messages job, and is part of the job identity."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglebatch.errors import JobError
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared

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


def messages_job(tmp_path, model, name="job", extra=""):
    inp = tmp_path / f"{name}-in.parquet"
    pq.write_table(pa.table({"messages": CONVERSATIONS}), inp)
    job = tmp_path / f"{name}.yaml"
    job.write_text(
        f"model: {model}\n{extra}input:\n  path: {inp}\n  messages_column: messages\n"
        f"output:\n  path: {tmp_path / name}\nsampling:\n  max_new_tokens: 4\n"
        "engine:\n  device: cpu\n  kv_cache_tokens: 1024\n"
    )
    return job


def test_validate_refuses_a_template_that_does_not_compile(tmp_path, tiny_model_dir):
    """The job's template file or the model's own: `validate` (and `run`, before any model)
    exits 2 naming the template; a job that renders no chat does not need it."""
    import shutil

    from support.cli import cli, finish

    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }}")
    job = messages_job(tmp_path, tiny_model_dir, extra="model_chat_template: broken.jinja\n")
    for verb in ("validate", "run"):
        out = finish(cli(verb, str(job)), status=2)
        assert "model_chat_template: " in out and "broken.jinja" in out, out
        assert "does not compile" in out and "Traceback" not in out, out
    assert not (tmp_path / "job").exists() or not any((tmp_path / "job").glob("part-*"))
    model = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text("{{ messages[0].content ")
    out = finish(cli("validate", str(messages_job(tmp_path, model, "own"))), status=2)
    assert f"model: {model}'s chat template" in out and "does not compile" in out, out
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["a b"]}), prompts)
    plain = tmp_path / "plain.yaml"
    plain.write_text(f"model: {model}\ninput:\n  path: {prompts}\noutput:\n  path: "
                     f"{tmp_path / 'plain'}\nengine:\n  device: cpu\n")  # fmt: skip
    finish(cli("validate", str(plain)))


# Doubles a string 29 times (512 MiB; minijinja's fuel allows it, a few instructions a doubling).
DOUBLING = ("{% set s = namespace(v='x') %}{% for i in range(29) %}{% set s.v = s.v ~ s.v %}"
            "{% endfor %}{{ s.v | length }}{{ messages[0]['content'] }}")  # fmt: skip

PEAK_RSS = """
import resource, sys
from eaglebatch.cli import main
sys.argv = ["eaglebatch", "run", sys.argv[1]]
try:
    main()
except SystemExit:
    pass
print("peak-kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def run_peak_kib(job) -> int:
    """`eaglebatch run JOB` in a subprocess; its peak RSS in KiB."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import eaglebatch

    path = {"PYTHONPATH": str(Path(eaglebatch.__file__).resolve().parent.parent)}
    p = subprocess.run([sys.executable, "-c", PEAK_RSS, str(job)], capture_output=True,
                       text=True, env={**os.environ, **path}, timeout=300)  # fmt: skip
    assert "peak-kib" in p.stdout, p.stderr
    return int(p.stdout.split("peak-kib")[-1])


def test_a_template_building_huge_strings_is_a_row_error_in_bounded_memory(tmp_path,
                                                                         tiny_model_dir):
    """Rows rendered by a doubling template are error rows naming the memory limit, and the
    run's peak RSS stays within 256 MiB of a run with a plain template (512 MiB of string
    and its copies otherwise)."""
    (tmp_path / "doubling.jinja").write_text(DOUBLING)
    (tmp_path / "plain.jinja").write_text(TEMPLATE)
    job = messages_job(tmp_path, tiny_model_dir, extra="model_chat_template: doubling.jinja\n")
    plain = messages_job(tmp_path, tiny_model_dir, "plain", "model_chat_template: plain.jinja\n")
    peak, plain_peak = run_peak_kib(job), run_peak_kib(plain)
    rows = pq.read_table(tmp_path / "job").to_pylist()
    assert len(rows) == 2 and all(r["finish_reason"] == "error" for r in rows), rows
    assert all("memory limit" in r["error"] for r in rows), rows[0]["error"]
    assert all(r["error"] is None for r in pq.read_table(tmp_path / "plain").to_pylist())
    assert peak < plain_peak + (256 << 10), (peak, plain_peak)

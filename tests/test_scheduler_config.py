"""The scheduler's settings (job/scheduler_config.py): one declaration per setting on each side of
the boundary. A setting the job spells comes from the job schema by name, default included; the
Python dataclasses and the Rust structs name the same sections and fields."""

from __future__ import annotations

import dataclasses

import pytest

from eaglebatch import _native
from eaglebatch.job.config import load_job
from eaglebatch.job.scheduler_config import (
    JOB_SECTIONS,
    SECTIONS,
    SchedulerConfig,
    from_job,
    sectioned,
)

# every section's fields by name (unique across the sections)
FIELDS = {f.name: f for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
# what the run resolves, not the job: files, the model's tokens, the worker's sizes, the engine
# settings, the scope and resume
RESOLVED = {"input_files", "prompt_column", "input_format", "row_range", "tokenizer_file",
            "chat_template", "bos_token", "eos_token", "eos_token_ids", "vocab_size",
            "reasoning_ids", "output_dir", "file_metadata", "keep_columns", "num_blocks",
            "max_model_len", "max_draft_tokens", "overlap", "skip_rows", "skip_samples",
            "state_checkpoint_interval", "state_checkpoints",  # the model's state (worker)
            "read_batch_rows", "queue_rows",
            "task",  # the job's top-level key, passed by name
            # a pooled task's head, from the job's embed section and the model
            # (job/pooling.py scheduler_settings)
            "prompt_prefix", "truncate", "pooling", "pool_width", "pool_normalize",
            "pool_dimensions", "labels", "multi_label",
            # the job's storage section, renamed (scheduler_config.storage_section)
            "endpoint", "options", "unconditional"}  # fmt: skip


def job_sources(name: str) -> list[str]:
    return [s for s, model in JOB_SECTIONS.items() if name in model.model_fields]


def test_every_setting_comes_from_one_job_key_or_is_resolved() -> None:
    for name in FIELDS:
        sources = job_sources(name)
        assert len(sources) <= 1, (name, sources)  # one key, in one section
        assert sources or name in RESOLVED, name


def test_defaults_are_the_job_schemas() -> None:
    for name, f in FIELDS.items():
        sources = job_sources(name)
        if not sources or name in RESOLVED:
            continue
        info = JOB_SECTIONS[sources[0]].model_fields[name]
        ours = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        theirs = info.get_default(call_default_factory=True)
        assert ours == (list(theirs) if isinstance(theirs, tuple) else theirs), name


def test_the_python_and_rust_field_lists_are_the_same() -> None:
    ours = [f.name for f in dataclasses.fields(SchedulerConfig) if f.name not in SECTIONS]
    ours += [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert sorted(_native.SCHEDULER_CONFIG_FIELDS) == sorted(ours)
    assert {f.name for f in dataclasses.fields(SchedulerConfig)} == {"task", *SECTIONS}


def test_field_names_are_unique_across_the_sections() -> None:
    names = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)) == len(FIELDS)


def test_sectioned_routes_each_setting_to_its_section_and_rejects_unknown_names() -> None:
    cfg = sectioned(input_files=["a"], prompt_column="p", tokenizer_file="t", chat_template=None,
                    bos_token=None, eos_token=None, eos_token_ids=[2], temperature=0.5,
                    output_dir="o", file_metadata={}, num_blocks=3, max_model_len=9,
                    task="score")  # fmt: skip
    assert (cfg.task, cfg.input.input_files, cfg.sampling.temperature) == ("score", ["a"], 0.5)
    assert (cfg.sampling.eos_token_ids, cfg.output.output_dir) == ([2], "o")
    assert (cfg.policy.num_blocks, cfg.storage.endpoint) == (3, None)
    with pytest.raises(TypeError, match="storage_endpoint"):
        sectioned(storage_endpoint="http://x")


def test_a_jobs_values_reach_the_scheduler_by_name(tmp_path) -> None:
    job_file = tmp_path / "j.yaml"
    job_file.write_text(
        "model: m\ninput:\n  path: x.parquet\n  id_column: key\n  limit: 9\n"
        "  sampling_columns: {temperature: t}\noutput:\n  path: o\n  part_rows: 7\n"
        "  logprobs: 2\nsampling:\n  temperature: 0.5\n  top_k: 3\n  stop: [x, y]\n  n: 2\n"
        "  stop_token_ids: [5]\nengine:\n  block_size: 8\n  chunked_prefill: true\n"
    )
    job = load_job(job_file, [])
    resolved = {name: None for name in RESOLVED}
    cfg = from_job(job, **resolved)
    inp, samp, pol = cfg.input, cfg.sampling, cfg.policy
    assert (inp.id_column, inp.limit, inp.sampling_columns) == ("key", 9, {"temperature": "t"})
    assert (cfg.output.part_rows, samp.logprobs) == (7, 2)
    assert (samp.temperature, samp.top_k, samp.stop, samp.n, samp.stop_token_ids) == (
        0.5, 3, ["x", "y"], 2, [5])  # fmt: skip
    assert (pol.block_size, pol.chunked_prefill) == (8, True)
    assert pol.max_draft_tokens is None  # resolved values are the caller's, never the job's


def test_a_missing_resolved_setting_fails_by_name(tmp_path) -> None:
    job_file = tmp_path / "j.yaml"
    job_file.write_text("model: m\ninput:\n  path: x.parquet\noutput:\n  path: o\n")
    with pytest.raises(TypeError, match="num_blocks"):
        from_job(load_job(job_file, []), **{n: None for n in RESOLVED - {"num_blocks"}})

"""Job file parsing: defaults, overrides, and errors that name the key."""

from pathlib import Path

import pytest

from eaglebatch.config import JobError, load_job

BASE = """
model: smollm2-135m-instruct
input:
  path: data/in.parquet
output:
  path: out
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def test_defaults_and_relative_paths(tmp_path):
    job = load_job(write(tmp_path, BASE))
    assert job.sampling.max_new_tokens == 256 and job.sampling.temperature == 0.0
    assert job.engine.block_size == 16 and job.engine.device == "auto"
    assert job.input.text_column == "prompt"
    assert job.input.path == str(tmp_path / "data" / "in.parquet")
    assert job.output.path == str(tmp_path / "out")
    assert job.model == "smollm2-135m-instruct"


def test_misspelled_key_is_named(tmp_path):
    with pytest.raises(JobError, match=r"unknown key 'sampling.temprature'"):
        load_job(write(tmp_path, BASE + "sampling:\n  temprature: 0.5\n"))


def test_unknown_top_level_key(tmp_path):
    with pytest.raises(JobError, match=r"unknown key 'engin'"):
        load_job(write(tmp_path, BASE + "engin:\n  device: cpu\n"))


@pytest.mark.parametrize(
    "extra, key",
    [
        ("sampling:\n  temperature: -1\n", "sampling.temperature"),
        ("sampling:\n  max_new_tokens: 0\n", "sampling.max_new_tokens"),
        ("sampling:\n  top_p: 1.5\n", "sampling.top_p"),
        ("engine:\n  device: tpu\n", "engine.device"),
        ("engine:\n  attention_backend: magic\n", "engine.attention_backend"),
        ("engine:\n  max_batch_size: 0\n", "engine.max_batch_size"),
        ("speculative:\n  prompt_lookup_min: -1\n", "speculative.prompt_lookup_min"),
        (
            "speculative:\n  prompt_lookup_min: 4\n  prompt_lookup_max: 2\n",
            "speculative.prompt_lookup_max",
        ),
        ("speculative:\n  prompt_lookup_tokens: 0\n", "speculative.prompt_lookup_tokens"),
        ("speculative:\n  prompt_lookup_tokens: 33\n", "speculative.prompt_lookup_tokens"),
    ],
)
def test_bad_values_name_the_key(tmp_path, extra, key):
    with pytest.raises(JobError, match=key.replace(".", r"\.")):
        load_job(write(tmp_path, BASE + extra))


@pytest.mark.parametrize(
    "overrides, lookahead",
    [
        ([], 0),  # no draft: plain decoding
        (["draft=head"], 8),  # the default prompt_lookup_tokens
        (["draft=head", "speculative.num_steps=10"], 10),
        (["draft=head", "speculative.prompt_lookup_tokens=2"], 3),
        (["draft=head", "speculative.prompt_lookup_min=0"], 3),  # lookup off: the head's K
    ],
)
def test_the_schedulers_lookahead_is_the_widest_round(tmp_path, overrides, lookahead):
    assert load_job(write(tmp_path, BASE), overrides).num_speculative_tokens == lookahead


def test_missing_required_key(tmp_path):
    with pytest.raises(JobError, match=r"missing required key 'output'"):
        load_job(write(tmp_path, "model: x\ninput:\n  path: a.parquet\n"))


def test_overrides(tmp_path):
    job = load_job(
        write(tmp_path, BASE),
        ["engine.max_batch_size=8", 'sampling.stop=["###", "\\n\\n"]', "input.limit=5"],
    )
    assert job.engine.max_batch_size == 8
    assert job.sampling.stop == ("###", "\n\n")
    assert job.input.limit == 5


def test_override_unknown_key_is_named(tmp_path):
    with pytest.raises(JobError, match=r"unknown key 'engine.max_batch'"):
        load_job(write(tmp_path, BASE), ["engine.max_batch=8"])


def test_override_syntax(tmp_path):
    with pytest.raises(JobError, match="expected key.path=value"):
        load_job(write(tmp_path, BASE), ["engine.max_batch_size"])


def test_prompt_and_messages_are_exclusive(tmp_path):
    text = BASE.replace(
        "path: data/in.parquet", "path: a\n  prompt_column: p\n  messages_column: m"
    )
    with pytest.raises(JobError, match="only one of input.prompt_column"):
        load_job(write(tmp_path, text))


def test_not_a_mapping(tmp_path):
    with pytest.raises(JobError, match="must be a mapping"):
        load_job(write(tmp_path, "- a\n- b\n"))


def test_missing_job_file(tmp_path):
    with pytest.raises(JobError, match="cannot read job file"):
        load_job(tmp_path / "nope.yaml")


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "jobs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_example_jobs_are_valid(path):
    """Every job in jobs/ parses: train-draft jobs (they have a `train` or `data` section) as
    TrainJob, the others as run jobs."""
    import yaml

    from eaglebatch.train.job import load_train_job

    raw = yaml.safe_load(path.read_text())
    if {"train", "data"} & raw.keys():
        job = load_train_job(path)
        assert job.work_dir.parent == job.output_path
    else:
        load_job(path)

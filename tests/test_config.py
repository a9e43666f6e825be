"""Job file parsing: defaults, overrides, and errors that name the key."""

import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eaglebatch.errors import JobError
from eaglebatch.job.config import load_job

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


@pytest.mark.parametrize("key, value", [
    ("sampling.temperature", "2e6"), ("sampling.temperature", "5e-6"),
    ("sampling.top_p", "0"), ("sampling.min_p", "1.5"), ("sampling.repetition_penalty", "0"),
    ("sampling.frequency_penalty", "-3"), ("sampling.presence_penalty", "2.5"),
    ("sampling.top_p", "1e-300"), ("sampling.max_new_tokens", "0"), ("sampling.top_k", "-1"),
    ("sampling.n", "5000"), ("output.logprobs", "21"), ("output.prompt_logprobs", "21"),
])  # fmt: skip
def test_sampling_ranges_are_the_extensions_one_statement(tmp_path, key, value):
    """A job key's range is the one the rows' columns and batch lines meet (sampling_params.rs
    RANGES, through `sampling_rule`): the message is the extension's, naming the key."""
    from eaglebatch import _native

    section, name = key.split(".")
    rule = "logprobs" if section == "output" else name
    words = _native.sampling_rule(rule, float(value) if "." in value or "e" in value
                                  else int(value))  # fmt: skip
    assert words is not None
    text = BASE + f"sampling:\n  {name}: {value}\n"
    if section == "output":
        text = BASE.replace("output:\n", f"output:\n  {name}: {value}\n")
    with pytest.raises(JobError) as err:
        load_job(write(tmp_path, text))
    assert f"{key}: {words}" in str(err.value), str(err.value)


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
    assert load_job(write(tmp_path, BASE), overrides).max_draft_tokens == lookahead


def test_missing_required_key(tmp_path):
    with pytest.raises(JobError, match=r"missing required key 'output'"):
        load_job(write(tmp_path, "model: x\ninput:\n  path: a.parquet\n"))


def test_draft_mtp_is_a_keyword_not_a_folder(tmp_path):
    """`draft: mtp` (the model's own MTP layer) stays the keyword even beside a folder named
    mtp, which is written ./mtp."""
    (tmp_path / "mtp").mkdir()
    assert load_job(write(tmp_path, BASE + "draft: mtp\n")).draft == "mtp"
    assert load_job(write(tmp_path, BASE + "draft: ./mtp\n")).draft == str(tmp_path / "mtp")


def test_builtin_models_and_drafts_may_be_spelt_as_builtin_inputs_are(tmp_path):
    over = ["model=builtin:gemma3-270m", "draft=builtin:smollm2-135m-instruct-eagle"]
    job = load_job(write(tmp_path, BASE), over)
    assert (job.model, job.draft) == ("gemma3-270m", "smollm2-135m-instruct-eagle")
    assert load_job(write(tmp_path, BASE), ["model=builtin:nope"]).model == "builtin:nope"
    from eaglebatch.job.model_files import resolve_model_dir

    with pytest.raises(JobError, match=r"model: 'builtin:nope' is neither .* smollm2-135m"):
        resolve_model_dir("builtin:nope")


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


# --- Strict reading: duplicate keys, alias bombs, ~, types, bounds, encodings, junk -----------


def test_duplicate_keys_are_errors_naming_the_key_and_line(tmp_path):
    with pytest.raises(JobError, match=r"line 9: duplicate key 'sampling' \(first at line 7\)"):
        load_job(write(tmp_path, BASE + "sampling:\n  temperature: 0.5\nsampling:\n  top_k: 3\n"))
    nested = BASE + "sampling:\n  temperature: 0.5\n  top_k: 3\n  temperature: 1\n"
    with pytest.raises(JobError, match=r"line 10: duplicate key 'temperature' \(first at line 8\)"):
        load_job(write(tmp_path, nested))
    with pytest.raises(JobError, match=r"--set sampling: line 1: duplicate key 'top_k'"):
        load_job(write(tmp_path, BASE), ["sampling={top_k: 1, top_k: 2}"])


def test_merge_keys_still_work_and_do_not_count_as_duplicates(tmp_path):
    text = BASE + "sampling:\n  <<: {temperature: 0.5, top_k: 3}\n  top_k: 4\n"
    job = load_job(write(tmp_path, text))
    assert job.sampling.temperature == 0.5 and job.sampling.top_k == 4


def bomb(levels: int = 9, width: int = 9) -> str:
    names = [f"l{i}" for i in range(levels)]
    lines = [f"{names[0]}: &{names[0]} [" + ", ".join(['"lol"'] * width) + "]"]
    for prev, name in zip(names, names[1:]):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * width) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text",
    [
        BASE + bomb(),  # billion laughs: 9**9 strings through aliases
        BASE + "sampling:\n  stop: &s [\"a\", *s]\n",  # a list that holds itself
        # merges of merges (PyYAML's own flattening copies 9**8 pairs)
        "a: &a {" + ", ".join(f"k{i}: 1" for i in range(9)) + "}\n"
        + "".join(f"b{i}: &b{i} {{<<: [" + ", ".join([f"*{p}"] * 9) + "]}\n"
                  for i, p in enumerate(["a"] + [f"b{j}" for j in range(7)])),
    ],
    ids=["billion-laughs", "self-reference", "merge-bomb"],
)
def test_alias_bombs_fail_fast_with_a_short_message(tmp_path, text):
    import time

    p = write(tmp_path, text)
    t0 = time.perf_counter()
    with pytest.raises(JobError) as e:
        load_job(p)
    assert time.perf_counter() - t0 < 1.0
    assert len(str(e.value)) < 2000, len(str(e.value))


def test_a_bomb_in_an_override_is_bounded_too(tmp_path):
    value = "{" + bomb().strip().replace("\n", ", ") + "}"
    with pytest.raises(JobError, match="--set sampling.stop: the job expands to more than 100,0"):
        load_job(write(tmp_path, BASE), ["sampling.stop=" + value])


def test_long_values_are_cut_in_error_messages(tmp_path):
    with pytest.raises(JobError) as e:
        load_job(write(tmp_path, BASE + "sampling:\n  temperature: " + "x" * 100_000 + "\n"))
    msg = str(e.value)
    assert "sampling.temperature" in msg and "(cut: 100,000 characters in all)" in msg
    assert len(msg) < 400
    with pytest.raises(JobError) as e:  # a long list: cut, and only the first problems listed
        load_job(write(tmp_path, BASE + "sampling:\n  stop: [" + ", ".join(["1"] * 5000) + "]\n"))
    msg = str(e.value)
    assert "sampling.stop.0" in msg and "4,990 more problems" in msg and len(msg) < 3000


def test_home_is_expanded_in_paths(tmp_path, monkeypatch):
    import os
    import pwd

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        pytest.skip("this user has no passwd entry, so ~user cannot be expanded")
    text = (f"model: ~/models/m\ndraft: ~{user}/heads/h\ninput:\n  path: ~/data/in.parquet\n"
            "output:\n  path: ~/out\n")
    (tmp_path / "jobs").mkdir()
    job = load_job(write(tmp_path / "jobs", text))
    assert job.model == str(home / "models" / "m")
    assert job.draft == os.path.join(pwd.getpwnam(user).pw_dir, "heads", "h")
    assert job.input.path == str(home / "data" / "in.parquet")
    assert job.output.path == str(home / "out")
    # an unknown user's ~name stays as written, like a shell: a relative path
    job = load_job(tmp_path / "jobs" / "job.yaml", ["output.path=~no-such-user-xyz/out"])
    assert job.output.path == str((tmp_path / "jobs" / "~no-such-user-xyz" / "out").resolve())


def test_home_is_expanded_in_train_job_paths(tmp_path, monkeypatch):
    from eaglebatch.train.job import load_train_job

    monkeypatch.setenv("HOME", str(tmp_path))
    job = load_train_job(write(tmp_path, "model: ~/m\ninput:\n  path: ~/in.parquet\n"
                                         "output:\n  path: ~/head\nhead:\n  init_from: ~/h0\n"))
    assert job.model == str(tmp_path / "m") and job.input.path == str(tmp_path / "in.parquet")
    assert job.output_path == tmp_path / "head" and job.head.init_from == str(tmp_path / "h0")


@pytest.mark.parametrize(
    "extra, key",
    [
        ("sampling:\n  max_new_tokens: true\n", "sampling.max_new_tokens"),  # was 1
        ("sampling:\n  max_new_tokens: '32'\n", "sampling.max_new_tokens"),  # was 32
        ("sampling:\n  max_new_tokens: 256.0\n", "sampling.max_new_tokens"),
        ("sampling:\n  max_new_tokens: 1.5\n", "sampling.max_new_tokens"),
        ("sampling:\n  temperature: '0.5'\n", "sampling.temperature"),  # was 0.5
        ("sampling:\n  temperature: false\n", "sampling.temperature"),  # was 0.0
        ("sampling:\n  stop: [1]\n", "sampling.stop.0"),
        ("speculative:\n  adaptive: 1\n", "speculative.adaptive"),  # was true
        ("speculative:\n  adaptive: 'false'\n", "speculative.adaptive"),  # was false
        ("speculative:\n  adaptive: no\n", "speculative.adaptive"),  # YAML 1.1's false: text
        ("engine:\n  cuda_graph: 0\n", "engine.cuda_graph"),
        ("engine:\n  device: 1\n", "engine.device"),
        ("input:\n  path: a\n  prompt_column: 7\n", "input.prompt_column"),
        ("output:\n  path: 5\n", "output.path"),
    ],
)
def test_types_are_strict(tmp_path, extra, key):
    section = extra.split(":")[0]
    text = BASE if section not in ("input", "output") else without(section)
    with pytest.raises(JobError, match=rf"{re.escape(key)}: "):
        load_job(write(tmp_path, text + extra))


def without(section: str) -> str:
    """BASE less one of its sections."""
    return BASE.replace({"input": "input:\n  path: data/in.parquet\n",
                         "output": "output:\n  path: out\n"}[section], "")


def test_a_number_for_text_suggests_quoting(tmp_path):
    with pytest.raises(JobError, match=r'model: .*got 123; quote it to make it text: "123"'):
        load_job(write(tmp_path, BASE.replace("smollm2-135m-instruct", "123")))


def test_strict_types_still_take_what_yaml_means(tmp_path):
    text = without("output") + ("sampling:\n  temperature: 1\n  top_p: 1\n  stop: ['###']\n"
                                "output:\n  path: 2024-12-01\n")
    job = load_job(write(tmp_path, text))
    assert job.sampling.temperature == 1.0 and isinstance(job.sampling.temperature, float)
    assert job.sampling.stop == ("###",) and job.output.path.endswith("2024-12-01")  # not a date
    job = load_job(write(tmp_path, BASE + "sampling:\n  temperature: 1e-3\n  top_k: 0x10\n"))
    assert job.sampling.temperature == 0.001 and job.sampling.top_k == 16
    job = load_job(write(tmp_path, BASE), [
        "sampling.max_new_tokens=32", "sampling.temperature=0", "sampling.stop=[]", "draft=null",
        'input.prompt_column="123"', "engine.cuda_graph=false",
    ])
    assert job.sampling.max_new_tokens == 32 and job.sampling.temperature == 0.0
    assert job.draft is None and job.input.prompt_column == "123"
    assert job.engine.cuda_graph is False


BIG = 99999999999999999999999
RUN_INT_KEYS = [
    "input.limit", "output.part_rows", "sampling.max_new_tokens", "sampling.top_k",
    "sampling.seed", "engine.max_batch_size", "engine.kv_cache_tokens", "engine.block_size",
    "engine.max_num_batched_tokens", "engine.max_model_len", "engine.num_threads",
    "speculative.num_steps", "speculative.topk", "speculative.prompt_lookup_min",
    "speculative.prompt_lookup_max", "speculative.prompt_lookup_tokens",
]
TRAIN_INT_KEYS = [
    "data.holdout_rows", "data.num_prompts", "data.max_prompt_tokens", "data.min_prompt_tokens",
    "data.max_new_tokens", "data.max_batch_size", "data.num_reference", "data.max_answer_tokens",
    "head.draft_vocab_size", "train.warmup_steps", "train.batch_tokens", "train.unroll",
    "train.checkpoint_every", "train.val_sequences", "train.seed", "train.num_threads",
]


@pytest.mark.parametrize("key", RUN_INT_KEYS)
def test_every_run_integer_has_an_upper_bound(tmp_path, key):
    # the bound in pydantic's words, or a sampling range in the extension's (sampling_rule)
    bounded = rf"{re.escape(key)}: (Input should be less than|must be in \d+\.\.=\d+)"
    with pytest.raises(JobError, match=bounded):
        load_job(write(tmp_path, BASE), [f"{key}={BIG}"])


@pytest.mark.parametrize("key", TRAIN_INT_KEYS + ["head.aux_layer_ids"])
def test_every_train_integer_has_an_upper_bound(tmp_path, key):
    from eaglebatch.train.job import load_train_job

    value = f"[1, 2, {BIG}]" if key == "head.aux_layer_ids" else str(BIG)
    with pytest.raises(JobError, match=rf"{re.escape(key)}(\.2)?: Input should be less than"):
        load_train_job(write(tmp_path, BASE), [f"{key}={value}"])


def test_integers_take_their_largest_value_and_floats_must_be_finite(tmp_path):
    job = load_job(write(tmp_path, BASE),
                   [f"sampling.max_new_tokens={2**31 - 1}", f"sampling.seed={2**63 - 1}"])
    assert job.sampling.max_new_tokens == 2**31 - 1
    for item in ["output.flush_interval_s=1e300", "sampling.temperature=.inf",
                 "engine.kv_cache_memory_fraction=.nan"]:
        with pytest.raises(JobError, match=re.escape(item.split("=")[0])):
            load_job(write(tmp_path, BASE), [item])


def test_a_job_file_that_is_not_utf8(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_bytes(b"\xff\xfe" + "model: m\n".encode("utf-16-le"))
    with pytest.raises(JobError, match=rf"job file {re.escape(str(p))} is not UTF-8 text \("):
        load_job(p)


def test_a_job_file_that_is_a_directory_or_huge(tmp_path):
    with pytest.raises(JobError, match="is a directory"):
        load_job(tmp_path)
    p = write(tmp_path, BASE + "# padding\n" * 200_000)
    with pytest.raises(JobError, match="larger than 1 MiB"):
        load_job(p)


@pytest.mark.parametrize(
    "text, match",
    [
        ("a: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested more than 64 levels"),
        ("a: " + "{a: " * 10_000 + "1" + "}" * 10_000 + "\n", "nested more than 64 levels"),
        (BASE + "x: !!python/object/apply:os.system ['true']\n", "could not determine a constr"),
        (BASE + "sampling:\n  stop: [!!binary aGVsbG8=]\n", "could not determine a constructor"),
        (BASE + "sampling:\n  temperature: !!float abc\n", "'abc' is not a number"),
        (BASE + "sampling:\n  top_k: !!int abc\n", "'abc' is not an integer"),
        (BASE + "speculative:\n  adaptive: !!bool maybe\n", "not a boolean"),
        (BASE + "sampling:\n  top_k: 0x" + "f" * 5000 + "\n", "far too large"),
        ("- model\n- input\n", "must be a mapping of keys .*, not a list"),
        ("just text\n", "must be a mapping of keys"),
        (BASE + "1: x\n", "line 7: key 1 is a number, not text"),
        (BASE + "null: x\n", "line 7: key null is null, not text"),
        (BASE + "[a, b]: x\n", "key .* is a list, not text"),
        (BASE + '"": x\n', "line 7: empty key"),
        ("model: m\ninput: null\noutput:\n  path: o\n", "input: expected a section"),
        (BASE + "sampling: []\n", "sampling: expected a section"),
        (BASE + "sampling:\n  stop: a\n", "sampling.stop: expected a list"),
        ("model: 'a\\0b'\ninput:\n  path: a\noutput:\n  path: o\n", ""),  # single-quoted: ok
        ('model: "a\\0b"\ninput:\n  path: a\noutput:\n  path: o\n', "model: .*NUL"),
        ('model: "\\ud800"\ninput:\n  path: a\noutput:\n  path: o\n', "lone surrogate"),
        ("model: ''\ninput:\n  path: a\noutput:\n  path: o\n", "model: String should have"),
        ("model: m\x1b\n", "unacceptable character"),
        ("a: 1\n---\nb: 2\n", "expected a single document"),
        ("a: &x 1\nb: *y\n", "undefined alias"),
        ("a: &a {<<: *a}\n", "merges a mapping into itself"),
        ("a: {<<: 5}\n", "a merge key"),
        ("model: " + "x" * 5000 + "\ninput:\n  path: a\noutput:\n  path: o\n", ""),  # a name
    ],
    ids=lambda v: re.sub(r"\W+", "-", v[-40:]).strip("-")[:40] if isinstance(v, str) else None,
)
def test_junk_job_files_raise_job_error(tmp_path, text, match):
    p = write(tmp_path, text)
    if not match:  # loads (later steps report a missing model)
        load_job(p)
        return
    with pytest.raises(JobError, match=match) as e:
        load_job(p)
    assert len(str(e.value)) < 2000


# --- Property: whatever the file, load_job returns a JobConfig or raises a short JobError -------

SCHEMA_KEYS = [
    "model", "draft", "input", "output", "sampling", "engine", "speculative", "data", "head",
    "train", "path", "prompt_column", "messages_column", "id_column", "limit",
    "apply_chat_template", "part_rows", "flush_interval_s", "include_token_ids",
    "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "device", "dtype",
    "max_batch_size", "kv_cache_tokens", "block_size", "max_model_len", "cuda_graph",
    "num_threads", "num_steps", "topk", "adaptive", "prompt_lookup_min", "init_from",
    "aux_layer_ids", "epochs", "lr", "<<", "~", "", "1", "null", "a b",
]
SCALARS = [
    "0", "1", "-1", "3", "0.5", "1e-3", "1.5", "256.0", "true", "false", "yes", "no", "null",
    "~", "''", '""', ".inf", "-.inf", ".nan", "0x10", "0o17", "010", "1_000", "2024-01-01",
    "cpu", "cuda", "auto", "builtin:sharegpt", "~/x", "~root/y", "a/b", "./c", "'0.5'", '"\\0"',
    '"\\ud800"', "99999999999999999999999", "-99999999999999999999999", "!!float abc",
    "!!int x", "!!bool maybe", "!!binary aGk=", "!!timestamp 2001-12-14", "!!set {a}",
    "!!python/object/apply:os.system ['true']", "!foo bar", "*a", "&a 1", "[]", "{}", "[1, 2]",
    "['a', '']", "{a: 1}", "{a: 1, a: 2}", "[[[[[[1]]]]]]", "'''", "[", "{", "- x", ": x",
    "x" * 300, "|\n  block", ">-\n  folded",
]


def yaml_ish(draw, depth: int = 0) -> list[str]:
    """Lines of a YAML-like mapping: schema keys with random scalars, flow values and nested
    mappings, sometimes badly indented, anchored, aliased, merged or duplicated."""
    lines = []
    for _ in range(draw(st.integers(0, 6))):
        key = draw(st.sampled_from(SCHEMA_KEYS))
        indent = "  " * depth + draw(st.sampled_from(["", "", "", " "]))
        anchor = draw(st.sampled_from(["", "", "", "&a ", "&b "]))
        if depth < 3 and draw(st.integers(0, 3)) == 0:
            lines.append(f"{indent}{key}: {anchor}".rstrip())
            lines.extend(yaml_ish(draw, depth + 1))
        else:
            value = draw(st.one_of(st.sampled_from(SCALARS), st.text(max_size=12),
                                   st.integers().map(str), st.floats().map(str)))
            lines.append(f"{indent}{key}: {anchor}{value}")
    return lines


@st.composite
def job_texts(draw) -> bytes:
    kind = draw(st.sampled_from(["text", "bytes", "grammar", "grammar", "dumped"]))
    if kind == "text":
        return draw(st.text(max_size=200)).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "dumped":
        import yaml

        leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                           st.text(max_size=10), st.sampled_from(SCALARS))
        tree = st.recursive(leaves, lambda c: st.one_of(
            st.lists(c, max_size=4),
            st.dictionaries(st.one_of(st.sampled_from(SCHEMA_KEYS), st.integers(), st.none()),
                            c, max_size=4)), max_leaves=20)
        data = draw(st.dictionaries(st.sampled_from(SCHEMA_KEYS), tree, max_size=6))
        return yaml.safe_dump(data, allow_unicode=draw(st.booleans())).encode()
    base = draw(st.sampled_from(["", BASE]))
    return (base + "\n".join(yaml_ish(draw)) + "\n").encode()


overrides = st.lists(
    st.builds(lambda k, v: f"{k}={v}",
              st.sampled_from(["sampling.temperature", "sampling.stop", "engine", "input.path",
                               "model", "draft", "train.seed", "data.max_batch_size", "a..b",
                               "sampling.top_k.x", ""]),
              st.one_of(st.sampled_from(SCALARS), st.text(max_size=10))),
    max_size=2,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=job_texts(), sets=overrides, train=st.booleans())
def test_any_job_file_loads_or_raises_a_short_job_error(tmp_path_factory, data, sets, train):
    from eaglebatch.job.config import JobConfig
    from eaglebatch.train.job import TrainJob, load_train_job

    d = tmp_path_factory.getbasetemp() / "junk"
    d.mkdir(exist_ok=True)
    p = d / "job.yaml"
    p.write_bytes(data)
    try:
        job = (load_train_job if train else load_job)(p, sets)
    except JobError as e:
        assert 0 < len(str(e)) < 4096, len(str(e))
    else:
        assert isinstance(job, TrainJob if train else JobConfig)


def test_the_job_record_carries_no_credential(tmp_path):
    """job_to_dict (part footers, bench reports) masks the endpoint's user information and every
    option value; an endpoint without credentials is kept as written."""
    from eaglebatch.job.config import job_from_dict, job_to_dict

    job = {"model": "builtin:smollm2-135m-instruct", "input": {"path": "in.parquet"},
           "output": {"path": "out"},
           "storage": {"endpoint": "https://AKIDUSER:pa%2Fss@minio.internal:9000/",
                       "options": {"aws_secret_access_key": "s3cret", "aws_region": "x"}}}
    record = json.dumps(job_to_dict(job_from_dict(job, base_dir=tmp_path)))
    assert "AKIDUSER" not in record and "pa%2Fss" not in record and "s3cret" not in record
    storage = json.loads(record)["storage"]
    assert storage["endpoint"] == "https://***@minio.internal:9000/"
    assert storage["options"] == {"aws_secret_access_key": "***", "aws_region": "***"}
    job["storage"] = {"endpoint": "http://minio:9000"}
    assert job_to_dict(job_from_dict(job, base_dir=tmp_path))["storage"]["endpoint"] == (
        "http://minio:9000")  # fmt: skip


def test_python_and_rust_judge_credential_option_names_alike():
    """One rule names a storage option a credential: the Rust side redacts such values from its
    messages (storage.rs `is_secret_name`) and run-batch refuses them with --set
    (job/secrets.py), through the extension."""
    native = pytest.importorskip("eaglebatch._native")
    from eaglebatch.job.secrets import is_secret_option

    secret = ["aws_secret_access_key", "token", "password", "AWS_SESSION_TOKEN",
              "azure_storage_sas_key", "google_application_credentials", "aws_access_key_id"]
    plain = ["endpoint", "region", "aws_region", "aws_allow_http", "bucket"]
    for key in secret + plain:
        assert is_secret_option(key) == native.is_secret_name(key) == (key in secret), key
    # str.upper() reads this as AWS_SECRET ('\u017f' -> 'S'); the one rule is ASCII's
    assert is_secret_option("aws_\u017fecret") == native.is_secret_name("aws_\u017fecret")

"""Reading the RoPE settings of a config.json: each kind's keys, its defaults, the refused
kinds, the longrope length cap and the partial rotary width. (The values against transformers'
own computation: tests/test_rotary.py.)"""

from __future__ import annotations

import math

import pytest

from eaglebatch.model.config import ModelConfig
from eaglebatch.model.config import RopeScaling as ReExported
from eaglebatch.model.rope_config import RopeScaling, parse_rope, rotary_dim_of

MAX_POS = 32768
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0],
            "original_max_position_embeddings": 4096}  # fmt: skip


def scaling_of(spec: dict, **top) -> RopeScaling | None:
    return parse_rope({"rope_scaling": spec, **top}, MAX_POS)[1]


def test_config_re_exports_the_class() -> None:
    assert ReExported is RopeScaling


@pytest.mark.parametrize(
    "spec, missing",
    [
        ({"rope_type": "linear"}, "'factor'"),
        ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "low_freq_factor"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "high_freq_factor"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 4096}, "'factor'"),
        ({**LONGROPE, "short_factor": None}, "short_factor"),
        ({k: v for k, v in LONGROPE.items() if k != "long_factor"}, "long_factor"),
    ],
)
def test_a_missing_required_key_is_named(spec: dict, missing: str) -> None:
    kind = spec["rope_type"]
    with pytest.raises(ValueError, match=f"RoPE scaling '{kind}' is missing {missing}"):
        scaling_of(spec)


@pytest.mark.parametrize("kind", ["dynamic", "mrope", "longrope2"])
@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_refused_kinds_list_the_supported_ones(kind: str, key: str) -> None:
    supported = "supported: default, linear, llama3, yarn, longrope"
    with pytest.raises(ValueError, match=f"{key}='{kind}'; {supported}"):
        scaling_of({key: kind, "factor": 2.0})
    with pytest.raises(ValueError, match=f"{key}='{kind}'"):  # the transformers 5 layout too
        parse_rope({"rope_parameters": {key: kind, "factor": 2.0, "rope_theta": 1e4}}, MAX_POS)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({**YARN, "factor": "4"}, "factor must be a positive number"),
        ({**YARN, "beta_fast": "fast"}, "beta_fast must be a non-negative number"),
        ({**YARN, "truncate": "no"}, "truncate must be true or false"),
        ({**YARN, "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
        ({**LONGROPE, "short_factor": [1.0, "x"]}, "short_factor must be a list"),
        ({**LONGROPE, "long_factor": 2.0}, "long_factor must be a list"),
    ],
)
def test_bad_values_are_named(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        scaling_of(spec)


def test_yarn_defaults() -> None:
    s = scaling_of(YARN)
    assert (s.rope_type, s.factor, s.original_max_position_embeddings) == ("yarn", 4.0, 8192)
    assert (s.beta_fast, s.beta_slow, s.truncate) == (32.0, 1.0, True)
    assert s.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    assert s.max_len_cap is None and s.llama_4_scaling_beta is None


def test_yarn_settings() -> None:
    s = scaling_of({**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False,
                    "mscale": 1.0, "mscale_all_dim": 0.5, "llama_4_scaling_beta": 0.1})  # fmt: skip
    assert (s.beta_fast, s.beta_slow, s.truncate, s.llama_4_scaling_beta) == (16, 2, False, 0.1)
    want = (0.1 * math.log(4.0) + 1) / (0.05 * math.log(4.0) + 1)
    assert s.attention_factor == pytest.approx(want)
    assert scaling_of({**YARN, "mscale": 1.0}).attention_factor == scaling_of(YARN).attention_factor
    assert scaling_of({**YARN, "mscale": 1.0, "attention_factor": 0.9}).attention_factor == 0.9
    # a null factor is the ratio of the lengths; no original length means max_position_embeddings
    assert scaling_of({**YARN, "factor": None}).factor == MAX_POS / 8192
    unset = scaling_of({"rope_type": "yarn", "factor": 2.0})
    assert unset.original_max_position_embeddings == MAX_POS


def test_longrope_defaults_and_cap() -> None:
    s = scaling_of(LONGROPE)
    assert (s.short_factor, s.long_factor) == ((1.0, 2.0), (3.0, 4.0))
    assert s.factor == MAX_POS / 4096
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(4096)))
    assert s.max_len_cap == 4096
    given = scaling_of({**LONGROPE, "factor": 1.0})
    assert given.attention_factor == 1.0 and given.max_len_cap == 4096
    assert scaling_of({**{k: v for k, v in LONGROPE.items() if k != "rope_type"},
                       "type": "su"}).rope_type == "longrope"  # early Phi-3  # fmt: skip


def test_no_cap_for_the_other_kinds() -> None:
    assert scaling_of({"rope_type": "linear", "factor": 2.0}).max_len_cap is None
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1, "high_freq_factor": 4}
    assert scaling_of(llama3).max_len_cap is None


def test_a_top_level_original_length_wins() -> None:
    """Phi-3 keeps original_max_position_embeddings at the top level (transformers prefers it)."""
    spec = {**LONGROPE, "original_max_position_embeddings": 2048}
    assert scaling_of(spec, original_max_position_embeddings=4096).max_len_cap == 4096
    assert scaling_of(spec).max_len_cap == 2048


def test_nested_layout_reads_the_full_attention_entry() -> None:
    raw = {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                               "full_attention": {**YARN, "rope_theta": 5e5, "truncate": False}},
           "original_max_position_embeddings": 1024}  # fmt: skip
    theta, s = parse_rope(raw, MAX_POS)
    assert theta == 5e5 and s.rope_type == "yarn"
    # as transformers: `truncate` only from the outer dict, no top-level original length
    assert s.truncate and s.original_max_position_embeddings == 8192


def test_model_config_accepts_the_new_kinds() -> None:
    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 16, "vocab_size": 32,
            "max_position_embeddings": MAX_POS}  # fmt: skip  (head_dim 4: 2 factors per list)
    assert ModelConfig.from_dict({**base, "rope_scaling": YARN}).rope_scaling == scaling_of(YARN)
    got = ModelConfig.from_dict({**base, "rope_parameters": {**LONGROPE, "rope_theta": 1e4}})
    assert got.rope_scaling.max_len_cap == 4096 and got.rope_theta == 1e4
    assert got.max_model_len == 4096 < MAX_POS  # longrope serves what its short factors cover
    with pytest.raises(ValueError, match="short_factor has 2 entries, the rotary dim 8 needs 4"):
        ModelConfig.from_dict({**base, "num_attention_heads": 8, "rope_parameters": LONGROPE})


@pytest.mark.parametrize(
    "raw, want",
    [
        ({}, 128),
        ({"partial_rotary_factor": 0.75}, 96),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, 64),
        ({"rope_parameters": {"partial_rotary_factor": 0.5}, "partial_rotary_factor": 0.25}, 64),
        ({"rope_scaling": {**YARN, "partial_rotary_factor": 0.25}}, 32),
        ({"rope_parameters": {"full_attention": {"partial_rotary_factor": 0.5}}}, 64),
    ],
)
def test_rotary_dim_of(raw: dict, want: int) -> None:
    assert rotary_dim_of(raw, 128) == want


@pytest.mark.parametrize("factor", [0, -0.5, 1.5, "half", True, 0.001, 0.3])
def test_bad_partial_rotary_factor_is_named(factor) -> None:
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rotary_dim_of({"partial_rotary_factor": factor}, 10)  # 0.3 * 10 = 3: odd

"""ModelConfig parsing of Hugging Face config.json files."""

from __future__ import annotations

import json

import pytest

from eaglebatch.model.config import ModelConfig, RopeScaling

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def cfg(**overrides) -> ModelConfig:
    raw = {**BASE, **overrides}
    return ModelConfig.from_dict({k: v for k, v in raw.items() if v is not None})


def test_smollm2_like_llama() -> None:
    c = cfg()
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (576, 30, 9)
    assert (c.num_key_value_heads, c.head_dim) == (3, 64)
    assert c.tie_word_embeddings and not c.attention_bias and not c.o_proj_bias
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.eos_token_id == (2,) and c.bos_token_id == 1
    assert c.torch_dtype == "bfloat16" and c.max_model_len == 8192


def test_explicit_head_dim_and_defaults() -> None:
    c = cfg(head_dim=128, num_key_value_heads=None, tie_word_embeddings=None, rope_theta=None)
    assert c.head_dim == 128 and c.num_key_value_heads == 9
    assert not c.tie_word_embeddings and c.rope_theta == 10000.0


def test_eos_list_and_missing_tokens() -> None:
    assert cfg(eos_token_id=[128001, 128008, 128009]).eos_token_id == (128001, 128008, 128009)
    c = cfg(eos_token_id=None, bos_token_id=None)
    assert c.eos_token_id == () and c.bos_token_id is None


def test_transformers5_dtype_key() -> None:
    assert cfg(torch_dtype=None, dtype="float16").torch_dtype == "float16"


LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_llama3_rope_scaling(key: str) -> None:
    c = cfg(rope_scaling={**LLAMA3, key: "llama3"}, max_position_embeddings=131072)
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


def test_rope_parameters_layout() -> None:
    params = {**LLAMA3, "rope_type": "llama3", "rope_theta": 500000.0}
    c = cfg(rope_theta=None, rope_parameters=params)
    assert c.rope_theta == 500000.0 and c.rope_scaling is not None
    assert c.rope_scaling.rope_type == "llama3"
    c = cfg(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert c.rope_theta == 1e6 and c.rope_scaling is None


def test_linear_rope_scaling() -> None:
    assert cfg(rope_scaling={"type": "linear", "factor": 2.0}).rope_scaling == RopeScaling(
        "linear", 2.0
    )


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn'"),
        ({"type": "dynamic", "factor": 2.0}, "type='dynamic'"),
        ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
        ({"type": "linear"}, "factor"),
    ],
)
def test_bad_rope_scaling(spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        cfg(rope_scaling=spec)


def test_unsupported_model_type_is_named() -> None:
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; supported: llama, "):
        cfg(model_type="gpt2")
    with pytest.raises(ValueError, match="hidden_act 'quick_gelu'"):
        cfg(hidden_act="quick_gelu")
    with pytest.raises(ValueError, match="architecture 'LlamaForSequenceClassification'"):
        cfg(architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ValueError, match="'hidden_size'"):
        cfg(hidden_size=None)
    with pytest.raises(ValueError, match="multiple"):
        cfg(num_key_value_heads=2)


def test_qwen2_has_qkv_bias_and_optional_window() -> None:
    qwen = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    c = cfg(**qwen, sliding_window=4096, use_sliding_window=False, max_position_embeddings=32768)
    assert c.attention_bias and not c.o_proj_bias
    assert c.sliding_window is None and c.max_model_len == 32768
    c = cfg(**qwen, sliding_window=4096, use_sliding_window=True, max_position_embeddings=32768)
    assert c.max_model_len == 4096


def test_llama_attention_bias_covers_o_proj() -> None:
    c = cfg(attention_bias=True, mlp_bias=True)
    assert c.attention_bias and c.o_proj_bias and c.mlp_bias


def test_mistral_sliding_window_caps_max_model_len() -> None:
    mistral = {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    c = cfg(**mistral, sliding_window=4096, max_position_embeddings=32768)
    assert c.sliding_window == 4096 and c.max_model_len == 4096
    assert cfg(**mistral, sliding_window=None).max_model_len == 8192


def test_from_dir(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert ModelConfig.from_dir(tmp_path) == cfg()
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_dir(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)


MINISTRAL3 = {"model_type": "ministral3", "architectures": ["Ministral3ForCausalLM"],
              "rope_theta": None}  # fmt: skip
# the published rope_parameters of Ministral 3 (YaRN), and the same with default RoPE
MINISTRAL3_YARN = {"type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                   "original_max_position_embeddings": 16384, "max_position_embeddings": 262144,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                   "llama_4_scaling_beta": 0.1}  # fmt: skip
MINISTRAL3_DEFAULT = {"rope_type": "default", "rope_theta": 1e6, "llama_4_scaling_beta": 0.1,
                      "original_max_position_embeddings": 16384}  # fmt: skip


def test_ministral3_scales_queries_by_position() -> None:
    c = cfg(**MINISTRAL3, rope_parameters=MINISTRAL3_DEFAULT)
    assert c.query_position_scale == (0.1, 16384) and c.rope_theta == 1e6
    assert c.rope_scaling is None and c.sliding_window is None
    without = {k: v for k, v in MINISTRAL3_DEFAULT.items() if k != "llama_4_scaling_beta"}
    assert cfg(**MINISTRAL3, rope_parameters=without).query_position_scale is None
    windowed = cfg(**MINISTRAL3, rope_parameters=MINISTRAL3_DEFAULT, sliding_window=4096)
    assert windowed.max_model_len == 4096  # a length cap, every layer windowed


@pytest.mark.parametrize("params, message", [
    (MINISTRAL3_YARN, "type='yarn'"),  # until YaRN lands in model/rotary.py
    ({**MINISTRAL3_DEFAULT, "llama_4_scaling_beta": -1}, "llama_4_scaling_beta"),
    ({**MINISTRAL3_DEFAULT, "llama_4_scaling_beta": "0.1"}, "llama_4_scaling_beta"),
    ({**MINISTRAL3_DEFAULT, "original_max_position_embeddings": None},
     "original_max_position_embeddings"),
    ({**MINISTRAL3_DEFAULT, "original_max_position_embeddings": 0},
     "original_max_position_embeddings"),
])  # fmt: skip
def test_ministral3_refuses_what_it_does_not_implement(params, message) -> None:
    with pytest.raises(ValueError, match=message):
        cfg(**MINISTRAL3, rope_parameters=params)


def test_a_mistral3_checkpoint_reads_as_its_text_tower() -> None:
    text = {k: v for k, v in {**BASE, **MINISTRAL3}.items() if v is not None}
    c = ModelConfig.from_dict({"model_type": "mistral3", "architectures": [
        "Mistral3ForConditionalGeneration"], "text_config": {
        **text, "rope_parameters": MINISTRAL3_DEFAULT}, "vision_config": {"model_type": "pixtral"}})
    assert c.text_tower and c.model_type == "ministral3" and c.query_position_scale == (0.1, 16384)


def test_ministral_windows_its_sliding_layers() -> None:
    ministral = {"model_type": "ministral", "architectures": ["MinistralForCausalLM"],
                 "num_hidden_layers": 3}  # fmt: skip
    types = ["full_attention", "sliding_attention", "sliding_attention"]
    c = cfg(**ministral, sliding_window=4096, layer_types=types)
    assert [c.window_of(i) for i in range(3)] == [None, 4096, 4096]
    assert c.max_model_len == 8192  # real windows: no length cap
    assert cfg(**ministral, sliding_window=64).window_of(0) == 64  # no layer_types: all sliding
    assert cfg(**ministral, sliding_window=None).layer_types is None
    with pytest.raises(ValueError, match="sliding_window"):
        cfg(**ministral, sliding_window=None, layer_types=types)
    with pytest.raises(ValueError, match="layer_types"):
        cfg(**ministral, sliding_window=64, layer_types=types[:2])

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


PHI3 = {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "tie_word_embeddings": False}


def test_phi3_window_caps_the_length_and_fused_rows_follow_the_shape() -> None:
    from eaglebatch.model.registry import family_of

    c = cfg(**PHI3, sliding_window=2047, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                             "partial_rotary_factor": 1.0})  # fmt: skip
    assert c.max_model_len == 2047 and not (c.attention_bias or c.o_proj_bias or c.mlp_bias)
    split = dict(family_of("phi3").split("model.layers.1.self_attn.qkv_proj.weight",
                                         (576 + 2 * 192, 576), c))  # fmt: skip
    assert split == {f"model.layers.1.self_attn.{p}_proj.weight": (r, 576)
                     for p, r in (("q", 576), ("k", 192), ("v", 192))}  # fmt: skip
    split = dict(family_of("phi3").split("model.layers.0.mlp.gate_up_proj.weight",
                                         (2 * 1536, 576), c))  # fmt: skip
    assert split == {"model.layers.0.mlp.gate_proj.weight": (1536, 576),
                     "model.layers.0.mlp.up_proj.weight": (1536, 576)}  # fmt: skip
    with pytest.raises(ValueError, match="qkv_proj.weight.*expects 960 rows"):
        dict(family_of("phi3").split("m.self_attn.qkv_proj.weight", (576, 576), c))


@pytest.mark.parametrize("setting, key", [
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor = 0.75"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor = 0.5"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     "longrope"),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}}, "'su'"),
])  # fmt: skip
def test_phi3_refuses_partial_rotary_and_longrope(setting, key) -> None:
    with pytest.raises(ValueError, match=key):
        cfg(**PHI3, **setting)


def test_from_dir(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert ModelConfig.from_dir(tmp_path) == cfg()
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_dir(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)

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


GEMMA4 = {
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 320, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "sliding_window": 8, "hidden_activation": "gelu_pytorch_tanh",
    "layer_types": ["sliding_attention", "full_attention"] * 2, "hidden_size_per_layer_input": 0,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1000000.0},
    },
}  # fmt: skip


GEMMA4_TYPES = tuple(GEMMA4["layer_types"])


def gemma4(**overrides) -> ModelConfig:
    return ModelConfig.from_dict({**GEMMA4, **overrides})


def test_gemma4_full_layers_have_their_own_heads_and_proportional_rope() -> None:
    c = gemma4(global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
               layer_types=["sliding_attention"] * 4)  # the last layer is always full
    assert [c.heads_of(i) for i in range(4)] == [(4, 2, 16)] * 3 + [(4, 1, 32)]
    assert c.k_eq_v_layers == (False, False, False, True) and c.kv_source_layers is None
    assert c.rope_scaling == RopeScaling("proportional", 1.0, partial_rotary_factor=0.25)
    assert (c.rope_theta, c.rope_local_theta, c.attention_window) == (1e6, 1e4, 8)
    assert c.attention_scale_of(0) == c.attention_scale_of(3) == 1.0
    # transformers gates the global KV heads on attention_k_eq_v; 512 is its global head dim
    c = gemma4(num_global_key_value_heads=1)
    assert c.heads_of(3) == (4, 2, 512) and c.k_eq_v_layers is None
    # transformers 5 writes the same as per_layer_config
    c = gemma4(per_layer_config={"1": {"head_dim": 32}, "3": {"head_dim": 32,
                                                             "num_key_value_heads": 1}})
    assert [c.heads_of(i)[1:] for i in range(4)] == [(2, 16), (2, 32), (2, 16), (1, 32)]


def test_gemma4_shared_kv_layers_ple_and_double_wide_mlp() -> None:
    c = gemma4(num_hidden_layers=6, layer_types=["sliding_attention", "sliding_attention",
                                                 "full_attention"] * 2,
               num_kv_shared_layers=3, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
               vocab_size_per_layer_input=320)  # fmt: skip
    assert c.kv_source_layers == (0, 1, 2, 1, 1, 2)  # the last earlier owner of each kind
    assert c.layer_intermediate_sizes == (96, 96, 96, 192, 192, 192)
    assert c.per_layer_input_size == 8 and c.layer_scalar and c.v_norm
    # "vision": only image tokens attend both ways, and a text run has none
    assert gemma4(use_bidirectional_attention="vision").layer_types == GEMMA4_TYPES


@pytest.mark.parametrize("overrides, key", [
    ({"enable_moe_block": True}, "enable_moe_block"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"per_layer_config": {"3": {"intermediate_size": 8}}}, "intermediate_size"),
    ({"per_layer_config": {"3": {"head_dim": 8}}}, "several head dims"),
    ({"hidden_size_per_layer_input": 8}, "vocab_size_per_layer_input"),
    ({"num_kv_shared_layers": 4}, "num_kv_shared_layers"),
    ({"num_kv_shared_layers": 3}, "num_kv_shared_layers = 3 leaves no full_attention"),
    ({"rope_parameters": None}, "rope_parameters"),
])  # fmt: skip
def test_gemma4_refuses_what_it_does_not_implement(overrides, key) -> None:
    with pytest.raises(ValueError, match=key):
        gemma4(**overrides)


def test_gemma4_multimodal_checkpoint_is_its_text_tower() -> None:
    text = {k: v for k, v in GEMMA4.items() if k not in ("architectures", "model_type")}
    c = ModelConfig.from_dict({"model_type": "gemma4", "architectures":
                               ["Gemma4ForConditionalGeneration"], "text_config": text})
    assert c.text_tower and c.model_type == "gemma4_text" and c.heads_of(1)[2] == 512

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
        ({"rope_type": "mrope", "factor": 4.0}, "rope_type='mrope'; supported: default, "),
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
    with pytest.raises(ValueError, match="architecture 'LlamaForTokenClassification'"):
        cfg(architectures=["LlamaForTokenClassification"])
    with pytest.raises(ValueError, match="architecture 'Qwen3ForSequenceClassification'"):
        cfg(architectures=["Qwen3ForSequenceClassification"])  # another family's
    # a sequence classifier of the family: its score head's outputs (task classify / reward)
    assert cfg(architectures=["LlamaForSequenceClassification"]).head_outputs == 2
    labels = {"0": "neg", "1": "neu", "2": "pos"}
    assert cfg(architectures=["LlamaForSequenceClassification"], id2label=labels).head_outputs == 3
    assert cfg().head_outputs == 0
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


def _longrope(pairs: int, **extra) -> dict:
    return {"short_factor": [1.0 + i / pairs for i in range(pairs)],
            "long_factor": [2.0 + i for i in range(pairs)], **extra}  # fmt: skip


@pytest.mark.parametrize("setting", [
    {"partial_rotary_factor": 0.75},  # Phi-4-mini's 3/4 of each head, default RoPE
    # Phi-3-mini-128k: "su" is longrope, the top-level original length
    {"rope_scaling": _longrope(32, type="su"), "original_max_position_embeddings": 4096,
     "max_position_embeddings": 131072},
    # "yarn" is longrope too; the original length is Phi3Config's 4096, never the one inside
    {"rope_scaling": _longrope(32, type="yarn", original_max_position_embeddings=99)},
    # Phi-4-mini in the transformers 5 layout: partial rotary and longrope
    {"rope_parameters": _longrope(24, rope_type="longrope", partial_rotary_factor=0.75,
                                  rope_theta=1e4),
     "original_max_position_embeddings": 4096, "max_position_embeddings": 131072},
])  # fmt: skip
def test_phi3_rope_is_read_as_phi3config_normalises_it(setting) -> None:
    """Rotary width, RoPE kind, original length and attention factor as transformers'
    Phi3Config and its longrope computation have them; max_model_len capped at the original
    length under longrope."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = cfg(**PHI3, **setting)
    raw = {**BASE, **PHI3, **setting}
    ref = transformers.Phi3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    params = ref.rope_parameters
    head_dim = raw["hidden_size"] // raw["num_attention_heads"]
    assert (c.rotary_dim or c.head_dim) == int(head_dim * params["partial_rotary_factor"])
    if params["rope_type"] == "default":
        assert c.rope_scaling is None and c.max_model_len == raw["max_position_embeddings"]
        return
    s = c.rope_scaling
    assert s.rope_type == params["rope_type"] == "longrope"
    assert s.original_max_position_embeddings == params["original_max_position_embeddings"]
    assert list(s.short_factor) == params["short_factor"]
    _, attention = ROPE_INIT_FUNCTIONS["longrope"](ref, "cpu")
    assert s.attention_factor == pytest.approx(attention, rel=1e-12)
    assert c.max_model_len == min(raw["max_position_embeddings"], 4096)


@pytest.mark.parametrize("setting, key", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type = 'linear'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_parameters.rope_type = 'dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0}}, "rope_scaling.rope_type = 'llama3'"),
    # Phi3Config sizes the lists by hidden / heads (64 dims), its RoPE by head_dim (32)
    ({"head_dim": 32, "rope_scaling": _longrope(16, type="longrope")},
     "rope_scaling.short_factor has 16 entries, phi3 needs 32"),
    ({"head_dim": 32, "rope_scaling": _longrope(32, type="longrope")},
     "short_factor has 32 entries, the rotary dim 32 needs 16"),
    ({"partial_rotary_factor": 0.75, "rope_scaling": _longrope(32, type="su")},
     "short_factor has 32 entries, the rotary dim 48 needs 24"),
])  # fmt: skip
def test_phi3_refuses_what_phi3config_rejects(setting, key) -> None:
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


OLMO2 = {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"]}
OLMO3 = {"model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"], "num_hidden_layers": 8}


def test_olmo_layers_are_post_norm_with_projection_qk_norms() -> None:
    from eaglebatch.cpu.decoder import native_layers_fit

    for family in (OLMO2, OLMO3):
        c = cfg(**family, attention_bias=True)
        assert (c.norm_layout, c.qk_norm, c.norm_kind) == ("post", "projection", "rms_cast_last")
        assert c.attention_bias and c.o_proj_bias and not c.mlp_bias
        assert not native_layers_fit(c)  # the CPU path runs its torch layers, native GEMMs
    assert cfg(**OLMO2).layer_types is None and cfg(**OLMO2).rope_local_theta is None


@pytest.mark.parametrize("rope", [
    {"rope_theta": 1234.0},
    {"rope_theta": 1234.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    {"rope_theta": None},
    {"rope_theta": None, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 20.0}}},
    {"rope_theta": None, "rope_parameters": {"sliding_attention": {"rope_type": "default"}}},
    {"rope_theta": 77.0, "rope_parameters": {"sliding_attention": {"rope_type": "default"},
                                             "full_attention": {"rope_type": "default"}}},
])  # fmt: skip
def test_olmo3_rope_per_layer_type_as_transformers_reads_it(rope) -> None:
    """Full layers' base and scaling, sliding layers' base: those of transformers' Olmo3Config
    (whose flat layout gives rope_theta to full layers only, 500000 to sliding ones)."""
    import transformers

    c = cfg(**OLMO3, **rope)
    raw = {**BASE, **OLMO3, **rope}
    ref = transformers.Olmo3Config.from_dict({k: v for k, v in raw.items() if v is not None})
    full, local = ref.rope_parameters["full_attention"], ref.rope_parameters["sliding_attention"]
    assert (c.rope_theta, c.rope_local_theta) == (full["rope_theta"], local["rope_theta"])
    assert (c.rope_scaling.factor if c.rope_scaling else None) == full.get("factor")


def test_olmo3_layer_types_and_window() -> None:
    c = cfg(**OLMO3)
    assert [c.window_of(i) for i in range(8)] == [4096, 4096, 4096, None] * 2
    c = cfg(**OLMO3, sliding_window=16, layer_types=["full_attention"] * 7 + ["sliding_attention"])
    assert [c.window_of(i) for i in range(8)] == [None] * 7 + [16] and c.max_model_len == 8192


@pytest.mark.parametrize("raw, message", [
    ({**OLMO2, "mlp_bias": True}, "mlp_bias"),
    ({**OLMO2, "clip_qkv": 8.0}, "clip_qkv"),
    ({**OLMO3, "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type = 'linear'"),
    ({**OLMO3, "rope_parameters": {"rope_type": "default", "rope_theta": 10.0}},
     "keyed by layer type"),
    ({**OLMO3, "sliding_window": None}, "sliding_window = None"),
    ({**OLMO3, "layer_types": ["full_attention"]}, "layer_types"),
])  # fmt: skip
def test_olmo_refuses_what_it_does_not_implement(raw, message) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, **raw})
SMOLLM3 = {"model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"],
           "num_hidden_layers": 6, "tie_word_embeddings": None}  # fmt: skip


@pytest.mark.parametrize("settings", [
    {}, {"no_rope_layer_interval": 3}, {"no_rope_layers": [1, 0, 0, 1, 1, 0, 1]},
    {"use_sliding_window": True, "sliding_window": 16, "no_rope_layer_interval": 2},
    {"use_sliding_window": True, "sliding_window": None},
    {"use_sliding_window": False, "sliding_window": 16},
    {"use_sliding_window": True, "sliding_window": 16,
     "layer_types": ["sliding_attention", "full_attention"] * 3},
])  # fmt: skip
def test_smollm3_rope_and_sliding_layers_as_transformers_derives_them(settings) -> None:
    """Which layers skip RoPE and which are windowed, as transformers' SmolLM3Config says."""
    transformers = pytest.importorskip("transformers")
    c = cfg(**SMOLLM3, **settings)
    ref = transformers.SmolLM3Config(num_hidden_layers=6,
                                     **{k: v for k, v in settings.items() if v is not None})
    assert [c.uses_rope(i) for i in range(6)] == [bool(f) for f in ref.no_rope_layers[:6]]
    assert [c.window_of(i) for i in range(6)] == [
        16 if t == "sliding_attention" else None for t in ref.layer_types]
    assert c.tie_word_embeddings and c.sliding_window is None and c.max_model_len == 8192
    assert c.rope_layers is None or not all(c.rope_layers)


@pytest.mark.parametrize(("settings", "key"), [
    ({"rope_theta": None}, "rope_theta"),
    ({"no_rope_layers": [1, 0]}, "no_rope_layers"),
    ({"no_rope_layers": [1, 2, 1, 1, 1, 1]}, "no_rope_layers"),
    ({"no_rope_layer_interval": 0}, "no_rope_layer_interval"),
    ({"layer_types": ["full_attention"] * 5}, "layer_types"),
    ({"layer_types": ["sliding_attention"] * 6, "sliding_window": 8}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention"] * 6, "use_sliding_window": True}, "sliding_window"),
])  # fmt: skip
def test_smollm3_refuses_what_it_does_not_implement(settings, key) -> None:
    with pytest.raises(ValueError, match=key):
        cfg(**SMOLLM3, **settings)


GRANITE = {"model_type": "granite", "architectures": ["GraniteForCausalLM"]}


def test_granite_multipliers() -> None:
    c = cfg(**GRANITE, embedding_multiplier=12.0, residual_multiplier=0.22,
            attention_multiplier=0.0078125, logits_scaling=8, attention_bias=True)  # fmt: skip
    assert (c.embedding_multiplier, c.residual_multiplier) == (12.0, 0.22)
    assert (c.attention_scale, c.logits_divisor) == (0.0078125, 8.0)
    assert c.attention_bias and c.o_proj_bias
    # transformers' GraniteConfig defaults every multiplier to 1, the attention scale too
    c = cfg(**GRANITE, tie_word_embeddings=None)
    assert (c.embedding_multiplier, c.residual_multiplier, c.logits_divisor) == (1.0, 1.0, 1.0)
    assert c.attention_scale == 1.0 and not c.tie_word_embeddings


@pytest.mark.parametrize("key", ["embedding_multiplier", "residual_multiplier",
                                 "attention_multiplier", "logits_scaling"])  # fmt: skip
def test_granite_refuses_bad_multipliers(key) -> None:
    for bad in (0, -1.0, "2", True):
        with pytest.raises(ValueError, match=key):
            cfg(**GRANITE, **{key: bad})
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
    published = cfg(**MINISTRAL3, rope_parameters=MINISTRAL3_YARN)
    assert published.query_position_scale == (0.1, 16384)
    assert (published.rope_scaling.rope_type, published.rope_scaling.factor) == ("yarn", 16.0)


@pytest.mark.parametrize("params, message", [
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


GEMMA4_MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
              "moe_intermediate_size": 8}  # fmt: skip


def test_gemma4_moe_adds_scaled_routed_experts_beside_every_dense_mlp() -> None:
    c = gemma4(**GEMMA4_MOE)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 8)
    assert all(c.is_sparse(i) for i in range(4)) and c.intermediate_size == 96
    assert c.moe_beside_dense and c.router_input_scale and c.router_expert_scale
    assert c.norm_topk_prob and c.router_weights_float32
    # the experts' keys mean nothing without enable_moe_block (transformers ignores them)
    assert gemma4(**{**GEMMA4_MOE, "enable_moe_block": False}).num_experts == 0


@pytest.mark.parametrize("overrides, key", [
    ({"enable_moe_block": True}, "num_experts"),
    ({**GEMMA4_MOE, "top_k_experts": 5}, "top_k_experts = 5 exceeds num_experts = 4"),
    ({**GEMMA4_MOE, "moe_intermediate_size": None}, "moe_intermediate_size"),
    ({**GEMMA4_MOE, "enable_moe_block": "yes"}, "enable_moe_block"),
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


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8", "compressed-tensors"])
def test_a_quantized_checkpoint_is_refused_naming_its_method(method) -> None:
    with pytest.raises(ValueError, match=f"quantization_config.quant_method = '{method}'"):
        cfg(quantization_config={"quant_method": method, "bits": 4})


def test_qwen3_moe_experts_and_sparse_layers() -> None:
    c = cfg(model_type="qwen3_moe", architectures=None, num_hidden_layers=4,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
            decoder_sparse_step=2, mlp_only_layers=[3])  # fmt: skip
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 16)
    assert c.norm_topk_prob and not c.router_weights_float32 and c.qk_norm == "head"
    assert [c.is_sparse(i) for i in range(4)] == [False, True, False, False]
    # transformers 5 writes num_local_experts; its defaults where keys are absent
    d = cfg(model_type="qwen3_moe", architectures=None, num_local_experts=16,
            moe_intermediate_size=16)  # fmt: skip
    assert (d.num_experts, d.num_experts_per_tok, d.norm_topk_prob) == (16, 8, False)
    assert d.sparse_layers is None and d.is_sparse(29)


def test_mixtral_renormalises_in_float32_and_renames_its_experts() -> None:
    from eaglebatch.model.registry import family_of

    c = cfg(model_type="mixtral", architectures=None, num_local_experts=4, sliding_window=64)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 1536)
    assert c.norm_topk_prob and c.router_weights_float32 and c.max_model_len == 64
    assert all(c.is_sparse(i) for i in range(c.num_hidden_layers))
    split = dict(family_of("mixtral").split("model.layers.0.block_sparse_moe.experts.3.w3.weight",
                                            (1536, 576), c))  # fmt: skip
    assert split == {"model.layers.0.mlp.experts.3.up_proj.weight": (1536, 576)}


def test_fused_3d_experts_split_per_expert() -> None:
    import torch

    from eaglebatch.model.registry import family_of

    c = cfg(model_type="qwen3_moe", architectures=None, num_experts=2, num_experts_per_tok=1,
            moe_intermediate_size=3)  # fmt: skip
    fam, h = family_of("qwen3_moe"), c.hidden_size
    gate_up = torch.arange(2 * 6 * h, dtype=torch.float32).view(2, 6, h)
    parts = dict(fam.split("model.layers.1.mlp.experts.gate_up_proj", gate_up, c))
    assert torch.equal(parts["model.layers.1.mlp.experts.1.gate_proj.weight"], gate_up[1, :3])
    assert torch.equal(parts["model.layers.1.mlp.experts.0.up_proj.weight"], gate_up[0, 3:])
    down = dict(fam.split("m.experts.down_proj", (2, h, 3), c))
    assert down == {"m.experts.0.down_proj.weight": (h, 3), "m.experts.1.down_proj.weight": (h, 3)}
    with pytest.raises(ValueError, match="experts.down_proj"):
        list(fam.split("m.experts.down_proj", (2, h, 4), c))


@pytest.mark.parametrize("settings, key", [
    (dict(num_experts=2, num_experts_per_tok=3), "num_experts_per_tok"),
    (dict(mlp_only_layers=[30]), "mlp_only_layers"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob"),
    (dict(moe_intermediate_size=None), "moe_intermediate_size"),
])  # fmt: skip
def test_moe_refuses_settings_naming_the_key(settings, key) -> None:
    base = dict(model_type="qwen3_moe", architectures=None, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16)  # fmt: skip
    with pytest.raises(ValueError, match=key):
        cfg(**{**base, **settings})


def test_qwen2_moe_reads_its_shared_expert_and_refuses_sliding_windows() -> None:
    qwen2_moe = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
                 "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                 "shared_expert_intermediate_size": 40, "num_hidden_layers": 2}  # fmt: skip
    c = cfg(**qwen2_moe)
    assert (c.num_experts, c.num_experts_per_tok, c.shared_expert_intermediate_size) == (8, 2, 40)
    assert c.attention_bias and not c.o_proj_bias and not c.norm_topk_prob
    with pytest.raises(ValueError, match="use_sliding_window = True"):
        cfg(**qwen2_moe, use_sliding_window=True)


def _gpt_oss(**overrides) -> ModelConfig:
    return cfg(model_type="gpt_oss", architectures=None, tie_word_embeddings=None,
               num_hidden_layers=4, num_local_experts=8, **overrides)  # fmt: skip


def test_gpt_oss_features_and_transformers_defaults() -> None:
    """What GptOssConfig completes where config.json is silent: alternating sliding (even
    layers) and full layers of 128, YaRN x32 over 4096 untruncated on base 150000, biased
    attention, 4 experts per token; sinks, the biased top-k router, biased clamped experts."""
    c = _gpt_oss(rope_theta=None)
    assert [c.window_of(i) for i in range(4)] == [128, None, 128, None]
    s = c.rope_scaling
    assert (c.rope_theta, s.rope_type, s.factor, s.truncate) == (150000.0, "yarn", 32.0, False)
    assert s.original_max_position_embeddings == 4096 and s.beta_fast == 32.0
    assert c.attention_bias and c.o_proj_bias and c.attention_sinks and not c.tie_word_embeddings
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 4, 1536)
    assert (c.router_scoring, c.router_bias, c.expert_bias) == ("topk_softmax", True, True)
    assert (c.expert_activation, c.swiglu_alpha, c.swiglu_limit) == ("clamped_swiglu", 1.702, 7.0)
    assert c.norm_kind == "rms_cast_last" and all(c.is_sparse(i) for i in range(4))
    # the released layout: rope_scaling beside a top-level base
    d = _gpt_oss(rope_theta=None, rope_scaling={"rope_type": "yarn", "factor": 32.0,
                                                "beta_fast": 32.0, "beta_slow": 1.0,
                                                "truncate": False,
                                                "original_max_position_embeddings": 4096})
    assert d.rope_theta == 150000.0 and d.rope_scaling == s


def test_gpt_oss_checkpoint_names_map_onto_the_decoder() -> None:
    from eaglebatch.model.registry import family_of

    c = _gpt_oss(intermediate_size=16)
    h, fam = c.hidden_size, family_of("gpt_oss")
    assert dict(fam.split("model.layers.1.mlp.router.bias", (8,), c)) == {
        "model.layers.1.mlp.gate.bias": (8,)}
    split = dict(fam.split("model.layers.1.mlp.experts.down_proj", (8, 16, h), c))
    assert split["model.layers.1.mlp.experts.7.down_proj.weight"] == (h, 16) and len(split) == 8


@pytest.mark.parametrize("overrides, key", [
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
    ({"swiglu_limit": -1.0}, "swiglu_limit"),
    ({"swiglu_alpha": 0}, "swiglu_alpha"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quant_method"),
])  # fmt: skip
def test_gpt_oss_refuses_what_it_does_not_implement(overrides, key) -> None:
    with pytest.raises(ValueError, match=key):
        _gpt_oss(**overrides)

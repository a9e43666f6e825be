"""RoPE frequencies, attention factors, cos/sin tables and the rotation itself against Hugging
Face transformers, for every supported kind, with full and partial rotary dims."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3 import modeling_phi3

from eaglebatch.model.rope_config import parse_rope, rotary_dim_of
from eaglebatch.model.rotary import (
    RotaryEmbedding,
    apply_rotary,
    attention_factor,
    inverse_frequencies,
)

SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
             num_hidden_layers=1, vocab_size=32)  # fmt: skip


def factors(n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (1 + 10 * torch.rand(n, generator=g, dtype=torch.float64)).tolist()


def llama(rope: dict, max_pos: int = 16384, **extra) -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(**SHAPE, head_dim=64, max_position_embeddings=max_pos,
                                    rope_parameters=dict(rope), **extra)  # fmt: skip


def phi3(rope: dict, partial: float = 1.0, **extra) -> transformers.PretrainedConfig:
    """head_dim 64 (hidden 256 / 4 heads), original length 4096, 131072 positions."""
    return transformers.Phi3Config(**SHAPE, max_position_embeddings=131072,
                                   original_max_position_embeddings=4096,
                                   partial_rotary_factor=partial, rope_parameters=dict(rope),
                                   **extra)  # fmt: skip


YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
        "original_max_position_embeddings": 4096}  # fmt: skip
CONFIGS = {
    "default": lambda: llama({"rope_type": "default", "rope_theta": 50000.0}),
    "linear": lambda: llama({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5}),
    "llama3": lambda: llama({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 2048}, max_pos=131072),
    "yarn": lambda: llama(YARN),
    "yarn_mscale": lambda: llama({**YARN, "factor": 16.0, "mscale": 1.0, "mscale_all_dim": 0.8}),
    "yarn_attention_factor_betas": lambda: llama({**YARN, "attention_factor": 1.25,
                                                  "beta_fast": 16, "beta_slow": 2}),
    "yarn_untruncated": lambda: llama({**YARN, "truncate": False}),
    "yarn_null_factor": lambda: llama({**YARN, "factor": None}, max_pos=32768),
    "yarn_partial": lambda: llama({**YARN, "partial_rotary_factor": 0.5}),
    "yarn_nested": lambda: transformers.Olmo3Config(
        **SHAPE, max_position_embeddings=65536, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
            "full_attention": {**YARN, "rope_theta": 5e5, "factor": 8.0, "truncate": False}}),
    # gpt-oss's own default: YaRN x32 over 4096 positions, untruncated, base 150000
    "yarn_gpt_oss": lambda: transformers.GptOssConfig(**SHAPE, head_dim=64,
                                                      max_position_embeddings=131072),
    "longrope": lambda: phi3({"rope_type": "longrope", "rope_theta": 10000.0,
                              "short_factor": factors(32, 0), "long_factor": factors(32, 1)}),
    "longrope_partial": lambda: phi3({"rope_type": "longrope", "rope_theta": 10000.0,
                                      "short_factor": factors(24, 2),
                                      "long_factor": factors(24, 3)}, partial=0.75),
    "longrope_given": lambda: phi3({"rope_type": "longrope", "rope_theta": 10000.0,
                                    "short_factor": factors(32, 4), "long_factor": factors(32, 5),
                                    "factor": 2.0, "attention_factor": 1.1}),
}  # fmt: skip


def reference(config: transformers.PretrainedConfig) -> tuple[torch.Tensor, float]:
    """transformers' own (inv_freq, attention_scaling) for `config`."""
    nested = "full_attention" in config.rope_parameters
    params = config.rope_parameters["full_attention"] if nested else config.rope_parameters
    kind = params["rope_type"]
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    layer = {"layer_type": "full_attention"} if nested else {}
    return ROPE_INIT_FUNCTIONS[kind](config, None, **layer)


def ours(config: transformers.PretrainedConfig) -> tuple[torch.Tensor, float, int]:
    """(inv_freq, attention factor, rotary dim) from the config as written to config.json."""
    raw = config.to_dict()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta, scaling = parse_rope(raw, raw["max_position_embeddings"])
    dim = rotary_dim_of(raw, head_dim)
    return inverse_frequencies(dim, theta, scaling), attention_factor(scaling), dim


@pytest.mark.parametrize("name", CONFIGS)
def test_frequencies_and_attention_factor_match_transformers(name: str) -> None:
    config = CONFIGS[name]()
    want_freq, want_factor = reference(config)
    got_freq, got_factor, dim = ours(config)
    assert got_freq.dtype == torch.float32 and got_freq.shape == want_freq.shape == (dim // 2,)
    assert torch.equal(got_freq, want_freq.float())  # bitwise, hence token-identical outputs
    assert got_factor == pytest.approx(want_factor, abs=1e-12, rel=0)


def test_the_cases_exercise_what_they_name() -> None:
    """Guards the table above: every scaled case changes the frequencies, and the attention
    factors differ from 1 where the kind has one."""
    plain = inverse_frequencies(64, 1e6, None)
    assert not torch.equal(ours(CONFIGS["yarn"]())[0], plain)
    factors_of = {name: ours(CONFIGS[name]())[1] for name in CONFIGS}
    assert factors_of["default"] == factors_of["linear"] == factors_of["llama3"] == 1.0
    assert len({factors_of[n] for n in ("yarn", "yarn_mscale", "yarn_attention_factor_betas",
                                        "longrope", "longrope_given")}) == 5  # fmt: skip
    assert ours(CONFIGS["yarn_partial"]())[2] == 32 and ours(CONFIGS["longrope_partial"]())[2] == 48


def table_config(config: transformers.PretrainedConfig, max_positions: int) -> SimpleNamespace:
    """The fields RotaryEmbedding reads, as ModelConfig would hold them."""
    theta, scaling = parse_rope(config.to_dict(), config.max_position_embeddings)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return SimpleNamespace(head_dim=head_dim, rope_theta=theta, rope_scaling=scaling,
                           max_model_len=max_positions, rotary_dim=None)  # fmt: skip


@pytest.mark.parametrize("name", ["yarn_mscale", "yarn_partial", "longrope_partial", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cos_sin_tables_match_transformers(name: str, dtype: torch.dtype) -> None:
    """cos/sin (attention factor included) for every position up to the longrope cap, where
    transformers still uses the short factors."""
    config = CONFIGS[name]()
    config._attn_implementation = "eager"
    kind = modeling_phi3.Phi3RotaryEmbedding if "longrope" in name else LlamaRotaryEmbedding
    ref = kind(config)
    raw = config.to_dict()
    _, scaling = parse_rope(raw, config.max_position_embeddings)
    positions = 4096 if scaling.max_len_cap is None else scaling.max_len_cap
    head_dim = table_config(config, positions).head_dim
    ours = RotaryEmbedding(table_config(config, positions), rotary_dim=rotary_dim_of(raw, head_dim))
    x = torch.zeros(1, dtype=dtype)
    want_cos, want_sin = ref(x, torch.arange(positions)[None])
    got_cos, got_sin = ours(torch.arange(positions), dtype)
    assert got_cos.shape == (positions, 1, want_cos.shape[-1])
    assert torch.equal(got_cos[:, 0], want_cos[0]) and torch.equal(got_sin[:, 0], want_sin[0])


def test_longrope_past_the_cap_is_what_transformers_switches() -> None:
    """One position past max_len_cap, transformers moves the whole batch to the long factors
    (the rule rope_config documents): our short-factor table then differs, hence the cap."""
    config = CONFIGS["longrope"]()
    _, scaling = parse_rope(config.to_dict(), config.max_position_embeddings)
    cap = scaling.max_len_cap
    assert cap == 4096
    ref = modeling_phi3.Phi3RotaryEmbedding(config)
    ours = RotaryEmbedding(table_config(config, cap + 1))
    want, _ = ref(torch.zeros(1), torch.arange(cap + 1)[None])
    got, _ = ours(torch.arange(cap + 1), torch.float32)
    assert not torch.equal(got[1:, 0], want[0, 1:])


@pytest.mark.parametrize("rotary_dim", [64, 48, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_matches_phi3(rotary_dim: int, dtype: torch.dtype) -> None:
    """Only the first rotary_dim dims turn, the rest pass through, as Phi-3 does it."""
    g = torch.Generator().manual_seed(rotary_dim)
    t, heads, kv_heads, head_dim = 7, 4, 2, 64
    q = torch.randn(t, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype)
    angles = torch.randn(t, rotary_dim // 2, generator=g) * 3
    cos, sin = (f(torch.cat((angles, angles), -1)).to(dtype) * 1.2 for f in (torch.cos, torch.sin))
    want_q, want_k = modeling_phi3.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )  # [1, H, T, D]
    got_q = apply_rotary(q, cos[:, None], sin[:, None])
    got_k = apply_rotary(k, cos[:, None], sin[:, None])
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))
    assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:])


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_full_rotary_runs_no_extra_ops() -> None:
    """rotary_dim == head_dim keeps the one-concatenation path (what ran before partial rotary
    existed); a partial one adds exactly the two slices and the final concatenation."""
    x, cos = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    with OpCounter() as full:
        apply_rotary(x, cos, cos)
    assert sorted(full.ops) == sorted(["slice.Tensor", "neg.default", "slice.Tensor",
                                       "cat.default", "mul.Tensor", "mul.Tensor",
                                       "add.Tensor"])  # fmt: skip
    half_cos = cos[..., :4]
    with OpCounter() as partial:
        apply_rotary(x, half_cos, half_cos)
    assert partial.ops.count("cat.default") == 2 and len(partial.ops) == len(full.ops) + 3


def test_rotary_dim_is_checked() -> None:
    cfg = SimpleNamespace(head_dim=64, rope_theta=1e4, rope_scaling=None, max_model_len=8,
                          rotary_dim=None)  # fmt: skip
    for bad in (0, 7, 66):
        with pytest.raises(ValueError, match="rotary_dim"):
            RotaryEmbedding(cfg, rotary_dim=bad)
    emb = RotaryEmbedding(cfg, rotary_dim=32, device="meta")
    assert emb.cos_table.shape == (8, 32)


def test_longrope_factors_must_cover_the_rotary_dim() -> None:
    config = CONFIGS["longrope"]()
    _, scaling = parse_rope(config.to_dict(), config.max_position_embeddings)
    with pytest.raises(ValueError, match="short_factor has 32 entries.*needs 24"):
        inverse_frequencies(48, 1e4, scaling)

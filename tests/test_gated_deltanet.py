"""Gated DeltaNet (model/gated_deltanet.py) against transformers' own Qwen3.5 / Qwen3-Next
linear-attention layers (their torch paths), weights copied from them, in float32."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from eaglebatch.model.deltanet_layout import split_ba, split_qkvz
from eaglebatch.model.deltanet_shape import DeltaNetShape
from eaglebatch.model.gated_deltanet import GatedDeltaNet

TOL = dict(atol=1e-5, rtol=1e-5)  # float32, against transformers (observed: below 1e-6)
# float64 (module and states), ours against ours: forms that must agree up to rounding alone
# (in float32 even transformers' own 37 + 63 token prefill differs from its 100-token one by
# ~5e-5 on these random weights: the gated norm amplifies the rounding of small heads)
EXACT = dict(atol=1e-10, rtol=1e-10)
HIDDEN = 48
SIZES = dict(hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
             num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             vocab_size=64, intermediate_size=64)  # fmt: skip
FAMILIES = ("qwen3_5_text", "qwen3_next")


def _randomize(module: torch.nn.Module) -> None:
    """Values away from transformers' init (ones, zeros) so every parameter matters."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.5 if "conv1d" in name or "dt_bias" in name else 0.2
            p.add_(torch.randn_like(p) * scale)


def _pair(family: str, seed: int = 0) -> tuple[torch.nn.Module, GatedDeltaNet, object]:
    """(transformers' layer 0, ours with its weights, the HF config)."""
    torch.manual_seed(seed)
    if family == "qwen3_5_text":
        cfg = Qwen3_5TextConfig(**SIZES)
        ref = Qwen3_5GatedDeltaNet(cfg, 0).eval()
    else:
        cfg = Qwen3NextConfig(**SIZES, num_experts=4, num_experts_per_tok=2)
        ref = Qwen3NextGatedDeltaNet(cfg, 0).eval()
    _randomize(ref)
    shape = DeltaNetShape.from_raw(cfg.to_dict())
    ours = GatedDeltaNet(shape).eval()
    state = dict(ref.state_dict())
    if family == "qwen3_next":  # the interleaved fused projections, split
        parts = {**split_qkvz(state.pop("in_proj_qkvz.weight"), shape),
                 **split_ba(state.pop("in_proj_ba.weight"), shape)}  # fmt: skip
        state.update({f"{name}.weight": w for name, w in parts.items()})
    ours.load_state_dict(state, strict=True)
    return ref, ours, cfg


def _ref_run(ref, cfg, xs: list[torch.Tensor]):
    """transformers' layer over consecutive calls sharing one cache: (outputs, conv state [C, K-1]
    (its cache keeps K inputs, the oldest unused), SSM state) after the last call."""
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        outs = [ref(x.unsqueeze(0), cache=cache)[0] for x in xs]
    conv = cache.get_conv_state(0)[0, :, 1:]
    return outs, conv, cache.get_recurrent_state(0)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_equals_transformers(family: str) -> None:
    ref, ours, cfg = _pair(family)
    x = torch.randn(150, HIDDEN)  # three chunks of 64, the last partial
    (want,), want_conv, want_ssm = _ref_run(ref, cfg, [x])
    conv0, ssm0 = ours.new_states(1)
    with torch.no_grad():
        out, conv, ssm = ours.prefill(x, conv0[0], ssm0[0])
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(conv, want_conv, **TOL)
    torch.testing.assert_close(ssm, want_ssm, **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_in_two_parts_equals_one(family: str) -> None:
    _, ours, _ = _pair(family, seed=1)
    ours.double()
    x = torch.randn(100, HIDDEN, dtype=torch.float64)
    conv0, ssm0 = (t.double() for t in ours.new_states(1))
    with torch.no_grad():
        whole, conv_w, ssm_w = ours.prefill(x, conv0[0], ssm0[0])
        first, conv_1, ssm_1 = ours.prefill(x[:37], conv0[0], ssm0[0])
        second, conv_2, ssm_2 = ours.prefill(x[37:], conv_1, ssm_1)
    torch.testing.assert_close(torch.cat((first, second)), whole, **EXACT)
    torch.testing.assert_close(conv_2, conv_w, **EXACT)
    torch.testing.assert_close(ssm_2, ssm_w, **EXACT)


@pytest.mark.parametrize("family", FAMILIES)
def test_step_after_prefill_equals_transformers_next_token(family: str) -> None:
    ref, ours, cfg = _pair(family, seed=2)
    prompt, nxt = torch.randn(70, HIDDEN), torch.randn(1, HIDDEN)
    (_, want), want_conv, want_ssm = _ref_run(ref, cfg, [prompt, nxt])
    conv0, ssm0 = ours.new_states(1)
    with torch.no_grad():
        _, conv, ssm = ours.prefill(prompt, conv0[0], ssm0[0])
        out, conv_after, ssm_after = ours.step(nxt, [1], conv[None], ssm[None])
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(conv_after[0], want_conv, **TOL)
    torch.testing.assert_close(ssm_after[0], want_ssm, **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_token_step_keeps_the_state_after_each_position(family: str) -> None:
    _, ours, _ = _pair(family, seed=3)
    conv, ssm = _random_states(ours.double(), 1)
    x = torch.randn(3, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        out, conv_after, ssm_after = ours.step(x, [3], conv, ssm)
        c, s = conv, ssm
        for t in range(3):
            o, c, s = ours.step(x[t:t + 1], [1], c, s)
            torch.testing.assert_close(out[t:t + 1], o, **EXACT)
            torch.testing.assert_close(conv_after[t:t + 1], c, **EXACT)
            torch.testing.assert_close(ssm_after[t:t + 1], s, **EXACT)
    assert not torch.equal(ssm_after[0], ssm_after[2])  # the positions' states differ


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_batched_equal_rows_alone(family: str) -> None:
    _, ours, _ = _pair(family, seed=4)
    lengths = [2, 1, 4, 3]
    conv, ssm = _random_states(ours.double(), len(lengths))
    x = torch.randn(sum(lengths), HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        out, conv_after, ssm_after = ours.step(x, lengths, conv, ssm)
        start = 0
        for row, n in enumerate(lengths):
            part = slice(start, start + n)
            o, c, s = ours.step(x[part], [n], conv[row:row + 1], ssm[row:row + 1])
            torch.testing.assert_close(out[part], o, **EXACT)
            torch.testing.assert_close(conv_after[part], c, **EXACT)
            torch.testing.assert_close(ssm_after[part], s, **EXACT)
            start += n


def test_step_from_a_prefilled_state_equals_prefill_of_the_whole() -> None:
    """A 3-token verify after a prefill equals prefilling prompt + those 3 tokens."""
    _, ours, _ = _pair("qwen3_5_text", seed=5)
    ours.double()
    x = torch.randn(90, HIDDEN, dtype=torch.float64)
    conv0, ssm0 = (t.double() for t in ours.new_states(1))
    with torch.no_grad():
        whole, conv_w, ssm_w = ours.prefill(x, conv0[0], ssm0[0])
        _, conv, ssm = ours.prefill(x[:87], conv0[0], ssm0[0])
        out, conv_after, ssm_after = ours.step(x[87:], [3], conv[None], ssm[None])
    torch.testing.assert_close(out, whole[87:], **EXACT)
    torch.testing.assert_close(conv_after[-1], conv_w, **EXACT)
    torch.testing.assert_close(ssm_after[-1], ssm_w, **EXACT)


def test_state_shapes_and_bytes() -> None:
    shape = DeltaNetShape.from_raw(Qwen3_5TextConfig(**SIZES).to_dict())
    assert shape.conv_state_shape == (2 * 2 * 8 + 4 * 12, 3)  # q, k, v channels; K - 1
    assert shape.ssm_state_shape == (4, 8, 12)
    assert shape.state_bytes == 4 * (80 * 3 + 4 * 8 * 12)
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        DeltaNetShape.from_raw({**SIZES, "linear_num_value_heads": 3})
    with pytest.raises(ValueError, match="hidden_act"):
        DeltaNetShape.from_raw({**SIZES, "hidden_act": "gelu"})


def _random_states(ours: GatedDeltaNet, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    conv, ssm = ours.new_states(rows)
    dt = ours.A_log.dtype
    return torch.randn_like(conv, dtype=dt), torch.randn_like(ssm, dtype=dt) * 0.3


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_activations_with_float32_states_equal_transformers(family: str) -> None:
    """bf16 weights and activations, float32 states (transformers keeps the SSM state in float32
    too): prefill then one decode step, the outputs equal to bf16 rounding (observed: equal)."""
    ref, ours, cfg = _pair(family, seed=6)
    ref.to(torch.bfloat16)
    ours.to(torch.bfloat16)
    prompt, nxt = (torch.randn(n, HIDDEN).to(torch.bfloat16) for n in (80, 1))
    (want_p, want_n), _, want_ssm = _ref_run(ref, cfg, [prompt, nxt])
    conv0, ssm0 = ours.new_states(1)  # float32
    with torch.no_grad():
        out_p, conv, ssm = ours.prefill(prompt, conv0[0], ssm0[0])
        out_n, _, ssm_after = ours.step(nxt, [1], conv[None], ssm[None])
    assert ssm_after.dtype == torch.float32
    torch.testing.assert_close(out_p, want_p)
    torch.testing.assert_close(out_n, want_n)
    torch.testing.assert_close(ssm_after[0], want_ssm, **TOL)

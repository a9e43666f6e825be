"""The extension's gated delta rule (cpu/deltanet.py) against the torch recurrence it replaces
(model/delta_rule.py), and the swap into a Gated DeltaNet layer."""

from __future__ import annotations

import pytest
import torch

from eaglebatch.cpu.deltanet import native_steps, use_native_deltanet
from eaglebatch.model.delta_rule import stepwise_delta_rule
from eaglebatch.model.deltanet_shape import DeltaNetShape
from eaglebatch.model.gated_deltanet import GatedDeltaNet


def _inputs(lengths, heads=3, dk=8, dv=5, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t, b = sum(lengths), len(lengths)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k = (torch.nn.functional.normalize(r(t, heads, dk), dim=-1) for _ in range(2))
    g = -torch.rand(t, heads, generator=gen, dtype=dtype)
    beta = torch.rand(t, heads, generator=gen, dtype=dtype)
    return q, k, r(t, heads, dv), g, beta, r(b, heads, dk, dv)


@pytest.mark.parametrize("lengths", [[1], [1, 1, 1, 1], [4, 1, 3], [6, 2]])
def test_native_steps_equal_the_torch_recurrence(lengths) -> None:
    args = _inputs(lengths)
    o, after = native_steps(*args[:5], lengths, args[5])
    want_o, want_after = stepwise_delta_rule(*args[:5], lengths, args[5])
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, want_after, rtol=1e-5, atol=1e-5)


def test_float64_and_non_contiguous_inputs_are_served() -> None:
    lengths = [2, 3]
    args = _inputs(lengths, dtype=torch.float64)
    o, after = native_steps(*args[:5], lengths, args[5])  # torch's: identical bits
    want = stepwise_delta_rule(*args[:5], lengths, args[5])
    assert torch.equal(o, want[0]) and torch.equal(after, want[1])
    q, k, v, g, beta, states = _inputs(lengths)
    q_wide = torch.cat([q, q], dim=-1)[..., : q.shape[-1]]  # a non-contiguous view
    o, _ = native_steps(q_wide, k, v, g, beta, lengths, states)
    torch.testing.assert_close(o, stepwise_delta_rule(q, k, v, g, beta, lengths, states)[0],
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_a_swapped_layer_steps_as_the_plain_one() -> None:
    shape = DeltaNetShape(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=8,
                          head_v_dim=8, conv_kernel=4, eps=1e-6)  # fmt: skip
    torch.manual_seed(0)
    layer = GatedDeltaNet(shape)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x, lengths = torch.randn(5, 32), [2, 1, 2]
    conv, ssm = (torch.randn(3, *s) for s in (shape.conv_state_shape, shape.ssm_state_shape))
    with torch.inference_mode():
        want = layer.step(x, lengths, conv, ssm)
        use_native_deltanet(layer, 1)
        assert type(layer).__name__ == "NativeGatedDeltaNet"
        got = layer.step(x, lengths, conv, ssm)
        use_native_deltanet(layer, 0)
        assert type(layer) is GatedDeltaNet
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

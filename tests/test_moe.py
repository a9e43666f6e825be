"""The routed MLP (model/moe.py): its graph-capture path (every expert, masked) equals the
grouped one, the shared expert joins behind its sigmoid gate, and the router variants (its
input normed and scaled, a scale per expert) score as defined."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from eaglebatch.model.moe import SparseMoeBlock, route


def _block(shared: int, renormalise: bool, weights_float32: bool,
           router_scales: bool = False) -> SparseMoeBlock:  # fmt: skip
    cfg = SimpleNamespace(hidden_size=16, num_experts=5, num_experts_per_tok=2,
                          moe_intermediate_size=8, norm_topk_prob=renormalise,
                          router_weights_float32=weights_float32,
                          shared_expert_intermediate_size=shared, rms_norm_eps=1e-6,
                          router_input_scale=router_scales,
                          router_expert_scale=router_scales)  # fmt: skip
    torch.manual_seed(0)
    block = SparseMoeBlock(cfg, F.silu)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def _reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: sum over its top-k experts (ascending) of weight * expert(x)."""
    probs = torch.softmax(block.gate(x).float(), dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        w, e = torch.topk(probs[t], block.top_k)
        w = w / w.sum() if block.renormalise else w
        for we, ee in sorted(zip(w.tolist(), e.tolist()), key=lambda p: p[1]):
            out[t] += we * block.experts[ee](x[t : t + 1])[0]
    if block.shared_expert is not None:
        out += torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out


@pytest.mark.parametrize("shared, renormalise, f32", [(0, True, True), (0, False, False),
                                                      (12, False, False)])  # fmt: skip
def test_grouped_and_masked_paths_equal_the_per_token_reference(shared, renormalise, f32):
    block = _block(shared, renormalise, f32)
    x = torch.randn(11, 16)
    with torch.no_grad():
        want = _reference(block, x)
        got = block(x)
        weights, experts = route(block.gate(x), 2, renormalise, f32)
        grouped, masked = block._grouped(x, weights, experts), block._dense(x, weights, experts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(masked, grouped, rtol=1e-6, atol=1e-7)


def _scaled_router_reference(block: SparseMoeBlock, x, router_in) -> torch.Tensor:
    """Per token: the router scores rms(r) * scale / sqrt(H) of its own input r, the top-k
    renormalised, each weight times its expert's scale; the experts run on x."""
    r = router_in / router_in.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    probs = torch.softmax(block.gate(r * block.router_scale / 4.0).float(), dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        w, e = torch.topk(probs[t], block.top_k)
        w = w / w.sum() * block.per_expert_scale[e]
        for we, ee in zip(w.tolist(), e.tolist()):
            out[t] += we * block.experts[ee](x[t : t + 1])[0]
    return out


def test_scaled_router_scores_its_own_input_and_scales_each_expert():
    block = _block(0, True, True, router_scales=True)
    x, router_in = torch.randn(9, 16), 3.0 * torch.randn(9, 16)
    with torch.no_grad():
        want = _scaled_router_reference(block, x, router_in)
        got = block(x, router_input=router_in)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(block(x, router_input=x), got)  # the router input counts

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



def _gemma4_pair(block: SparseMoeBlock):
    """transformers' Gemma 4 router and experts holding `block`'s weights."""
    import transformers
    from transformers.models.gemma4 import modeling_gemma4 as g4

    cfg = transformers.Gemma4TextConfig(hidden_size=16, num_experts=5, top_k_experts=2,
                                        moe_intermediate_size=8, enable_moe_block=True,
                                        rms_norm_eps=1e-6, num_hidden_layers=1,
                                        hidden_activation="silu")  # fmt: skip (as _block)
    router, experts = g4.Gemma4TextRouter(cfg), g4.Gemma4TextExperts(cfg)
    with torch.no_grad():
        router.proj.weight.copy_(block.gate.weight)
        router.scale.copy_(block.router_scale)
        router.per_expert_scale.copy_(block.per_expert_scale)
        for e, ex in enumerate(block.experts):
            experts.gate_up_proj[e].copy_(torch.cat([ex.gate_proj.weight, ex.up_proj.weight]))
            experts.down_proj[e].copy_(ex.down_proj.weight)
    return router, experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_router_equals_gemma4s_router_and_experts(dtype):
    """router_input_scale + router_expert_scale (Gemma 4): the router scores its own input
    (the residual) normed and scaled, each weight times its expert's scale, in the reference's
    dtypes and order (its weights bit for bit)."""
    block = _block(0, True, True, router_scales=True)
    router, experts = _gemma4_pair(block)
    block, router, experts = block.to(dtype), router.to(dtype), experts.to(dtype)
    x, residual = torch.randn(13, 16).to(dtype), (3 * torch.randn(13, 16)).to(dtype)
    with torch.no_grad():
        _, weights, index = router(residual)
        got_weights, got_index = route(block._logits(residual), 2, True, True,
                                       block.per_expert_scale)  # fmt: skip
        assert torch.equal(got_index, index) and torch.equal(got_weights, weights)
        want = experts(x, index, weights)
        got = block(x, router_input=residual)
        tol = {} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-7}
        torch.testing.assert_close(got, want, **tol)  # GEMMs of other rows: not bit for bit
        masked = block._dense(x, got_weights, got_index)  # the path CUDA graphs capture
        torch.testing.assert_close(masked, block._grouped(x, got_weights, got_index), **tol)
        assert not torch.allclose(block(x), want)  # the router input counts

"""The routed MLP (model/moe.py): its graph-capture path (every expert, masked) equals the
grouped one, the shared expert joins behind its sigmoid gate, and the router variants (its
input normed and scaled, a scale per expert) score as defined; the grouped GEMMs over stacked
expert weights (model/moe_grouped.py, CUDA's path, forced onto the CPU here) equal the
per-expert loop bit for bit, hold no second copy of the weights, and replay in CUDA graphs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eaglebatch.model import moe_grouped
from eaglebatch.model.moe import Expert, SparseMoeBlock, route

# ModelConfig's MoE features at their defaults
DEFAULTS = dict(router_scoring="softmax", router_bias=False, expert_bias=False,
                expert_activation="gated", swiglu_alpha=1.702, swiglu_limit=7.0,
                router_input_scale=False, router_expert_scale=False)  # fmt: skip


def _block(shared: int, renormalise: bool, weights_float32: bool, **features) -> SparseMoeBlock:
    cfg = SimpleNamespace(hidden_size=16, num_experts=5, num_experts_per_tok=2,
                          moe_intermediate_size=8, norm_topk_prob=renormalise,
                          router_weights_float32=weights_float32,
                          shared_expert_intermediate_size=shared, rms_norm_eps=1e-6,
                          **{**DEFAULTS, **features})  # fmt: skip
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
    block = _block(0, True, True, router_input_scale=True, router_expert_scale=True)
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
def _gpt_oss_reference(block: SparseMoeBlock, x: torch.Tensor, alpha: float, limit: float):
    """transformers' gpt-oss MLP per token: top-k logits of the biased router, softmax over
    them; each expert gate/up with biases, clamped, (up + 1) * gate * sigmoid(alpha * gate),
    down with its bias."""
    logits = block.gate(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        values, experts = torch.topk(logits[t], block.top_k)
        weights = torch.softmax(values, dim=-1)
        for w, e in sorted(zip(weights.tolist(), experts.tolist()), key=lambda p: p[1]):
            ex = block.experts[e]
            gate = (x[t] @ ex.gate_proj.weight.T + ex.gate_proj.bias).clamp(max=limit)
            up = (x[t] @ ex.up_proj.weight.T + ex.up_proj.bias).clamp(-limit, limit)
            inner = (up + 1) * gate * torch.sigmoid(gate * alpha)
            out[t] += w * (inner @ ex.down_proj.weight.T + ex.down_proj.bias)
    return out


def test_biased_topk_softmax_router_and_clamped_swiglu_experts():
    """gpt-oss's routed MLP as features: the router's bias and top-k-then-softmax scoring,
    expert biases, the clamped SwiGLU (limit small enough that the clamps bite); the graph
    path equals the grouped one."""
    alpha, limit = 1.702, 0.6
    block = _block(0, False, False, router_scoring="topk_softmax", router_bias=True,
                   expert_bias=True, expert_activation="clamped_swiglu", swiglu_alpha=alpha,
                   swiglu_limit=limit)  # fmt: skip
    assert block.gate.bias is not None and block.experts[0].down_proj.bias is not None
    x = torch.randn(13, 16) * 3
    with torch.no_grad():
        gate_out = block.experts[0].gate_proj(x)
        assert (gate_out > limit).any() and (gate_out < -limit).any()
        want = _gpt_oss_reference(block, x, alpha, limit)
        got = block(x)
        weights, experts = route(block.gate(x), 2, False, False, scoring="topk_softmax")
        masked = block._dense(x, weights, experts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(masked, got, rtol=1e-6, atol=1e-6)


def test_topk_softmax_is_renormalised_softmax():
    """Softmax over the top k logits = the full softmax's top k renormalised (same experts)."""
    logits = torch.randn(7, 6)
    w, e = route(logits, 3, False, False, scoring="topk_softmax")
    w2, e2 = route(logits, 3, True, True, scoring="softmax")
    assert torch.equal(e, e2)
    torch.testing.assert_close(w, w2)


@pytest.mark.parametrize("key, value", [("router_scoring", "sigmoid"),
                                        ("expert_activation", "geglu_clamped")])  # fmt: skip
def test_unknown_router_scoring_or_expert_activation_is_refused_by_name(key, value):
    with pytest.raises(ValueError, match=key):
        _block(0, False, False, **{key: value})


def _gpt_oss_mlp():
    """transformers' gpt-oss MLP (router + fused experts), random, and our block for it."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    hf_cfg = transformers.GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=5,
                                       num_experts_per_tok=2, swiglu_limit=0.8)  # fmt: skip
    torch.manual_seed(1)
    mlp = GptOssMLP(hf_cfg).eval()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.5)
    cfg = SimpleNamespace(hidden_size=16, num_experts=5, num_experts_per_tok=2,
                          moe_intermediate_size=8, norm_topk_prob=False,
                          router_weights_float32=False, shared_expert_intermediate_size=0,
                          **{**DEFAULTS, "router_scoring": "topk_softmax", "router_bias": True,
                             "expert_bias": True, "expert_activation": "clamped_swiglu",
                             "swiglu_limit": 0.8})  # fmt: skip
    return mlp, cfg


def test_interleaved_expert_layout_loads_transformers_gpt_oss_experts():
    """gpt-oss's fused experts (gate_up_proj [E, H, 2I] with gate/up interleaved, its bias,
    down_proj [E, I, H] and bias, all x @ W) split per expert: our block on them equals
    transformers' GptOssMLP; the shapes alone split the same way."""
    from eaglebatch.model.expert_layout import expert_tensors

    mlp, cfg = _gpt_oss_mlp()
    block = SparseMoeBlock(cfg, F.silu)
    state = {}
    for name, t in mlp.state_dict().items():
        name = "mlp." + name.replace("router.", "gate.")
        parts = expert_tensors(name, t, cfg, "interleaved")
        shapes = expert_tensors(name, tuple(t.shape), cfg, "interleaved")
        if parts is None:
            state[name] = t
            continue
        parts, shapes = list(parts), list(shapes)
        assert [(n, tuple(p.shape)) for n, p in parts] == shapes
        state.update(parts)
    assert len(state) == 2 + 5 * 6
    block.load_state_dict({k.removeprefix("mlp."): v for k, v in state.items()})
    x = torch.randn(9, 16) * 2
    with torch.no_grad():
        want, _ = mlp(x[None])
        got = block(x)
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)


def test_expert_tensor_of_the_wrong_shape_is_refused_by_name():
    from eaglebatch.model.expert_layout import expert_tensors

    _, cfg = _gpt_oss_mlp()
    name = "model.layers.0.mlp.experts.gate_up_proj"
    with pytest.raises(ValueError, match="experts.gate_up_proj.*the model expects"):
        expert_tensors(name, (5, 16, 17), cfg, "interleaved")
    with pytest.raises(ValueError, match="gate_up_proj_bias"):
        expert_tensors(name + "_bias", (5, 15), cfg, "interleaved")
    assert expert_tensors(name + "_bias", (5, 16), cfg, "stacked") is None  # not that layout's


# -- the grouped-GEMM path (model/moe_grouped.py) ------------------------------------------


def _cfg(experts: int, top_k: int, shared: int = 0, f32: bool = False, **features):
    """hidden 64, experts' inner 32: rows of 16-byte multiples in every float dtype."""
    return SimpleNamespace(hidden_size=64, num_experts=experts, num_experts_per_tok=top_k,
                           moe_intermediate_size=32, norm_topk_prob=True,
                           router_weights_float32=f32, shared_expert_intermediate_size=shared,
                           rms_norm_eps=1e-6, **{**DEFAULTS, **features})  # fmt: skip


def _stacked_block(monkeypatch, num_experts: int, top_k: int, shared: int = 0,
                   f32: bool = False, **features) -> SparseMoeBlock:  # fmt: skip
    """A block of `num_experts` experts stacked on the CPU (ON_CPU), built as from_pretrained
    builds it."""
    monkeypatch.setattr(moe_grouped, "ON_CPU", True)
    cfg = _cfg(num_experts, top_k, shared, f32, **features)
    torch.manual_seed(1)
    with torch.device("meta"):  # as from_pretrained builds it, then to_empty stacks
        block = SparseMoeBlock(cfg, F.silu)
    block.to_empty(device="cpu")
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    assert block._stacked is not None
    return block


def _paths(block: SparseMoeBlock, x: torch.Tensor):
    """(the per-expert loop, the grouped GEMMs) on the same routing of `x`."""
    with torch.no_grad():
        weights, experts = route(block.gate(x), block.top_k, block.renormalise,
                                 block.weights_float32, scoring=block.scoring)  # fmt: skip
        grouped = moe_grouped.grouped_experts(x, weights, experts, block._stacked,
                                              block.experts[0].glu)  # fmt: skip
        return block._grouped(x, weights, experts), grouped, experts


@pytest.mark.parametrize("top_k", [1, 2, 4])  # 4: the order of a token's sum shows
@pytest.mark.parametrize("tokens", [1, 2, 5, 33])
@pytest.mark.parametrize("f32", [False, True])
def test_grouped_gemms_equal_the_per_expert_loop_bit_for_bit(monkeypatch, top_k, tokens, f32):
    """float32 on the CPU: the same rows per expert in the same order and the same sums in
    expert order, so the same bits (torch's CPU grouped matmul runs one mm per group, as
    nn.Linear does); few tokens over 8 experts leave experts unused. (Two slots add in either
    order to the same bits: k = 4 checks the ascending expert order.)"""
    block = _stacked_block(monkeypatch, 8, top_k, f32=f32)
    x = torch.randn(tokens, 64)
    loop, grouped, experts = _paths(block, x)
    assert torch.equal(grouped, loop)
    if tokens * top_k < 8:
        assert experts.unique().numel() < 8  # some experts had no row


def test_grouped_gemms_run_the_experts_own_activation(monkeypatch):
    """The clamped SwiGLU (gpt-oss's activation, here without biases) between the grouped
    GEMMs, limit low enough that the clamps bite: the loop's bits."""
    block = _stacked_block(monkeypatch, 6, 3, expert_activation="clamped_swiglu",
                           swiglu_limit=0.5, router_scoring="topk_softmax")  # fmt: skip
    x = torch.randn(21, 64) * 3
    loop, grouped, _ = _paths(block, x)
    assert torch.equal(grouped, loop)
    with torch.no_grad():
        plain = block.experts[0].act(block.experts[0].gate_proj(x)) * block.experts[0].up_proj(x)
        assert not torch.allclose(block.experts[0].glu(block.experts[0].gate_proj(x),
                                                       block.experts[0].up_proj(x)), plain)


def test_block_runs_the_grouped_gemms_when_stacked(monkeypatch):
    """forward takes the grouped path (the loop is never called), shared expert included, and
    equals the per-token reference; two runs give the same bits."""
    block = _stacked_block(monkeypatch, 6, 2, shared=12)

    def no_loop(*_):
        raise AssertionError("the per-expert loop ran")

    monkeypatch.setattr(SparseMoeBlock, "_grouped", no_loop)
    x = torch.randn(9, 64)
    with torch.no_grad():
        first, second = block(x), block(x)
        torch.testing.assert_close(first, _reference(block, x), rtol=1e-5, atol=1e-5)
    assert torch.equal(first, second)


def test_expert_weights_are_views_of_the_stacks(monkeypatch):
    """No second copy: each expert's gate/up/down weight is a slice of the stacks, so loading
    by per-expert name (a copy into the parameter) fills them; a cast stacks again."""
    block = _stacked_block(monkeypatch, 4, 2)
    gate_up, down = block._stacked
    inner, size = 32, gate_up[0].numel() * gate_up.element_size()
    for e, ex in enumerate(block.experts):
        assert ex.gate_proj.weight.data_ptr() == gate_up.data_ptr() + e * size
        assert ex.up_proj.weight.data_ptr() == gate_up[e, inner:].data_ptr()
        assert ex.down_proj.weight.data_ptr() == down[e].data_ptr()
    params = dict(block.named_parameters())
    assert not any(p.data_ptr() == gate_up.data_ptr() for n, p in params.items()
                   if not n.startswith("experts.0."))  # fmt: skip
    with torch.no_grad():
        params["experts.2.up_proj.weight"].copy_(torch.full((32, 64), 7.0))
    assert torch.equal(gate_up[2, inner:], torch.full((32, 64), 7.0))
    block.to(torch.float64)  # not a grouped-matmul dtype: views dropped, weights kept
    assert block._stacked is None
    assert torch.equal(block.experts[2].up_proj.weight, torch.full((32, 64), 7.0).double())
    block.to(torch.bfloat16)
    assert block._stacked[0].dtype == torch.bfloat16
    assert block.experts[3].down_proj.weight.data_ptr() == block._stacked[1][3].data_ptr()


def test_which_experts_are_stacked(monkeypatch):
    """Not on the CPU (outside tests), not with a bias, a swapped-in linear class (native or
    GGUF weights) or rows off 16 bytes: those keep the per-expert loop."""
    block = _stacked_block(monkeypatch, 4, 2)
    assert moe_grouped.stackable(block.experts)
    monkeypatch.setattr(moe_grouped, "ON_CPU", False)
    assert not moe_grouped.stackable(block.experts)
    monkeypatch.setattr(moe_grouped, "ON_CPU", True)
    block.experts[1].up_proj = torch.nn.Linear(64, 32, bias=True)
    assert not moe_grouped.stackable(block.experts)
    block.experts[1].up_proj = type("Swapped", (torch.nn.Linear,), {})(64, 32, bias=False)
    assert not moe_grouped.stackable(block.experts)
    biased = SparseMoeBlock(_cfg(4, 2, expert_bias=True), F.silu)  # gpt-oss's experts
    assert biased._stacked is None and not moe_grouped.stackable(biased.experts)
    odd = _block(0, True, False)  # hidden 16, inner 8 in float32: 32 bytes, fits
    assert moe_grouped.stackable(odd.experts)
    odd.experts[0].gate_proj = torch.nn.Linear(16, 6, bias=False)  # 24-byte rows
    assert not moe_grouped.stackable(odd.experts)


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@_CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_gemms_on_cuda_equal_the_per_expert_loop(dtype):
    torch.manual_seed(2)
    block = SparseMoeBlock(_cfg(8, 2), F.silu).to("cuda", dtype)
    assert block._stacked is not None
    x = torch.randn(37, 64, device="cuda", dtype=dtype)
    loop, grouped, _ = _paths(block, x)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped, loop, **tol)


@_CUDA
def test_block_replays_in_a_cuda_graph_as_run_eagerly():
    """Captured at two batch sizes: the replay equals the eager forward (the grouped GEMMs
    where torch's kernel needs no sync, the dense masked path elsewhere)."""
    torch.manual_seed(3)
    block = SparseMoeBlock(_cfg(8, 2), F.silu).to("cuda", torch.bfloat16)
    for tokens in (3, 16):
        static = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                block(static)  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = block(static)
            fresh = torch.randn_like(static)
            static.copy_(fresh)
            graph.replay()
            eager = block(fresh)
        if moe_grouped.fits_capture(fresh):
            assert torch.equal(captured, eager)
        else:
            torch.testing.assert_close(captured, eager, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("bias", [False, True])
def test_experts_built_on_meta_skip_init_and_match_a_cpu_build(bias, monkeypatch):
    """Expert linears built on the meta device (the loaders' build) skip the random init (a
    Python decomposition per call on meta: seconds for a 128-expert, 48-layer model) and are
    plain nn.Linear with the parameters, shapes and names of a CPU build."""
    inits = []
    real = nn.init.kaiming_uniform_
    monkeypatch.setattr(nn.init, "kaiming_uniform_",
                        lambda *a, **k: inits.append(1) or real(*a, **k))  # fmt: skip
    with torch.device("meta"):
        meta = Expert(64, 32, F.silu, bias=bias)
    assert inits == []
    cpu = Expert(64, 32, F.silu, bias=bias)
    assert len(inits) == 3  # a CPU build keeps nn.Linear's init
    assert all(type(p) is nn.Linear for p in (meta.gate_proj, meta.up_proj, meta.down_proj))
    shapes = {n: (p.shape, p.requires_grad) for n, p in cpu.named_parameters()}
    assert {n: (p.shape, p.requires_grad) for n, p in meta.named_parameters()} == shapes
    assert all(p.is_meta for p in meta.parameters())


def test_routing_counts_are_tokens_per_active_expert_of_generation_steps():
    """moe_counts: a layer step's (token, expert) pairs over its distinct experts, summed over
    decode and verify steps only (a prefill's are dropped when its step closes)."""
    from eaglebatch.model.moe import expert_rows
    from eaglebatch.model.moe_counts import RoutingCounts, count_routing

    counts = RoutingCounts()

    def add(experts):
        counts.add(expert_rows(torch.tensor(experts), 8))

    add([[0, 1], [2, 3], [0, 4]])  # a prefill: 6 pairs, 5 experts
    counts.close_step("prefill")
    assert counts.rows_per_active is None
    add([[0, 1], [1, 0]])  # decode, layer 0: 4 pairs on 2 experts
    add([[2, 3], [3, 4]])  # layer 1: 4 pairs on 3 experts
    counts.close_step("decode")
    add([[5, 6]])  # a chunked-prefill step carrying decode rows
    counts.close_step("mixed")
    assert (counts.pairs, counts.active) == (8, 5) and counts.rows_per_active == 8 / 5
    block = _block(0, True, False)
    assert count_routing(nn.Sequential(block)) is block.routing_counts is not None
    block(torch.randn(3, 16))
    block.routing_counts.close_step("verify")
    assert block.routing_counts.pairs == 6
    assert count_routing(nn.Linear(2, 2)) is None

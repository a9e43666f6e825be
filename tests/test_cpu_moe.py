"""The native routed MLP (cpu/moe.py, rust/src/cpu/moe.rs) against the plain grouped path of
model/moe.py: float32, bf16-copy and GGUF block experts, int8 activations, a row alone and
among others, the steps that keep the plain path, and the checks of the native call."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eaglebatch import _native
from eaglebatch.cpu import accelerate
from eaglebatch.cpu.gemm import SMALL_GEMM_AVAILABLE, SMALL_GEMM_MAX_ROWS, use_small_gemm
from eaglebatch.cpu.moe import use_native_moe
from eaglebatch.cpu.quantized import QuantizedWeight, use_quantized_weights
from eaglebatch.model.decoder_layer import _ACTIVATIONS
from eaglebatch.model.moe import SparseMoeBlock
from test_moe import DEFAULTS

pytestmark = pytest.mark.skipif(not SMALL_GEMM_AVAILABLE, reason="CPU without the kernels")
HIDDEN, INNER = 64, 32


def _block(experts=6, top_k=2, shared=0, act="silu", seed=0, **features) -> SparseMoeBlock:
    cfg = SimpleNamespace(hidden_size=HIDDEN, num_experts=experts, num_experts_per_tok=top_k,
                          moe_intermediate_size=INNER, norm_topk_prob=True,
                          router_weights_float32=False, shared_expert_intermediate_size=shared,
                          rms_norm_eps=1e-6, **{**DEFAULTS, **features})  # fmt: skip
    torch.manual_seed(seed)
    block = SparseMoeBlock(cfg, _ACTIVATIONS[act])
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block.requires_grad_(False)


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """Counts the native calls."""
    seen: list[int] = []
    real = _native.moe_experts

    def spy(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_native, "moe_experts", spy)
    return seen


def _both(block: SparseMoeBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(native, plain grouped path on the same GEMM kernel) outputs of the block."""
    with torch.inference_mode():
        use_native_moe(block, 2)
        native = block(x)
        use_native_moe(block, 0)
        plain = block(x)
    return native, plain


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_float32_experts_equal_the_grouped_path(act, calls):
    block = _block(shared=12, act=act)
    x = torch.randn(9, HIDDEN)
    with torch.inference_mode():
        torch_path = block(x)  # plain torch: F.linear everywhere
    use_small_gemm(block, 2)
    native, plain = _both(block, x)
    assert len(calls) == 1
    torch.testing.assert_close(native, plain, rtol=1e-5, atol=1e-6)  # the activation's rounding
    torch.testing.assert_close(native, torch_path, rtol=1e-5, atol=1e-5)


def test_gpt_oss_experts_run_natively_with_their_biases_and_clamped_swiglu(calls):
    """expert_activation clamped_swiglu (gpt-oss) with expert and router biases: the block's
    experts name the kernel's activation, and the native call equals the plain path."""
    block = _block(act="silu", router_scoring="topk_softmax", router_bias=True,
                   expert_bias=True, expert_activation="clamped_swiglu", swiglu_limit=0.5)
    assert block.experts[0].native_activation == ("clamped_swiglu", 1.702, 0.5)
    x = torch.randn(7, HIDDEN)
    use_small_gemm(block, 2)
    native, plain = _both(block, x)
    assert len(calls) == 1
    torch.testing.assert_close(native, plain, rtol=1e-5, atol=1e-6)


def test_accelerate_swaps_it_in_and_bf16_copies_give_the_same_result(calls):
    block = _block()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # exact bf16 values
    x = torch.randn(5, HIDDEN)
    accelerate(block, 2)
    assert type(block).__name__ == "NativeSparseMoeBlock"
    with torch.inference_mode():
        f32 = block(x)
    accelerate(block, 2, bf16_weights=True)
    with torch.inference_mode():
        bf16 = block(x)
    assert len(calls) == 2 and torch.equal(f32, bf16)


def _quantize(block: SparseMoeBlock, ggml_type: int, int8: bool) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    weights = {}
    for name, p in block.named_parameters():
        if name.startswith("experts."):
            blocks = quantize(p.detach().numpy(), GGMLQuantizationType(ggml_type))
            weights[name] = QuantizedWeight(torch.from_numpy(blocks), ggml_type, tuple(p.shape))
    use_quantized_weights(block, weights, threads=2, int8=int8)


@pytest.mark.parametrize("ggml_type, int8", [(2, False), (8, True), (39, False), (39, True)])
def test_gguf_block_experts_equal_the_grouped_path(ggml_type, int8, calls):
    block = _block()
    use_small_gemm(block, 2)
    _quantize(block, ggml_type, int8)
    x = torch.randn(7, HIDDEN)
    native, plain = _both(block, x)
    assert len(calls) == 1
    # float: the same products, the activation's rounding; int8: that rounding may move an
    # activation across an 8-bit step
    tol = 2e-2 if int8 else 1e-5
    torch.testing.assert_close(native, plain, rtol=tol, atol=tol)


@pytest.mark.parametrize("ggml_type, int8", [(0, False), (2, False), (2, True)])
def test_a_row_gives_the_same_bits_alone_and_among_others(ggml_type, int8):
    block = _block(experts=8, top_k=3)
    use_small_gemm(block, 2)
    if ggml_type:
        _quantize(block, ggml_type, int8)
    use_native_moe(block, 2)
    x = torch.randn(20, HIDDEN)
    with torch.inference_mode():
        together = block(x)
        for i in (0, 7, 19):
            alone = block(x[i : i + 1])
            assert torch.equal(alone[0].view(torch.int32), together[i].view(torch.int32)), i


def test_steps_the_kernel_does_not_take_keep_the_plain_path(calls):
    block = _block(experts=2, top_k=2)  # every token on both experts
    use_small_gemm(block, 2)
    use_native_moe(block, 2)
    with torch.inference_mode():
        block(torch.randn(SMALL_GEMM_MAX_ROWS + 1, HIDDEN))  # prefill: too many rows per expert
        assert calls == []
        block(torch.randn(SMALL_GEMM_MAX_ROWS, HIDDEN))
        assert calls == [1]
    block.requires_grad_(True)
    block(torch.randn(3, HIDDEN)).sum().backward()  # a gradient: torch's path
    assert calls == [1] and block.experts[0].up_proj.weight.grad is not None
    erf = _block(act="gelu")  # an activation the kernel lacks
    use_native_moe(erf, 2)
    with torch.inference_mode():
        erf(torch.randn(3, HIDDEN))
    assert calls == [1] and erf.native_experts is False


def _call(**change):
    """The native call on a 2-expert float32 layer with `change`d arguments."""
    w = [torch.randn(INNER, HIDDEN), torch.randn(INNER, HIDDEN), torch.randn(HIDDEN, INNER)]
    x, out = torch.randn(3, HIDDEN), torch.empty(3, HIDDEN)
    args = dict(
        x=x.data_ptr(), out=out.data_ptr(), hidden=HIDDEN, inner=INNER,
        experts=np.array([[0, 1], [1, 0], [0, 1]], dtype=np.int64),
        weights=np.full((3, 2), 0.5, dtype=np.float32),
        matrices=np.array([[t.data_ptr() for t in w]] * 2, dtype=np.uint64),
        types=np.zeros((2, 3), dtype=np.uint32), biases=np.zeros((2, 3), dtype=np.uint64),
    )  # fmt: skip
    args.update(change)
    _native.moe_experts(**args)
    return out


def test_bad_calls_are_value_errors():
    assert torch.isfinite(_call()).all()
    bad = [
        dict(experts=np.array([[0, 2], [1, 0], [0, 1]], dtype=np.int64)),  # no expert 2
        dict(experts=np.array([[0, -1], [1, 0], [0, 1]], dtype=np.int64)),
        dict(weights=np.full((3, 1), 0.5, dtype=np.float32)),
        dict(types=np.full((2, 3), 13, dtype=np.uint32)),  # Q5_K: not read
        dict(types=np.full((2, 3), 12, dtype=np.uint32)),  # Q4_K: 256-element blocks > HIDDEN
        dict(matrices=np.zeros((2, 3), dtype=np.uint64)),
        dict(biases=np.zeros((3, 3), dtype=np.uint64)),
        dict(x=0),
        dict(activation="gelu"),
    ]
    for change in bad:
        with pytest.raises(ValueError):
            _call(**change)

"""cpu/gemm.py: the native few-row GEMM against F.linear, and when it is (not) used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn import Linear

from eaglebatch.cpu import gemm as linear_mod
from eaglebatch.cpu.gemm import SMALL_GEMM_MAX_ROWS, linear, use_small_gemm
from eaglebatch.errors import JobError
from eaglebatch.job.engine_settings import resolve_small_gemm

native = pytest.mark.skipif(
    not linear_mod.SMALL_GEMM_AVAILABLE, reason="the CPU has neither AVX-512F nor AVX2+FMA"
)


def _no_f_linear(monkeypatch):
    """Makes any F.linear call fail, so a passing call proves the native kernel ran."""

    def boom(*args, **kwargs):
        raise AssertionError("F.linear called")

    monkeypatch.setattr(linear_mod.F, "linear", boom)


@native
@pytest.mark.parametrize("k", [576, 37, 3])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_matches_f_linear(monkeypatch, k, threads):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(131, k, generator=g)  # odd n: a last block of one weight row
    bias = torch.randn(131, generator=g)
    xs = {m: torch.randn(m, k, generator=g) for m in range(1, SMALL_GEMM_MAX_ROWS + 1)}
    want = {m: F.linear(x.double(), w.double(), bias.double()) for m, x in xs.items()}
    _no_f_linear(monkeypatch)
    for m, x in xs.items():
        got = linear(x, w, bias, threads=threads)
        assert got.shape == (m, 131) and got.dtype == torch.float32
        # outputs are O(sqrt(k)): float32 sums of k products carry ~1e-6 sqrt(k) of rounding
        torch.testing.assert_close(got.double(), want[m], rtol=1e-5, atol=5e-5)


@native
def test_a_row_is_bitwise_the_same_whatever_shares_the_call():
    """A K = 3 verify step (4 rows) must compute each row exactly as a 1-row decode step."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 576, generator=g)
    x = torch.randn(SMALL_GEMM_MAX_ROWS, 576, generator=g)
    for threads in (1, 2):
        together = linear(x, w, threads=threads)
        for i in range(len(x)):
            assert torch.equal(linear(x[i : i + 1], w, threads=2), together[i : i + 1]), i
        # a non-contiguous input (a column slice) takes the same path after a copy
        wide = torch.cat([x, x], dim=1)[:, :576]
        assert torch.equal(linear(wide, w, threads=threads), together)


def test_falls_back_to_f_linear_where_the_kernel_does_not_apply():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 32, generator=g)
    cases = [
        torch.randn(SMALL_GEMM_MAX_ROWS + 1, 32, generator=g),  # too many rows
        torch.randn(2, 32, generator=g).bfloat16(),  # not float32
        torch.randn(2, 3, 32, generator=g),  # not 2-d
    ]
    for x in cases:
        ww = w.to(x.dtype)
        assert torch.equal(linear(x, ww, threads=2), F.linear(x, ww))
    x = torch.randn(2, 32, generator=g)
    assert torch.equal(linear(x, w, threads=0), F.linear(x, w))  # switched off
    # autograd needs F.linear: gradients flow
    wg = w.clone().requires_grad_(True)
    linear(x, wg, threads=2).sum().backward()
    torch.testing.assert_close(wg.grad, x.sum(0).expand(64, 32))


@native
def test_use_small_gemm_switches_every_linear_of_a_module(monkeypatch):
    net = torch.nn.Sequential(Linear(8, 16), torch.nn.ReLU(), Linear(16, 4))
    assert use_small_gemm(net, 2)
    assert [m.small_gemm_threads for m in net if isinstance(m, Linear)] == [2, 2]
    x = torch.randn(3, 8)
    want = torch.nn.functional.linear(
        torch.relu(F.linear(x, net[0].weight, net[0].bias)), net[2].weight, net[2].bias
    )
    with torch.inference_mode():
        _no_f_linear(monkeypatch)
        got = net(x)
    torch.testing.assert_close(got, want)
    monkeypatch.undo()
    assert not use_small_gemm(net, 0)
    assert all(getattr(m, "small_gemm_threads", 0) == 0 for m in net.modules())


def test_engine_cpu_gemm_setting():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_small_gemm("torch", cpu, torch.float32) == 0
    assert resolve_small_gemm("auto", cpu, torch.bfloat16) == 0
    assert resolve_small_gemm("auto", cuda, torch.bfloat16) == 0
    with pytest.raises(JobError, match="engine.cpu_gemm"):
        resolve_small_gemm("native", cuda, torch.float32)
    with pytest.raises(JobError, match="engine.cpu_gemm"):
        resolve_small_gemm("native", cpu, torch.bfloat16)
    auto = resolve_small_gemm("auto", cpu, torch.float32)
    assert auto == (torch.get_num_threads() if linear_mod.SMALL_GEMM_AVAILABLE else 0)


@native
@pytest.mark.parametrize("k", [576, 37])
def test_bf16_weights_give_the_float32_bits(monkeypatch, k):
    """A weight holding bf16 values read from its exact bf16 copy: the same bits, any m."""
    g = torch.Generator().manual_seed(k)
    w = torch.randn(131, k, generator=g).bfloat16().float()  # bf16 values in float32
    bias = torch.randn(131, generator=g)
    w16 = linear_mod.exact_bf16(w)
    assert w16 is not None and w16.dtype == torch.bfloat16
    real, narrow = linear_mod._native.small_gemm, []

    def spy(*args):
        narrow.append(args[-1])  # the weight_type (GGML number)
        return real(*args)

    for m in (1, 4, SMALL_GEMM_MAX_ROWS):
        x = torch.randn(m, k, generator=g)
        want = linear(x, w, bias, threads=2)
        monkeypatch.setattr(linear_mod._native, "small_gemm", spy)
        got = linear(x, w, bias, threads=2, weight_bf16=w16)
        monkeypatch.undo()
        assert narrow.pop() == linear_mod.GGML_BF16  # the kernel read the bf16 copy
        assert torch.equal(got, want)


def test_exact_bf16_refuses_weights_that_are_not_bf16_values():
    w = torch.randn(8, 8).bfloat16().float()
    assert linear_mod.exact_bf16(w) is not None
    w[3, 3] += 1e-4  # one value off the bf16 grid
    assert linear_mod.exact_bf16(w) is None
    assert linear_mod.exact_bf16(w.bfloat16()) is None  # only float32 weights get a copy


@native
def test_use_small_gemm_keeps_bf16_copies_only_where_exact():
    net = torch.nn.Sequential(Linear(8, 16), Linear(16, 4))
    with torch.no_grad():
        net[0].weight.copy_(net[0].weight.bfloat16().float())
    use_small_gemm(net, 2, bf16_weights=True)
    assert net[0].weight_bf16 is not None and net[1].weight_bf16 is None
    x = torch.randn(3, 8)
    with torch.inference_mode():
        got = net(x)
    use_small_gemm(net, 2)  # without the flag: copies dropped
    assert net[0].weight_bf16 is None
    with torch.inference_mode():
        assert torch.equal(net(x), got)
    use_small_gemm(net, 0, bf16_weights=True)  # off: no copies either
    assert getattr(net[0], "weight_bf16", None) is None

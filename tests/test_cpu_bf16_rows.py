"""The native bfloat16 RMSNorm and RoPE (cpu/bf16_rows.py) against transformers' formulas
computed by torch's own ops, and a bfloat16 model with them swapped in against the same model
without them and against the float32 model (test_llama's transformers checkpoints)."""

from __future__ import annotations

import pytest
import torch

from eaglebatch.cpu.bf16_rows import Bf16Norm, Bf16Rotary, use_bf16_rows
from eaglebatch.model import CausalLM
from eaglebatch.model.decoder_layer import RMSNorm
from eaglebatch.model.rotary import apply_rotary

pytest.importorskip("eaglebatch._native")


def _hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm in x's dtype: normalised in float32, cast, then scaled."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps apart a and b are (same-sign finite values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("shape", [(7, 576), (33, 37), (5, 3, 64), (1, 16)])
def test_norm_matches_the_hf_formula(shape) -> None:
    torch.manual_seed(sum(shape))
    h = shape[-1]
    norm = RMSNorm(h, 1e-6, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(shape) * 3).to(torch.bfloat16)
    want = _hf_norm(x, norm.weight, 1e-6)
    use_bf16_rows(norm, 2)
    assert isinstance(norm, Bf16Norm)
    with torch.no_grad():
        got = norm(x)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    # the float32 mean may add in another order: a value then rounds one step apart, rarely
    assert _ulps(got, want).max() <= 1
    assert (got != want).float().mean() < 1e-3
    # rows are independent of the others and of how the threads split them
    with torch.no_grad():
        flat = x.reshape(-1, h)
        assert torch.equal(norm(flat[-1:])[0], got.reshape(-1, h)[-1])


def test_norm_outside_its_case_runs_torch() -> None:
    norm = RMSNorm(64, 1e-5, dtype=torch.bfloat16)
    use_bf16_rows(norm, 2)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    want = _hf_norm(x, norm.weight, 1e-5)
    # autograd on: torch's ops, and a gradient flows
    x.requires_grad_(True)
    out = norm(x)
    assert out.requires_grad and torch.equal(out, want.detach())
    with torch.no_grad():  # float32 and non-contiguous inputs: torch's forward
        x32 = torch.randn(4, 64)
        assert torch.equal(norm(x32), RMSNorm.forward(norm, x32))
        strided = torch.randn(64, 4, dtype=torch.bfloat16).t()
        assert torch.equal(norm(strided), RMSNorm.forward(norm, strided))
    use_bf16_rows(norm, 0)
    assert type(norm) is RMSNorm


def test_only_plain_norms_are_swapped() -> None:
    from types import SimpleNamespace

    from eaglebatch.model.decoder_layer import make_norm

    cast_last = make_norm(SimpleNamespace(norm_kind="rms_cast_last", rms_norm_eps=1e-5), 8)
    plain = RMSNorm(8, 1e-5)
    module = torch.nn.ModuleList([cast_last, plain])
    use_bf16_rows(module, 2)
    assert not isinstance(cast_last, Bf16Norm) and isinstance(plain, Bf16Norm)


@pytest.mark.parametrize(("tokens", "heads", "d"), [(2048, 9, 64), (5, 2, 8), (1, 4, 128)])
def test_rotary_gives_torchs_bits(tokens, heads, d) -> None:
    """q * cos + rotate_half(q) * sin, each op rounded to bfloat16, as torch computes it."""
    from types import SimpleNamespace

    torch.manual_seed(tokens + d)
    x = (torch.randn(tokens, heads, d) * 2).to(torch.bfloat16)
    angles = torch.randn(tokens, 1, d // 2).repeat(1, 1, 2) * 3
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    rope = SimpleNamespace(bf16_threads=2)
    with torch.no_grad():
        got = Bf16Rotary.rotate(rope, x, cos, sin)
    half = d // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    assert torch.equal(got, x * cos + rotated * sin)
    assert torch.equal(got, apply_rotary(x, cos, sin))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bfloat16_model_with_the_native_norm(tmp_path, family) -> None:
    """Prefill logits of a bfloat16 model: with the native norm as close to the float32 model
    as torch's bfloat16 norms are, and close to those."""
    from test_llama import PROMPTS, Runner, make_checkpoint

    make_checkpoint(family, tmp_path)
    ref = Runner(CausalLM.from_pretrained(tmp_path)).step(list(enumerate(PROMPTS)))
    model = CausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    plain = Runner(model).step(list(enumerate(PROMPTS)))
    use_bf16_rows(model, 2)
    swapped = sum(isinstance(m, Bf16Norm) for m in model.modules())
    assert swapped >= 2 * model.config.num_hidden_layers
    assert sum(isinstance(m, Bf16Rotary) for m in model.modules()) == model.config.num_hidden_layers
    native = Runner(model).step(list(enumerate(PROMPTS)))
    for r, p, n in zip(ref, plain, native, strict=True):
        torch_err = (p - r).abs().max().item()
        assert (n - r).abs().max().item() <= 1.5 * torch_err + 1e-2
        torch.testing.assert_close(n, p, atol=0.1, rtol=0.05)


def test_engine_settings_turn_it_on_for_bfloat16_cpu_runs(tmp_path, tiny_model_dir) -> None:
    from eaglebatch.job.config import load_job
    from eaglebatch.job.engine_settings import resolve_engine
    from eaglebatch.job.model_files import model_files
    from eaglebatch.model.config import ModelConfig

    def settings(*over: str):
        job_file = tmp_path / "j.yaml"
        job_file.write_text(f"model: {tiny_model_dir}\ninput:\n  path: x.parquet\n"
                            "output:\n  path: o\nengine:\n  device: cpu\n")  # fmt: skip
        job = load_job(job_file, list(over))
        mf = model_files(job.model)
        return resolve_engine(job, mf, ModelConfig.from_dir(mf.dir))

    assert settings("engine.dtype=bfloat16").bf16_rows
    assert not settings("engine.dtype=bfloat16", "engine.cpu_gemm=torch").bf16_rows
    assert not settings("engine.dtype=float32").bf16_rows

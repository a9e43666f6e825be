"""`engine.activations: int8` (rust/src/cpu/int8_gemm.rs, cpu/quantized.py): products with GGUF
blocks that quantize x to 8 bits, against their definition computed here in float64 from the
`gguf` package's dequantizer and numpy's own rounding; whole greedy runs of the embedded model
(speculative equals plain under int8, close to the float32 model); the job's checks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eaglebatch.cpu.gemm import SMALL_GEMM_AVAILABLE
from eaglebatch.cpu.quantized import BLOCK_TYPES, QuantizedWeight
from eaglebatch.errors import JobError
from eaglebatch.job import builtin
from eaglebatch.prepare import prepare
from test_quantized import _job, _outputs, _prompts, dequantized, random_blocks

pytest.importorskip("eaglebatch._native")
native = pytest.mark.skipif(not SMALL_GEMM_AVAILABLE, reason="CPU without AVX-512F / AVX2+FMA")
BLOCK_FORMATS = sorted(t for t, (_, elems, _) in BLOCK_TYPES.items() if elems > 1)


def quantize_rows(x: np.ndarray) -> np.ndarray:
    """x [m, k] as the int8 path sees it: per block of 32, d = max|v| / 127 and q =
    round-half-even(v / d), returned as d * q in float64."""
    m, k = x.shape
    v = x.reshape(m, k // 32, 32).astype(np.float32)
    d = np.abs(v).max(axis=2, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint(v * inv), -127, 127)  # numpy rounds half to even
    return (d.astype(np.float64) * q).reshape(m, k)


@native
@pytest.mark.parametrize("ggml_type", BLOCK_FORMATS)
def test_products_equal_their_definition_from_the_gguf_dequantizer(ggml_type):
    """1 row, a few, and 130 (past SMALL_GEMM_MAX_ROWS, as a prefill takes them)."""
    n, k = 24, 512
    blocks = random_blocks(ggml_type, n, k, seed=ggml_type)
    w = dequantized(blocks, ggml_type).double().numpy()
    qw = QuantizedWeight(torch.from_numpy(np.ascontiguousarray(blocks)), ggml_type, (n, k), True)
    assert qw.takes_int8
    rng = np.random.default_rng(1)
    for m in (1, 5, 130):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, 3] *= 40  # an outlier channel, as LLM activations have
        xhat = quantize_rows(x)
        want, size = xhat @ w.T, np.abs(xhat) @ np.abs(w).T
        got = qw.linear(torch.from_numpy(x), threads=2).double().numpy()
        assert np.all(np.abs(got - want) <= 1e-5 * size + 1e-30), (ggml_type, m)


@native
def test_a_row_gives_the_same_bits_alone_and_among_others():
    blocks = random_blocks(2, 40, 256, seed=3)
    qw = QuantizedWeight(torch.from_numpy(np.ascontiguousarray(blocks)), 2, (40, 256), True)
    x = torch.randn(131, 256)
    together = qw.linear(x, threads=2)
    for i in (0, 7, 127, 128, 130):
        alone = qw.linear(x[i : i + 1], threads=1)
        assert torch.equal(alone[0].view(torch.int32), together[i].view(torch.int32)), i


@native
def test_sixteen_bit_weights_stay_exact_under_int8():
    """int8 is for block formats: an F16 weight's product is still the float32 one."""
    blocks = random_blocks(1, 16, 64, seed=4)
    exact = QuantizedWeight(torch.from_numpy(blocks), 1, (16, 64))
    asked = QuantizedWeight(torch.from_numpy(blocks), 1, (16, 64), True)
    assert not asked.takes_int8
    x = torch.randn(3, 64)
    assert torch.equal(asked.linear(x, 1), exact.linear(x, 1))


@native
@pytest.mark.slow
def test_speculative_decoding_reproduces_plain_int8_decoding_close_to_float32(tmp_path):
    """16 prompts of the embedded model (Q4_1 blocks, Q8_0 embedding and head): the EAGLE head
    over the int8 model gives its plain greedy tokens exactly; against the float32 model the
    8-bit inputs change few tokens (most outputs agree on their first 8 tokens)."""
    prompts = _prompts(16)
    int8 = "  activations: int8\n"
    want = _outputs(tmp_path, builtin.BUILTIN_MODEL, prompts, "quantized", int8)
    (tmp_path / "spec").mkdir()
    head = f"{int8}draft: smollm2-135m-instruct-eagle\n"
    assert _outputs(tmp_path / "spec", builtin.BUILTIN_MODEL, prompts, "quantized", head) == want
    exact = _outputs(tmp_path, builtin.BUILTIN_MODEL, prompts, "dequantized")
    assert exact != want  # another function: 8-bit inputs
    same_start = sum(a[:8] == b[:8] for a, b in zip(exact, want))
    assert same_start >= 10, same_start


def test_int8_needs_a_gguf_model_read_as_blocks(tmp_path, tiny_model_dir):
    int8 = "  activations: int8\n"
    with pytest.raises(JobError, match="engine.activations: 'int8' needs a GGUF model .* holds "
                       "no GGUF file"):  # fmt: skip
        prepare(_job(tmp_path, str(tiny_model_dir), ["hi"], "auto", int8))
    with pytest.raises(JobError, match="engine.activations: 'int8' .* engine.weights is "
                       "dequantized"):  # fmt: skip
        prepare(_job(tmp_path, builtin.BUILTIN_MODEL, ["hi"], "dequantized", int8))


@pytest.mark.parametrize(("engine", "why"), [
    ("  dtype: bfloat16\n", "engine.dtype is bfloat16"),
    ("  cpu_gemm: torch\n", "engine.cpu_gemm is torch"),
])  # fmt: skip
def test_validate_refuses_the_int8_conflicts_run_refuses(tmp_path, engine, why):
    """A builtin model is not converted by `validate`, which still runs the engine checks of
    `run` (one function): the same exit 2, the message naming the setting in the way."""
    from click.testing import CliRunner

    from eaglebatch.cli import main

    job = _job(tmp_path, builtin.BUILTIN_MODEL, ["hi"], "auto", "  activations: int8\n")
    path = tmp_path / "auto" / "job.yaml"
    path.write_text(path.read_text().replace("  dtype: float32\n", "") + engine)
    for cmd in ("validate", "run"):
        r = CliRunner().invoke(main, [cmd, str(path)])
        assert r.exit_code == 2, r.output
        assert "engine.activations: 'int8'" in r.output and why in r.output, r.output
        assert "float32 here" not in r.output
    assert job.model == builtin.BUILTIN_MODEL


def test_int8_outputs_do_not_resume_float32_ones(tmp_path):
    """The resume identity names int8 (and leaves the default out: earlier jobs resume)."""
    from eaglebatch.output.resume import job_identity

    job = _job(tmp_path, builtin.BUILTIN_MODEL, ["hi"], "auto")
    int8 = _job(tmp_path, builtin.BUILTIN_MODEL, ["hi"], "auto", "  activations: int8\n")
    files, model = [Path(job.input.path)], SimpleNamespace(dir=builtin.builtin_model_dir())
    plain = job_identity(job, files, model, None, "float32", 64)
    other = job_identity(int8, files, model, None, "float32", 64)
    assert "activations" not in plain["engine"]
    assert other["engine"]["activations"] == "int8"

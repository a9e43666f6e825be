"""GGUF files of the hybrid families (`qwen35`, `qwen35moe`, `qwen3next`: model/hybrid_gguf.py)
written from tiny transformers checkpoints the way llama.cpp's converter writes them
(support/hybrid_gguf.py): the header maps to the checkpoint's config, every parameter reads
back as the checkpoint's (the converter's transforms undone), and a job on the file generates
what transformers generates from the checkpoint; a Q8_0 file runs from its blocks as from its
dequantized values."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from eaglebatch.model import CausalLM, ModelConfig
from support.hybrid_gguf import write_hybrid_gguf
from support.tiny import make_tiny_model, write_prompts
from test_hybrid_models import HYBRIDS, SHAPE

native = pytest.mark.skipif(pytest.importorskip("importlib").util.find_spec(
    "eaglebatch._native") is None, reason="needs the native extension")  # fmt: skip
# Qwen3-Next routes every layer here: llama.cpp's qwen3next tensors have no dense MLP
FAMILIES = {**HYBRIDS, "qwen3_next": {**HYBRIDS["qwen3_next"], "decoder_sparse_step": 1}}
PROMPTS = ["the cat", "1, 2, 3", "hello there", "once upon a time", "a b c d e f",
           "what is", "The quick brown fox", "zz"]  # fmt: skip
MAX_NEW = 32
# the header's float32 epsilon, and the token ids of the file's tokenizer
HEADER_ONLY = {"rms_norm_eps", "bos_token_id", "eos_token_id", "deltanet"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(kind, qtype) -> (the transformers checkpoint, its GGUF file), written once."""
    made: dict = {}

    def get(kind: str, qtype: str = "F32") -> tuple[Path, Path]:
        if kind not in made:
            d = tmp_path_factory.mktemp(kind)
            made[kind] = make_tiny_model(d / "hf", init_std=0.1, max_position_embeddings=1024,
                                         **{**SHAPE, **FAMILIES[kind]})  # fmt: skip
        hf = made[kind]
        return hf, write_hybrid_gguf(hf, hf.parent / f"{qtype}.gguf", qtype)

    return get


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEBATCH_CACHE", str(tmp_path / "cache"))


def _parameters(folder: Path, gguf: Path | None = None) -> dict[str, torch.Tensor]:
    model = CausalLM.from_pretrained(folder, gguf=gguf) if gguf else CausalLM.from_pretrained(
        folder)  # fmt: skip
    return {n: p.detach() for n, p in model.named_parameters()}


def _check_config(hf: Path, folder: Path) -> None:
    want = dataclasses.asdict(ModelConfig.from_dir(hf))
    got = dataclasses.asdict(ModelConfig.from_dir(folder))
    assert {k for k in want if want[k] != got[k]} <= HEADER_ONLY
    assert got["deltanet"] == {**want["deltanet"], "eps": got["deltanet"]["eps"]}


def _hf_greedy(model, ids: list[int]) -> list[int]:
    """MAX_NEW tokens of transformers' model by argmax over its cache (no end-of-sequence
    stop, no logits processing: the checkpoint's eos id is another token of the file's)."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(MAX_NEW):
            step = model(x, past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


def _job(tmp: Path, gguf: Path, weights: str, batch: int, draft: str = "") -> object:
    from eaglebatch.cli import main

    inp = write_prompts(tmp / "in.parquet", PROMPTS)
    out = tmp / f"{gguf.stem}-{weights}-{batch}"
    job = tmp / f"{gguf.stem}-{weights}-{batch}.yaml"
    job.write_text(
        f"model: {gguf}\n{draft}input:\n  path: {inp}\noutput:\n  path: {out}\n"
        f"  include_token_ids: true\nsampling:\n  max_new_tokens: {MAX_NEW}\n"
        f"  ignore_eos: true\nengine:\n  device: cpu\n  kv_cache_tokens: 2048\n"
        f"  max_batch_size: {batch}\n  weights: {weights}\n"
    )
    return CliRunner().invoke(main, ["run", str(job)]), out


def _tokens(tmp: Path, gguf: Path, weights: str, batch: int) -> list[list[int]]:
    r, out = _job(tmp, gguf, weights, batch)
    assert r.exit_code == 0, r.output
    return pq.read_table(out).sort_by("row_index").column("output_token_ids").to_pylist()


@native
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_an_f32_hybrid_gguf_generates_what_transformers_generates_from_the_checkpoint(
        tmp_path, files, kind):  # fmt: skip
    """Config from the header = the checkpoint's (linear-layer sizes, layer kinds, partial
    rotary, experts); every parameter = the checkpoint's within float32 rounding of the
    converter's transforms (1 + w norms, -exp(A_log), Qwen3-Next's regrouped qkvz and its b / a
    rows, Qwen3.5's tiled value heads); greedy 32 tokens of 8 prompts at batch 1 and 8 =
    transformers' on the checkpoint."""
    import transformers
    from tokenizers import Tokenizer

    from eaglebatch.job.gguf_model import gguf_model_dir

    hf, gguf = files(kind)
    folder = gguf_model_dir(str(gguf))
    _check_config(hf, folder)
    want, got = _parameters(hf), _parameters(folder, gguf)
    assert sorted(got) == sorted(want)
    far = [n for n in want if not torch.allclose(got[n], want[n], rtol=0, atol=1e-6)]
    assert far == []
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    expected = [_hf_greedy(model.eval(), tok.encode(p).ids) for p in PROMPTS]
    assert _tokens(tmp_path, gguf, "dequantized", 1) == expected
    assert _tokens(tmp_path, gguf, "dequantized", 8) == expected


@native
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_a_q8_0_hybrid_gguf_runs_from_its_blocks_as_from_its_values(tmp_path, files, kind):
    """The linear layers' projections are read as stored blocks (in their row order: Qwen3-Next's
    b / a rows of ssm_ba, Qwen3.5's tiled value heads), except a weight whose columns the
    converter reordered (Qwen3.5's ssm_out with more value than key heads: dequantized); the
    parameters are the checkpoint's within Q8_0's error; greedy tokens from the blocks = from
    the dequantized values."""
    from eaglebatch.cpu.gguf_blocks import checkpoint, kept_names
    from eaglebatch.job.gguf_model import gguf_model_dir

    hf, gguf = files(kind, "Q8_0")
    folder = gguf_model_dir(str(gguf))
    ck = checkpoint(gguf, ModelConfig.from_dir(folder))
    kept = kept_names(ck)
    linear = "model.layers.0.linear_attn."
    for part in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
        assert f"{linear}{part}.weight" in kept
        blocks = ck.blocks(f"{linear}{part}.weight")
        assert torch.equal(ck.float32(f"{linear}{part}.weight"), _expanded(ck, blocks, part))
    assert (f"{linear}out_proj.weight" in kept) == (kind == "qwen3_next")
    want, got = _parameters(hf), _parameters(folder, gguf)
    spread = {n: want[n].abs().max().item() for n in want}
    far = [n for n in want if not torch.allclose(got[n], want[n], rtol=0, atol=spread[n] / 100)]
    assert far == []
    dequantized = _tokens(tmp_path, gguf, "dequantized", 8)
    assert _tokens(tmp_path, gguf, "quantized", 8) == dequantized


def _expanded(ck, blocks: torch.Tensor, part: str) -> torch.Tensor:
    """Blocks of a Q8_0 weight dequantized by the gguf package (row by row)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = dequantize(blocks.numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.asarray(w, np.float32).reshape(blocks.shape[0], -1))


@native
def test_a_file_with_the_mtp_block_runs_the_model_without_it(tmp_path, files):
    """A converter that keeps the MTP layer writes it as one more block (`nextn_predict_layers`):
    the model is the first block_count - 1 blocks and generates what the file without it does;
    `draft: mtp` stays refused."""
    from eaglebatch.job.gguf_model import gguf_model_dir

    hf, plain = files("qwen3_5_text")
    gguf = write_hybrid_gguf(hf, tmp_path / "mtp.gguf", mtp_block=True)
    assert ModelConfig.from_dir(gguf_model_dir(str(gguf))).num_hidden_layers == 4
    assert _tokens(tmp_path, gguf, "quantized", 8) == _tokens(tmp_path, plain, "quantized", 8)


@native
def test_draft_mtp_on_a_hybrid_gguf_is_refused_naming_the_file(tmp_path, files):
    hf, gguf = files("qwen3_5_text")
    r, _ = _job(tmp_path, gguf, "dequantized", 1, draft="draft: mtp\n")
    assert r.exit_code == 2, r.output
    assert "draft: mtp" in r.output and "safetensors checkpoint only" in r.output
    assert "Traceback" not in r.output


def test_the_header_maps_the_linear_layers_and_refuses_what_it_lacks():
    """ssm keys -> linear_* sizes; layer kinds from the interval, MTP blocks left out; partial
    rotary from the rotary dims; a missing or inconsistent key refused by name; a qwen3next
    layer without a router refused naming the tensor."""
    from types import SimpleNamespace

    from eaglebatch.model.qwen3_5 import QWEN3_5
    from eaglebatch.model.qwen3_next import QWEN3_NEXT

    own = {"block_count": 9, "nextn_predict_layers": 1, "full_attention_interval": 4,
           "ssm.conv_kernel": 4, "ssm.state_size": 128, "ssm.group_count": 16,
           "ssm.time_step_rank": 32, "ssm.inner_size": 4096, "rope.dimension_count": 64,
           "attention.key_length": 256}  # fmt: skip
    got = QWEN3_5.gguf_config(own, {})
    assert got["num_hidden_layers"] == 8 and got["linear_value_head_dim"] == 128
    assert got["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert got["partial_rotary_factor"] == 0.25 and got["linear_num_value_heads"] == 32
    with pytest.raises(ValueError, match=r"qwen35\.ssm\.state_size"):
        QWEN3_5.gguf_config({k: v for k, v in own.items() if k != "ssm.state_size"}, {})
    with pytest.raises(ValueError, match=r"qwen35\.ssm\.inner_size = 4001"):
        QWEN3_5.gguf_config({**own, "ssm.inner_size": 4001}, {})
    with pytest.raises(ValueError, match=r"qwen35\.rope\.dimension_count"):
        QWEN3_5.gguf_config({**own, "rope.dimension_count": 512}, {})
    moe = {**own, "expert_count": 4, "expert_used_count": 2,
           "expert_shared_feed_forward_length": 48}  # fmt: skip
    routed = {f"blk.{i}.ffn_gate_inp.weight": SimpleNamespace(shape=(64, 4)) for i in range(7)}
    routed["blk.0.ffn_gate_exps.weight"] = SimpleNamespace(shape=(64, 32, 4))
    with pytest.raises(ValueError, match=r"blk\.7\.ffn_gate_inp\.weight is missing"):
        QWEN3_NEXT.gguf_config(moe, routed)

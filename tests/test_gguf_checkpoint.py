"""A GGUF file read as the checkpoint (model/gguf_checkpoint.py, cpu/gguf_blocks.py) against
transformers' GGUF loader, which shares none of its code: every parameter of both embedded
files equals transformers' float32 conversion bit for bit (llama's un-permuted q/k rows,
Gemma's norms), and every weight read as blocks expands to it; unpermuted blocks are the
file's own mapped bytes; the cached folder holds no weights."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from eaglebatch.cpu.gemm import SMALL_GEMM_AVAILABLE
from eaglebatch.cpu.gguf_blocks import checkpoint, kept_names, quantized_weights
from eaglebatch.job import builtin
from eaglebatch.model import CausalLM, ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from synthetic_gguf import write_gguf_from_hf, write_llama_gguf  # noqa: E402

from support.tiny import make_tiny_model, write_prompts  # noqa: E402

pytest.importorskip("eaglebatch._native")
pytestmark = pytest.mark.skipif(not SMALL_GEMM_AVAILABLE, reason="needs the native kernels")


def _names():
    names = [builtin.BUILTIN_MODEL]
    try:
        builtin.builtin_gguf(builtin.BUILTIN_GEMMA)
        names.append(builtin.BUILTIN_GEMMA)
    except Exception:  # the Gemma package is not installed
        pass
    return names


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.slow
@pytest.mark.parametrize("name", _names())
def test_parameters_and_blocks_equal_transformers_conversion(name):
    folder, gguf = builtin.builtin_model_dir(name), builtin.builtin_gguf(name)
    cfg = ModelConfig.from_dir(folder)
    ref = dict(CausalLM.from_pretrained(builtin.builtin_reference_dir(name))
               .named_parameters())  # fmt: skip
    ours = dict(CausalLM.from_pretrained(folder, gguf=gguf).named_parameters())
    assert ref.keys() == ours.keys()
    assert [n for n in ref if not same_bits(ref[n], ours[n])] == []
    ck = checkpoint(gguf, cfg)
    blocks = quantized_weights(ck)
    assert blocks.keys() == kept_names(ck) and len(blocks) > len(ref) // 2
    for n, qw in blocks.items():
        assert same_bits(qw.rows(torch.arange(qw.shape[0])), ref[n]), n
    assert any(".q_proj." in n for n in blocks) or name == builtin.BUILTIN_GEMMA


def test_blocks_in_file_order_are_the_mapped_bytes_and_the_folder_holds_no_weights():
    folder, gguf = builtin.builtin_model_dir(), builtin.builtin_gguf()
    ck = checkpoint(gguf, ModelConfig.from_dir(folder))
    base = np.frombuffer(ck.reader.map, np.uint8, 1).ctypes.data  # the map's first byte
    name = "model.layers.0.mlp.up_proj.weight"
    assert ck.blocks(name).data_ptr() == base + int(ck.tensors[name].data_offset)
    q = "model.layers.0.self_attn.q_proj.weight"  # llama: rows reordered, a copy
    assert ck.blocks(q).data_ptr() != base + int(ck.tensors[q].data_offset)
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix in (".safetensors", ".bin", ".blocks")]
    assert sum(p.stat().st_size for p in files) < 50 << 20


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_a_synthetic_mixed_gguf_equals_transformers_and_runs_both_ways(tmp_path, monkeypatch,
                                                                        arch):  # fmt: skip
    """Q4_0 / Q8_0 / F16 / BF16 / float32, 4 heads over 2 KV heads: every parameter as
    transformers converts it, every 2-D tensor read as blocks (F16 and BF16 too; Phi-3's
    q/k/v and gate/up as row ranges of its fused attn_qkv and ffn_up, views of the map), and
    greedy output from the blocks equals the dequantized model's and transformers' float32
    conversion's."""
    from eaglebatch.cli import main
    from eaglebatch.job.gguf_model import gguf_model_dir, gguf_reference_dir

    monkeypatch.setenv("EAGLEBATCH_CACHE", str(tmp_path / "cache"))
    gguf = write_llama_gguf(tmp_path / "tiny.gguf", "tiny", arch=arch)
    folder, reference = gguf_model_dir(str(gguf)), gguf_reference_dir(str(gguf))
    cfg = ModelConfig.from_dir(folder)
    assert (cfg.model_type, cfg.num_attention_heads, cfg.num_key_value_heads) == (arch, 4, 2)
    ref = dict(CausalLM.from_pretrained(reference).named_parameters())
    ours = dict(CausalLM.from_pretrained(folder, gguf=gguf).named_parameters())
    assert [n for n in ref if not same_bits(ref[n], ours[n])] == []
    ck = checkpoint(gguf, cfg)
    blocks = quantized_weights(ck)
    assert {qw.type_name for qw in blocks.values()} == {"Q4_0", "Q8_0", "F16", "BF16"}
    assert blocks.keys() == {n for n, p in ref.items() if p.dim() == 2}
    for n, qw in blocks.items():
        assert same_bits(qw.rows(torch.arange(qw.shape[0])), ref[n]), n
    if arch == "phi3":  # k_proj: the rows after q_proj's in the file's attn_qkv, not a copy
        base = np.frombuffer(ck.reader.map, np.uint8, 1).ctypes.data
        k, t = "model.layers.1.self_attn.k_proj.weight", ck.reader.tensors["blk.1.attn_qkv.weight"]
        q_bytes = ck.nbytes("model.layers.1.self_attn.q_proj.weight")
        assert ck.blocks(k).data_ptr() == base + t.data_offset + q_bytes
    inp = write_prompts(tmp_path / "in.parquet", ["the cat", "1, 2, 3", "hello there"])
    got = {}
    for weights, model in (("quantized", gguf), ("dequantized", gguf), ("float32", reference)):
        job = tmp_path / f"{weights}.yaml"
        job.write_text(
            f"model: {model}\ninput:\n  path: {inp}\noutput:\n  path: {tmp_path / weights}\n"
            "  include_token_ids: true\nsampling:\n  max_new_tokens: 12\n  ignore_eos: true\n"
            "engine:\n  device: cpu\n  kv_cache_tokens: 1024\n"
            + (f"  weights: {weights}\n" if model == gguf else "")
        )
        r = CliRunner().invoke(main, ["run", str(job)])
        assert r.exit_code == 0, r.output
        table = pq.read_table(tmp_path / weights).sort_by("row_index")
        got[weights] = table.column("output_token_ids").to_pylist()
    assert got["quantized"] == got["dequantized"] == got["float32"]
    assert all(len(t) == 12 for t in got["quantized"])


@pytest.mark.parametrize("dims, factors, partial, message", [
    (16, False, None, None),
    (12, False, None, "phi3.rope.dimension_count = 12: the model config rotates 16"),
    (12, False, 0.75, None),  # Phi-4-mini with its config.json: 3/4 of each head of 16
    (16, False, 0.75, "phi3.rope.dimension_count = 16: the model config rotates 12"),
    (16, True, None, "rope_factors_long.weight"),
])  # fmt: skip
def test_rope_the_config_lacks_is_refused(tmp_path, dims, factors, partial, message):
    """Partial rotary (Phi-4-mini) in the header is served where the config rotates as many
    dims, refused by name otherwise (transformers' conversion drops it); longrope factors
    (Phi-3 128k) are refused by name."""
    from gguf import GGUFWriter

    from eaglebatch.model.gguf_checkpoint import GgufCheckpoint

    w = GGUFWriter(str(tmp_path / "m.gguf"), "phi3")
    w.add_rope_dimension_count(dims)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    if factors:
        w.add_tensor("rope_factors_long.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = ModelConfig.from_dict({"model_type": "phi3", "hidden_size": 64, "intermediate_size": 128,
                                 "num_hidden_layers": 1, "num_attention_heads": 4,
                                 "vocab_size": 8, "max_position_embeddings": 64,
                                 "partial_rotary_factor": partial})  # fmt: skip
    names = ["model.embed_tokens.weight"]
    if message is None:
        assert GgufCheckpoint(tmp_path / "m.gguf", cfg, names).shapes() == {names[0]: (8, 64)}
        return
    with pytest.raises(ValueError, match=message):
        GgufCheckpoint(tmp_path / "m.gguf", cfg, names)


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order (each head's two RoPE halves interleaved)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _file_value(gguf_path, name: str) -> torch.Tensor:
    """Parameter `name`'s tensor of the file dequantized by the gguf package alone."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    t = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}[name]
    w = dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.array(w, dtype=np.float32).reshape(tuple(reversed(
        [int(d) for d in t.shape]))))  # fmt: skip


_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}  # fmt: skip


def _gguf_name(name: str, arch: str) -> str:
    """The file's tensor name of parameter `name` by hand (llama.cpp's names)."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
           "model.norm.weight": "output_norm.weight"}  # fmt: skip
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    base = rest.removesuffix(".weight")
    if base == "post_attention_layernorm":
        base = "post_attention_norm" if arch == "olmo2" else "ffn_norm"
    return f"blk.{layer}.{_HF_TO_GGUF.get(base, base)}.weight"


def _hf_greedy_raw(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens of a transformers model by argmax (no end-of-sequence stop)."""
    ids = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def _runs_as_transformers(tmp_path, gguf, folder, ref_dir, ours, cfg, prompts) -> None:
    """`ours` (the GGUF file's parameters) saved as float32 into `ref_dir` (which holds the
    config to check against): transformers' greedy tokens on it equal those of `eaglebatch run`
    on the GGUF file, its blocks read quantized and dequantized."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from eaglebatch.cli import main

    save_file({n: p.detach().contiguous() for n, p in ours.items()
               if not (n == "lm_head.weight" and cfg.tie_word_embeddings)},
              str(ref_dir / "model.safetensors"))  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    want = [_hf_greedy_raw(hf, tok.encode(p).ids, 12) for p in prompts]
    inp = write_prompts(tmp_path / "in.parquet", prompts)
    for weights in ("quantized", "dequantized"):
        job = tmp_path / f"{weights}.yaml"
        job.write_text(
            f"model: {gguf}\ninput:\n  path: {inp}\noutput:\n  path: {tmp_path / weights}\n"
            "  include_token_ids: true\nsampling:\n  max_new_tokens: 12\n  ignore_eos: true\n"
            f"engine:\n  device: cpu\n  kv_cache_tokens: 1024\n  weights: {weights}\n"
        )
        r = CliRunner().invoke(main, ["run", str(job)])
        assert r.exit_code == 0, r.output
        table = pq.read_table(tmp_path / weights).sort_by("row_index")
        assert table.column("output_token_ids").to_pylist() == want, weights


@pytest.mark.parametrize("arch, shape", [("olmo2", "tiny"), ("granite", "tiny"),
                                         ("smollm3", "tiny4")])  # fmt: skip
def test_a_gguf_whose_config_transformers_cannot_read_runs_as_transformers_computes_it(
        tmp_path, monkeypatch, arch, shape):  # fmt: skip
    """olmo2 / granite / smollm3 files (config.json from the header by the family's
    gguf_config, the tokenizer by transformers' GGUF tokenizer conversion): every parameter
    is the gguf package's dequantized tensor of the file (q/k rows in llama.cpp's permuted
    order for granite / smollm3, as written for olmo2), blocks expand to it, and greedy output
    from the blocks equals the dequantized model's and transformers' own model's (its class
    for the written config.json, with those float32 weights)."""

    from eaglebatch.job.gguf_model import gguf_model_dir

    monkeypatch.setenv("EAGLEBATCH_CACHE", str(tmp_path / "cache"))
    gguf = write_llama_gguf(tmp_path / "tiny.gguf", shape, arch=arch, vocab=512)
    folder = gguf_model_dir(str(gguf))
    cfg = ModelConfig.from_dir(folder)
    assert (cfg.model_type, cfg.vocab_size, cfg.num_key_value_heads) == (arch, 512, 2)
    ours = dict(CausalLM.from_pretrained(folder, gguf=gguf).named_parameters())
    permuted = arch != "olmo2"
    for n, p in ours.items():
        value = p.detach()
        if permuted and (".q_proj." in n or ".k_proj." in n):
            value = _llama_cpp_permute(value, 4 if ".q_proj." in n else 2)
        assert same_bits(value, _file_value(gguf, _gguf_name(n, arch))), n
    blocks = quantized_weights(checkpoint(gguf, cfg))
    assert blocks.keys() == {n for n, p in ours.items() if p.dim() == 2}
    for n, qw in blocks.items():
        assert same_bits(qw.rows(torch.arange(qw.shape[0])), ours[n]), n
    ref_dir = tmp_path / "float32"
    ref_dir.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (ref_dir / f).write_bytes((folder / f).read_bytes())
    _runs_as_transformers(tmp_path, gguf, folder, ref_dir, ours, cfg,
                          ["the cat", "1, 2, 3", "hello there"])


@pytest.mark.parametrize("arch, key, message", [
    ("olmo2", "sliding_window", "olmo2.attention.sliding_window"),
    ("granite", "rope_scaling", "granite.rope.scaling.type = 'yarn'"),
    ("smollm3", "rope_freqs", "rope_freqs.weight"),
    ("mistral3", "rope_freqs", "rope_freqs.weight"),
    ("mistral3", "rope_scaling_linear", "mistral3.rope.scaling.type = 'linear'"),
    ("gemma4", "no_pattern", "gemma4.attention.sliding_window_pattern"),
    ("gemma4", "moe", "gemma4.expert_used_count = None"),
])  # fmt: skip
def test_a_header_key_the_config_cannot_hold_is_refused_by_name(tmp_path, monkeypatch, arch,
                                                                key, message):  # fmt: skip
    """An OLMo 3 file (llama.cpp writes it as olmo2 with a sliding window), RoPE scaling or
    frequency factors (rope_freqs) in a file of a family whose config comes from gguf_config,
    a Gemma 4 file without its layer pattern or with experts but no top k: a JobError naming
    the key or tensor before any work, never a model run without them."""
    from gguf import GGUFWriter, RopeScalingType

    from eaglebatch.errors import JobError
    from eaglebatch.job.gguf_model import gguf_model_dir

    monkeypatch.setenv("EAGLEBATCH_CACHE", str(tmp_path / "cache"))
    w = GGUFWriter(str(tmp_path / "m.gguf"), arch)
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(4)
    if key == "sliding_window":
        w.add_sliding_window(4096)
    elif key == "rope_scaling":
        w.add_rope_scaling_type(RopeScalingType.YARN)
    elif key == "rope_scaling_linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
    elif key == "rope_freqs":  # llama3-style frequency factors: never dropped silently
        w.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))
    elif key == "moe":
        w.add_expert_count(4)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(JobError, match=message.replace(".", r"\.")):
        gguf_model_dir(str(tmp_path / "m.gguf"))


# tiny models written as llama.cpp's converter writes them (synthetic_gguf.write_gguf_from_hf):
# Gemma 4s (as tests/test_model_families.py's): full layers with their own head dim, one KV
# head and V from k (attention_k_eq_v), soft-capped logits, an untied head; and E2B-like:
# per-layer embeddings, the last two layers reading earlier layers' KV caches, double-wide
# MLP; Ministral 3: YaRN (Ministral 3's mscale settings) and queries scaled per position
_GEMMA4 = dict(model_type="gemma4_text", sliding_window=8, hidden_activation="gelu_pytorch_tanh")
FROM_HF = {
    "gemma4": ("gemma4", dict(
        _GEMMA4, layer_types=["sliding_attention", "full_attention", "full_attention"],
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=0, final_logit_softcapping=30.0)),
    "gemma4_e2b": ("gemma4", dict(
        _GEMMA4, num_layers=4, global_head_dim=32, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=512, num_kv_shared_layers=2, use_double_wide_mlp=True,
        tie_word_embeddings=True, layer_types=["sliding_attention", "full_attention"] * 2)),
    "ministral3": ("mistral3", dict(model_type="ministral3", rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5,
        "original_max_position_embeddings": 8})),
}  # fmt: skip


def _file_name(name: str, arch: str) -> str:
    """The file's tensor of parameter `name` (the gguf package's map, as llama.cpp's
    converter names it; a bare parameter, Gemma 4's layer_scalar, as `.weight`)."""
    import gguf

    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    mapping = gguf.get_tensor_name_map(by_name[arch], 8)
    return mapping.get_name(name.removesuffix(".weight")) + ".weight"


@pytest.mark.parametrize("kind", list(FROM_HF))
def test_a_converted_gguf_runs_as_transformers_runs_the_original_config(tmp_path, monkeypatch,
                                                                        kind):  # fmt: skip
    """A checkpoint written as llama.cpp's converter writes it (Gemma 4: per-kind head dims,
    KV heads per layer, the proportional RoPE as rope_freqs, PLE, KV sharing, double-wide
    MLP, layer scalars; Ministral 3: YaRN and the attention temperature, q/k permuted; Q4_0 /
    Q8_0 / F16 / float32): the config from its header is the original's (but the
    float32-rounded epsilon and the tokenizer's ids), every parameter is the file's
    dequantized tensor, blocks expand to it, and greedy output (from the blocks and
    dequantized) equals transformers' on the ORIGINAL config.json with those weights."""
    import dataclasses
    import shutil

    from eaglebatch.job.gguf_model import gguf_model_dir

    monkeypatch.setenv("EAGLEBATCH_CACHE", str(tmp_path / "cache"))
    arch, extra = FROM_HF[kind]
    shape = dict(num_layers=3, head_dim=24, hidden_size=64, num_heads=4, num_kv_heads=2,
                 vocab_size=512)  # fmt: skip
    hf_dir = make_tiny_model(tmp_path / "hf", **{**shape, **extra})
    gguf = write_gguf_from_hf(hf_dir, tmp_path / "tiny.gguf", arch)
    folder = gguf_model_dir(str(gguf))
    cfg = ModelConfig.from_dir(folder)
    want = dataclasses.asdict(ModelConfig.from_dir(hf_dir))
    got = dataclasses.asdict(cfg)
    differ = {k for k in want if want[k] != got[k]}
    assert differ <= {"rms_norm_eps", "bos_token_id", "eos_token_id"}, differ
    ours = dict(CausalLM.from_pretrained(folder, gguf=gguf).named_parameters())
    for n, p in ours.items():
        value = p.detach()
        if arch == "mistral3" and (".q_proj." in n or ".k_proj." in n):
            value = _llama_cpp_permute(value, 4 if ".q_proj." in n else 2)
        assert same_bits(value, _file_value(gguf, _file_name(n, arch))), n
    blocks = quantized_weights(checkpoint(gguf, cfg))
    assert {qw.type_name for qw in blocks.values()} == {"Q4_0", "Q8_0", "F16"}
    for n, qw in blocks.items():
        assert same_bits(qw.rows(torch.arange(qw.shape[0])), ours[n]), n
    ref_dir = tmp_path / "float32"
    shutil.copytree(hf_dir, ref_dir)
    _runs_as_transformers(tmp_path, gguf, folder, ref_dir, ours, cfg,
                          ["the cat", "1, 2, 3", "hello there, the sun"])


def _gemma4_header(**changes) -> dict:
    """The `gemma4.` header keys (prefix dropped) of a valid 4-layer Gemma 4, changed."""
    own = {"block_count": 4, "attention.head_count": 4, "attention.head_count_kv": 2,
           "attention.sliding_window_pattern": [True, False, True, False],
           "attention.sliding_window": 8, "attention.key_length": 32,
           "attention.key_length_swa": 16, "feed_forward_length": 128,
           "rope.freq_base": 1e6, "rope.dimension_count": 32}  # fmt: skip
    return {**own, **changes}


def _tensors(freqs=None, no_v=()) -> dict:
    from types import SimpleNamespace

    t = {"token_embd.weight": SimpleNamespace(shape=(64, 512))}
    t.update({f"blk.{i}.attn_v.weight": None for i in range(4) if i not in no_v})
    if freqs is not None:
        t["rope_freqs.weight"] = SimpleNamespace(data=np.array(freqs, dtype=np.float32),
                                                 ggml_type=0)  # fmt: skip
    return t


@pytest.mark.parametrize("own, tensors, message", [
    (_gemma4_header(), _tensors([1.0] * 4 + [1e30] * 12), None),
    (_gemma4_header(), _tensors([1e30] * 12 + [1.0] * 4), "rope_freqs.weight"),
    (_gemma4_header(), _tensors([1.0] * 4 + [2.0] * 12), "rope_freqs.weight"),
    (_gemma4_header(), _tensors([1.0] * 8), "rope_freqs.weight"),
    (_gemma4_header(**{"attention.sliding_window_pattern": [True, False, False, True]}),
     _tensors(), "a sliding last layer"),
    (_gemma4_header(**{"attention.head_count_kv": [2, 1, 2, 1]}), _tensors(),
     "need attention_k_eq_v"),
    (_gemma4_header(**{"attention.head_count_kv": [2, 1, 2, 1]}), _tensors(no_v=(1, 3)), None),
    (_gemma4_header(), _tensors(no_v=(0,)), "a sliding layer without attn_v"),
    (_gemma4_header(**{"feed_forward_length": [128, 128, 256, 128]}), _tensors(),
     "gemma4.feed_forward_length"),
    (_gemma4_header(**{"rope.dimension_count_swa": 8}), _tensors(),
     "gemma4.rope.dimension_count_swa"),
    (_gemma4_header(**{"attention.value_length": 16}), _tensors(), "value_length"),
])  # fmt: skip
def test_gemma4_header_values_gemma4_cannot_have_are_refused(own, tensors, message):
    """What a Gemma 4 config cannot state -- RoPE factors not of the proportional form, a
    sliding last layer, full layers with their own KV heads but a v projection, V from k on
    a sliding layer, an MLP size not doubled exactly on the shared layers, partial RoPE on
    sliding layers, value lengths apart from key lengths -- is refused naming it."""
    from eaglebatch.model.gemma4_gguf import gemma4_gguf_config

    if message is None:
        config = gemma4_gguf_config(own, tensors)
        full = config["rope_parameters"]["full_attention"]
        assert full.get("partial_rotary_factor", 1.0) in (0.25, 1.0)
        return
    with pytest.raises(ValueError, match=message):
        gemma4_gguf_config(own, tensors)

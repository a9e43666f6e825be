"""Mixture-of-experts GGUF files (model/moe_gguf.py, the experts of model/gguf_checkpoint.py,
cpu/gguf_blocks.py): tiny qwen3_moe (top-k renormalised), qwen2_moe (shared expert), Mixtral
(written by llama.cpp as `llama` with experts), gpt-oss (model/gpt_oss_gguf.py: sinks, biased
router and experts, sliding layers, YaRN) and Gemma 4 MoE (model/gemma4_gguf.py: experts
beside the dense MLP, router scales, fused gate/up experts) checkpoints written by
transformers, converted as llama.cpp's converter does (tests/support/moe_gguf.py: Q4_K, Q8_0
and MXFP4 experts).
References that share none of eaglebatch's code: the original config.json, the `gguf`
package's dequantizer, transformers' own GGUF loader and transformers' models."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from eaglebatch.cpu.gemm import SMALL_GEMM_AVAILABLE
from eaglebatch.model import CausalLM, ModelConfig
from eaglebatch.model.expert_layout import EXPERT_PARAMETER
from support.moe_gguf import ARCH, write_moe_gguf
from support.tiny import make_tiny_model, write_prompts

pytest.importorskip("eaglebatch._native")
native = pytest.mark.skipif(not SMALL_GEMM_AVAILABLE, reason="needs the native kernels")

# hidden 256: the experts' gate/up rows are whole Q4_K blocks (layer 0), down rows Q8_0 blocks
SHAPE = dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512)
FAMILIES = {
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=64, norm_topk_prob=True),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=64, shared_expert_intermediate_size=96),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    # sinks, biases; sliding (last 8 positions) and full layers (llama.cpp alternates them as
    # gpt-oss's default layer_types); YaRN x4 over 32 positions; MXFP4 experts of 512
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=8, rope_parameters={
                        "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "truncate": False, "original_max_position_embeddings": 32,
                        "rope_theta": 150000.0}),
    # 4 experts of 64 beside each dense MLP, 2 per token (scaled router, scale per expert),
    # fused gate/up experts in the file; sliding and full layers
    "gemma4_moe": dict(model_type="gemma4_text", head_dim=32, global_head_dim=64,
                       sliding_window=8, hidden_activation="gelu_pytorch_tanh",
                       layer_types=["sliding_attention", "full_attention"],
                       hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
                       top_k_experts=2, moe_intermediate_size=64, tie_word_embeddings=True),
}  # fmt: skip
# the block types of each kind's experts in the file
EXPERT_TYPES = {"qwen3_moe": {"Q4_K", "Q8_0"}, "qwen2_moe": {"Q4_K", "Q8_0"},
                "mixtral": {"Q4_K", "Q8_0"}, "gpt_oss": {"MXFP4"}, "gemma4_moe": {"Q8_0"}}
# an expert's parameter (a weight or a bias) and its layer
_EXPERT = re.compile(r"^.+\.layers\.(?P<bid>\d+)\..+\.experts\.(?P<e>\d+)\."
                     r"(?P<proj>gate|up|down)_proj\.(?P<kind>weight|bias)$")  # fmt: skip
# Gemma 4's router scales, by the names llama.cpp gives them (the gguf package has none)
_SCALES = {"moe.router_scale": "ffn_gate_inp.scale", "moe.per_expert_scale": "ffn_down_exps.scale"}
PROMPTS = ["the cat", "1, 2, 3", "hello there", "once upon a time", "a b c d e f",
           "what is", "The quick brown fox", "zz"]  # fmt: skip
MAX_NEW = 32


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """kind -> (the transformers checkpoint, its GGUF file), written once per module."""
    made = {}

    def get(kind: str) -> tuple[Path, Path]:
        if kind not in made:
            d = tmp_path_factory.mktemp(kind)
            hf = make_tiny_model(d / "hf", **SHAPE, **FAMILIES[kind])
            made[kind] = hf, write_moe_gguf(hf, d / "m.gguf")
        return made[kind]

    return get


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEBATCH_CACHE", str(tmp_path / "cache"))


def _file_tensors(gguf: Path) -> dict[str, tuple[np.ndarray, object]]:
    """name -> (float32 in the natural order, the reader's tensor) by the gguf package alone."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    out = {}
    for t in GGUFReader(str(gguf)).tensors:
        shape = tuple(reversed([int(d) for d in t.shape]))
        out[t.name] = np.array(dequantize(t.data, t.tensor_type), np.float32).reshape(shape), t
    return out


def _expert_value(tensors, m: re.Match) -> np.ndarray:
    """An expert's parameter: its slab of blk.N.ffn_{proj}_exps, else its half (gate first)
    of its slab of blk.N.ffn_gate_up_exps."""
    own = f"blk.{m['bid']}.ffn_{m['proj']}_exps.{m['kind']}"
    if own in tensors:
        return tensors[own][0][int(m["e"])]
    both = tensors[f"blk.{m['bid']}.ffn_gate_up_exps.{m['kind']}"][0][int(m["e"])]
    half = both.shape[0] // 2
    return both[:half] if m["proj"] == "gate" else both[half:]


def _file_value(tensors, name: str, raw: dict) -> torch.Tensor:
    """Parameter `name`'s value in the file: an expert's slab of its 3-D tensor (its row of a
    bias), q/k rows un-permuted for a `llama` file, the shared expert's gate as one row, Gemma
    4's router scales and gpt-oss's sinks by llama.cpp's names (llama.cpp's layout, written by
    hand here)."""
    import gguf

    arch = ARCH[raw["model_type"]]
    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    names = gguf.get_tensor_name_map(by_name[arch], raw["num_hidden_layers"])
    scale = next((v for k, v in _SCALES.items() if name.endswith(k)), None)
    if m := _EXPERT.match(name):
        w = _expert_value(tensors, m)
    elif scale is not None:
        w = tensors[f"blk.{name.split('.layers.')[1].split('.')[0]}.{scale}"][0]
    else:
        stem, suffix = name, "weight"  # a bare parameter (sinks) is stored as `.weight`
        if name.endswith((".weight", ".bias")):
            stem, _, suffix = name.rpartition(".")
        w = tensors[f"{names.get_name(stem)}.{suffix}"][0]
    if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
        heads = raw["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
        half = w.shape[0] // heads // 2
        w = w.reshape(heads, half, 2, -1).swapaxes(1, 2).reshape(w.shape)
    return torch.from_numpy(np.ascontiguousarray(w.reshape(-1, w.shape[-1])
                                                 if "shared_expert_gate" in name else w))


def _check_parameters(hf: Path, gguf: Path, folder: Path) -> dict[str, torch.Tensor]:
    """The config from the header is the original's; every parameter (each expert's too) is
    the gguf dequantizer's value of the file; returns them."""
    want = dataclasses.asdict(ModelConfig.from_dir(hf))
    got = dataclasses.asdict(ModelConfig.from_dir(folder))
    assert {k for k in want if want[k] != got[k]} <= {"rms_norm_eps", "bos_token_id",
                                                      "eos_token_id"}  # fmt: skip
    raw = json.loads((hf / "config.json").read_text())
    ours = {n: p.detach() for n, p in CausalLM.from_pretrained(folder, gguf=gguf)
            .named_parameters()}  # fmt: skip
    tensors = _file_tensors(gguf)
    assert [n for n in ours if not torch.equal(ours[n], _file_value(tensors, n, raw))] == []
    assert sum(1 for n in ours if EXPERT_PARAMETER.match(n)) == 2 * 4 * 3
    return ours


def _check_expert_blocks(kind: str, gguf: Path, folder: Path,
                         ours: dict[str, torch.Tensor]) -> None:  # fmt: skip
    """Each expert's blocks are its slab of the map (a view, no copy; a fused gate/up
    tensor's gate rows, then up rows, of the expert's slab) and expand to its parameter bit
    for bit; the file's expert types (Q4_K and Q8_0, MXFP4) all run."""
    from eaglebatch.cpu.gguf_blocks import checkpoint, quantized_weights

    ck = checkpoint(gguf, ModelConfig.from_dir(folder))
    blocks = quantized_weights(ck)
    experts = {n: qw for n, qw in blocks.items() if EXPERT_PARAMETER.match(n)}
    assert len(experts) == 2 * 4 * 3
    assert {q.type_name for q in experts.values()} == EXPERT_TYPES[kind]
    base = np.frombuffer(ck.reader.map, np.uint8, 1).ctypes.data
    for n, qw in experts.items():
        m, t = EXPERT_PARAMETER.match(n), ck.tensors[n]
        slab = qw.blocks.numel()
        at = int(m["e"])
        if t.name.endswith(".ffn_gate_up_exps.weight"):  # [gate; up] per expert
            at = 2 * at + (m["proj"] == "up_proj")
        assert qw.blocks.dim() == 2 and qw.blocks.dtype == torch.uint8
        assert qw.blocks.data_ptr() == base + t.data_offset + at * slab, n
        assert torch.equal(qw.rows(torch.arange(qw.shape[0])), ours[n]), n
        assert torch.equal(ck.float32(n), ours[n]), n


def _hf_greedy(model, ids: list[int]) -> list[int]:
    """MAX_NEW tokens of transformers' model by argmax over its KV cache (no end-of-sequence
    stop, no logits processing)."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(MAX_NEW):
            step = model(x, past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


def _with_our_parameters(hf: Path, ours: dict[str, torch.Tensor]):
    """transformers' model of checkpoint `hf` with every parameter of ours copied into its
    own tensors (the family's split gives views of them: fused and interleaved experts)."""
    from transformers import AutoModelForCausalLM

    from eaglebatch.model.registry import family_of

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    cfg = ModelConfig.from_dir(hf)
    family = family_of(cfg.model_type)
    done, kept = set(), []
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            parts = [(n, view) for n, view in family.split(name, t, cfg) if n in ours]
            kept += [] if parts else [name]
            for n, view in parts:
                view.copy_(ours[n])
                done.add(n)
    assert done == set(ours) and set(kept) <= {"lm_head.weight"}, kept  # tied: the embedding
    return model


def _transformers_model(kind: str, hf: Path, gguf: Path, ours: dict, tmp: Path):
    """transformers' model on the ORIGINAL config.json: where its GGUF loader reads the
    architecture (qwen2moe, qwen3moe), with its own conversion of the file's tensors (checked
    equal to ours); else (Mixtral: transformers reads a `llama` file as a dense Llama;
    gpt-oss, Gemma 4 MoE: it knows not llama.cpp's tensor names) with our parameters."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from eaglebatch.model.registry import family_of

    config = AutoConfig.from_pretrained(hf)
    if kind in ("gpt_oss", "gemma4_moe"):
        return _with_our_parameters(hf, ours)
    if kind != "mixtral":
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     config=config, dtype=torch.float32)
        cfg = ModelConfig.from_dir(hf)
        family = family_of(cfg.model_type)
        theirs = dict(p for n, t in model.state_dict().items()
                      for p in family.split(n, t, cfg))  # fmt: skip
        assert [n for n in ours if not torch.equal(theirs[n], ours[n])] == []
        return model.eval()
    renamed = family_of("mixtral").renamed
    back = {}
    for n, t in ours.items():
        for old, new in reversed(renamed):
            n = n.replace(new, old)
        back[n] = t.contiguous()
    ref = tmp / "reference"
    ref.mkdir()
    (ref / "config.json").write_bytes((hf / "config.json").read_bytes())
    save_file(back, str(ref / "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()


def _eaglebatch(tmp: Path, gguf: Path, weights: str, batch: int) -> list[list[int]]:
    from eaglebatch.cli import main

    inp = write_prompts(tmp / "in.parquet", PROMPTS)
    out = tmp / f"{weights}-{batch}"
    job = tmp / f"{weights}-{batch}.yaml"
    job.write_text(
        f"model: {gguf}\ninput:\n  path: {inp}\noutput:\n  path: {out}\n"
        f"  include_token_ids: true\nsampling:\n  max_new_tokens: {MAX_NEW}\n"
        f"  ignore_eos: true\nengine:\n  device: cpu\n  kv_cache_tokens: 2048\n"
        f"  max_batch_size: {batch}\n  weights: {weights}\n"
    )
    r = CliRunner().invoke(main, ["run", str(job)])
    assert r.exit_code == 0, r.output
    return pq.read_table(out).sort_by("row_index").column("output_token_ids").to_pylist()


@native
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_a_moe_gguf_runs_from_its_expert_blocks_as_transformers_computes_it(tmp_path, files,
                                                                            kind):  # fmt: skip
    """Config from the header = the original's (expert count, top k, expert sizes, shared
    expert, Qwen3 MoE's renormalisation, Mixtral from a `llama` file, gpt-oss's window, layer
    kinds and YaRN, Gemma 4's MoE block); every parameter = the gguf dequantizer's value
    (experts and their biases as slabs of the 3-D tensors, fused gate/up split); expert blocks
    are views of the map; greedy 32 tokens of 8 prompts from the blocks (batch 1 and 8) = the
    dequantized model's = transformers' on the original config."""
    from tokenizers import Tokenizer

    from eaglebatch.job.gguf_model import gguf_model_dir

    hf, gguf = files(kind)
    folder = gguf_model_dir(str(gguf))
    ours = _check_parameters(hf, gguf, folder)
    _check_expert_blocks(kind, gguf, folder, ours)
    model = _transformers_model(kind, hf, gguf, ours, tmp_path)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    want = [_hf_greedy(model, tok.encode(p).ids) for p in PROMPTS]
    assert _eaglebatch(tmp_path, gguf, "quantized", 1) == want
    assert _eaglebatch(tmp_path, gguf, "quantized", 8) == want
    assert _eaglebatch(tmp_path, gguf, "dequantized", 8) == want


def _edit_rows(name: str, data: np.ndarray) -> np.ndarray:
    """blk.1.ffn_up_exps with 32 rows more per expert than the header states."""
    if name == "blk.1.ffn_up_exps.weight":
        return np.concatenate([data, data[:, :32]], axis=1)
    return data


def _edit_bias_rows(name: str, data: np.ndarray) -> np.ndarray:
    """blk.1.ffn_up_exps.bias with 32 rows more per expert than the header states."""
    if name == "blk.1.ffn_up_exps.bias":
        return np.concatenate([data, data[:, :32]], axis=1)
    return data


def _without_bias(name: str, data: np.ndarray) -> np.ndarray | None:
    """No blk.1.ffn_up_exps.bias."""
    return None if name == "blk.1.ffn_up_exps.bias" else data


def _without_scale(name: str, data: np.ndarray) -> np.ndarray | None:
    """No blk.1.ffn_down_exps.scale (Gemma 4's per-expert scale)."""
    return None if name == "blk.1.ffn_down_exps.scale" else data


@pytest.mark.parametrize("kind, header, edit, message", [
    ("qwen3_moe", {"expert_count": 8}, None,
     "qwen3moe.expert_count = 8, but tensor blk.0.ffn_down_exps.weight holds 4 experts"),
    ("qwen3_moe", {}, _edit_rows,
     "GGUF tensor blk.1.ffn_up_exps.weight has shape (4, 96, 256) [experts, rows, columns]"),
    ("qwen3_moe", {"expert_gating_func": 2}, None, "qwen3moe.expert_gating_func = 2"),
    ("qwen3_moe", {"expert_weights_norm": 0}, None, "qwen3moe.expert_weights_norm = 0"),
    ("qwen2_moe", {"expert_weights_scale": 2.5}, None, "qwen2moe.expert_weights_scale = 2.5"),
    ("mixtral", {"expert_used_count": 5}, None,
     "llama.expert_used_count = 5 exceeds llama.expert_count = 4"),
    ("mixtral", {"expert_group_count": 2}, None, "llama.expert_group_count = 2"),
    ("gpt_oss", {"expert_gating_func": 1}, None, "gpt-oss.expert_gating_func = 1"),
    ("gpt_oss", {"rope.scaling.yarn_attn_factor": 2.0}, None,
     "gpt-oss.rope.scaling.yarn_attn_factor: 2.0"),
    ("gpt_oss", {"rope.scaling.type": "linear"}, None, "gpt-oss.rope.scaling.type: 'linear'"),
    ("gpt_oss", {"attention.sliding_window": 0}, None, "gpt-oss.attention.sliding_window: 0"),
    ("gpt_oss", {"attention.sliding_window_pattern": [True]}, None,
     "gpt-oss.attention.sliding_window_pattern: [True]"),
    ("gpt_oss", {"rope.freq_base_swa": 1000.0}, None, "gpt-oss.rope.freq_base_swa: 1000.0"),
    ("gpt_oss", {}, _edit_bias_rows,
     "GGUF tensor blk.1.ffn_up_exps.bias has shape (4, 544) [experts, rows]"),
    ("gpt_oss", {}, _without_bias,
     "missing tensors: model.layers.1.mlp.experts.0.up_proj.bias"),
    ("gemma4_moe", {"expert_used_count": 5}, None,
     "gemma4.expert_used_count = 5 exceeds gemma4.expert_count = 4"),
    ("gemma4_moe", {"expert_gating_func": 2}, None, "gemma4.expert_gating_func = 2"),
    ("gemma4_moe", {}, _without_scale,
     "missing tensors: model.layers.1.moe.per_expert_scale"),
])  # fmt: skip
def test_a_moe_gguf_the_model_cannot_represent_is_refused_by_name(
        tmp_path, files, kind, header, edit, message):  # fmt: skip
    """Expert counts or shapes that disagree with the header, a routing no setting holds: exit
    2 naming the header key or tensor, before any work, no traceback."""
    from eaglebatch.cli import main

    hf, _ = files(kind)
    gguf = write_moe_gguf(hf, tmp_path / "bad.gguf", header=header, edit=edit)
    job = tmp_path / "job.yaml"
    inp = write_prompts(tmp_path / "in.parquet", ["hi"])
    job.write_text(f"model: {gguf}\ninput:\n  path: {inp}\noutput:\n  path: {tmp_path / 'out'}"
                   "\nengine:\n  device: cpu\n")  # fmt: skip
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert message in r.output.replace("\n", " "), r.output


@native
def test_gpt_oss_fused_gate_up_experts_and_biases_are_split_gate_first(tmp_path, files):
    """llama.cpp's converter asked to fuse gate and up (--fuse-gate-up-exps) writes one
    ffn_gate_up_exps and its bias per layer, each expert's gate rows first: the config is the
    original's, each expert's gate / up weight and bias is its half of the expert's slab (the
    gguf dequantizer's values), the blocks views of the map."""
    from gguf import GGUFReader

    from eaglebatch.job.gguf_model import gguf_model_dir

    hf, _ = files("gpt_oss")
    gguf = write_moe_gguf(hf, tmp_path / "fused.gguf", fused=True)
    names = {t.name for t in GGUFReader(str(gguf)).tensors}
    assert {"blk.1.ffn_gate_up_exps.weight", "blk.1.ffn_gate_up_exps.bias"} <= names
    assert not any(".ffn_up_exps." in n for n in names)
    folder = gguf_model_dir(str(gguf))
    ours = _check_parameters(hf, gguf, folder)
    _check_expert_blocks("gpt_oss", gguf, folder, ours)


def _prepared_plan(tmp_path: Path, gguf: Path, weights: str):
    from eaglebatch.job.config import load_job
    from eaglebatch.prepare import prepare

    job = tmp_path / f"{weights}.yaml"
    inp = write_prompts(tmp_path / "in.parquet", ["hi"])
    job.write_text(f"model: {gguf}\ninput:\n  path: {inp}\noutput:\n  path: {tmp_path / 'out'}"
                   f"\nengine:\n  device: cpu\n  kv_cache_tokens: 1024\n  weights: {weights}\n")
    return job, prepare(load_job(job), check_memory=False).memory_plan


@native
def test_the_memory_line_states_the_experts_as_mapped_file_pages(tmp_path, files,
                                                                  monkeypatch):  # fmt: skip
    """Read as blocks, the experts are the file's *_exps bytes, counted in the model's figure
    and stated apart (with what a token reads: top 2 of 4); a machine without room for them
    is refused naming them; dequantized, they are float32 parameters like the rest."""
    from eaglebatch.cli import main
    from eaglebatch.job import memory
    from eaglebatch.job.gguf_model import gguf_model_dir

    _, gguf = files("qwen3_moe")
    on_file = sum(t.n_bytes for _, t in _file_tensors(gguf).values() if "_exps." in t.name)
    job, plan = _prepared_plan(tmp_path, gguf, "quantized")
    assert plan.experts == memory.MappedExperts(int(on_file), 4, 2)
    assert plan.model_bytes > on_file
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 0, r.output
    assert "as mapped file pages, of which a token reads its 2 of 4 per layer" in r.output
    monkeypatch.setattr(memory, "available_memory", lambda: plan.model_bytes - 1)
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert f"{memory._gib(on_file)} of them experts, mapped file pages" in r.output
    monkeypatch.undo()
    _, plan = _prepared_plan(tmp_path, gguf, "dequantized")
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_dir(gguf_model_dir(str(gguf))), max_positions=2)
    assert plan.experts is None
    assert plan.model_bytes == sum(p.numel() * 4 for p in model.parameters())


def test_a_llama_file_with_experts_is_mixtral_and_one_without_is_llama():
    from eaglebatch.model.registry import GGUF_ARCHITECTURES, family_of_gguf

    assert family_of_gguf("llama", experts=True).model_type == "mixtral"
    assert family_of_gguf("llama").model_type == "llama"
    assert family_of_gguf("qwen3moe", experts=True).model_type == "qwen3_moe"
    assert family_of_gguf("qwen2moe", experts=True).model_type == "qwen2_moe"
    assert len(GGUF_ARCHITECTURES) == len(set(GGUF_ARCHITECTURES))


def _info(*shape: int):
    return SimpleNamespace(shape=shape)


def test_the_header_maps_dense_layers_and_refuses_what_the_family_lacks():
    """A qwen layer without a router is dense (mlp_only_layers); a Mixtral one is refused; a
    shared expert in a qwen3moe file, or a shared expert of unknown size, is refused."""
    from eaglebatch.model.mixtral import MIXTRAL
    from eaglebatch.model.qwen2_moe import QWEN2_MOE
    from eaglebatch.model.qwen3_moe import QWEN3_MOE

    own = {"block_count": 2, "expert_count": 4, "expert_used_count": 2}
    layer0 = {"blk.0.ffn_gate_inp.weight": _info(64, 4),
              "blk.0.ffn_gate_exps.weight": _info(64, 32, 4)}  # fmt: skip
    got = QWEN3_MOE.gguf_config(own, layer0)
    assert got["mlp_only_layers"] == [1] and got["moe_intermediate_size"] == 32
    assert got["norm_topk_prob"] is True
    with pytest.raises(ValueError, match=r"GGUF tensor blk\.1\.ffn_gate_inp\.weight is missing"):
        MIXTRAL.gguf_config(own, layer0)
    shexp = {**layer0, "blk.0.ffn_up_shexp.weight": _info(64, 48)}
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up_shexp\.weight: a qwen3moe file"):
        QWEN3_MOE.gguf_config(own, shexp)
    with pytest.raises(ValueError, match=r"qwen2moe\.expert_shared_feed_forward_length"):
        QWEN2_MOE.gguf_config(own, layer0)
    got = QWEN2_MOE.gguf_config(own, {**layer0, "blk.0.ffn_gate_shexp.weight": _info(64, 48)})
    assert got["shared_expert_intermediate_size"] == 48 and got["norm_topk_prob"] is False

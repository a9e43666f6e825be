"""Mixture-of-experts GGUF files (model/moe_gguf.py, the experts of model/gguf_checkpoint.py,
cpu/gguf_blocks.py): tiny qwen3_moe (top-k renormalised), qwen2_moe (shared expert) and
Mixtral (written by llama.cpp as `llama` with experts) checkpoints written by transformers,
converted as llama.cpp's converter does (tests/support/moe_gguf.py: Q4_K and Q8_0 experts).
References that share none of eaglebatch's code: the original config.json, the `gguf`
package's dequantizer, transformers' own GGUF loader and transformers' models."""

from __future__ import annotations

import dataclasses
import json
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
}  # fmt: skip
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


def _file_value(tensors, name: str, raw: dict) -> torch.Tensor:
    """Parameter `name`'s value in the file: an expert's slab of its 3-D tensor, q/k rows
    un-permuted for a `llama` file, the shared expert's gate as one row (llama.cpp's layout,
    written by hand here)."""
    import gguf

    arch = ARCH[raw["model_type"]]
    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    names = gguf.get_tensor_name_map(by_name[arch], raw["num_hidden_layers"])
    m = EXPERT_PARAMETER.match(name)
    stem = f"{m['stem']}.{m['proj']}" if m else name.removesuffix(".weight").removesuffix(".bias")
    suffix = ".bias" if name.endswith(".bias") else ".weight"
    w = tensors[names.get_name(stem) + suffix][0]
    w = w[int(m["e"])] if m else w
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


def _check_expert_blocks(gguf: Path, folder: Path, ours: dict[str, torch.Tensor]) -> None:
    """Each expert's blocks are its slab of the map (a view, no copy) and expand to its
    parameter bit for bit; Q4_K and Q8_0 experts both run."""
    from eaglebatch.cpu.gguf_blocks import checkpoint, quantized_weights

    ck = checkpoint(gguf, ModelConfig.from_dir(folder))
    blocks = quantized_weights(ck)
    experts = {n: qw for n, qw in blocks.items() if EXPERT_PARAMETER.match(n)}
    assert len(experts) == 2 * 4 * 3 and {q.type_name for q in experts.values()} == {"Q4_K",
                                                                                     "Q8_0"}
    base = np.frombuffer(ck.reader.map, np.uint8, 1).ctypes.data
    for n, qw in experts.items():
        e, t = int(EXPERT_PARAMETER.match(n)["e"]), ck.tensors[n]
        slab = qw.blocks.numel()
        assert qw.blocks.dim() == 2 and qw.blocks.dtype == torch.uint8
        assert qw.blocks.data_ptr() == base + t.data_offset + e * slab, n
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


def _transformers_model(kind: str, hf: Path, gguf: Path, ours: dict, tmp: Path):
    """transformers' model on the ORIGINAL config.json: where its GGUF loader reads the
    architecture (qwen2moe, qwen3moe), with its own conversion of the file's tensors (checked
    equal to ours); else (Mixtral: transformers reads a `llama` file as a dense Llama) with
    our parameters under the checkpoint's own names."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from eaglebatch.model.registry import family_of

    config = AutoConfig.from_pretrained(hf)
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
    expert, Qwen3 MoE's renormalisation, Mixtral from a `llama` file); every parameter = the
    gguf dequantizer's value (experts as slabs of the 3-D tensors); expert blocks are views of
    the map; greedy 32 tokens of 8 prompts from the blocks (batch 1 and 8) = the dequantized
    model's = transformers' on the original config."""
    from tokenizers import Tokenizer

    from eaglebatch.job.gguf_model import gguf_model_dir

    hf, gguf = files(kind)
    folder = gguf_model_dir(str(gguf))
    ours = _check_parameters(hf, gguf, folder)
    _check_expert_blocks(gguf, folder, ours)
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


def _prepared_plan(tmp_path: Path, gguf: Path, weights: str):
    from eaglebatch.engine import prepare
    from eaglebatch.job.config import load_job

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

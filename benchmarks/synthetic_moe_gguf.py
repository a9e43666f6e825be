"""Qwen3-MoE-shaped GGUF files of random weights (llama.cpp architecture `qwen3moe`), at the size
of Qwen3-30B-A3B or tiny, for the MoE CPU benchmark (no model hub is reachable here).

    python benchmarks/synthetic_moe_gguf.py [--model-shape 30b-a3b|tiny] OUT.gguf

The 30B-A3B shape is the published model's body: 48 layers, hidden 2048, 32 query heads and 4
KV heads of 128, per-head q/k norms, 128 experts of 768 per layer, 8 per token, renormalised
(~29 B expert weights, ~3 B active per token). Its vocabulary is the embedded SmolLM2's
(49152 tokens, the tokenizer both engines read from the file) instead of Qwen's 151936, so the
embedding and output matrices are a third of the real ones'.

Types are those of a Q4_0 file: Q4_0 for the embedding, attention and expert matrices, Q8_0 for
the output matrix, float32 router and norms. The file is streamed tensor by tensor (~17 GB at
30B-A3B, never held in memory): Q4_0 blocks are written directly, each value a random 4-bit code
(0..15, less 8) times a per-block scale of +-0.02 / 4.6 (the sign random, so the codes' mean
of -0.5 cancels), so weights have std ~0.02 and activations stay finite; router and norm
weights are normal. The text generated is noise; the point is the shape and the bytes each
engine reads.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_gguf import _copy_tokenizer, _matrix, _norm, _tokenizer_source  # noqa: E402

ARCH = "qwen3moe"
Q4_0_BYTES = 18  # per block of 32: fp16 scale, 16 bytes of 4-bit codes


@dataclass(frozen=True)
class MoeShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_ff: int

    @property
    def expert_params(self) -> int:
        return self.layers * self.experts * 3 * self.expert_ff * self.hidden


SHAPES = {
    "30b-a3b": MoeShape(2048, 48, 32, 4, 128, 128, 8, 768),
    "tiny": MoeShape(64, 2, 4, 2, 16, 8, 2, 32),
}


def q4_0_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """uint8 [rows, cols / 32 * 18]: random Q4_0 blocks (module doc)."""
    nblocks = rows * cols // 32
    sign = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), nblocks)
    scale = (sign * np.float32(0.02 / 4.6)).astype(np.float16)
    out = np.frombuffer(rng.bytes(nblocks * Q4_0_BYTES), dtype=np.uint8).reshape(nblocks, -1)
    out = out.copy()
    out[:, :2] = scale.view(np.uint8).reshape(nblocks, 2)
    return out.reshape(rows, cols // 32 * Q4_0_BYTES)


def _header(w, s: MoeShape) -> None:
    w.add_name(f"synthetic-{ARCH}")
    w.add_block_count(s.layers)
    w.add_context_length(40960)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(6144)  # the dense MLP size a Qwen3-MoE config states (unused)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    w.add_expert_feed_forward_length(s.expert_ff)
    w.add_file_type(2)  # mostly Q4_0


def _tensors(s: MoeShape, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape in numpy order, kind) of every tensor, in file order; kind: q4_0, q8_0,
    norm, router."""
    hd = s.head_dim
    out = [("token_embd.weight", (vocab, s.hidden), "q4_0"),
           ("output_norm.weight", (s.hidden,), "norm"),
           ("output.weight", (vocab, s.hidden), "q8_0")]  # fmt: skip
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (s.hidden,), "norm"),
                (b + "attn_q.weight", (s.heads * hd, s.hidden), "q4_0"),
                (b + "attn_k.weight", (s.kv_heads * hd, s.hidden), "q4_0"),
                (b + "attn_v.weight", (s.kv_heads * hd, s.hidden), "q4_0"),
                (b + "attn_output.weight", (s.hidden, s.heads * hd), "q4_0"),
                (b + "attn_q_norm.weight", (hd,), "norm"),
                (b + "attn_k_norm.weight", (hd,), "norm"),
                (b + "ffn_norm.weight", (s.hidden,), "norm"),
                (b + "ffn_gate_inp.weight", (s.experts, s.hidden), "router"),
                (b + "ffn_gate_exps.weight", (s.experts, s.expert_ff, s.hidden), "q4_0"),
                (b + "ffn_up_exps.weight", (s.experts, s.expert_ff, s.hidden), "q4_0"),
                (b + "ffn_down_exps.weight", (s.experts, s.hidden, s.expert_ff),
                 "q4_0")]  # fmt: skip
    return out


def _data(rng, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """The stored bytes (or float32 values) of one tensor; a 3-D expert tensor is its experts'
    matrices one after another."""
    if kind == "norm":
        return _norm(rng, shape[0])
    if kind == "router":
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))
    if kind == "q8_0":
        from gguf import GGMLQuantizationType

        return _matrix(rng, shape[0], shape[1], GGMLQuantizationType.Q8_0)
    rows = int(np.prod(shape[:-1]))
    blocks = q4_0_blocks(rng, rows, shape[-1])
    return blocks.reshape(*shape[:-1], blocks.shape[-1])


def write_moe_gguf(path: Path, shape: str = "30b-a3b", seed: int = 0) -> Path:
    """Writes the random `shape` (SHAPES) GGUF to `path` (module doc), streaming its tensors."""
    from gguf import GGMLQuantizationType, GGUFWriter

    s = SHAPES[shape]
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), ARCH)
    _header(w, s)
    vocab = _copy_tokenizer(w, _tokenizer_source())
    tensors = _tensors(s, vocab)
    types = {"q4_0": GGMLQuantizationType.Q4_0, "q8_0": GGMLQuantizationType.Q8_0}
    for name, shp, kind in tensors:
        qtype = types.get(kind)
        if qtype is None:
            w.add_tensor_info(name, shp, np.dtype(np.float32), 4 * int(np.prod(shp)))
            continue
        elems, nbytes = (32, Q4_0_BYTES) if kind == "q4_0" else (32, 34)
        byte_shape = (*shp[:-1], shp[-1] // elems * nbytes)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shp, kind in tensors:
        w.write_tensor_data(_data(rng, shp, kind))
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", choices=sorted(SHAPES), default="30b-a3b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    write_moe_gguf(args.out, args.model_shape, args.seed)
    s = SHAPES[args.model_shape]
    print(f"{args.out}: {args.out.stat().st_size / 2**30:.2f} GiB, "
          f"{s.expert_params / 1e9:.1f} B expert weights")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

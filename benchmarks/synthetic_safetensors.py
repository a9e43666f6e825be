"""Llama-shaped Hugging Face folders of random bf16 or fp16 weights at real sizes, for the
CPU-at-scale benchmark (no model hub is reachable here).

    python benchmarks/synthetic_safetensors.py --model-shape 1b|3b|7b|tiny [--dtype bf16|f16] OUT

The shapes are synthetic_gguf.py's; the tokenizer is the embedded SmolLM2's (its cached
folder's tokenizer files); weights are normal with std 0.02 (norms 1), written a shard of
about 2 GiB at a time (model-0000i-of-0000n.safetensors and an index), so writing a 7B folder
holds one shard in memory, not the model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from synthetic_gguf import SHAPES, Shape

SHARD_BYTES = 2 << 30


def _tensors(s: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    hd = s.hidden // s.heads
    out = [("model.embed_tokens.weight", (vocab, s.hidden)), ("lm_head.weight", (vocab, s.hidden)),
           ("model.norm.weight", (s.hidden,))]  # fmt: skip
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (s.hidden, s.hidden)),
            (p + "self_attn.k_proj.weight", (s.kv_heads * hd, s.hidden)),
            (p + "self_attn.v_proj.weight", (s.kv_heads * hd, s.hidden)),
            (p + "self_attn.o_proj.weight", (s.hidden, s.hidden)),
            (p + "mlp.gate_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.up_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.down_proj.weight", (s.hidden, s.intermediate)),
            (p + "input_layernorm.weight", (s.hidden,)),
            (p + "post_attention_layernorm.weight", (s.hidden,)),
        ]
    return out


def _config(s: Shape, vocab: int, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": s.hidden, "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "head_dim": s.hidden // s.heads,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "vocab_size": vocab, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2, "torch_dtype": {"bf16": "bfloat16", "f16": "float16"}[dtype],
    }  # fmt: skip


def write_llama_safetensors(out: Path, shape: str, dtype: str = "bf16", seed: int = 0) -> Path:
    """Writes a random Llama folder of `shape` (SHAPES) in `dtype` to `out`."""
    import torch
    from safetensors.torch import save_file

    from eaglebatch.job import builtin

    s = SHAPES[shape]
    tok = builtin.builtin_model_dir(builtin.BUILTIN_MODEL)
    vocab = json.loads((tok / "config.json").read_text())["vocab_size"]
    out.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tok / f, out / f)
    (out / "config.json").write_text(json.dumps(_config(s, vocab, dtype), indent=2))
    torch_dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    g = torch.Generator().manual_seed(seed)
    shards, current, size = [], {}, 0
    for name, dims in _tensors(s, vocab):
        if len(dims) == 1:
            t = torch.ones(dims, dtype=torch_dtype)
        else:
            t = (torch.randn(dims, generator=g) * 0.02).to(torch_dtype)
        current[name], size = t, size + t.numel() * 2
        if size >= SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, out / file)
        weight_map.update(dict.fromkeys(tensors, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--dtype", choices=["bf16", "f16"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    write_llama_safetensors(args.out, args.model_shape, args.dtype, args.seed)
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    print(f"{args.out}: {size / 2**30:.2f} GiB of weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())

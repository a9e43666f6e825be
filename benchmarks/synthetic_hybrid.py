"""A Qwen3.5-shaped hybrid (Gated DeltaNet + gated full attention) Hugging Face folder of random
weights about the embedded default model's size, for the prefix-caching benchmark (no model
hub is reachable here): written by transformers' own Qwen3_5ForCausalLM, with the embedded
SmolLM2's tokenizer and chat template, so any job of the default model runs on it.

    python benchmarks/synthetic_hybrid.py OUT [--layers 30] [--hidden 576]

Default shape: hidden 576, 30 layers with full attention every 4th (23 linear, 7 full),
linear heads 4 key x 64 / 8 value x 64, conv kernel 4, full attention 4 heads x 128 (1 KV
head), MLP 1536, tied embeddings: about 140 M parameters (SmolLM2-135M: 135 M).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch


def hybrid_config(layers: int, hidden: int, tokenizer_dir: Path):
    from transformers import Qwen3_5TextConfig

    ref = json.loads((tokenizer_dir / "config.json").read_text())
    return Qwen3_5TextConfig(
        vocab_size=ref["vocab_size"], hidden_size=hidden, intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
        linear_num_key_heads=4, linear_key_head_dim=64, linear_num_value_heads=8,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, tie_word_embeddings=True,
        max_position_embeddings=8192, bos_token_id=ref.get("bos_token_id"),
        eos_token_id=ref.get("eos_token_id"),
    )  # fmt: skip


def write(out: Path, layers: int, hidden: int) -> Path:
    from transformers import Qwen3_5ForCausalLM

    from eaglebatch.job import builtin

    tok = builtin.builtin_model_dir(builtin.BUILTIN_MODEL)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(hybrid_config(layers, hidden, tok)).eval()
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tok / f).exists():
            shutil.copy(tok / f, out / f)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {params / 1e6:.0f} M parameters")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    args = ap.parse_args()
    write(args.out, args.layers, args.hidden)


if __name__ == "__main__":
    main()

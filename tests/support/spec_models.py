"""Tiny random targets and draft heads for the speculative-decoding tests.

Targets are Hugging Face Llama models re-initialised at unit scale (as in test_llama.py): HF's
default init gives near-uniform logits whose top two differ by float noise, which would make
"speculative greedy == plain greedy" a test of rounding rather than of the algorithm.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eaglebatch.attention import allocate_kv_cache
from eaglebatch.model import CausalLM
from eaglebatch.speculative import init_random_draft
from eaglebatch.worker import KvBudget, Worker


def make_target_dir(
    path: Path,
    *,
    num_layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 320,
    max_positions: int = 256,
    tie: bool = False,
    seed: int = 0,
) -> Path:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(mean=1.0, std=0.1)
            elif "embed_tokens" in name:
                p.normal_(std=1.0)
            else:
                p.normal_(std=1.5 / p.shape[1] ** 0.5)
    hf.save_pretrained(path)
    return path


def target_worker(
    path: Path,
    *,
    num_blocks: int = 512,
    block_size: int = 4,
    max_model_len: int = 128,
) -> Worker:
    model = CausalLM.from_pretrained(path, max_positions=max_model_len)
    kv = allocate_kv_cache(model.config, num_blocks, block_size, model.dtype, "cpu")
    return Worker(model, kv, KvBudget(num_blocks, block_size, 0), max_model_len)


def make_draft_dir(path: Path, target: Path, kind: str, **kwargs) -> Path:
    """A random head; EAGLE-3 reads target layers (1, 2, 3) unless `aux_layer_ids` is given
    (the default (2, L//2, L-3) needs L >= 6 distinct layers)."""
    if kind == "eagle3":
        kwargs.setdefault("aux_layer_ids", (1, 2, 3))
    return init_random_draft(path, target, kind, **kwargs)

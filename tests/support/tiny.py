"""Tiny random checkpoints with a real byte-level BPE tokenizer, for fast end-to-end tests.

The tokenizer has no merges: every byte is one token (ids 0..255), plus special tokens, so any
text round-trips and every id is < the tiny vocabulary. The model is a random Hugging Face
transformers model saved as safetensors: the same weights drive eaglebatch and the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HYBRIDS = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")  # linear-attention layers


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)  # ids 256, 257, 258
    return tok


def make_tiny_model(
    out: Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 320,
    eos_token_id: int = 258,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    init_std: float = 0.2,
    model_type: str = "llama",
    num_labels: int = 0,
    **extra,
) -> Path:
    """Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json and a chat
    template into `out`. A larger `init_std` gives peakier logits (fewer near-ties).
    model_type: any of the mapping below (then `extra` may set head_dim, sliding_window,
    layer_types, multipliers, ...). `num_labels` > 0: a *ForSequenceClassification checkpoint
    with that many labels (a score head, no LM head)."""
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
        "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
        "ministral3": (transformers.Ministral3Config, transformers.Ministral3ForCausalLM),
        "ministral": (transformers.MinistralConfig, transformers.MinistralForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma4_text": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
        "qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig,
                             transformers.Qwen3_5MoeForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    }[model_type]
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=257,
        eos_token_id=eos_token_id,
        initializer_range=init_std,
        **extra,
    )
    if num_labels:
        cfg.num_labels = num_labels
        cfg.id2label = {i: f"label_{i}" for i in range(num_labels)}
        cfg.label2id = {v: k for k, v in cfg.id2label.items()}
        cfg.pad_token_id = eos_token_id
        model = transformers.AutoModelForSequenceClassification.from_config(cfg).eval()
    else:
        model = model_cls(cfg).eval()
    if model_type == "gemma4_text":  # its norm weights, layer scalars and router scales start
        # at 1: vary them
        varied = ("norm.weight", "norm_1.weight", "norm_2.weight", "layer_scalar",
                  "router.scale", "per_expert_scale")  # fmt: skip
        with torch.no_grad():
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(varied):
                    t.uniform_(0.5, 1.5)
    if model_type == "gpt_oss":  # its expert biases start at 0 and its sinks small: vary them
        with torch.no_grad():
            for name, t in model.named_parameters():
                if name.endswith(("_bias", "sinks")):
                    t.normal_(0, 1.0 if name.endswith("sinks") else init_std)
    if model_type in HYBRIDS:  # (1 + w) norms start at w = 0, the decays at fixed values
        varied = ("norm.weight", "layernorm.weight", "dt_bias", "A_log")
        with torch.no_grad():
            for name, t in model.named_parameters():
                if name.endswith(varied):
                    t.add_(torch.randn_like(t) * 0.3)
    model.save_pretrained(str(out))
    byte_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out


def write_prompts(path: Path, prompts: list, ids: list | None = None, column: str = "prompt",
                  extra: dict | None = None):  # fmt: skip
    """A Parquet input of `prompts` (and `ids`, and the `extra` columns beside them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {column: prompts, **(extra or {})}
    if ids is not None:
        cols = {"id": ids, **cols}
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path)
    return path

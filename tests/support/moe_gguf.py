"""A tiny mixture-of-experts Hugging Face checkpoint written as a GGUF file the way llama.cpp's
converter writes it (`qwen3moe`, `qwen2moe`, Mixtral as `llama` with experts, `gpt-oss`,
`gemma4`): each layer's experts stacked into 3-D tensors (ffn_gate_exps / ffn_up_exps /
ffn_down_exps, [E, rows, k]; with `fused`, the default for gemma4, gate and up as one
ffn_gate_up_exps, each expert's gate rows first), gpt-oss's expert biases likewise
(ffn_*_exps.bias, [E, rows]) and its sinks as attn_sinks.weight, Gemma 4's router scales as
ffn_gate_inp.scale and ffn_down_exps.scale (the names the gguf package lacks), the router as
ffn_gate_inp (float32, as llama.cpp keeps it), Qwen2 MoE's shared expert as ffn_*_shexp and
its one-row gate as a vector, Mixtral's q/k rows permuted; the header's expert keys (Gemma 4:
synthetic_gguf's Gemma 4 header besides; gpt-oss: its window and YaRN keys); the tokenizer is
SmolLM2's first vocab_size tokens (synthetic_gguf).

Types: gpt-oss's experts MXFP4; other layer 0 experts Q4_K where a row is whole 256-blocks
(not Gemma 4's), else Q8_0; every other matrix Q8_0 (F16 where a row is not whole 32-blocks);
vectors and biases float32. The `gguf` package has no Q4_K quantizer: Q4_K tensors are random
blocks of about the checkpoint's spread (not its values), which the tests read back through
the `gguf` dequantizer like any other tensor.

`header` overrides header keys (without the `{arch}.` prefix); `edit(gguf_name, float array)
-> array or None` changes (None: drops) a tensor before it is quantized (the tests' broken
files)."""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from synthetic_gguf import (  # noqa: E402
    _copy_tokenizer,
    _gemma4_header,
    _permute,
    _tokenizer_source,
)

ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama",
        "gpt_oss": "gpt-oss", "gemma4_text": "gemma4"}  # fmt: skip
_EXPERT = re.compile(r"^(?P<stem>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\."
                     r"(?P<kind>weight|bias)$")  # fmt: skip
# a layer's stacked expert tensor (`_tensors`), named by llama.cpp's fixed expert names
_STACKED = re.compile(r"^.+\.layers\.(?P<bid>\d+)\..+\.experts\.(?P<proj>gate|up|down)_proj\."
                      r"(?P<kind>weight|bias)$")  # fmt: skip
# Gemma 4's router scales: the gguf package's map names neither
_SCALES = {".moe.router_scale": "ffn_gate_inp.scale",
           ".moe.per_expert_scale": "ffn_down_exps.scale"}  # fmt: skip
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _header(raw: dict, arch: str) -> dict:
    """{key without the `{arch}.` prefix: value} as llama.cpp's converter writes them."""
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    own = {"block_count": raw["num_hidden_layers"],
           "context_length": raw["max_position_embeddings"],
           "embedding_length": raw["hidden_size"],
           "feed_forward_length": raw["intermediate_size"],
           "attention.head_count": raw["num_attention_heads"],
           "attention.head_count_kv": raw["num_key_value_heads"],
           "attention.layer_norm_rms_epsilon": float(raw["rms_norm_eps"]),
           "rope.freq_base": float(raw.get("rope_theta")
                                   or raw["rope_parameters"]["rope_theta"]),
           "rope.dimension_count": head_dim,
           "expert_count": raw.get("num_experts") or raw["num_local_experts"],
           "expert_used_count": raw["num_experts_per_tok"]}  # fmt: skip
    if arch != "llama":  # Mixtral: the experts' size is feed_forward_length
        own["expert_feed_forward_length"] = (raw.get("moe_intermediate_size")
                                             or raw["intermediate_size"])  # fmt: skip
        own["attention.key_length"] = head_dim
    if raw.get("shared_expert_intermediate_size"):
        own["expert_shared_feed_forward_length"] = raw["shared_expert_intermediate_size"]
    if arch == "gpt-oss":
        own.update(_gpt_oss_header(raw, head_dim))
    return own


def _gpt_oss_header(raw: dict, head_dim: int) -> dict:
    """What llama.cpp's converter adds for gpt-oss: the value length, the sliding window, the
    YaRN settings of rope_parameters (its beta keys too, as a converter of today writes)."""
    rope = raw["rope_parameters"]
    return {"attention.value_length": head_dim,
            "attention.sliding_window": raw["sliding_window"],
            "rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
            "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
            "rope.scaling.yarn_beta_fast": float(rope["beta_fast"]),
            "rope.scaling.yarn_beta_slow": float(rope["beta_slow"])}  # fmt: skip


def _gemma4_moe_header(raw: dict) -> dict:
    """The expert keys of a Gemma 4 file (the rest: synthetic_gguf's Gemma 4 header)."""
    return {"expert_count": raw["num_experts"], "expert_used_count": raw["top_k_experts"],
            "expert_feed_forward_length": raw["moe_intermediate_size"]}  # fmt: skip


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    """The checkpoint's tensors by eaglebatch's parameter names, experts stacked per layer
    and projection ([E, rows, k] under `...experts.{proj}.weight`, biases [E, rows] under
    `.bias`)."""
    from safetensors.numpy import load_file

    from eaglebatch.model import ModelConfig
    from eaglebatch.model.registry import family_of

    cfg = ModelConfig.from_dir(folder)
    family = family_of(cfg.model_type)
    out, experts = {}, defaultdict(dict)
    for name, t in load_file(str(folder / "model.safetensors")).items():
        for n, v in family.split(name, t, cfg):
            if m := _EXPERT.match(n):
                experts[f"{m['stem']}.{m['proj']}.{m['kind']}"][int(m["e"])] = v
            else:
                out[n] = v
    for n, parts in experts.items():
        out[n] = np.stack([parts[e] for e in sorted(parts)])
    return out


def _qtype(gguf_name: str, data: np.ndarray, arch: str):
    from gguf import GGMLQuantizationType as Q

    k = data.shape[-1]
    if data.ndim == 1 or ".ffn_gate_inp" in gguf_name or gguf_name.endswith(".bias"):
        return Q.F32
    if data.ndim == 3 and arch == "gpt-oss":
        return Q.MXFP4
    if data.ndim == 3 and arch != "gemma4" and gguf_name.startswith("blk.0.") and k % 256 == 0:
        return Q.Q4_K
    return Q.Q8_0 if k % 32 == 0 else Q.F16


def _q4_k(data: np.ndarray) -> np.ndarray:
    """Random Q4_K blocks (uint8 [..., rows, k / 256 * 144]) of about `data`'s spread: random
    4-bit quants and 6-bit scales under one fp16 scale and offset chosen for that spread."""
    rng = np.random.default_rng(data.size)
    blocks = rng.integers(0, 256, (data.size // 256, 144), dtype=np.uint8)
    d = np.float16(data.std() / 300)  # a random quant times scale spreads about 300 units
    for at, value in ((0, d), (2, np.float16(d * 7.5))):  # the offset centres them near 0
        blocks[:, at : at + 2] = np.full((len(blocks), 1), value).view(np.uint8)
    return blocks.reshape(*data.shape[:-1], -1)


def _add(w, gguf_name: str, data: np.ndarray, arch: str) -> None:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    ty = _qtype(gguf_name, data, arch)
    if ty == Q.Q4_K:
        w.add_tensor(gguf_name, _q4_k(data), raw_dtype=ty)
    elif ty == Q.F32:
        w.add_tensor(gguf_name, data.astype(np.float32))
    elif ty == Q.F16:
        w.add_tensor(gguf_name, data.astype(np.float16))
    else:
        w.add_tensor(gguf_name, quantize(data.astype(np.float32), ty), raw_dtype=ty)


def _write_header(w, own: dict, arch: str) -> None:
    for key, value in own.items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        elif isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", int(value))


def _out_name(name: str, names) -> str:
    """The file's name of (stacked) checkpoint tensor `name`: llama.cpp's fixed expert names,
    Gemma 4's scales, else the gguf package's map (a bare parameter as `.weight`)."""
    if m := _STACKED.match(name):
        return f"blk.{m['bid']}.ffn_{m['proj']}_exps.{m['kind']}"
    for suffix, out in _SCALES.items():
        if name.endswith(suffix):
            return f"blk.{_LAYER.search(name)[1]}.{out}"
    stem, suffix = name, "weight"
    if name.endswith((".weight", ".bias")):
        stem, _, suffix = name.rpartition(".")
    return f"{names.get_name(stem)}.{suffix}"


def _fuse(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each layer's ffn_gate_exps and ffn_up_exps (weights, biases) as one ffn_gate_up_exps,
    each expert's gate rows first."""
    out = dict(tensors)
    for name in [n for n in tensors if ".ffn_gate_exps." in n]:
        up = name.replace(".ffn_gate_exps.", ".ffn_up_exps.")
        out[name.replace(".ffn_gate_exps.", ".ffn_gate_up_exps.")] = np.concatenate(
            [out.pop(name), out.pop(up)], axis=1)
    return out


def _file_tensors(folder: Path, raw: dict, arch: str, fused: bool) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under the file's names, float32, as the converter lays them."""
    import gguf

    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    names = gguf.get_tensor_name_map(by_name[arch], raw["num_hidden_layers"])
    out = {}
    for name, t in _tensors(folder).items():
        gguf_name = _out_name(name, names)
        data = t.astype(np.float32)
        if gguf_name.endswith(".ffn_gate_inp_shexp.weight"):
            data = data.reshape(-1)  # llama.cpp: the one-row gate as a vector
        if arch == "llama" and gguf_name.endswith((".attn_q.weight", ".attn_k.weight")):
            data = _permute(data, raw["num_attention_heads" if ".attn_q." in gguf_name
                                    else "num_key_value_heads"])  # fmt: skip
        out[gguf_name] = data
    return _fuse(out) if fused else out


def write_moe_gguf(folder: Path, path: Path, header: dict | None = None,
                   edit: Callable | None = None, fused: bool | None = None) -> Path:  # fmt: skip
    """The tiny MoE checkpoint `folder` (tests/support/tiny.py) as GGUF file `path` (module
    doc)."""
    from gguf import GGUFWriter

    raw = json.loads((folder / "config.json").read_text())
    arch = ARCH[raw["model_type"]]
    w = GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{raw['model_type']}")
    if arch == "gemma4":
        _gemma4_header(w, raw)
        _write_header(w, {**_gemma4_moe_header(raw), **(header or {})}, arch)
    else:
        _write_header(w, {**_header(raw, arch), **(header or {})}, arch)
    _copy_tokenizer(w, _tokenizer_source(), raw["vocab_size"])
    fused = arch == "gemma4" if fused is None else fused
    for out, data in sorted(_file_tensors(folder, raw, arch, fused).items()):
        data = edit(out, data) if edit else data
        if data is not None:
            _add(w, out, data, arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

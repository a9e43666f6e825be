"""A tiny hybrid (Gated DeltaNet) Hugging Face checkpoint written as a GGUF file the way
llama.cpp's converter writes it (`qwen35`, `qwen35moe`, `qwen3next`), re-done here from reading
its source (convert_hf_to_gguf.py):
- the header: Qwen3NextModel.set_gguf_parameters' ssm keys (conv kernel, state size = key
  head dim, group count = key heads, time step rank = value heads, inner size = value heads
  times value head dim), full_attention_interval and rope.dimension_count (head dim times
  partial_rotary_factor) on top of the text model's keys and Qwen2MoeModel's expert keys;
  qwen35 / qwen35moe also rope.dimension_sections (the _Qwen35MRopeMixin default);
- the tensors: Qwen3NextModel.modify_tensors (A_log stored as -exp(A_log), dt_bias renamed
  dt_proj.bias, the conv1d weight squeezed, every `norm.weight` but the linear layers' gated
  norm stored as 1 + w, in_proj_qkvz regrouped into all q, all k, all v rows (attn_qkv) and the
  z rows (attn_gate)); for qwen35 / qwen35moe first _LinearAttentionVReorderBase.modify_tensors
  (with more value heads than key heads, every per-value-head axis reordered from grouped by
  key head to tiled); experts stacked per layer into ffn_*_exps (Qwen2MoeModel), the shared
  expert's one-row gate as a vector; names by the gguf package's map (a tensor without a
  `.weight` / `.bias` suffix keeps none: A_log -> ssm_a).
`mtp_block`: as a converter that keeps the MTP layer (_Qwen35MtpMixin) writes it, one block more
at the end (`nextn_predict_layers` 1, `block_count` + 1; here a copy of the last layer's
tensors, which a reader of the model must leave unread).
`qtype` "F32", or "Q8_0": every matrix whose rows are whole 32-blocks as Q8_0 (else F16),
the router and vectors float32. The tokenizer is SmolLM2's first vocab_size tokens."""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from synthetic_gguf import _copy_tokenizer, _tokenizer_source  # noqa: E402

ARCH = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next"}
_EXPERT = re.compile(r"^model\.layers\.(?P<bid>\d+)\.mlp\.experts\.(?P<e>\d+)\."
                     r"(?P<proj>gate|up|down)_proj\.weight$")  # fmt: skip
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _header(raw: dict, arch: str) -> dict:
    head = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rotary = raw.get("partial_rotary_factor") or raw["rope_parameters"]["partial_rotary_factor"]
    own = {"block_count": raw["num_hidden_layers"],
           "context_length": raw["max_position_embeddings"],
           "embedding_length": raw["hidden_size"],
           "feed_forward_length": raw["intermediate_size"],
           "attention.head_count": raw["num_attention_heads"],
           "attention.head_count_kv": raw["num_key_value_heads"],
           "attention.key_length": head, "attention.value_length": head,
           "attention.layer_norm_rms_epsilon": float(raw["rms_norm_eps"]),
           "rope.freq_base": float(raw["rope_parameters"]["rope_theta"]),
           "ssm.conv_kernel": raw["linear_conv_kernel_dim"],
           "ssm.state_size": raw["linear_key_head_dim"],
           "ssm.group_count": raw["linear_num_key_heads"],
           "ssm.time_step_rank": raw["linear_num_value_heads"],
           "ssm.inner_size": raw["linear_value_head_dim"] * raw["linear_num_value_heads"],
           "full_attention_interval": raw.get("full_attention_interval", 4),
           "rope.dimension_count": int(head * rotary)}  # fmt: skip
    if arch != "qwen3next":
        own["rope.dimension_sections"] = [11, 11, 10, 0]
    if raw.get("num_experts"):
        own.update({"expert_count": raw["num_experts"],
                    "expert_used_count": raw["num_experts_per_tok"],
                    "expert_feed_forward_length": raw["moe_intermediate_size"],
                    "expert_shared_feed_forward_length":
                        raw["shared_expert_intermediate_size"]})  # fmt: skip
    return own


def _tiled(t: torch.Tensor, dim: int, raw: dict, head: int) -> torch.Tensor:
    """Axis `dim` of value heads of `head` each, grouped by key head -> tiled."""
    hk = raw["linear_num_key_heads"]
    r = raw["linear_num_value_heads"] // hk
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], hk, r, head, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def _v_reordered(name: str, t: torch.Tensor, raw: dict) -> torch.Tensor:
    """qwen35 / qwen35moe: the value-head axes tiled where Hv != Hk (module doc)."""
    hk, hv = raw["linear_num_key_heads"], raw["linear_num_value_heads"]
    if hk == hv or "linear_attn." not in name:
        return t
    dv, qk = raw["linear_value_head_dim"], 2 * hk * raw["linear_key_head_dim"]
    if ".in_proj_qkv." in name:
        return torch.cat([t[:qk], _tiled(t[qk:], 0, raw, dv)])
    if ".in_proj_z." in name:
        return _tiled(t, 0, raw, dv)
    if ".in_proj_a." in name or ".in_proj_b." in name or ".A_log" in name or ".dt_bias" in name:
        return _tiled(t, 0, raw, 1)
    if ".conv1d." in name:
        t = t.squeeze()
        return torch.cat([t[:qk], _tiled(t[qk:], 0, raw, dv)])
    if ".out_proj." in name:
        return _tiled(t, 1, raw, dv)
    return t


def _qkvz(t: torch.Tensor, raw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj_qkvz (per key head: q, k, v, z) -> (all q, all k, all v rows; all z rows)."""
    hk, dk = raw["linear_num_key_heads"], raw["linear_key_head_dim"]
    rv = raw["linear_num_value_heads"] // hk * raw["linear_value_head_dim"]
    q, k, v, z = t.reshape(hk, -1, t.shape[1]).split([dk, dk, rv, rv], dim=1)
    flat = [x.reshape(-1, t.shape[1]) for x in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3]


def _mapped(name: str, names) -> str:
    stem, suffix = name, ""
    if name.endswith((".weight", ".bias")):
        stem, dot, suffix = name.rpartition(".")
        suffix = dot + suffix
    return names.get_name(stem) + suffix


def _converted(name: str, t: torch.Tensor, raw: dict, arch: str, names) -> dict:
    """{file name: tensor} of checkpoint tensor `name` (module doc)."""
    if arch != "qwen3next":
        t = _v_reordered(name, t, raw)
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name[: -len("dt_bias")] + "dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    if "in_proj_qkvz.weight" in name:
        bid = _LAYER.search(name)[1]
        qkv, z = _qkvz(t, raw)
        return {f"blk.{bid}.attn_qkv.weight": qkv, f"blk.{bid}.attn_gate.weight": z}
    out = _mapped(name, names)
    if out.endswith(".ffn_gate_inp_shexp.weight"):
        t = t.reshape(-1)
    return {out: t}


def _file_tensors(folder: Path, raw: dict, arch: str) -> dict[str, np.ndarray]:
    import gguf
    from safetensors.torch import load_file

    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    names = gguf.get_tensor_name_map(by_name[arch], raw["num_hidden_layers"])
    out, experts = {}, defaultdict(dict)
    for name, t in load_file(str(folder / "model.safetensors")).items():
        if name.startswith("mtp."):
            continue  # the converter's MTP blocks are not the model's
        if m := _EXPERT.match(name):
            experts[f"blk.{m['bid']}.ffn_{m['proj']}_exps.weight"][int(m["e"])] = t
            continue
        out.update(_converted(name, t.float(), raw, arch, names))
    for n, parts in experts.items():
        out[n] = torch.stack([parts[e] for e in sorted(parts)]).float()
    return {n: t.numpy() for n, t in out.items()}


def _add(w, name: str, data: np.ndarray, qtype: str) -> None:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == "F32" or data.ndim == 1 or ".ffn_gate_inp." in name:
        w.add_tensor(name, data)
    elif data.shape[-1] % 32:
        w.add_tensor(name, data.astype(np.float16))
    else:
        w.add_tensor(name, quantize(data, Q.Q8_0), raw_dtype=Q.Q8_0)


def _write_header(w, own: dict, arch: str) -> None:
    for key, value in own.items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", int(value))


def _with_mtp_block(tensors: dict[str, np.ndarray], layers: int) -> dict[str, np.ndarray]:
    last = f"blk.{layers - 1}."
    extra = {f"blk.{layers}." + n[len(last) :]: t for n, t in tensors.items()
             if n.startswith(last)}  # fmt: skip
    return {**tensors, **extra}


def write_hybrid_gguf(folder: Path, path: Path, qtype: str = "F32",
                      header: dict | None = None, mtp_block: bool = False) -> Path:  # fmt: skip
    """The tiny hybrid checkpoint `folder` as GGUF file `path` (module doc); `header`
    overrides keys (without the `{arch}.` prefix)."""
    from gguf import GGUFWriter

    raw = json.loads((folder / "config.json").read_text())
    arch = ARCH[raw["model_type"]]
    w = GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{raw['model_type']}")
    own = _header(raw, arch)
    tensors = _file_tensors(folder, raw, arch)
    if mtp_block:
        own.update(block_count=own["block_count"] + 1, nextn_predict_layers=1)
        tensors = _with_mtp_block(tensors, raw["num_hidden_layers"])
    _write_header(w, {**own, **(header or {})}, arch)
    _copy_tokenizer(w, _tokenizer_source(), raw["vocab_size"])
    for name, data in sorted(tensors.items()):
        _add(w, name, data, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

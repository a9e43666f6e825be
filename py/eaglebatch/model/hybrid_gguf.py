"""GGUF files of the hybrid linear-attention families as llama.cpp's converter writes them:
`qwen35` (Qwen3.5 dense), `qwen35moe` (Qwen3.5 MoE), `qwen3next` (Qwen3-Next).

Header -> config.json (`hybrid_gguf_config`): the Gated DeltaNet sizes from the `ssm.` keys
(conv_kernel: linear_conv_kernel_dim; state_size: linear_key_head_dim; group_count:
linear_num_key_heads; time_step_rank: linear_num_value_heads; inner_size: value heads times
linear_value_head_dim), the layer kinds from `full_attention_interval` (every interval-th layer
full, as llama.cpp computes them), partial rotary from `rope.dimension_count` over the head
dim; `block_count` less `nextn_predict_layers` (a converter that keeps the MTP layer writes it
as the last blocks: those are the drafter's, never loaded); the experts from moe_gguf.py
(every layer routes: llama.cpp's tensors of these architectures have no dense MLP, so a
Qwen3-Next checkpoint with `mlp_only_layers` has no such file; one without a layer's router
is refused naming the tensor).

Tensors (`hybrid_gguf_fixup`): what the converter does to a linear layer, undone (the rest of
the model is the gguf package's name map, with 1 taken off every RMSNorm weight, which the
converter stores as 1 + w, except the gated norm `ssm_norm` it keeps):
- A_log is stored as -exp(A_log) in `ssm_a` (read back as log(-a)); dt_bias as `ssm_dt.bias`;
  the conv1d weight [C, 1, K] squeezed to [C, K] in `ssm_conv1d`; out_proj in `ssm_out`;
- qwen3next: in_proj_qkvz regrouped as all q rows, all k rows, all v rows (`attn_qkv`, the
  layout of Qwen3.5's in_proj_qkv) and the z rows (`attn_gate`); in_proj_ba kept as it is
  (`ssm_ba`: per key head, its value heads' b rows then their a rows);
- qwen35 / qwen35moe: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a as `attn_qkv`,
  `attn_gate`, `ssm_beta`, `ssm_alpha`; where there are more value heads than key heads, every
  per-value-head axis (the v rows of attn_qkv and the conv's v channels, attn_gate's rows,
  ssm_beta / ssm_alpha / ssm_a / ssm_dt, ssm_out's columns) reordered from grouped by key head
  to tiled (value head j of key head g moves to j * Hk + g). ssm_out's column order is applied
  to dequantized values only (its blocks are not read as stored).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from eaglebatch.model.deltanet_shape import DeltaNetShape
from eaglebatch.model.family import FULL, LINEAR
from eaglebatch.model.gguf_fix import GgufFix
from eaglebatch.model.moe_gguf import moe_gguf_config

_NEXT = "qwen3next"


def _positive(own: dict[str, Any], key: str, arch: str) -> int:
    value = own.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"GGUF {arch}.{key} = {value!r}: a {arch} file needs a positive count")
    return value


def _deltanet(own: dict[str, Any], arch: str) -> dict[str, int]:
    heads = _positive(own, "ssm.time_step_rank", arch)
    inner = _positive(own, "ssm.inner_size", arch)
    if inner % heads:
        raise ValueError(f"GGUF {arch}.ssm.inner_size = {inner} is not a multiple of "
                         f"{arch}.ssm.time_step_rank = {heads} (the value heads)")  # fmt: skip
    return {"linear_conv_kernel_dim": _positive(own, "ssm.conv_kernel", arch),
            "linear_key_head_dim": _positive(own, "ssm.state_size", arch),
            "linear_num_key_heads": _positive(own, "ssm.group_count", arch),
            "linear_num_value_heads": heads, "linear_value_head_dim": inner // heads}  # fmt: skip


def _layers(own: dict[str, Any], arch: str) -> dict[str, Any]:
    """num_hidden_layers (MTP blocks left out) and layer_types from the interval."""
    blocks = _positive(own, "block_count", arch)
    layers = blocks - int(own.get("nextn_predict_layers", 0))
    every = _positive(own, "full_attention_interval", arch)
    types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(layers)]
    return {"num_hidden_layers": layers, "layer_types": types, "full_attention_interval": every}


def _rotary(own: dict[str, Any], arch: str) -> dict[str, Any]:
    dims = own.get("rope.dimension_count")
    head = own.get("attention.key_length")
    if not isinstance(dims, int) or not isinstance(head, int) or not 0 < dims <= head:
        raise ValueError(f"GGUF {arch}.rope.dimension_count = {dims!r}: a {arch} file needs "
                         f"its rotary dims (at most {arch}.attention.key_length = "
                         f"{head!r})")  # fmt: skip
    return {"partial_rotary_factor": dims / head}


def hybrid_gguf_config(arch: str, experts: bool):
    """The `gguf_config` (family.py) of `arch` files; `experts`: it has routed MLPs."""

    def config(own: dict[str, Any], tensors) -> dict[str, Any]:
        out = {**_deltanet(own, arch), **_layers(own, arch), **_rotary(own, arch)}
        if experts:
            own = {**own, "block_count": out["num_hidden_layers"]}
            moe = moe_gguf_config(own, tensors, arch=arch, experts_key="num_experts",
                                  inner_key="moe_intermediate_size", renormalise=True,
                                  shared=True)  # fmt: skip
            out.update(moe, norm_topk_prob=True, decoder_sparse_step=1)
        return out

    return config


def _tiled(shape: DeltaNetShape, dim: int) -> np.ndarray:
    """File row of each parameter row of a per-value-head axis of `dim` per head, where the
    converter tiled the value heads (module doc)."""
    hk, r = shape.num_k_heads, shape.num_v_heads // shape.num_k_heads
    return np.arange(shape.num_v_heads * dim).reshape(r, hk, dim).swapaxes(0, 1).reshape(-1)


def _next_ba(shape: DeltaNetShape, second: bool) -> np.ndarray:
    """ssm_ba's rows of in_proj_b (`second` False) or in_proj_a."""
    hk, r = shape.num_k_heads, shape.num_v_heads // shape.num_k_heads
    return (np.arange(hk)[:, None] * 2 * r + (r if second else 0) + np.arange(r)).reshape(-1)


def _a_log(a: np.ndarray) -> np.ndarray:
    return np.log(-a)


def _qkv_rows(shape: DeltaNetShape, reorder: bool) -> np.ndarray | None:
    if not reorder:
        return None
    qk = np.arange(2 * shape.key_dim)
    return np.concatenate([qk, 2 * shape.key_dim + _tiled(shape, shape.head_v_dim)])


def _fixes(arch: str, s: DeltaNetShape, bid: str) -> dict[str, GgufFix]:
    """{parameter suffix under `linear_attn.`: its fix} of layer `bid` (module doc)."""
    blk = f"blk.{bid}."
    re = arch != _NEXT and s.num_v_heads != s.num_k_heads
    heads = _tiled(s, 1) if re else None
    conv = (s.conv_dim, 1, s.conv_kernel)
    fixes = {
        "A_log": GgufFix(blk + "ssm_a", heads, value=_a_log),
        "dt_bias": GgufFix(blk + "ssm_dt.bias", heads),
        "conv1d.weight": GgufFix(blk + "ssm_conv1d.weight", _qkv_rows(s, re), shape=conv),
        "norm.weight": GgufFix(blk + "ssm_norm.weight"),
        "out_proj.weight": GgufFix(blk + "ssm_out.weight",
                                   cols=_tiled(s, s.head_v_dim) if re else None),
        "in_proj_qkv.weight": GgufFix(blk + "attn_qkv.weight", _qkv_rows(s, re)),
        "in_proj_z.weight": GgufFix(blk + "attn_gate.weight",
                                    _tiled(s, s.head_v_dim) if re else None),
    }  # fmt: skip
    if arch == _NEXT:
        fixes["in_proj_b.weight"] = GgufFix(blk + "ssm_ba.weight", _next_ba(s, False),
                                            2 * s.num_v_heads)  # fmt: skip
        fixes["in_proj_a.weight"] = GgufFix(blk + "ssm_ba.weight", _next_ba(s, True),
                                            2 * s.num_v_heads)  # fmt: skip
    else:
        fixes["in_proj_b.weight"] = GgufFix(blk + "ssm_beta.weight", heads)
        fixes["in_proj_a.weight"] = GgufFix(blk + "ssm_alpha.weight", heads)
    return fixes


def hybrid_gguf_fixup(name: str, cfg, arch: str) -> GgufFix | None:
    """The fix of parameter `name` of a model of config `cfg` read from an `arch` file, None
    for a parameter read as the name map says."""
    stem, sep, suffix = name.partition(".linear_attn.")
    if not sep:
        return None
    bid = stem.rsplit(".", 1)[-1]
    return _fixes(arch, cfg.deltanet, bid).get(suffix)


def hybrid_gguf_keys(arch: str, experts: bool) -> dict[str, Any]:
    """A hybrid family's GGUF declarations (Family's gguf_* fields) for llama.cpp's `arch`:
    (1 + w) norms stored with the 1 folded in, the header read and the tensors fixed up here."""
    return {"gguf_architectures": (arch,), "gguf_experts": experts, "gguf_norm_offset": 1.0,
            "gguf_config": hybrid_gguf_config(arch, experts=experts),
            "gguf_fixup": partial(hybrid_gguf_fixup, arch=arch)}  # fmt: skip

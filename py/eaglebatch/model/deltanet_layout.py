"""Qwen3-Next's fused, interleaved Gated DeltaNet projections, split into the parameters
`GatedDeltaNet` holds (Qwen3.5's layout: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`).

Qwen3-Next stores `linear_attn.in_proj_qkvz.weight` grouped by key head: for each of the Hk key
heads g, its q rows (Dk), its k rows (Dk), then the v rows (r * Dv) and z rows (r * Dv) of the
r = Hv / Hk value heads it serves. `in_proj_ba.weight` likewise: per key head, r b rows then r a
rows. Qwen3.5 stores all q rows, all k rows, all v rows (in_proj_qkv), and z, b, a apart. Both
are the same linear maps; the split is a row permutation (exact).
"""

from __future__ import annotations

import torch

from eaglebatch.model.deltanet_shape import DeltaNetShape


def split_qkvz(weight: torch.Tensor, shape: DeltaNetShape) -> dict[str, torch.Tensor]:
    """in_proj_qkvz [2*Hk*Dk + 2*Hv*Dv, H] -> {"in_proj_qkv": [2*Hk*Dk + Hv*Dv, H],
    "in_proj_z": [Hv*Dv, H]}."""
    dk, r_dv = shape.head_k_dim, shape.num_v_heads // shape.num_k_heads * shape.head_v_dim
    want = shape.num_k_heads * (2 * dk + 2 * r_dv)
    if weight.shape[0] != want:
        raise ValueError(f"in_proj_qkvz has {weight.shape[0]} rows, the config needs {want}")
    groups = weight.reshape(shape.num_k_heads, 2 * dk + 2 * r_dv, -1)  # [Hk, per head, H]
    q, k, v, z = groups.split([dk, dk, r_dv, r_dv], dim=1)
    flat = [x.reshape(-1, weight.shape[1]) for x in (q, k, v, z)]
    return {"in_proj_qkv": torch.cat(flat[:3]), "in_proj_z": flat[3].contiguous()}


def split_ba(weight: torch.Tensor, shape: DeltaNetShape) -> dict[str, torch.Tensor]:
    """in_proj_ba [2*Hv, H] -> {"in_proj_b": [Hv, H], "in_proj_a": [Hv, H]}."""
    r = shape.num_v_heads // shape.num_k_heads
    if weight.shape[0] != 2 * shape.num_v_heads:
        raise ValueError(f"in_proj_ba has {weight.shape[0]} rows, the config needs "
                         f"{2 * shape.num_v_heads}")  # fmt: skip
    b, a = weight.reshape(shape.num_k_heads, 2 * r, -1).split([r, r], dim=1)
    return {"in_proj_b": b.reshape(-1, weight.shape[1]).contiguous(),
            "in_proj_a": a.reshape(-1, weight.shape[1]).contiguous()}  # fmt: skip

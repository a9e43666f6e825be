"""Checkpoint layouts of MoE experts, mapped onto the per-expert parameters of moe.py
(mlp.experts.{e}.gate_proj/up_proj/down_proj.weight): the fused 3-D tensors transformers 5
may write (experts.gate_up_proj [E, 2I, H], gate rows first; experts.down_proj [E, H, I]).
Works on torch tensors and on shapes alike, and imports no torch."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

_FUSED = ("experts.gate_up_proj", "experts.down_proj")
# a per-expert parameter of moe.py: its layer's stem (`...mlp.experts`), index and projection
EXPERT_PARAMETER = re.compile(r"^(?P<stem>.+\.experts)\.(?P<e>\d+)\."
                              r"(?P<proj>gate_proj|up_proj|down_proj)\.weight$")  # fmt: skip


def expert_tensors(name: str, value: Any, cfg) -> Iterator[tuple[str, Any]] | None:
    """A fused 3-D expert tensor (`_FUSED`, a tensor or a shape) as the per-expert parameters
    it holds; None for any other tensor."""
    suffix = next((f for f in _FUSED if name.endswith(f)), None)
    if suffix is None or not cfg.num_experts:
        return None
    prefix = name[: -len(suffix)] + "experts."
    shape = tuple(value.shape if hasattr(value, "shape") else value)
    e, inner, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    want = (e, 2 * inner, h) if suffix == _FUSED[0] else (e, h, inner)
    if shape != want:
        raise ValueError(f"tensor {name!r} has shape {shape}, the model expects {want}")
    return _per_expert(prefix, suffix == _FUSED[0], value, shape, inner)


def _per_expert(prefix, gate_up: bool, value, shape, inner) -> Iterator[tuple[str, Any]]:
    tensor = hasattr(value, "shape")
    for e in range(shape[0]):
        if not gate_up:
            yield f"{prefix}{e}.down_proj.weight", value[e] if tensor else shape[1:]
            continue
        for part, lo in (("gate_proj", 0), ("up_proj", inner)):
            rows = value[e, lo : lo + inner] if tensor else (inner, shape[2])
            yield f"{prefix}{e}.{part}.weight", rows

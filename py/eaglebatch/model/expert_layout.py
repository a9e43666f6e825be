"""Checkpoint layouts of MoE experts, mapped onto the per-expert parameters of moe.py
(mlp.experts.{e}.gate_proj/up_proj/down_proj.weight, and .bias with expert biases). A family
names its layout (Family.expert_layout):

- "stacked" (what transformers 5 writes for Qwen MoE, Mixtral): experts.gate_up_proj
  [E, 2I, H], the gate's rows first; experts.down_proj [E, H, I] (nn.Linear's [out, in]).
- "interleaved" (gpt-oss): experts.gate_up_proj [E, H, 2I], transposed (x @ W) with gate and up
  interleaved along the last dim (even columns gate, odd up), experts.gate_up_proj_bias
  [E, 2I] interleaved the same way; experts.down_proj [E, I, H] (x @ W), experts.down_proj_bias
  [E, H].

Works on torch tensors and on shapes alike (views, no copies), and imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

EXPERT_LAYOUTS = ("stacked", "interleaved")
_GATE_UP, _DOWN = "experts.gate_up_proj", "experts.down_proj"
_SUFFIXES = {"stacked": (_GATE_UP, _DOWN),
             "interleaved": (_GATE_UP, _DOWN, _GATE_UP + "_bias", _DOWN + "_bias")}  # fmt: skip
# a per-expert parameter of moe.py: its layer's stem (`...mlp.experts`), index and projection
EXPERT_PARAMETER = re.compile(r"^(?P<stem>.+\.experts)\.(?P<e>\d+)\."
                              r"(?P<proj>gate_proj|up_proj|down_proj)\.weight$")  # fmt: skip


def expert_tensors(
    name: str, value: Any, cfg, layout: str = "stacked"
) -> Iterator[tuple[str, Any]] | None:
    """A fused expert tensor of `layout` (a tensor or a shape) as the per-expert parameters
    it holds; None for any other tensor. A shape other than the model's is a ValueError naming
    the tensor."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert layout {layout!r} is not one of {', '.join(EXPERT_LAYOUTS)}")
    suffix = next((f for f in _SUFFIXES[layout] if name.endswith(f)), None)
    if suffix is None or not cfg.num_experts:
        return None
    shape = tuple(value.shape if hasattr(value, "shape") else value)
    want = _shape(layout, suffix, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    if shape != want:
        raise ValueError(f"tensor {name!r} has shape {shape}, the model expects {want}")
    prefix = name[: -len(suffix)] + "experts."
    parts = _stacked if layout == "stacked" else _interleaved
    return _per_expert(prefix, parts(suffix, cfg.moe_intermediate_size), value)


def _shape(layout: str, suffix: str, e: int, inner: int, h: int) -> tuple[int, ...]:
    if layout == "stacked":
        return (e, 2 * inner, h) if suffix == _GATE_UP else (e, h, inner)
    return {_GATE_UP: (e, h, 2 * inner), _DOWN: (e, inner, h),
            _GATE_UP + "_bias": (e, 2 * inner), _DOWN + "_bias": (e, h)}[suffix]  # fmt: skip


def _stacked(suffix: str, inner: int) -> list[tuple[str, Any, bool]]:
    """(parameter, index into one expert's slice, transposed?) of each part."""
    if suffix == _DOWN:
        return [("down_proj.weight", slice(None), False)]
    return [("gate_proj.weight", slice(0, inner), False),
            ("up_proj.weight", slice(inner, 2 * inner), False)]  # fmt: skip


def _interleaved(suffix: str, inner: int) -> list[tuple[str, Any, bool]]:
    gate, up = (slice(None), slice(0, None, 2)), (slice(None), slice(1, None, 2))
    return {
        _GATE_UP: [("gate_proj.weight", gate, True), ("up_proj.weight", up, True)],
        _GATE_UP + "_bias": [("gate_proj.bias", slice(0, None, 2), False),
                             ("up_proj.bias", slice(1, None, 2), False)],
        _DOWN: [("down_proj.weight", slice(None), True)],
        _DOWN + "_bias": [("down_proj.bias", slice(None), False)],
    }[suffix]  # fmt: skip


def _per_expert(prefix: str, parts, value) -> Iterator[tuple[str, Any]]:
    tensor = hasattr(value, "shape")
    shape = tuple(value.shape if tensor else value)
    for e in range(shape[0]):
        for param, index, transposed in parts:
            if tensor:
                part = value[e][index]
                yield f"{prefix}{e}.{param}", part.T if transposed else part
            else:
                dims = tuple(len(range(*i.indices(n))) for i, n in
                             zip(index if isinstance(index, tuple) else (index,), shape[1:]))
                dims += shape[1 + len(dims):]
                yield f"{prefix}{e}.{param}", dims[::-1] if transposed else dims

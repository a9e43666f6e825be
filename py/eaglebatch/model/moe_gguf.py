"""A mixture-of-experts GGUF header -> the MoE keys of config.json (moe.py's settings), for the
families whose files llama.cpp writes with routed experts (`qwen3moe`, `qwen2moe`, Mixtral as
`llama` with experts, `gpt-oss`, `gemma4`): a family's `gguf_config` (family.py) calls
`moe_gguf_config` and adds what is its own (the top-k renormalisation and gating function
llama.cpp hard-codes per architecture).

What a file states (header keys given without the `{arch}.` prefix; tensors in GGUF order,
the innermost dimension first):
- `expert_count`, `expert_used_count`: num_experts (or num_local_experts), num_experts_per_tok;
- `expert_feed_forward_length`: the experts' inner size, else the rows of the file's first
  `ffn_gate_exps` (or half those of a fused `ffn_gate_up_exps`; llama.cpp's Mixtral files
  state it as `feed_forward_length` only);
- `expert_shared_feed_forward_length`: the shared expert's inner size (Qwen2 MoE), else the
  rows of its first `ffn_gate_shexp`;
- a layer without a router (`blk.N.ffn_gate_inp`) has a dense MLP (`mlp_only_layers`) where
  the family has them, else it is refused naming the tensor.

Invariants: every router and expert tensor (weights, biases, per-expert scales) holds
`expert_count` experts, else a ValueError naming the key and the tensor; an `expert_*` key
that changes the routing and that no setting here represents (a weight scale other than 1, a
gating function other than the architecture's, a top-k renormalisation other than the
architecture's, expert groups, shared experts the family has none of) is refused by name,
never dropped.
"""

from __future__ import annotations

import re
from typing import Any

_ROUTER = "blk.{}.ffn_gate_inp.weight"
# a tensor with one entry per expert, outermost (the last GGUF dimension)
_PER_EXPERT = re.compile(r"^blk\.\d+\.(ffn_gate_inp\.(weight|bias)|"
                         r"ffn_(gate|up|down|gate_up)_exps\.(weight|bias|scale))$")  # fmt: skip
_SHARED = re.compile(r"^blk\.\d+\.ffn_\w+_shexp\.weight$")
_SOFTMAX = 1  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid, 3 softmax of the top k


def _count(own: dict[str, Any], key: str, arch: str) -> int:
    value = own.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"GGUF {arch}.{key} = {value!r}: a mixture-of-experts file needs a "
                         "positive count")  # fmt: skip
    return value


def _check_counts(tensors, count: int, arch: str) -> None:
    """Every router ([H, E]), expert tensor ([k, rows, E]), expert bias ([rows, E]) and
    per-expert scale ([E]) holds `count` experts."""
    for name, t in sorted(tensors.items()):
        if _PER_EXPERT.match(name) and int(t.shape[-1]) != count:
            raise ValueError(f"GGUF {arch}.expert_count = {count}, but tensor {name} holds "
                             f"{int(t.shape[-1])} experts (shape {tuple(t.shape)})")  # fmt: skip


def _checked_settings(own: dict[str, Any], arch: str, renormalise: bool, shared: bool,
                      gating: int) -> None:  # fmt: skip
    """Refuses the `expert_*` keys whose value no setting represents (module doc)."""
    allowed = {"expert_weights_scale": 1.0, "expert_gating_func": gating,
               "expert_weights_norm": renormalise, "expert_shared_count": int(shared)}  # fmt: skip
    known = {"expert_count", "expert_used_count", "expert_feed_forward_length"}
    if shared:
        known.add("expert_shared_feed_forward_length")
    for key, value in sorted(own.items()):
        if not key.startswith("expert") or key in known:
            continue
        if key not in allowed or value != allowed[key]:
            raise ValueError(f"GGUF {arch}.{key} = {value!r}: not supported for {arch} files "
                             "(a routing this model does not compute)")  # fmt: skip


def _inner_rows(tensors, layer: int) -> int | None:
    """The experts' rows in layer `layer`'s ffn_gate_exps (half a fused ffn_gate_up_exps')."""
    t = tensors.get(f"blk.{layer}.ffn_gate_exps.weight")
    if t is not None:
        return int(t.shape[1])
    t = tensors.get(f"blk.{layer}.ffn_gate_up_exps.weight")
    return None if t is None else int(t.shape[1]) // 2


def _dense_layers(own: dict[str, Any], tensors, arch: str, dense_ok: bool) -> list[int]:
    layers = own.get("block_count")
    if not isinstance(layers, int):
        raise ValueError(f"GGUF {arch}.block_count = {layers!r}: not a layer count")
    dense = [i for i in range(layers) if _ROUTER.format(i) not in tensors]
    if dense and (not dense_ok or len(dense) == layers):
        raise ValueError(f"GGUF tensor {_ROUTER.format(dense[0])} is missing: every layer of "
                         f"a {arch} file with experts routes its MLP")  # fmt: skip
    return dense


def _shared_size(own: dict[str, Any], tensors, first: int, arch: str) -> int:
    size = own.get("expert_shared_feed_forward_length")
    shexp = tensors.get(f"blk.{first}.ffn_gate_shexp.weight")
    size = (None if shexp is None else int(shexp.shape[1])) if size is None else size
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"GGUF {arch}.expert_shared_feed_forward_length = {size!r} and no "
                         f"tensor blk.{first}.ffn_gate_shexp.weight: the shared expert's "
                         "size is unknown")  # fmt: skip
    return size


def moe_gguf_config(own: dict[str, Any], tensors, *, arch: str, experts_key: str,
                    inner_key: str, renormalise: bool, shared: bool = False,
                    dense_ok: bool = False, gating: int = _SOFTMAX) -> dict[str, Any]:  # fmt: skip
    """The MoE keys of config.json from header keys `own` (prefix dropped) and `tensors`
    (name -> GgufFile TensorInfo) of an `arch` file: the expert count as `experts_key`, their
    inner size as `inner_key`; `renormalise`: the top-k renormalisation llama.cpp computes for
    `arch`; `shared`: the family has a shared expert; `dense_ok`: it has dense layers
    (mlp_only_layers); `gating`: the gating function llama.cpp computes for `arch`. Raises
    ValueError naming a key or tensor it cannot represent."""
    count = _count(own, "expert_count", arch)
    used = _count(own, "expert_used_count", arch)
    if used > count:
        raise ValueError(f"GGUF {arch}.expert_used_count = {used} exceeds {arch}.expert_count "
                         f"= {count}")  # fmt: skip
    _check_counts(tensors, count, arch)
    _checked_settings(own, arch, renormalise, shared, gating)
    dense = _dense_layers(own, tensors, arch, dense_ok)
    first = next(i for i in range(own["block_count"]) if i not in dense)
    inner = own.get("expert_feed_forward_length")
    inner = _inner_rows(tensors, first) if inner is None else inner
    if not isinstance(inner, int) or inner < 1:
        raise ValueError(f"GGUF {arch}.expert_feed_forward_length = {inner!r} and no tensor "
                         f"blk.{first}.ffn_gate_exps.weight: the experts' size is unknown")
    config: dict[str, Any] = {experts_key: count, "num_experts_per_tok": used, inner_key: inner}
    if dense:
        config["mlp_only_layers"] = dense
    if shared:
        config["shared_expert_intermediate_size"] = _shared_size(own, tensors, first, arch)
    elif stray := sorted(n for n in tensors if _SHARED.match(n)):
        raise ValueError(f"GGUF tensor {stray[0]}: a {arch} file has no shared expert")
    return config

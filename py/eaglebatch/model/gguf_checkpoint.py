"""A GGUF file as the checkpoint: its tensors by Hugging Face parameter name, read from a
read-only memory map of the file (no float32 copy on disk, none in memory but one tensor at a
time while a dequantized parameter is filled).

Invariants:
- a tensor reaches the model as transformers' GGUF loader converts it (the tests' reference):
  the `gguf` package's dequantizer to float32, then the family's fix-ups (family.py): the rows
  of q_proj and k_proj un-permuted where llama.cpp interleaved each head's two RoPE halves
  (`gguf_qk_permuted`), norm weights less what llama.cpp added (`gguf_norm_offset`);
- `blocks(name)` is the file's bytes of a quantized weight in the parameter's row order: a view
  of the map when the order is the file's (nothing read until a kernel reads it), else a copy
  of the rows whose mapped pages are dropped from this process again (not resident twice);
- a parameter that is a part of one of the family's fused tensors (`Family.fused`, e.g. Phi-3's
  q_proj in `attn_qkv`) is read as its rows of the file's fused tensor, where the file holds
  that tensor and no tensor of the part's own (rows are whole blocks: GGUF quantizes by row);
  its `blocks` are a view of the map too;
- RoPE the header states and config.json (transformers' conversion) drops is refused, never
  run as full default RoPE: a `rope.dimension_count` other than the config's rotary dim
  (partial rotary, Phi-4-mini, is served where config.json states it) and per-frequency factor
  tensors (`rope_factors_*`: longrope, Phi-3 128k; not compared with config.json's factors);
- an expert's parameter (mlp.experts.{e}.gate_proj/up_proj/down_proj.weight, moe.py) is
  expert e's slab of layer N's 3-D tensor, by llama.cpp's names for every architecture
  (blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps, [experts, rows, k] innermost last; where
  the file has no ffn_gate_exps / ffn_up_exps, the gate's rows then the up's of each expert's
  slab of the fused blk.N.ffn_gate_up_exps, [experts, 2 * rows, k]): its `blocks` are a view
  of the map, contiguous rows of whole blocks (GGUF quantizes by row); an expert's bias
  (`.bias`, gpt-oss) is row e of the same name's `.bias` tensor ([experts, rows], the fused
  one's first or second half); a tensor of another expert count or expert shape than the
  config's is a ValueError naming the tensor (`shapes`);
- a parameter the gguf package's name map does not name is found by the family's
  `gguf_names` (Gemma 4's router scales); one the converter stored otherwise is read by the
  family's `gguf_fixup` (gguf_fix.py: rows reordered or selected, a value transform undone,
  a squeezed shape restored; its blocks in its row order where no column order applies);
- opening reads the header only; a parameter without its tensor, or of another shape, is a
  ValueError naming both (before anything is loaded, `check`).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from eaglebatch.model.family import Family
from eaglebatch.model.gguf_file import GgufFile
from eaglebatch.model.gguf_fix import GgufFix
from eaglebatch.model.registry import family_of

# llama.cpp stores the shared expert's one-row gate (mlp.shared_expert_gate [1, H]) as a vector
_ONE_ROW = ".shared_expert_gate.weight"
# a per-expert parameter of moe.py (a weight, or a bias with expert_bias) of layer `bid`
_EXPERT = re.compile(r"^.+\.layers\.(?P<bid>\d+)\..+\.experts\.(?P<e>\d+)\."
                     r"(?P<proj>gate|up|down)_proj\.(?P<kind>weight|bias)$")  # fmt: skip
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _expert_shape(cfg, proj: str, kind: str, fused: bool) -> tuple[int, ...]:
    """[experts, rows, k] (a bias: [experts, rows]) of a layer's expert tensor of projection
    `proj` (moe.py's Expert); `fused`: gate and up stacked (twice the rows)."""
    e, inner, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    rows, k = (h, inner) if proj == "down" else (inner * (2 if fused else 1), h)
    return (e, rows, k) if kind == "weight" else (e, rows)


def _qk_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's permute of a q or k weight of `heads` heads:
    HF row i is the file's row order[i]."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)


def _row_order(family: Family, gguf_name: str, rows: int, cfg) -> np.ndarray | None:
    if not family.gguf_qk_permuted:
        return None
    if ".attn_q." in gguf_name:
        return _qk_rows(rows, cfg.num_attention_heads)
    if ".attn_k." in gguf_name:
        return _qk_rows(rows, cfg.num_key_value_heads)
    return None


def _fused_part(family: Family, name: str, cfg) -> tuple[str, int, int] | None:
    """(the fused checkpoint tensor holding parameter `name`, its first row there, its rows)
    where `name` is a part of one of the family's fused tensors."""
    for f in family.fused:
        for i, part in enumerate(f.parts):
            if name.endswith(part):
                sizes = f.sizes(cfg)
                return name[: -len(part)] + f.name, sum(sizes[:i]), sizes[i]
    return None


def _norm_offset(family: Family, gguf_name: str) -> float:
    return family.gguf_norm_offset if "norm.weight" in gguf_name else 0.0


def check_rope(reader: GgufFile, cfg) -> None:
    """A ValueError naming the header key or tensor of a RoPE the model's config lacks."""
    key = f"{reader.architecture}.rope.dimension_count"
    dims = reader.meta.get(key)
    rotary = cfg.rotary_dim or cfg.head_dim
    if cfg.layer_head_dims is not None:  # per-kind head dims (Gemma 4): the key is the full
        # layers' whole head (their RoPE's own settings; the family's gguf_config checks both)
        rotary = cfg.layer_head_dims[cfg.num_hidden_layers - 1]
    if isinstance(dims, int) and dims != rotary:
        raise ValueError(f"GGUF {key} = {dims}: the model config rotates {rotary} dims of "
                         f"each head of {cfg.head_dim} (partial_rotary_factor)")  # fmt: skip
    factors = sorted(n for n in reader.tensors if n.startswith("rope_factors"))
    if factors:
        raise ValueError(f"GGUF tensor {factors[0]}: RoPE frequency factors (longrope) are "
                         "not supported")  # fmt: skip


class GgufCheckpoint:
    """The tensors of GGUF file `path` for the parameters `names` of a model of config `cfg`
    (ModelConfig). Parameters without a tensor are left out of `shapes` (check names them).
    `expand(data, ggml_type, (n, k))`: a faster dequantizer of 2-D quantized tensors giving
    the gguf package's values bit for bit, or None where it does not apply (the CPU kernels',
    cpu/gguf_blocks.py; this package does not import cpu/)."""

    def __init__(self, path: str | os.PathLike[str], cfg, names: Iterable[str],
                 expand: Callable | None = None) -> None:  # fmt: skip
        # lazy: the gguf package, only for a GGUF model
        import gguf

        self.path = Path(path)
        self.cfg = cfg
        self.expand = expand
        self.reader = GgufFile(self.path)
        self.arch = self.reader.architecture
        self.family = family_of(cfg.model_type)
        check_rope(self.reader, cfg)
        by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
        if self.arch not in by_name:
            raise ValueError(f"architecture {self.arch!r} unknown to the gguf package")
        mapping = gguf.get_tensor_name_map(by_name[self.arch], cfg.num_hidden_layers)
        self.tensors = {}
        self.rows: dict[str, tuple[int, int]] = {}  # fused parts: (first row, rows) of tensors[n]
        self.experts: dict[str, int] = {}  # an expert's parameter: its index in tensors[n]
        self.expert_rows: dict[str, int] = {}  # a part of ffn_gate_up_exps: its first row
        self.fixes: dict[str, GgufFix] = {}
        for name in names:
            if fix := self._fix(name):
                if (t := self.reader.tensors.get(fix.tensor)) is not None:
                    self.tensors[name], self.fixes[name] = t, fix
                continue
            if m := _EXPERT.match(name):  # expert e's slab of the layer's expert tensor
                t, first = self._expert_tensor(m)
                if t is not None:
                    self.tensors[name], self.experts[name] = t, int(m["e"])
                if first is not None:
                    self.expert_rows[name] = first
                continue
            t = self._named(name) or self._tensor(mapping, name)
            fused = _fused_part(self.family, name, cfg)
            whole = self._tensor(mapping, fused[0]) if fused else None
            if whole is not None and (t is None or t is whole):
                t, self.rows[name] = whole, fused[1:]
            if t is not None:
                self.tensors[name] = t

    def _fix(self, name: str) -> GgufFix | None:
        fixup = self.family.gguf_fixup
        return None if fixup is None else fixup(name, self.cfg)

    def _tensor(self, mapping, name: str):
        """The file's tensor of checkpoint tensor `name` (by the gguf package's name map)."""
        stem = name.removesuffix(".weight").removesuffix(".bias")
        base = mapping.get_name(stem)
        # a bare parameter (Gemma 4's layer_scalar) is stored as `.weight`, as llama.cpp names it
        suffix = name[len(stem):] or ".weight"
        return self.reader.tensors.get(f"{base}{suffix}") if base else None

    def _expert_tensor(self, m: re.Match):
        """(the file's tensor of expert parameter `m`, its first row in a fused gate/up
        tensor or None); (None, None) where the file has neither."""
        # lazy: the gguf package, only for a GGUF model
        import gguf

        names, tensors = gguf.TENSOR_NAMES, self.reader.tensors
        own = {"gate": gguf.MODEL_TENSOR.FFN_GATE_EXP, "up": gguf.MODEL_TENSOR.FFN_UP_EXP,
               "down": gguf.MODEL_TENSOR.FFN_DOWN_EXP}[m["proj"]]  # fmt: skip
        suffix = f".{m['kind']}"
        t = tensors.get(names[own].format(bid=m["bid"]) + suffix)
        if t is not None or m["proj"] == "down":
            return t, None
        t = tensors.get(names[gguf.MODEL_TENSOR.FFN_GATE_UP_EXP].format(bid=m["bid"]) + suffix)
        first = 0 if m["proj"] == "gate" else self.cfg.moe_intermediate_size
        return t, (first if t is not None else None)

    def _named(self, name: str):
        """The file's tensor of `name` by the family's `gguf_names`, or None."""
        for suffix, pattern in self.family.gguf_names:
            if name.endswith(suffix) and (m := _LAYER.search(name)):
                return self.reader.tensors.get(pattern.format(bid=m[1]))
        return None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """{parameter name: shape} of the tensors found (GGUF lists dimensions reversed)."""
        return self._shapes

    @cached_property
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for name, t in self.tensors.items():
            shape = tuple(int(d) for d in reversed(t.shape))
            if name in self.fixes:
                shape = self.fixes[name].param_shape(shape)
            elif name in self.experts:
                shape = self._expert_slab(name, shape)
            elif name.endswith(_ONE_ROW) and len(shape) == 1:
                shape = (1, *shape)
            if name in self.rows:  # checked against the fused tensor's rows (family.split)
                fused = _fused_part(self.family, name, self.cfg)[0]
                shape = dict(self.family.split(fused, shape, self.cfg))[name]
            shapes[name] = shape
        return shapes

    def _expert_slab(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """[rows, k] (a bias: [rows]) of expert parameter `name`, its file tensor of `shape`
        [experts, rows, k] ([experts, rows]) checked against the config's (a ValueError naming
        the tensor)."""
        m = _EXPERT.match(name)
        fused = name in self.expert_rows
        want = _expert_shape(self.cfg, m["proj"], m["kind"], fused)
        if shape != want:
            dims = "rows, columns" if m["kind"] == "weight" else "rows"
            raise ValueError(
                f"GGUF tensor {self.tensors[name].name} has shape {shape} [experts, {dims}]; "
                f"the model config expects {want} (num_experts = {want[0]}, "
                f"moe_intermediate_size = {self.cfg.moe_intermediate_size}, hidden_size = "
                f"{self.cfg.hidden_size}: the header's {self.arch}.expert_count and expert "
                "feed-forward length)"
            )
        rows = want[1] // 2 if fused else want[1]
        return (rows, *want[2:])

    def _data(self, name: str) -> np.ndarray:
        """The map's view of parameter `name`'s data (a fused part: its rows; an expert: its
        slab, contiguous in the map)."""
        data = self.tensors[name].data
        if name in self.experts:  # typed [E, rows, k] or blocks [E * rows, row bytes]
            return self._expert_data(name, data)
        if name not in self.rows:
            return data
        first, rows = self.rows[name]
        return data[first : first + rows]

    def _expert_data(self, name: str, data: np.ndarray) -> np.ndarray:
        """Expert parameter `name`'s slab of its tensor's `data` (rows of a bias' row)."""
        count = int(self.tensors[name].shape[-1])
        if name.endswith(".weight"):
            slab = data.reshape(count, -1, data.shape[-1])[self.experts[name]]
        else:  # a bias: [E, rows] (blocks: [E, row bytes])
            slab = data.reshape(count, -1)[self.experts[name]]
        first = self.expert_rows.get(name)
        if first is None:
            return slab
        rows = self.shapes()[name][0]
        if not name.endswith(".weight") and slab.dtype == np.uint8:  # a quantized bias row
            raise ValueError(f"GGUF tensor {self.tensors[name].name}: a quantized fused "
                             "expert bias is not supported")  # fmt: skip
        return slab[first : first + rows]

    def ggml_type(self, name: str) -> int:
        return self.tensors[name].ggml_type

    def nbytes(self, name: str) -> int:
        fix = self.fixes.get(name)
        if fix is not None and fix.rows is not None:  # its share of the file's rows
            t = self.tensors[name]
            return t.n_bytes * len(fix.rows) // int(t.shape[-1])
        return int(self._data(name).nbytes)

    def float32(self, name: str) -> torch.Tensor:
        """Parameter `name` dequantized to float32, fixed up as transformers does."""
        # lazy: the gguf package, only for a GGUF model
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        if name in self.fixes:
            return self._fixed_float32(name)
        t = self.tensors[name]
        shape = self.shapes()[name]
        w = None
        data = self._data(name)
        if self.expand is not None and len(shape) == 2:
            w = self.expand(data, t.ggml_type, shape)
        if w is None:
            qtype = GGMLQuantizationType(t.ggml_type)
            w = np.asarray(dequantize(data, qtype), dtype=np.float32).reshape(shape)
        order = _row_order(self.family, t.name, shape[0], self.cfg) if len(shape) == 2 else None
        if order is not None:
            w = w[order]
        offset = _norm_offset(self.family, t.name)
        if offset:
            w = w - np.float32(offset)
        return torch.from_numpy(np.array(w, dtype=np.float32, copy=True))

    def _fixed_float32(self, name: str) -> torch.Tensor:
        """Parameter `name` of the family's `gguf_fixup`: its file tensor dequantized whole,
        then the fix applied (no norm offset: the fix states the value)."""
        # lazy: the gguf package, only for a GGUF model
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        file_shape = tuple(int(d) for d in reversed(t.shape))
        w = np.asarray(dequantize(t.data, GGMLQuantizationType(t.ggml_type)), dtype=np.float32)
        w = self.fixes[name].apply(w.reshape(file_shape))
        return torch.from_numpy(np.array(w, dtype=np.float32, copy=True))

    def blocks_readable(self, name: str) -> bool:
        """Whether weight `name`'s blocks hold its rows whole (no column order to apply)."""
        fix = self.fixes.get(name)
        return fix is None or (fix.cols is None and fix.shape is None)

    def iter_float32(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            if name in self.tensors:
                yield name, self.float32(name)

    def blocks(self, name: str) -> torch.Tensor:
        """uint8 [rows, row bytes]: 2-D weight `name`'s blocks (its raw bytes for a float type)
        in its row order, a view of the map where the order is the file's."""
        t = self.tensors[name]
        data = self._data(name)
        fix = self.fixes.get(name)
        if fix is not None and fix.rows is not None:  # the file's rows, then the fix's order
            data = data.reshape(int(t.shape[-1]) if len(t.shape) > 1 else 1, -1).view(np.uint8)
            return torch.from_numpy(np.ascontiguousarray(data[fix.rows]))
        data = data.reshape(self.shapes()[name][0], -1).view(np.uint8)  # [rows, row bytes]
        order = _row_order(self.family, t.name, data.shape[0], self.cfg)
        if order is None:
            with warnings.catch_warnings():  # read-only: the kernels never write blocks
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(data)
        rows = np.ascontiguousarray(data[order])
        self.reader.drop_pages(t.data_offset + self.rows.get(name, (0,))[0] * data.shape[1],
                               data.nbytes)  # fmt: skip
        return torch.from_numpy(rows)

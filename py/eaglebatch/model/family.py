"""`Family`: what is particular to one model family, declared in its own file under model/
(llama.py, qwen3.py, gemma3.py, ...) and found by `model_type` in registry.py.

A family says how its `config.json` maps onto the engine's ModelConfig (the fields that are
not read the same way for every family: biases, windows, norm kind and placement, q/k norms,
multipliers, soft-capping, per-layer types, experts), which checkpoint tensors it stores
differently (fused projections split into the decoder's parameters, other names), and how
llama.cpp stores it in GGUF.
The decoder (decoder_layer.py, causal_lm.py) and every execution path read ModelConfig's
features only, never a family's name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from eaglebatch.model.expert_layout import expert_tensors

# the layer types of `layer_types`; LINEAR: a Gated DeltaNet layer (model/gated_deltanet.py)
SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"


@dataclass(frozen=True)
class Fused:
    """A checkpoint tensor `name` (a suffix, e.g. "self_attn.qkv_proj.weight") that holds the
    parameters `parts` (suffixes) stacked along dim 0, of `sizes(cfg)` rows each."""

    name: str
    parts: tuple[str, ...]
    sizes: Callable[[Any], tuple[int, ...]]


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    architecture: str  # the causal-LM class its `architectures` names
    # raw config.json -> the ModelConfig fields this family sets (the rest keep their defaults);
    # raises ValueError naming a key whose value the family does not implement
    features: Callable[[dict[str, Any]], dict[str, Any]]
    # raw config.json -> the same settings as this family's transformers config class
    # normalises them (renamed RoPE kinds, its own defaults), before the shared readers
    # (shapes, RoPE) see them; raises ValueError naming a key the family refuses. None: as is
    standardize: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    tie_word_embeddings: bool = False  # the default when config.json does not say
    # multimodal model_types whose `text_config` is this family's text model
    text_tower_of: tuple[str, ...] = ()
    fused: tuple[Fused, ...] = ()
    # (old, new) substrings of checkpoint tensor names, replaced in order before anything else
    # (a family that names the decoder's parameters otherwise, e.g. Mixtral's experts)
    renamed: tuple[tuple[str, str], ...] = ()
    # prefixes of checkpoint tensor names that are not the causal LM's and are never loaded
    # (e.g. a multi-token-prediction drafter's `mtp.` layers)
    dropped: tuple[str, ...] = ()
    # (name, tensor or shape, cfg) -> the (parameter name, tensor or shape) pairs a tensor the
    # family stores its own way holds (e.g. interleaved fused projections), None for any other
    splitter: Callable[[str, Any, Any], list[tuple[str, Any]] | None] | None = None
    # how the checkpoint stores fused 3-D expert tensors (expert_layout.py EXPERT_LAYOUTS)
    expert_layout: str = "stacked"
    # GGUF: llama.cpp's `general.architecture` names of this family's files, whether its
    # converter interleaved the two RoPE halves of q/k rows (llama), and what it added to norm
    # weights (Gemma stores 1 + w)
    gguf_architectures: tuple[str, ...] = ()
    # its files of those architectures hold routed experts (`{arch}.expert_count`): where two
    # families share an architecture (llama.cpp writes Mixtral as `llama`), a file is the one's
    # whose `gguf_experts` says what the file holds (registry.family_of_gguf)
    gguf_experts: bool = False
    gguf_qk_permuted: bool = False
    gguf_norm_offset: float = 0.0
    # (parameter name suffix, the file's tensor name with `{bid}` for the layer index) of the
    # parameters the gguf package's name map does not name (model/gguf_checkpoint.py)
    gguf_names: tuple[tuple[str, str], ...] = ()
    # (parameter name, cfg) -> how the parameter is read from a file whose converter stored it
    # otherwise (gguf_fix.GgufFix: reordered rows, a value transform, a squeezed shape), None
    # for a parameter read by the name map
    gguf_fixup: Callable[[str, Any], Any] | None = None
    # GGUF header -> config.json, where transformers' GGUF loader has no config mapping for
    # the architecture: the header's `{arch}.` keys (prefix dropped) and the file's tensors
    # (name -> GgufFile TensorInfo) -> this family's config.json keys beyond the shared ones
    # (model/gguf_config.py); raises ValueError naming a key or tensor it cannot represent.
    # None: transformers' loader writes config.json.
    gguf_config: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None

    def split(self, name: str, shape_or_tensor, cfg) -> Iterator[tuple[str, Any]]:
        """Checkpoint tensor `name` as (parameter name, tensor or shape) pairs: a fused tensor
        split into its parts, any other as it is, after the family's renames; fused 3-D MoE
        experts split per expert (expert_layout.py). Works on torch tensors and on shapes."""
        if self.dropped and name.startswith(self.dropped):
            return
        for old, new in self.renamed:
            name = name.replace(old, new)
        own = None if self.splitter is None else self.splitter(name, shape_or_tensor, cfg)
        if own is not None:
            yield from own
            return
        experts = expert_tensors(name, shape_or_tensor, cfg, self.expert_layout)
        if experts is not None:
            yield from experts
            return
        for f in self.fused:
            if name.endswith(f.name):
                yield from _split(name[: -len(f.name)], f, shape_or_tensor, cfg)
                return
        yield name, shape_or_tensor


def _split(prefix: str, f: Fused, value, cfg) -> Iterator[tuple[str, Any]]:
    sizes = f.sizes(cfg)
    if hasattr(value, "shape"):  # a tensor
        if value.shape[0] != sum(sizes):
            raise ValueError(f"tensor {prefix + f.name!r} has {value.shape[0]} rows, the model "
                             f"expects {sum(sizes)} ({' + '.join(map(str, sizes))})")  # fmt: skip
        yield from zip((prefix + p for p in f.parts), value.split(sizes, dim=0))
        return
    shape = tuple(value)
    if shape[0] != sum(sizes):
        raise ValueError(f"tensor {prefix + f.name!r} has shape {shape}, the model expects "
                         f"{sum(sizes)} rows ({' + '.join(map(str, sizes))})")  # fmt: skip
    for part, rows in zip(f.parts, sizes):
        yield prefix + part, (rows, *shape[1:])

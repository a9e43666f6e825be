"""A checkpoint's own multi-token-prediction layer (`draft: mtp`) checked against the model
before any work (speculative/mtp.py says what it computes).

A checkpoint that carries one (Qwen3.5 / 3.6, Qwen3-Next) states `mtp_num_hidden_layers` in its
(text) config and holds, beside the decoder's tensors:
  mtp.fc.weight [H, 2H], mtp.pre_fc_norm_embedding.weight [H], mtp.pre_fc_norm_hidden.weight [H],
  mtp.layers.0.* (one decoder layer of the model's full-attention kind, its parameters named as
  model.layers.N.*: gated attention, QK-norm, the dense MLP or the experts), mtp.norm.weight [H].
The embedding and the LM head are the model's. Any registered family whose checkpoint carries
these loads them: the layer is built as the model's last full-attention layer is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglebatch.model.config import ModelConfig
from eaglebatch.model.family import FULL

MTP = "mtp"  # the draft kind, and the job's `draft: mtp`
MTP_PREFIX = "mtp."  # the checkpoint's names of the layer's tensors
LAYERS_KEY = "mtp_num_hidden_layers"


@dataclass(frozen=True)
class MtpConfig:
    target: ModelConfig  # the model the layer belongs to (its sizes, norms, attention)
    layer: int  # the model's layer whose kind the MTP layer has (a full-attention one)
    kind: str = MTP

    @property
    def hidden_size(self) -> int:
        """The width of the draft state the worker keeps per row (the normed output)."""
        return self.target.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size


def states_mtp(raw: Mapping[str, Any]) -> bool:
    """Whether a draft folder's config.json is a model's that states an MTP layer count (its own
    MTP layer drafts; a draft head's config never states one)."""
    text = raw.get("text_config")
    return LAYERS_KEY in raw or (isinstance(text, Mapping) and LAYERS_KEY in text)


def mtp_layer_count(raw: Mapping[str, Any]) -> int:
    """`mtp_num_hidden_layers` of the config (its text_config's where it has one); 0 absent."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), Mapping) else {}
    value = raw.get(LAYERS_KEY, text.get(LAYERS_KEY, 0)) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{LAYERS_KEY} must be a count of layers, got {value!r}")
    return value


def parse_mtp_config(raw: Mapping[str, Any], target: ModelConfig) -> MtpConfig:
    """The MTP layer of the checkpoint whose config.json is `raw`, for `target` (that config
    parsed); ValueError saying what is missing or not supported."""
    n = mtp_layer_count(raw)
    if n == 0:
        raise ValueError(f"the model has no MTP layer (its config.json states no {LAYERS_KEY}); "
                         "draft: mtp drafts with a checkpoint's own mtp.* layer "
                         "(Qwen3.5, Qwen3.6, Qwen3-Next)")  # fmt: skip
    if n != 1:
        raise ValueError(f"{LAYERS_KEY} is {n}; only a single MTP layer is supported")
    return MtpConfig(target, full_attention_layer(target))


def full_attention_layer(cfg: ModelConfig) -> int:
    """The model's last layer of full attention with a KV cache of its own: the MTP layer is of
    its kind (its heads, head dim, MLP or experts)."""
    for i in reversed(range(cfg.num_hidden_layers)):
        full = cfg.layer_types is None or cfg.layer_types[i] == FULL
        if full and cfg.kv_source(i) == i:
            return i
    raise ValueError("the model has no full-attention layer to build its MTP layer from")


def check_mtp_shapes(expected: Mapping[str, tuple[int, ...]],
                     found: Mapping[str, tuple[int, ...]]) -> None:  # fmt: skip
    """The checkpoint's mtp.* tensors (`found`, names without the prefix, fused ones split)
    against the layer's parameters: none missing, none unexpected, each of its shape."""
    if not found:
        raise ValueError(f"the model's config states {LAYERS_KEY} but its checkpoint holds no "
                         f"{MTP_PREFIX}* tensors")  # fmt: skip
    for name, shape in found.items():
        want = expected.get(name)
        if want is not None and tuple(shape) != tuple(want):
            raise ValueError(f"tensor {MTP_PREFIX}{name} has shape {tuple(shape)}, the model's "
                             f"MTP layer needs {tuple(want)}")  # fmt: skip
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        parts = [f"{what}: {', '.join(MTP_PREFIX + n for n in names[:6])}"
                 for what, names in (("missing", missing), ("unexpected", unexpected)) if names]
        raise ValueError(f"the checkpoint's MTP layer does not match the model: "
                         f"{'; '.join(parts)}")  # fmt: skip

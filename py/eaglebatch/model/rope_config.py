"""The RoPE settings of a Hugging Face `config.json`: base, frequency scaling and rotary width.

Both layouts are read: transformers<5 (`rope_theta` + `rope_scaling`) and transformers>=5
(`rope_parameters`, possibly nested per layer type, of which the "full_attention" entry is taken).
The values are resolved here as transformers 5 resolves them (modeling_rope_utils), so that
model/rotary.py only computes:

- "default": no scaling (`parse_rope` returns None).
- "linear": every inverse frequency divided by `factor`.
- "llama3": Llama 3.1's banded scaling (`factor`, `low_freq_factor`, `high_freq_factor`,
  `original_max_position_embeddings`).
- "yarn": YaRN's blend of interpolated and original frequencies over a ramp between the
  correction dims of `beta_fast` (default 32) and `beta_slow` (default 1), floored / ceiled unless
  `truncate` is false; `factor` null means max_position_embeddings / original. cos and sin are
  multiplied by `attention_factor`, by default 0.1 ln(factor) + 1, or the ratio of that formula
  with `mscale` and with `mscale_all_dim` when both are set.
- "longrope" (also written "su"): each inverse frequency divided by its `short_factor` entry, cos
  and sin multiplied by `attention_factor`, by default sqrt(1 + ln(factor) / ln(original)) with
  `factor` = max_position_embeddings / original unless given.

`original_max_position_embeddings` of llama3, yarn and longrope: a top-level value wins (Phi-3
keeps it there), then the one in the RoPE settings, then max_position_embeddings.

Longrope length rule: transformers divides by `long_factor` instead, for a whole forward pass,
as soon as any position in it reaches `original_max_position_embeddings`. That choice depends on
which other sequences share the batch, so no batched engine reproduces it per row. We always use
`short_factor`, which is exact for every sequence no longer than the original length, and the
model's `max_model_len` must be capped at `RopeScaling.max_len_cap` (longer requests are refused).

Refused: "dynamic" (NTK) rescales the frequencies with the current batch's length, so a token's
logits would depend on which other requests share its batch; any kind not listed above.

Partial rotary (`partial_rotary_factor`, in the RoPE settings or at the top level): only the first
int(head_dim * factor) dims of each head are rotated; see `rotary_dim_of`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
ALIASES = {"su": "longrope"}  # the name of longrope in early Phi-3 configs


@dataclass(frozen=True)
class RopeScaling:
    """A non-default RoPE frequency scaling, resolved (no default is left to the consumer).
    `rope_type` is one of SUPPORTED_ROPE_TYPES other than "default"."""

    rope_type: str
    factor: float
    # llama3 only.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3, yarn and longrope.
    original_max_position_embeddings: int = 8192
    # yarn only.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # longrope only: one entry per rotated pair (rotary_dim / 2).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # yarn and longrope: the multiplier of cos and sin (1.0 for the other kinds).
    attention_factor: float = 1.0
    # Llama 4 / Ministral 3 query scaling, read along (None: absent); not applied by RoPE.
    llama_4_scaling_beta: float | None = None
    # proportional only (Gemma 4): the frequencies are the whole head's, only the lowest
    # `partial_rotary_factor` of them turn (the rest are zero: those pairs pass unrotated),
    # all divided by `factor`. Unlike partial rotary (rotary_dim_of), the rotated pairs are
    # (i, i + D/2) of the whole head.
    partial_rotary_factor: float = 1.0

    @property
    def max_len_cap(self) -> int | None:
        """The longest sequence this scaling serves exactly (longrope: the original length, see
        the module doc); None: no cap."""
        if self.rope_type == "longrope":
            return self.original_max_position_embeddings
        return None

    def check_rotary_dim(self, rotary_dim: int) -> None:
        """ValueError unless the per-pair factors (longrope) cover `rotary_dim` exactly."""
        if self.rope_type != "longrope":
            return
        for name in ("short_factor", "long_factor"):
            n = len(getattr(self, name))
            if n != rotary_dim // 2:
                raise ValueError(
                    f"RoPE scaling 'longrope': {name} has {n} entries, the rotary dim "
                    f"{rotary_dim} needs {rotary_dim // 2}"
                )


def parse_rope(raw: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) of a config.json's top level; a ValueError naming the bad key."""
    params, nested = _rope_parameters(raw)
    theta = raw.get("rope_theta")
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    theta = float(theta if theta is not None else 10000.0)

    scaling = raw.get("rope_scaling")
    spec = scaling if scaling else params
    if not spec:
        return theta, None
    if not isinstance(spec, dict):
        raise ValueError(f"model config: the RoPE settings must be an object, got {spec!r}")
    key = "rope_type" if "rope_type" in spec else "type"
    rope_type = spec.get(key, "default")
    rope_type = ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE scaling {key}={rope_type!r}; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", _factor(spec, "linear", None))
    if rope_type == "proportional":
        partial = _optional_number(spec, "partial_rotary_factor")
        if partial is not None and partial > 1.0:
            raise ValueError(f"model config: partial_rotary_factor must be <= 1, got {partial}")
        factor = _optional_number(spec, "factor")
        return theta, RopeScaling("proportional", 1.0 if factor is None else factor,
                                  partial_rotary_factor=1.0 if partial is None else partial)
    original = _original_len(raw, spec, max_pos, nested and not scaling)
    if rope_type == "longrope":
        return theta, _longrope(spec, original, max_pos)
    factor = _factor(spec, rope_type, None if rope_type != "yarn" else max_pos / original)
    if rope_type == "yarn":
        # transformers reads `truncate` from the outer dict, never from a nested entry
        outer = raw["rope_parameters"] if nested and not scaling else spec
        truncate = outer.get("truncate", True)
        return theta, _yarn(spec, factor, original, truncate)
    missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in spec]
    if missing:
        raise ValueError(f"RoPE scaling 'llama3' is missing {', '.join(missing)}")
    return theta, RopeScaling(
        "llama3",
        factor,
        low_freq_factor=_number(spec, "low_freq_factor"),
        high_freq_factor=_number(spec, "high_freq_factor"),
        original_max_position_embeddings=original,
    )


def rotary_dim_of(raw: dict[str, Any], head_dim: int) -> int:
    """How many leading dims of each head RoPE rotates: int(head_dim * partial_rotary_factor),
    the factor read from the RoPE settings, else the top level, else 1.0."""
    params, _ = _rope_parameters(raw)
    scaling = raw.get("rope_scaling")
    spec = scaling if isinstance(scaling, dict) and scaling else params
    if isinstance(spec, dict) and spec.get("rope_type") == "proportional":
        return head_dim  # its factor is the proportional frequencies' (RopeScaling)
    factor = spec.get("partial_rotary_factor") if isinstance(spec, dict) else None
    if factor is None:
        factor = raw.get("partial_rotary_factor")
    if factor is None:
        return head_dim
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"model config: partial_rotary_factor must be in (0, 1], got {factor!r}")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ValueError(
            f"model config: partial_rotary_factor {factor} gives an odd or empty rotary dim "
            f"{dim} (head_dim {head_dim}); RoPE needs an even one"
        )
    return dim


def _rope_parameters(raw: dict[str, Any]) -> tuple[Any, bool]:
    """`rope_parameters` (its "full_attention" entry when nested per layer type), and whether
    it was nested."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        return params["full_attention"], True
    return params, False


def _original_len(raw: dict[str, Any], spec: dict[str, Any], max_pos: int, nested: bool) -> int:
    """`original_max_position_embeddings` as transformers 5 standardizes it (module doc)."""
    top = None if nested else raw.get("original_max_position_embeddings")
    value = top if top is not None else spec.get("original_max_position_embeddings")
    if value is None:
        return max_pos
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"model config: original_max_position_embeddings must be a positive integer, "
            f"got {value!r}"
        )
    return value


def _factor(spec: dict[str, Any], rope_type: str, if_null: float | None) -> float:
    """`factor`, required; a null one is `if_null` where the kind allows it (yarn)."""
    if "factor" not in spec:
        raise ValueError(f"RoPE scaling {rope_type!r} is missing 'factor'")
    if spec["factor"] is None and if_null is not None:
        return if_null
    return _number(spec, "factor")


def _yarn(spec: dict[str, Any], factor: float, original: int, truncate: Any) -> RopeScaling:
    if truncate is not None and not isinstance(truncate, bool):
        raise ValueError(f"RoPE scaling 'yarn': truncate must be true or false, got {truncate!r}")
    attention = _optional_number(spec, "attention_factor")
    if attention is None:
        mscale = _optional_number(spec, "mscale")
        mscale_all_dim = _optional_number(spec, "mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor, 1.0)
    return RopeScaling(
        "yarn",
        factor,
        original_max_position_embeddings=original,
        beta_fast=_optional_number(spec, "beta_fast") or 32.0,  # 0 and null mean the default
        beta_slow=_optional_number(spec, "beta_slow") or 1.0,
        truncate=bool(truncate),
        attention_factor=float(attention),
        llama_4_scaling_beta=_optional_number(spec, "llama_4_scaling_beta"),
    )


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _longrope(spec: dict[str, Any], original: int, max_pos: int) -> RopeScaling:
    missing = [k for k in ("short_factor", "long_factor") if spec.get(k) is None]
    if missing:
        raise ValueError(f"RoPE scaling 'longrope' is missing {', '.join(missing)}")
    short, long = _factors(spec, "short_factor"), _factors(spec, "long_factor")
    factor = _optional_number(spec, "factor")
    if factor is None:
        factor = max_pos / original
    attention = _optional_number(spec, "attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        "longrope",
        float(factor),
        original_max_position_embeddings=original,
        short_factor=short,
        long_factor=long,
        attention_factor=float(attention),
    )


def _factors(spec: dict[str, Any], key: str) -> tuple[float, ...]:
    values = spec[key]
    if not isinstance(values, list) or not values or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e300 for v in values
    ):
        raise ValueError(f"RoPE scaling 'longrope': {key} must be a list of positive numbers")
    return tuple(float(v) for v in values)


def _number(spec: dict[str, Any], key: str) -> float:
    value = spec[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e300:
        raise ValueError(f"RoPE scaling: {key} must be a positive number, got {value!r}")
    return float(value)


def _optional_number(spec: dict[str, Any], key: str) -> float | None:
    """A positive number, or None when absent or null (0 is kept: callers treat it as unset)."""
    value = spec.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e300:
        raise ValueError(f"RoPE scaling: {key} must be a non-negative number, got {value!r}")
    return float(value)

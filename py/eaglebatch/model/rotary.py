"""Rotary position embedding (RoPE) with a precomputed cos/sin table.

Numerics follow the reference Hugging Face implementation so that greedy outputs agree token for
token: inverse frequencies, angles (position * inv_freq), cos/sin and their product with the
attention factor (yarn, longrope) are computed in float32, then cos/sin are cast to the
activation dtype and the rotation itself runs in that dtype.
Convention: "rotate half" (the two halves of the rotated dims are the real/imaginary parts), as
in HF checkpoints of Llama, Mistral, Qwen2 and Phi-3. Partial rotary: only the first `rotary_dim`
dims of each head are rotated, the rest pass through unchanged. The kinds and how their settings
are read: model/rope_config.py.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from eaglebatch.model.config import ModelConfig
from eaglebatch.model.rope_config import RopeScaling


def inverse_frequencies(rotary_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """float32 [rotary_dim // 2] inverse frequencies, scaled as the config says (the head_dim of
    a fully rotated head is its rotary_dim)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if scaling is None:
        return 1.0 / (theta**exponents)  # [R/2]
    scaling.check_rotary_dim(rotary_dim)
    if scaling.rope_type == "longrope":  # short factors always: see rope_config's module doc
        return 1.0 / (torch.tensor(scaling.short_factor, dtype=torch.float32) * theta**exponents)
    if scaling.rope_type == "yarn":
        return _yarn_scaled(theta**exponents, rotary_dim, theta, scaling)
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if scaling.rope_type == "proportional":  # the lowest frequencies over D rotate, none else
        rotated = int(scaling.partial_rotary_factor * rotary_dim // 2)
        zeros = inv_freq.new_zeros(rotary_dim // 2 - rotated)
        return torch.cat((inv_freq[:rotated], zeros)) / scaling.factor
    raise ValueError(f"unsupported RoPE scaling type {scaling.rope_type!r}")


def attention_factor(scaling: RopeScaling | None) -> float:
    """The multiplier of cos and sin (transformers' `attention_scaling`): 1 without scaling."""
    return 1.0 if scaling is None else scaling.attention_factor


def _yarn_scaled(
    pos_freqs: torch.Tensor, dim: int, theta: float, s: RopeScaling
) -> torch.Tensor:
    """YaRN: per pair, a blend of the original frequency (extrapolation) and the one divided by
    `factor` (interpolation), weighted by a linear ramp between the correction dims of beta_fast
    and beta_slow (fully original below the low one, fully interpolated above the high one)."""
    low, high = _yarn_correction_range(dim, theta, s)
    if low == high:
        high += 0.001  # avoids 0 / 0 in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    interpolated = 1.0 / (s.factor * pos_freqs)
    original = 1.0 / pos_freqs
    return interpolated * (1 - extrapolation_weight) + original * extrapolation_weight


def _yarn_correction_range(dim: int, theta: float, s: RopeScaling) -> tuple[float, float]:
    """The (low, high) dims, in [0, dim - 1], that turn beta_fast and beta_slow rotations over
    the original length; floored / ceiled when `truncate`."""

    def correction_dim(rotations: float) -> float:
        wavelengths = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return (dim * math.log(wavelengths)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency scaling: wavelengths longer than original_len / low_freq_factor are
    stretched by `factor`, shorter than original_len / high_freq_factor are kept, and the band in
    between is interpolated linearly in 1 / wavelength."""
    original_len = s.original_max_position_embeddings
    long_wavelen = original_len / s.low_freq_factor
    short_wavelen = original_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    stretched = torch.where(wavelen > long_wavelen, inv_freq / s.factor, inv_freq)
    # smooth = 0 at the long-wavelength edge of the band, 1 at the short one
    smooth = (original_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * stretched / s.factor + smooth * stretched
    in_band = ~(wavelen < short_wavelen) & ~(wavelen > long_wavelen)
    return torch.where(in_band, blended, stretched)


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables [max_positions, rotary_dim] (float32, non-persistent buffers),
    already multiplied by the scaling's attention factor."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int | None = None,
        device: torch.device | str | None = None,
        rotary_dim: int | None = None,
        head_dim: int | None = None,
    ) -> None:
        """`head_dim`: of the layers using this table (default cfg.head_dim)."""
        super().__init__()
        self.head_dim = head_dim or cfg.head_dim
        # the argument, else the config's (partial rotary), else the whole head
        self.rotary_dim = rotary_dim if rotary_dim is not None else cfg.rotary_dim or self.head_dim
        if self.rotary_dim % 2 or not 2 <= self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"rotary_dim must be even and in [2, head_dim={self.head_dim}], "
                f"got {self.rotary_dim}"
            )
        self.theta = cfg.rope_theta
        self.scaling = cfg.rope_scaling
        self.max_positions = max_positions or cfg.max_model_len
        self.register_buffer("cos_table", torch.empty(0, device=device), persistent=False)
        self.register_buffer("sin_table", torch.empty(0, device=device), persistent=False)
        self.rebuild()

    def rebuild(self) -> None:
        """(Re)computes the tables on the buffers' current device (e.g. after `to_empty`)."""
        device = self.cos_table.device
        if device.type == "meta":
            shape = (self.max_positions, self.rotary_dim)
            self.cos_table = torch.empty(shape, device=device)
            self.sin_table = torch.empty(shape, device=device)
            return
        inv_freq = inverse_frequencies(self.rotary_dim, self.theta, self.scaling).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.int64, device=device).float()
        angles = positions[:, None] * inv_freq[None, :]  # [P, R/2]
        angles = torch.cat((angles, angles), dim=-1)  # [P, R]
        factor = attention_factor(self.scaling)  # exact no-op when 1.0
        self.cos_table = angles.cos() * factor
        self.sin_table = angles.sin() * factor

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T], each [T, 1, R] in `dtype` (broadcasts over heads)."""
        cos = self.cos_table.index_select(0, positions).to(dtype)
        sin = self.sin_table.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with its first R dims rotated by cos/sin [T, 1, R] (R = D: all of them) and
    the other D - R passed through, in x's dtype."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:  # the common case: no slicing, no extra concatenation
        half = rot // 2
        if torch.is_grad_enabled() or sin.dtype != x.dtype:
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, H, D]
            return x * cos + rotated * sin
        # the same operations, in place where a buffer is fresh: 2 [T, H, D] buffers, not 5
        rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        rotated[..., :half].neg_()
        return (x * cos).add_(rotated.mul_(sin))
    head, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-head[..., half:], head[..., :half]), dim=-1)  # [T, H, R]
    return torch.cat((head * cos + rotated * sin, rest), dim=-1)

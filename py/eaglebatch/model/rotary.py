"""Rotary position embedding (RoPE) with a precomputed cos/sin table.

Numerics follow the reference Hugging Face implementation so that greedy outputs agree token for
token: inverse frequencies, angles (position * inv_freq) and cos/sin are computed in float32, then
cos/sin are cast to the activation dtype and the rotation itself runs in that dtype.
Convention: "rotate half" (the two halves of head_dim are the real/imaginary parts), as in HF
checkpoints of Llama, Mistral and Qwen2.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from eaglebatch.model.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies, scaled as the config says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if scaling.rope_type == "proportional":  # the lowest frequencies over D rotate, none else
        rotated = int(scaling.partial_rotary_factor * head_dim // 2)
        zeros = inv_freq.new_zeros(head_dim // 2 - rotated)
        return torch.cat((inv_freq[:rotated], zeros)) / scaling.factor
    raise ValueError(f"unsupported RoPE scaling type {scaling.rope_type!r}")


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
    """Holds cos/sin tables [max_positions, head_dim] (float32, non-persistent buffers)."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int | None = None,
        device: torch.device | str | None = None,
        head_dim: int | None = None,
    ) -> None:
        """`head_dim`: of the layers using this table (default cfg.head_dim)."""
        super().__init__()
        self.head_dim = head_dim or cfg.head_dim
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
            shape = (self.max_positions, self.head_dim)
            self.cos_table = torch.empty(shape, device=device)
            self.sin_table = torch.empty(shape, device=device)
            return
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.int64, device=device).float()
        angles = positions[:, None] * inv_freq[None, :]  # [P, D/2]
        angles = torch.cat((angles, angles), dim=-1)  # [P, D]
        self.cos_table = angles.cos()
        self.sin_table = angles.sin()

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T], each [T, 1, D] in `dtype` (broadcasts over heads)."""
        cos = self.cos_table.index_select(0, positions).to(dtype)
        sin = self.sin_table.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, 1, D], in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, H, D]
    return x * cos + rotated * sin

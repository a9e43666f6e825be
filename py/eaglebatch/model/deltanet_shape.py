"""`DeltaNetShape`: the sizes of a Gated DeltaNet (linear-attention) layer, read from the
`linear_*` keys of a Qwen3.5 / Qwen3-Next config.json, and the per-row state they imply.

Per linear layer and per running sequence (row) the engine must hold two float32 tensors:
  conv state  [conv_dim, conv_kernel - 1]  the last K - 1 inputs of the short convolution
              (conv_dim = 2 * Hk * Dk + Hv * Dv: the q, k and v channels, in that order)
  SSM state   [Hv, Dk, Dv]                 the delta rule's matrix per value head
`state_bytes` is their size; it does not grow with the sequence (unlike the KV cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eaglebatch.model.config_values import int_value, positive_float

STATE_BYTES_PER_VALUE = 4  # both states are float32


@dataclass(frozen=True)
class DeltaNetShape:
    hidden_size: int
    num_k_heads: int  # Hk: query/key heads; each serves Hv / Hk consecutive value heads
    num_v_heads: int  # Hv
    head_k_dim: int  # Dk
    head_v_dim: int  # Dv
    conv_kernel: int  # K: taps of the causal depthwise convolution
    eps: float  # of the gated RMSNorm on the output

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"model config: linear_num_value_heads ({self.num_v_heads}) is not a multiple "
                f"of linear_num_key_heads ({self.num_k_heads})"
            )
        if self.conv_kernel < 2:
            raise ValueError("model config: linear_conv_kernel_dim must be at least 2")

    @property
    def key_dim(self) -> int:  # Hk * Dk
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:  # Hv * Dv
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:  # channels of the convolution: q, k, v
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:  # per row
        return self.conv_dim, self.conv_kernel - 1

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:  # per row
        return self.num_v_heads, self.head_k_dim, self.head_v_dim

    @property
    def state_bytes(self) -> int:
        """Bytes of one row's conv and SSM states in one linear layer."""
        conv = self.conv_dim * (self.conv_kernel - 1)
        ssm = self.num_v_heads * self.head_k_dim * self.head_v_dim
        return (conv + ssm) * STATE_BYTES_PER_VALUE

    @classmethod
    def from_raw(cls, raw: dict[str, Any]) -> DeltaNetShape:
        """From a (text) config.json dict; transformers' defaults where a key is absent.
        The convolution's activation is `hidden_act`, which must be SiLU (checked here)."""
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"model config: hidden_act = {act!r} is not supported by the "
                             "linear-attention layers (silu)")  # fmt: skip
        return cls(
            hidden_size=int_value(raw, "hidden_size"),
            num_k_heads=int_value(raw, "linear_num_key_heads", 16),
            num_v_heads=int_value(raw, "linear_num_value_heads", 32),
            head_k_dim=int_value(raw, "linear_key_head_dim", 128),
            head_v_dim=int_value(raw, "linear_value_head_dim", 128),
            conv_kernel=int_value(raw, "linear_conv_kernel_dim", 4),
            eps=positive_float(raw, "rms_norm_eps", 1e-6),
        )

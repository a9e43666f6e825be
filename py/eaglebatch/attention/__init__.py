"""Paged attention backends. Backends are imported lazily by name: `get_backend("torch")` works
everywhere, "cpu" is torch's plus the extension's decode kernel (it lives with the rest of the
CPU fast path, eaglebatch/cpu/attention.py), and GPU-only backends (e.g. "flashinfer") are
imported only when asked for."""

from __future__ import annotations

import importlib
from typing import Any

from eaglebatch.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    allocate_kv_cache,
    kv_cache_bytes_per_block,
    write_kv_cache,
)

# name -> (module, class). A module is imported on first use only.
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("eaglebatch.attention.torch_backend", "TorchAttentionBackend"),
    "cpu": ("eaglebatch.cpu.attention", "CpuAttentionBackend"),
    "flashinfer": ("eaglebatch.attention.flashinfer_backend", "FlashInferAttentionBackend"),
}


def get_backend(name: str, **kwargs: Any) -> AttentionBackend:
    """Instantiates the backend registered as `name` with `kwargs`."""
    if name not in _BACKENDS:
        known = ", ".join(sorted(_BACKENDS))
        raise ValueError(f"unknown attention backend {name!r}; known: {known}")
    module_name, class_name = _BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"attention backend {name!r} is unavailable: {e}") from e
    return getattr(module, class_name)(**kwargs)


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "allocate_kv_cache",
    "get_backend",
    "kv_cache_bytes_per_block",
    "write_kv_cache",
]

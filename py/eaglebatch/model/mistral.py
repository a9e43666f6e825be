"""Mistral (`mistral`): Llama without biases, with every layer's attention windowed by
`sliding_window` (a length cap: config.py's module doc). llama.cpp writes Mistral files as
`llama`, so GGUF files of it load through the Llama family."""

from __future__ import annotations

from typing import Any

from eaglebatch.model.family import Family


def _features(raw: dict[str, Any]) -> dict[str, Any]:
    return {"sliding_window": raw.get("sliding_window")}


MISTRAL = Family("mistral", "MistralForCausalLM", _features)

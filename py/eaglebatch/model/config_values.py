"""Typed reads of `config.json` values: each returns the value or raises a ValueError naming the
key and what it holds. Shared by the config parser (config.py) and the family files."""

from __future__ import annotations

from typing import Any


def int_value(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer setting (`default` when absent or null)."""
    value = raw.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"model config is missing {key!r}")
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model config: {key} must be a positive integer, got {value!r}")
    return value


def positive_float(raw: dict[str, Any], key: str, default: float) -> float:
    """A positive number setting (`default` when absent or null)."""
    value = raw.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e300:
        raise ValueError(f"model config: {key} must be a positive number, got {value!r}")
    return float(value)


def bool_value(raw: dict[str, Any], key: str, default: bool = False) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"model config: {key} must be true or false, got {value!r}")
    return value


def token_id(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"model config: {key} must hold token ids, got {value!r}")
    return value


def refuse(raw: dict[str, Any], *keys: str) -> None:
    """A ValueError naming the first of `keys` set to a truthy value: a setting the family file
    does not implement (never run wrong)."""
    for key in keys:
        if raw.get(key):
            raise ValueError(f"model config: {key} = {raw[key]!r} is not supported")

"""The kinds of input column types: the rule by which inputs.py checks a column's type and
compares one file's type with another's (rust/src/column_kind.rs is the same rule over the
Rust Arrow types, and checks again when the scheduler opens the files).

Writers spell one logical type several ways: pyarrow and duckdb write `string`, polars
`large_string`, some `string_view`; pandas `category`, polars `Categorical` and
`dictionary_encode()` write dictionaries. So a dictionary-encoded column is judged by its
values (a dictionary of strings is a string column, wherever a string is expected, also inside
a list or a struct).
"""

from __future__ import annotations

import pyarrow as pa


def dense(t: pa.DataType) -> pa.DataType:
    """A dictionary-encoded type's value type (values are read through the keys)."""
    return t.value_type if pa.types.is_dictionary(t) else t


def is_text(t: pa.DataType) -> bool:
    t = dense(t)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def is_int(t: pa.DataType) -> bool:
    return pa.types.is_integer(dense(t))  # int8..int64, uint8..uint64


def is_number(t: pa.DataType) -> bool:
    return is_int(t) or pa.types.is_floating(dense(t))  # and float16, float32, float64


def is_list_of(t: pa.DataType, item) -> bool:
    """A list or large_list whose items pass `item`."""
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and item(t.value_type)

"""The kinds of input column types: the rule by which inputs.py checks a column's type and
compares one file's type with another's (rust/src/column_kind.rs is the same rule over the
Rust Arrow types, and checks again when the scheduler opens the files).

Writers spell one logical type several ways: pyarrow and duckdb write `string`, polars
`large_string`, some `string_view`; pandas `category`, polars `Categorical` and
`dictionary_encode()` write dictionaries. So:
- a dictionary-encoded column is judged by its values (a dictionary of strings is a string
  column, wherever a string is expected, also inside a list or a struct);
- a column whose type differs between files has one output type when both are of one kind
  (`unified`): strings of any spelling (and dictionaries of them) become large_string,
  integers of any width (and dictionaries of them) int64 -- but uint64 mixes with no other
  type, as int64 cannot hold its values. Other differences are refused, naming both files.
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


def unified(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The one output type of a column of type `a` in one file and `b` in another (see the
    module docstring), or None when they are of different kinds."""
    if a == b:
        return a
    if is_text(a) and is_text(b):
        return pa.large_string()
    if is_int(a) and is_int(b) and pa.uint64() not in (dense(a), dense(b)):
        return pa.int64()
    return None


MIXING_RULE = (
    "types of one kind mix (string, large_string, string_view and their dictionaries as "
    "large_string; integers of any width as int64, but uint64 only with uint64)"
)

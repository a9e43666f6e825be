"""What `Engine.generate` and friends accept as inputs, written as the Parquet file their job
reads: a list of prompt strings, a list of chat conversations (each a list of
`{"role", "content"}` messages), a `pyarrow.Table`, a `pyarrow.RecordBatchReader` (streamed to
disk batch by batch: memory stays bounded) or a pandas DataFrame. Tables keep their columns,
read by the job's `input.*` keys (`prompt_column` defaults to "prompt")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eaglebatch.errors import JobError

PROMPT, MESSAGES = "prompt", "messages"
_MESSAGE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def write_inputs(inputs: Any, path: Path, keys: Mapping[str, Any]) -> dict:
    """Writes `inputs` to the Parquet file `path`; returns the job's input section (`keys`,
    the caller's `input.*` keys, completed with the column names of a list input). JobError
    when the inputs are of no accepted kind."""
    section = {"path": str(path), **keys}
    if isinstance(inputs, pa.RecordBatchReader):
        _stream(inputs, path)
        return section
    if isinstance(inputs, pa.Table):
        pq.write_table(inputs, path)
        return section
    if _is_dataframe(inputs):
        pq.write_table(pa.Table.from_pandas(inputs, preserve_index=False), path)
        return section
    if isinstance(inputs, str) or not isinstance(inputs, Sequence):
        raise JobError(
            "inputs: expected a list of prompt strings, a list of message lists, a "
            f"pyarrow.Table, a pyarrow.RecordBatchReader or a pandas DataFrame, not "
            f"{type(inputs).__name__}"
        )
    column, array = _list_column(list(inputs))
    pq.write_table(pa.table({column: array}), path)
    if column == MESSAGES:
        section.setdefault("messages_column", MESSAGES)
    return section


def _is_dataframe(obj: Any) -> bool:
    return type(obj).__name__ == "DataFrame" and hasattr(obj, "to_numpy")


def _stream(reader: pa.RecordBatchReader, path: Path) -> None:
    with pq.ParquetWriter(path, reader.schema) as writer:
        for batch in reader:
            writer.write_batch(batch)


def _list_column(items: list) -> tuple[str, pa.Array]:
    """A list of strings as the prompt column, or of conversations as the messages column."""
    if all(isinstance(x, str) for x in items):
        return PROMPT, pa.array(items, pa.string())
    if all(_is_conversation(x) for x in items):
        rows = [[{"role": m["role"], "content": m["content"]} for m in conv] for conv in items]
        return MESSAGES, pa.array(rows, _MESSAGE)
    bad = next(i for i, x in enumerate(items) if not isinstance(x, str))
    raise JobError(
        f"inputs[{bad}]: expected every item to be a prompt string, or every item a list of "
        f"{{'role': ..., 'content': ...}} messages; got {type(items[bad]).__name__}"
    )


def _is_conversation(x: Any) -> bool:
    if not isinstance(x, Iterable) or isinstance(x, str | bytes | Mapping):
        return False
    return all(isinstance(m, Mapping) and {"role", "content"} <= m.keys() for m in x)

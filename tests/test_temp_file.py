"""Temporary files (temp_file.py): hidden, created exclusively, with the mode of any new file of
the process (0666 less the umask), for every writer that renames one over its final name."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglebatch.temp_file import new_temp_file


def _with_umask(umask: int, write) -> None:
    old = os.umask(umask)
    try:
        write()
    finally:
        os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_new_temp_files_are_hidden_exclusive_and_distinct(tmp_path):
    final = tmp_path / "x.json"
    made = [new_temp_file(final) for _ in range(20)]
    for fd, _ in made:
        os.close(fd)
    names = {p.name for _, p in made}
    assert len(names) == 20
    assert all(n.startswith(".x.json.") and n.endswith(".tmp") for n in names)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_writer_gives_its_file_the_parts_mode(tmp_path, umask):
    """The cached model's source record (storage/download.py), the builtin prompt file
    (job/builtin.py) and the GGUF hash index (job/gguf_model.py): 0666 less the umask, not
    mkstemp's owner-only 0600, and no temporary file left beside them."""
    from eaglebatch.job import builtin, gguf_model
    from eaglebatch.storage import download

    schema = pa.schema([("prompt", pa.string())])
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    index = tmp_path / "hashes.json"
    _with_umask(umask, lambda: download._write_record(tmp_path, {"a": [1, "e"]}))
    _with_umask(umask, lambda: builtin._write_rows(tmp_path / "p.parquet", schema,
                                                    iter([{"prompt": "hi"}])))  # fmt: skip
    _with_umask(umask, lambda: gguf_model._content_hash(gguf, index))
    record = tmp_path / download.SOURCE
    assert json.loads(record.read_text()) == {"a": [1, "e"]}
    assert pq.read_table(tmp_path / "p.parquet").column("prompt").to_pylist() == ["hi"]
    assert str(gguf.resolve()) in next(iter(json.loads(index.read_text())))
    for p in (record, tmp_path / "p.parquet", index):
        assert _mode(p) == 0o666 & ~umask, p
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [download.SOURCE, "p.parquet", "hashes.json", "m.gguf"])  # fmt: skip

"""`eaglebatch` as a subprocess, as a user's shell or an array job runs it, for the tests of
runs that span processes (shards, Ray)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

import eaglebatch

COLUMNS = ["row_index", "id", "output_token_ids", "output_text", "finish_reason", "error"]


def cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    """`eaglebatch ARGS` with this test's eaglebatch (the checkout's py/ in development,
    site-packages after `pip install .`), stdout and stderr captured."""
    path = {"PYTHONPATH": str(Path(eaglebatch.__file__).resolve().parent.parent)}
    return subprocess.Popen(
        [sys.executable, "-m", "eaglebatch.cli", *args], env={**os.environ, **path, **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen, status: int = 0, timeout: float = 300) -> str:
    """Waits for `proc`, which must exit with `status`; its stdout + stderr."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == status, err
    return out + err


def rows(path: Path) -> list[dict]:
    """The output's rows (COLUMNS) by row_index."""
    return sorted(pq.read_table(path, columns=COLUMNS).to_pylist(), key=lambda r: r["row_index"])

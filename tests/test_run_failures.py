"""Failures during a run (a damaged input page, a full disk): one message saying how to resume,
no traceback, no partial visible part, and a rerun completes every row exactly once."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import eaglebatch

pytest.importorskip("eaglebatch._native")


def write_job(tmp: Path, model: Path, inp: Path, part_rows: int = 10) -> Path:
    job = tmp / "job.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {inp}\noutput:\n  path: {tmp / 'out'}\n"
        f"  part_rows: {part_rows}\nsampling:\n  max_new_tokens: 3\n"
        "engine:\n  device: cpu\n  kv_cache_tokens: 4096\n  max_batch_size: 8\n"
        "  num_threads: 1\n"
    )
    return job


def run_cli(job: Path, file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    def limit():
        if file_size_limit is not None:  # writes beyond it fail with EFBIG, like a full disk
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    env = {**os.environ, "PYTHONPATH": str(Path(eaglebatch.__file__).resolve().parent.parent)}
    return subprocess.run(
        [sys.executable, "-m", "eaglebatch.cli", "run", str(job)], env=env, text=True,
        capture_output=True, timeout=600, preexec_fn=limit,
    )


def visible_parts_are_complete(out: Path) -> list[int]:
    """Every visible part reads in full; returns all row indices in them."""
    rows = []
    for f in sorted(out.glob("part-*.parquet")):
        rows += pq.read_table(f).column("row_index").to_pylist()
    return rows


def test_damaged_input_page_stops_with_a_message_then_resumes(tmp_path, tiny_model_dir):
    n = 400
    inp = tmp_path / "in.parquet"
    prompts = [f"prompt number {i} " + "x" * (i % 7) for i in range(n)]
    pq.write_table(pa.table({"prompt": prompts}), inp, row_group_size=100, compression="none")
    good = inp.read_bytes()
    md = pq.read_metadata(inp)
    col = md.row_group(3).column(0)
    start = col.data_page_offset + 40
    bad = bytearray(good)
    bad[start:start + 64] = bytes(64)  # zero the last row group's page data and lengths
    inp.write_bytes(bytes(bad))
    pq.read_metadata(inp)  # the footer is intact: validate cannot see it without the pages
    with pytest.raises(Exception):  # noqa: B017 (any pyarrow error: the pages are damaged)
        pq.read_table(inp)
    job = write_job(tmp_path, tiny_model_dir, inp)
    r = run_cli(job)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and str(inp) in r.stderr, r.stderr
    assert "run the same command again to resume" in r.stderr
    out = tmp_path / "out"
    first = visible_parts_are_complete(out)
    assert all(len(pq.read_metadata(p).schema) and pq.read_metadata(p).num_rows > 0
               for p in out.glob("part-*.parquet")), "no empty part"
    assert sorted(first) == list(range(300))  # every row before the damaged row group
    inp.write_bytes(good)  # the user restores the file: same content, same job
    r = run_cli(job)
    assert r.returncode == 0, r.stderr
    assert sorted(visible_parts_are_complete(out)) == list(range(n))


def test_full_disk_stops_with_a_message_then_resumes(tmp_path, tiny_model_dir):
    n = 60
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"row {i}" for i in range(n)]}), inp)
    job = write_job(tmp_path, tiny_model_dir, inp)
    r = run_cli(job, file_size_limit=1024)  # no part file fits
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "File too large" in r.stderr and "run the same command again to resume" in r.stderr
    out = tmp_path / "out"
    assert visible_parts_are_complete(out) == []
    r = run_cli(job)  # space is back
    assert r.returncode == 0, r.stderr
    assert sorted(visible_parts_are_complete(out)) == list(range(n))

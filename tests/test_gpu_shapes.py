"""benchmarks/gpu_shapes.py rehearsed on the CPU at a tiny shape: every section runs, overlapped
whole runs give the tokens of one-at-a-time runs, the JSON has what docs/gpu.md reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_gpu_shapes_runs_on_cpu(tmp_path):
    pytest.importorskip("eaglebatch._native")
    import gpu_shapes

    out = tmp_path / "shapes.json"
    rc = gpu_shapes.main(["--shapes", "tiny", "--device", "cpu", "--out", str(out),
                          "--batches", "1,3", "--run-batches", "1,3", "--hf-batches", "1",
                          "--context", "24", "--max-new", "6", "--k", "2", "--iters", "1"])
    report = json.loads(out.read_text())
    assert rc == 0 and report["errors"] == [] and report["failed"] == []
    tiny = report["shapes"]["tiny"]
    assert set(tiny["steps"]) == {"1", "3"} and set(tiny["runs"]) == {"1", "3"}
    for row in tiny["steps"].values():
        assert set(row["rounds"]) == {"1", "2"} and row["plain_decode_ms"] > 0
        assert len(row["speedup_by_accept_length"]) == len(gpu_shapes.ACCEPT_LENGTHS)
    for row in tiny["runs"].values():
        assert row["identical"] and row["overlap_on"]["output_tok_s"] > 0
    assert tiny["transformers"]["1"]["output_tok_s"] > 0

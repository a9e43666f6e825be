"""The GPU device check script runs end to end on CPU (tiny shape, graph steps run eagerly):
its correctness comparisons pass and it writes every section of its JSON report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_gpu_check_runs_on_cpu(tmp_path):
    pytest.importorskip("eaglebatch._native")
    import gpu_check

    out = tmp_path / "check.json"
    rc = gpu_check.main(["--out", str(out), "--shape", "tiny", "--device", "cpu",
                         "--batches", "1,3", "--max-new", "6", "--context", "40", "--iters", "1"])
    report = json.loads(out.read_text())
    assert report["errors"] == [] and report["failed"] == [] and rc == 0
    for b in ("1", "3"):
        checks = report["checks"]["float32_torch"][b]
        assert all(checks[n]["pass"] for n in ("plain_graph", "spec_eager", "spec_graph"))
        assert checks["graphs"]["replays"] > 0
        t = report["timings"]["torch"][b]["eager"]
        assert t["spec_round_ms"] > 0 and t["plain_decode_ms"] > 0
        assert report["transformers_generate"][b]["output_tok_s"] > 0
    assert "skipped" in report["checks"]["flashinfer"]
    for b in ("1", "3"):  # the teacher-forced kernel comparison (torch bf16 only, on CPU)
        k = report["checks"]["bfloat16_kernels_vs_float32"][b]
        assert k["positions"] >= 4 and k["torch"]["finite"]
        assert k["reference_reproduces_run"] >= 0.9  # teacher forcing replays the fp32 run
        assert k["torch"]["argmax_agree"] > 0.5 and "flashinfer" not in k

"""benchmarks/host_overhead.py in CI size: the real scheduler and writer under a fake worker."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_host_overhead_runs_plain_and_speculative_steps(tmp_path):
    pytest.importorskip("eaglebatch._native")
    import host_overhead

    out = tmp_path / "host.json"
    results = host_overhead.main(["--batch-sizes", "1", "16", "--steps", "40",
                                  "--output-tokens", "16", "--k", "2", "--device-ms", "1",
                                  "--json", str(out)])
    modes = ("plain", "plain overlap", "speculative K=2")
    assert [(r["mode"], r["prep"], r["batch"]) for r in results] == [
        (mode, prep, b) for mode in modes for prep in ("none", "worker") for b in (1, 16)
    ]
    for r in results:
        assert r["steps"] == 40 and r["rows_per_step"] <= r["batch"]
        assert r["device_idle_us"] >= 0
        assert r["plan_us"] > 0 and r["commit_us"] > 0 and r["writer_us"] > 0
        assert r["total_us"] == pytest.approx(r["plan_us"] + r["prep_us"] + r["commit_us"])
    assert min(r["rows_per_step"] for r in results if r["batch"] == 16) > 8  # rows keep joining
    assert json.loads(out.read_text()) == results
    prep = {(r["mode"], r["prep"], r["batch"]): r["prep_us"] for r in results}
    for mode in modes:  # "none" times two clock reads, "worker" the real preparation
        for b in (1, 16):
            assert prep[(mode, "worker", b)] > prep[(mode, "none", b)] + 10
    idle = {(r["mode"], r["prep"], r["batch"]): r["device_idle_us"] for r in results}
    for b in (1, 16):  # one step at a time, the device waits out the host's whole step
        assert idle[("plain", "worker", b)] > 0.5 * by_mode(results, "plain", b)["total_us"]


def by_mode(results, mode, batch):
    return next(r for r in results if (r["mode"], r["prep"], r["batch"]) == (mode, "worker",
                                                                             batch))


def test_overlap_hides_the_host_behind_a_slow_device(tmp_path):
    """With a device step much longer than the host's, overlapped steps leave the device
    (almost) never idle; one at a time it waits out every host step."""
    pytest.importorskip("eaglebatch._native")
    import host_overhead

    results = host_overhead.main(["--batch-sizes", "16", "--steps", "30", "--output-tokens",
                                  "16", "--k", "0", "--prep", "worker", "--device-ms", "20"])
    serial, overlapped = by_mode(results, "plain", 16), by_mode(results, "plain overlap", 16)
    assert serial["device_idle_us"] > 0.5 * serial["total_us"]
    assert overlapped["device_idle_us"] < 0.2 * serial["device_idle_us"]


def test_fake_speculative_answers_follow_the_acceptance_pattern():
    import host_overhead

    assert host_overhead._ranks(np.array([2, 1, 3])).tolist() == [0, 1, 0, 0, 1, 2]
    tokens = host_overhead._pattern(np.arange(5), np.zeros(5, dtype=np.int64))
    assert tokens.min() >= 1000 and len(set(tokens.tolist())) == 5

"""The default thread count (cpu/threads.py): the affinity mask (taskset), the cgroup CPU
quota (v1 and v2 files, the tightest along the path), and the share of the live eaglebatch
workers on the same CPUs; a gone process never counts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eaglebatch.cpu import threads
from support.tiny import make_tiny_model, write_prompts


def _cgroup(tmp: Path, lines: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc = tmp / "proc-self-cgroup"
    proc.write_text(lines)
    return root, proc


def test_cgroup_v2_quota_is_the_tightest_along_the_path(tmp_path):
    root, proc = _cgroup(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "cpu.max": "max 100000\n",
        "kubepods/cpu.max": "800000 100000\n",
        "kubepods/pod1/cpu.max": "150000 100000\n",
        "kubepods/pod1/ctr/cpu.max": "max 100000\n",
    })  # fmt: skip
    assert threads.cpu_quota(root, proc) == 1.5


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    root, proc = _cgroup(tmp_path, "4:memory:/job\n2:cpu,cpuacct:/job\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/job/cpu.cfs_quota_us": "300000\n",
        "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
    })  # fmt: skip
    assert threads.cpu_quota(root, proc) == 3.0
    (root / "cpu,cpuacct/job/cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cpu_quota(root, proc) is None
    assert threads.cpu_quota(tmp_path / "none", tmp_path / "missing") is None


def test_usable_cpus_follow_the_quota_rounded_up(tmp_path):
    root, proc = _cgroup(tmp_path, "0::/\n", {"cpu.max": "50000 100000\n"})
    cpus, usable = threads.usable_cpus(root, proc)
    assert cpus == frozenset(os.sched_getaffinity(0)) and usable == 1
    (root / "cpu.max").write_text(f"{len(cpus) * 100000 + 1} 100000\n")
    assert threads.usable_cpus(root, proc)[1] == len(cpus)  # never more than the mask


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not shutil.which("taskset"),
                    reason="needs taskset and 2 CPUs")  # fmt: skip
def test_the_default_follows_taskset(tmp_path):
    code = ("from eaglebatch.cpu import threads; from pathlib import Path; "
            f"p = threads.default_threads(Path({str(tmp_path / 'reg')!r})); "
            "print(p.threads, p.usable, p.workers)")  # fmt: skip
    one = min(os.sched_getaffinity(0))
    out = subprocess.run(["taskset", "-c", str(one), sys.executable, "-c", code],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.split() == ["1", "1", "1"]


def test_live_workers_on_the_same_cpus_share_them(tmp_path):
    reg = tmp_path / "reg"
    cpus = frozenset({0, 1, 2, 3})
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reg.mkdir()
        start = threads._start_time(peer.pid)
        (reg / f"{peer.pid}.json").write_text(json.dumps(
            {"pid": peer.pid, "start": start, "cpus": [2, 3]}))  # fmt: skip
        (reg / "999999999.json").write_text(json.dumps(
            {"pid": 999999999, "start": 1.0, "cpus": [0]}))  # a gone process  # fmt: skip
        (reg / f"{os.getpid()}.json").write_text(json.dumps(
            {"pid": os.getpid(), "start": 1.0, "cpus": [0]}))  # a reused pid  # fmt: skip
        assert threads.sharing(cpus, reg) == 1
        assert sorted(p.name for p in reg.iterdir()) == [f"{peer.pid}.json"]  # cleaned up
        assert threads.sharing(frozenset({0, 1}), reg) == 1  # no overlap: 0, at least 1
        mine = threads.register(cpus, reg)
        assert threads.sharing(cpus, reg) == 2
        mine.remove()
        assert threads.sharing(cpus, reg) == 1
    finally:
        peer.kill()
        peer.wait()
    assert threads.sharing(cpus, reg) == 1 and not list(reg.iterdir())


def test_a_run_says_its_threads(tmp_path):
    from click.testing import CliRunner

    from eaglebatch.cli import main

    model = make_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2,
                            num_kv_heads=1)  # fmt: skip
    job = tmp_path / "job.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {write_prompts(tmp_path / 'in.parquet', ['hi'])}\n"
        f"output:\n  path: {tmp_path / 'out'}\nsampling:\n  max_new_tokens: 2\n"
        "engine:\n  device: cpu\n  kv_cache_tokens: 256\n"
    )
    summary = tmp_path / "summary.json"
    r = CliRunner().invoke(main, ["run", str(job), "--summary-json", str(summary)])
    assert r.exit_code == 0, r.output
    assert "CPU threads" in r.output and "usable CPUs" in r.output
    assert "usable CPUs" in json.loads(summary.read_text())["threads"]

"""How many threads a CPU run uses when engine.num_threads is unset: the CPUs this process may
use, shared with the other eaglebatch workers on them.

- usable CPUs: the affinity mask (taskset, numactl, a batch scheduler's binding), capped by the
  cgroup CPU quota rounded up (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`; the
  tightest along the process's cgroup path, as a container sees it);
- share: every worker that reads this default registers itself in a per-user directory of
  this host (WORKERS_DIR) with its usable CPUs; the live ones whose CPUs overlap ours divide
  them (shards started together on one node get a core each instead of all of them each).
  An entry names a process and its start time, so a dead or reused pid never counts.

torch's default (physical cores of the whole machine) ignores both: in a pod limited to 2 CPUs
of a 64-core node it starts 32 threads, which the quota then throttles.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_limit(d: Path) -> float | None:
    """CPUs allowed by `d`/cpu.max ("max 100000" = none, "150000 100000" = 1.5)."""
    text = _read(d / "cpu.max")
    parts = text.split() if text else []
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_limit(d: Path) -> float | None:
    """CPUs allowed by `d`/cpu.cfs_quota_us over cpu.cfs_period_us (quota -1 = none)."""
    quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _lines(proc_cgroup: Path) -> list[tuple[str, str]]:
    """(controllers, path) of each line of /proc/self/cgroup ("" controllers: v2)."""
    out = []
    for line in (_read(proc_cgroup) or "").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        out.append((controllers, path or "/"))
    return out


def _ancestors(base: Path, path: str) -> list[Path]:
    """`base`/path and each folder above it up to `base` itself."""
    parts = [p for p in path.split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")):
    """The tightest cgroup CPU limit of this process in CPUs (a float), None when unlimited."""
    limits = []
    for controllers, path in _lines(proc_cgroup):
        if controllers == "":  # v2: one unified tree (or root/unified beside a v1 tree)
            for base in (root, root / "unified"):
                limits += [_v2_limit(d) for d in _ancestors(base, path)]
        elif "cpu" in controllers.split(","):
            for base in {root / controllers, root / "cpu", root / "cpu,cpuacct"}:
                limits += [_v1_limit(d) for d in _ancestors(base, path)]
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")):
    """(the CPU ids this process may run on, how many it may keep busy: their count capped by
    the cgroup quota rounded up, at least 1)."""
    cpus = frozenset(os.sched_getaffinity(0))
    quota = cpu_quota(root, proc_cgroup)
    count = len(cpus) if quota is None else min(len(cpus), math.ceil(quota))
    return cpus, max(1, count)


def workers_dir() -> Path:
    """This user's registry of eaglebatch workers on this host (memory-backed where it can)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return Path(os.environ.get("EAGLEBATCH_WORKERS_DIR", base / f"eaglebatch-{os.getuid()}"))


def _start_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


@dataclass(frozen=True)
class Registration:
    """This process's entry in workers_dir(): removed at exit (a killed one's is ignored and
    removed by the next reader, its process being gone)."""

    path: Path

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def register(cpus: frozenset[int], where: Path | None = None) -> Registration | None:
    """Adds this process (its CPU ids) to the registry; None when it cannot be written."""
    d = where or workers_dir()
    entry = {"pid": os.getpid(), "start": _start_time(os.getpid()), "cpus": sorted(cpus)}
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = d / f"{os.getpid()}.json"
        tmp = d / f".{os.getpid()}.tmp"
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, path)
    except OSError:
        return None
    reg = Registration(path)
    atexit.register(reg.remove)
    return reg


def sharing(cpus: frozenset[int], where: Path | None = None) -> int:
    """Live registered workers (this one included, if registered) whose CPUs overlap `cpus`;
    entries of gone processes are removed."""
    d = where or workers_dir()
    count = 0
    for path in d.glob("*.json") if d.is_dir() else ():
        try:
            entry = json.loads(path.read_text())
            pid, start, theirs = int(entry["pid"]), entry["start"], set(entry["cpus"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if start is None or _start_time(pid) != start:
            path.unlink(missing_ok=True)  # its process is gone (or the pid is another's now)
            continue
        count += bool(theirs & cpus)
    return max(1, count)


@dataclass(frozen=True)
class ThreadPlan:
    threads: int
    usable: int  # CPUs this process may keep busy (affinity and cgroup quota)
    workers: int  # eaglebatch workers sharing them, this one included

    def describe(self) -> str:
        shared = f", shared by {self.workers} eaglebatch workers" if self.workers > 1 else ""
        return f"{self.threads} ({self.usable} usable CPUs{shared})"


_joined: dict[Path, Registration | None] = {}  # registry -> this process's entry


def join(where: Path | None = None) -> None:
    """Registers this process once per registry (before its model loads, so that workers
    started together see each other when default_threads runs after the load)."""
    d = where or workers_dir()
    if d not in _joined:
        _joined[d] = register(usable_cpus()[0], d)


_plans: dict[Path, ThreadPlan] = {}  # registry -> this process's plan, decided once


def default_threads(where: Path | None = None) -> ThreadPlan:
    """The thread count of a worker without engine.num_threads: its share of the usable CPUs
    among the registered live workers on them (this one joins first if it has not). Decided
    once per process: every run of a process computes with the same thread count (torch's
    reductions may round differently with another)."""
    d = where or workers_dir()
    if d not in _plans:
        join(d)
        cpus, usable = usable_cpus()
        workers = sharing(cpus, d)
        _plans[d] = ThreadPlan(max(1, usable // workers), usable, workers)
    return _plans[d]


def set_threads(num_threads: int | None, device: torch.device) -> str | None:
    """Sets this process's torch threads (those the native kernels join too): engine.num_threads,
    else on the CPU its share of the CPUs it may use; says which."""
    if num_threads is not None:  # a Ray actor's too
        torch.set_num_threads(num_threads)
        return f"{num_threads} (engine.num_threads)"
    if device.type != "cpu":
        return None
    plan = default_threads()
    torch.set_num_threads(plan.threads)
    return plan.describe()

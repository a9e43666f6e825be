"""The Ray executor (`eaglebatch run --ray`): one job over engine actors on a Ray cluster.

The driver prepares and checks the job once (a bad job fails before Ray starts), holds
output.path exclusively, reads what is done anywhere under it and cuts the remaining rows into
units: contiguous row ranges of several batches each. Each actor loads the model once and runs
units one after another with the ordinary scheduler, worker and atomic part writer, each into
its own `unit-<start>-<end>/` directory (output/directory.py).

Invariants (exactly once):
- a unit writes only rows of its range, only into its directory, and skips the rows the driver
  found done elsewhere plus the rows already in complete parts of its directory; so a unit
  retried after its actor died regenerates exactly the rows that never reached a complete part;
- a driver killed and rerun reads the whole tree again (unit directories included): a unit of
  the new cut skips what any earlier unit finished;
- the driver creates every unit directory of its cut before any actor runs, an actor runs a
  unit only in an existing directory and holds its flock while it writes there, and a rerun
  driver keeps the existing units' ranges and names (cut_units): an actor that outlived its
  driver (a lost node, a slow teardown) and the rerun's actor contend for the same lock, so the
  rerun's unit waits for it, then reads what it wrote, and a row range has one directory.
Engine-fatal errors (CUDA errors, out of memory, any bug) end the actor process; Ray restarts it
and the driver retries the unit, up to ray.max_attempts. Bad rows stay error rows; a damaged
input ends the run with the message a single process would print.
"""

from __future__ import annotations

import math
import os
import re
import socket
import time
import traceback
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from eaglebatch.errors import JobError
from eaglebatch.job.config import JobConfig
from eaglebatch.output.directory import DirectoryInUse, release_output_dir, release_subdirs
from eaglebatch.output.resume import ResumeState
from eaglebatch.prepare import PreparedJob
from eaglebatch.runner import RunFailed, RunScope, open_output, run_prepared, write_batch_results
from eaglebatch.storage import location, parquet_source

PROGRESS_KEYS = ("requests_done", "requests_error", "output_tokens", "running", "waiting")
SUM_KEYS = ("requests", "errors", "prompt_tokens", "output_tokens", "preemptions",
            "cached_tokens", "prefill_tokens", "evictions", "spec_steps", "accepted_tokens",
            "spec_tokens")  # fmt: skip


def import_ray():
    """Ray, or a JobError saying how to install it."""
    try:
        # lazy: ray is an optional extra; torch only in the actors, not the driver
        import ray
    except ImportError:
        raise JobError(
            "--ray / engine.executor: ray needs Ray, which is not installed: "
            "pip install 'eaglebatch[ray]' (or pip install ray)"
        ) from None
    return ray


def check_address(address: str | None) -> None:
    """A HOST:PORT address must accept a connection (Ray itself would retry for minutes)."""
    if address in (None, "", "auto", "local") or address.startswith("ray://"):
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except (OSError, ValueError) as e:
        raise JobError(
            f"ray.address: cannot reach a Ray cluster at {address!r} ({e}); start it with "
            f"`ray start --head` or fix the address"
        ) from None


@dataclass(frozen=True)
class Unit:
    start: int  # [start, end) of the input's row_index
    end: int
    skip: np.ndarray = field(repr=False)  # int64 rows of the range done before this run
    # sampling.n > 1: sample keys written before this run of rows not done (ResumeState)
    skip_samples: np.ndarray = field(repr=False, default_factory=lambda: np.empty(0, np.int64))

    @property
    def name(self) -> str:
        return f"unit-{self.start:012d}-{self.end:012d}"

    @property
    def rows(self) -> int:
        return self.end - self.start - len(self.skip)


def unit_rows(remaining: int, actors: int, max_batch_size: int) -> int:
    """About four units per actor, each of 4 to 64 batches, never fewer units than actors."""
    rows = math.ceil(remaining / (4 * actors))
    rows = min(max(rows, 4 * max_batch_size), 64 * max_batch_size)
    return max(1, min(rows, math.ceil(remaining / actors)))


def cut_units(
    total_rows: int, done: np.ndarray, rows_per_unit: int, existing: list[tuple[int, int]] = ()
) -> list[Unit]:
    """The rows of [0, total_rows) not in `done` (sorted) as contiguous units; done rows inside
    a unit's range are its `skip`. `existing`: the ranges of the unit directories already under
    output.path, which keep their ranges and names (a late actor of an earlier run and this
    run's actor then contend for one directory lock); only the rows outside them are cut anew,
    into units of about `rows_per_unit` remaining rows each."""
    kept: list[tuple[int, int]] = []
    for a, b in sorted(existing):
        if a < total_rows and a < b and (not kept or a >= kept[-1][1]):
            kept.append((a, b))
    units = [_unit(a, b, done) for a, b in kept]
    edges = [0, *[x for a, b in kept for x in (a, min(b, total_rows))], total_rows]
    for a, b in zip(edges[::2], edges[1::2], strict=True):
        units += [_unit(x, y, done) for x, y in _cut_range(a, b, done, rows_per_unit)]
    return sorted((u for u in units if u.rows > 0), key=lambda u: u.start)


def _unit(a: int, b: int, done: np.ndarray) -> Unit:
    return Unit(a, b, done[np.searchsorted(done, a) : np.searchsorted(done, b)])


def _cut_range(a: int, b: int, done: np.ndarray, rows_per_unit: int) -> list[tuple[int, int]]:
    """[a, b) cut where each piece but the last has `rows_per_unit` rows not in `done`."""
    below = int(np.searchsorted(done, a))
    remaining = (b - a) - (int(np.searchsorted(done, b)) - below)
    bounds = [a]
    for k in range(1, math.ceil(remaining / rows_per_unit) if remaining > 0 else 0):
        # the first x with k * rows_per_unit rows to do in [a, x)
        want, lo, hi = k * rows_per_unit, bounds[-1], b
        while lo < hi:
            mid = (lo + hi) // 2
            if mid - a - (int(np.searchsorted(done, mid)) - below) >= want:
                hi = mid
            else:
                lo = mid + 1
        bounds.append(lo)
    bounds.append(b)
    return [(x, y) for x, y in zip(bounds, bounds[1:], strict=False) if y > x]


UNIT_DIR = re.compile(r"unit-(\d+)-(\d+)")


def unit_ranges(out: Path) -> list[tuple[int, int]]:
    """The (start, end) of the unit directories under output.path."""
    if not out.is_dir():
        return []
    found = (UNIT_DIR.fullmatch(d.name) for d in out.iterdir() if d.is_dir())
    return [(int(m[1]), int(m[2])) for m in found if m]


class EngineActor:
    """One engine on one GPU (or CPU threads); runs units. Wrapped by `ray.remote` in
    `_actor_class`; `progress` is answered while `run_unit` runs (max_concurrency=2)."""

    def __init__(self, prep: PreparedJob) -> None:
        # lazy: ray is an optional extra; torch only in the actors, not the driver
        from eaglebatch.runner import build_worker

        self.prep = prep
        self.worker = build_worker(prep)
        self.current = dict.fromkeys(PROGRESS_KEYS, 0)  # the running unit's counters

    def where(self) -> str:
        return f"{socket.gethostname()}:{os.getpid()}"

    def progress(self) -> dict:
        return self.current

    def _progress(self, p: dict) -> None:
        self.current = {k: p[k] for k in PROGRESS_KEYS if k in p}

    def run_unit(self, unit: Unit) -> dict:
        scope = RunScope(subdir=unit.name, row_range=(unit.start, unit.end), unit=True)
        try:
            own = open_output(self.prep, scope=scope)
            done = np.union1d(unit.skip, own.done_rows).astype(np.int64)
            samples = np.union1d(unit.skip_samples, own.partial_samples).astype(np.int64)
            resume = replace(own, done_rows=done, partial_samples=samples)
            res = run_prepared(self.prep, self.worker, self._progress, resume=resume, scope=scope)
        except DirectoryInUse:  # an actor of a lost node still finishing it: try again later
            return {"busy": True}
        except (RunFailed, JobError) as e:  # the input or the output itself: the run stops
            cause, status = getattr(e, "cause", str(e)), getattr(e, "exit_status", 2)
            return {"failed": cause, "exit_status": status}
        except BaseException:  # engine-fatal: end the process; Ray restarts it, the unit reruns
            traceback.print_exc()
            os._exit(70)
        self.current = dict.fromkeys(PROGRESS_KEYS, 0)  # the driver counts the result instead
        return {"stats": res.stats, "wall_s": res.wall_s, "where": self.where()}


def _actor_class(ray, prep: PreparedJob, cpus: int):
    gpu = _on_cuda(prep)
    # spread over the nodes; no restarts by Ray: the driver replaces a dead actor (_Pool)
    options = {"num_cpus": 1 if gpu else cpus, "num_gpus": 1 if gpu else 0, "max_restarts": 0,
               "max_concurrency": 2, "scheduling_strategy": "SPREAD"}  # fmt: skip
    return ray.remote(**options)(EngineActor)


def _on_cuda(prep: PreparedJob) -> bool:
    return prep.engine.device.type == "cuda"


def actor_plan(ray, job: JobConfig, cuda: bool) -> tuple[int, int]:
    """(actors, CPUs per actor) from the job's ray section and the cluster's resources."""
    cfg = job.ray
    cpus = cfg.cpus_per_actor or (1 if cuda else job.engine.num_threads or 1)
    if cfg.actors is not None:
        return cfg.actors, cpus
    res = ray.cluster_resources()
    if cuda:
        return max(1, int(res.get("GPU", 0))), cpus
    return max(1, (int(res.get("CPU", 1)) - 1) // cpus), cpus


@dataclass
class RayRun:
    """What the driver tracks: units to run, the ones running, and the finished results."""

    units: deque[Unit]
    output_dir: str
    max_attempts: int
    running: dict = field(default_factory=dict)  # ObjectRef -> (actor id, unit)
    attempts: dict[str, int] = field(default_factory=dict)  # unit name -> failed attempts
    results: list[dict] = field(default_factory=list)
    retried: int = 0
    busy_since: dict[str, float] = field(default_factory=dict)  # unit name -> first refusal

    def failed(self, why: str, user_error: bool = False) -> RunFailed:
        return RunFailed(why, None, self.output_dir, user_error)


class _Pool:
    """The engine actors: starting (loading the model), idle or busy. An actor that dies is
    replaced by a new one (which waits for resources if its node is gone), so a unit is only
    ever handed to an actor that is up."""

    def __init__(self, ray, make, n: int, max_attempts: int) -> None:
        self.ray, self.make = ray, make
        self.actors: dict[int, object] = {}
        self.starting: dict = {}  # ObjectRef of `where` -> actor id
        self.idle: list[int] = []
        self.failures, self.budget = 0, max_attempts * n
        for i in range(n):
            self._spawn(i)

    def _spawn(self, i: int) -> None:
        actor = self.actors[i] = self.make()
        self.starting[actor.where.remote()] = i

    def replace(self, i: int, why: object, run: RayRun) -> None:
        self.failures += 1
        if self.failures > self.budget:
            raise run.failed(f"ray: engine actors died {self.failures} times; last: {why}")
        self._spawn(i)

    def started(self, ref, run: RayRun) -> None:
        i = self.starting.pop(ref)
        try:
            self.ray.get(ref)
            self.idle.append(i)
        except self.ray.exceptions.RayError as e:  # died loading the model, or its node did
            self.replace(i, e, run)


def _submit(pool: _Pool, run: RayRun) -> None:
    while run.units and pool.idle:
        i, unit = pool.idle.pop(), run.units.popleft()
        run.running[pool.actors[i].run_unit.remote(unit)] = (i, unit)


def _collect(ray, ref, pool: _Pool, run: RayRun) -> None:
    """One finished unit call: its result, or the unit back in the queue if its actor died."""
    i, unit = run.running.pop(ref)
    try:
        result = ray.get(ref)
    except ray.exceptions.RayError as e:  # the actor died: killed, out of memory, node lost
        n = run.attempts[unit.name] = run.attempts.get(unit.name, 0) + 1
        if n >= run.max_attempts:
            raise run.failed(f"ray: unit {unit.name} failed {n} times "
                             f"(ray.max_attempts); last: {e}") from None  # fmt: skip
        run.retried += 1
        run.units.appendleft(unit)
        pool.replace(i, e, run)
        return
    pool.idle.append(i)
    if result.get("busy"):
        _requeue_busy(unit, run)
        return
    run.busy_since.pop(unit.name, None)
    if "failed" in result:
        raise run.failed(result["failed"], result["exit_status"] == 2)
    run.results.append(result)


def _requeue_busy(unit: Unit, run: RayRun, patience_s: float = 1800.0) -> None:
    """A unit whose directory another process still holds (the actor of a node that was lost
    but still runs) waits at the back of the queue; the lock is what keeps its rows once."""
    first = run.busy_since.setdefault(unit.name, time.monotonic())
    if time.monotonic() - first > patience_s:
        raise run.failed(f"ray: {unit.name} stayed locked by another process for "
                         f"{patience_s:.0f} s; stop that process and run again")  # fmt: skip
    run.units.append(unit)
    if all(u.name in run.busy_since for u in run.units):
        time.sleep(0.5)  # nothing else to do: do not spin on the lock


def _progress(ray, pool: _Pool, run: RayRun, polls: dict) -> dict:
    """Finished units' counters plus the running units' current ones (never blocks)."""
    for i in {i for i, _ in run.running.values()} - set(polls.values()):
        polls[pool.actors[i].progress.remote()] = i
    current = {}
    ready, _ = ray.wait(list(polls), num_returns=len(polls), timeout=0) if polls else ([], [])
    for ref in ready:
        i = polls.pop(ref)
        try:
            current[i] = ray.get(ref)
        except ray.exceptions.RayError:
            pass
    p = {k: sum(c.get(k, 0) for c in current.values()) for k in PROGRESS_KEYS}
    p["requests_done"] += sum(r["stats"]["requests"] for r in run.results)
    p["output_tokens"] += sum(r["stats"]["output_tokens"] for r in run.results)
    return p


def wait_started(ray, pool: _Pool, run: RayRun) -> None:
    """Until every actor has loaded the model (or been replaced after dying doing so)."""
    while pool.starting:
        ready, _ = ray.wait(list(pool.starting), num_returns=1)
        pool.started(ready[0], run)


def dispatch(ray, pool: _Pool, run: RayRun, view=None) -> RayRun:
    """Runs every unit on the pool's actors (one unit per actor at a time) until all are done."""
    polls: dict = {}
    last = {k: 0 for k in PROGRESS_KEYS}
    while run.units or run.running:
        _submit(pool, run)
        waiting = list(run.running) + list(pool.starting)
        ready, _ = ray.wait(waiting, num_returns=1, timeout=0.5)
        for ref in ready:
            if ref in pool.starting:
                pool.started(ref, run)
            else:
                _collect(ray, ref, pool, run)
        if view is not None:
            p = _progress(ray, pool, run, polls)
            last = {k: max(p[k], last[k]) if k in ("requests_done", "output_tokens") else p[k]
                    for k in PROGRESS_KEYS}  # fmt: skip
            view({**last, "requests_total": view.total})
    return run


def latency_stats(out: Path, units: list[Unit]) -> dict:
    """Latency, TTFT and TPOT percentiles of the rows in this run's unit directories (read
    from the parts' columns: the actors' own summaries cannot be merged into percentiles)."""
    import pyarrow.parquet as pq

    parts = [p for u in units for p in sorted((out / u.name).glob("part-*.parquet"))]
    if not parts:
        return {}
    cols = {"latency": "latency_s", "ttft": "ttft_s", "tpot": "tpot_s"}
    stats = {}
    for name, col in cols.items():
        values = np.concatenate([
            pq.read_table(parquet_source(p), columns=[col])
            .column(col).to_numpy(zero_copy_only=False)
            for p in parts
        ]).astype(np.float64)  # fmt: skip
        values = values[~np.isnan(values)]
        for q in (50, 90, 99) if name == "latency" else (50, 99):
            stats[f"{name}_p{q}"] = float(np.percentile(values, q)) if values.size else None
    return stats


def summary(run: RayRun, wall_s: float, actors: int) -> dict:
    """The run's counters summed over its units, and each actor's rows and tok/s."""
    stats = {k: sum(r["stats"].get(k, 0) for r in run.results) for k in SUM_KEYS}
    per_actor: dict[str, dict] = {}
    for r in run.results:
        a = per_actor.setdefault(r["where"], {"units": 0, "rows": 0, "tokens": 0, "busy_s": 0.0})
        a["units"] += 1
        a["rows"] += r["stats"]["requests"]
        a["tokens"] += r["stats"]["output_tokens"]
        a["busy_s"] += r["wall_s"]
    stats.update(units=len(run.results), units_retried=run.retried, actors=actors)
    stats["per_actor"] = per_actor
    return stats


def run_on_ray(prep: PreparedJob, address: str | None, restart: bool, console) -> tuple:
    """The whole job on Ray; returns (stats, wall seconds). See the module docstring."""
    # lazy: ray is an optional extra; torch only in the actors, not the driver
    from eaglebatch.progress import ProgressView

    ray = import_ray()
    check_address(address)
    out = location(prep.job.output.path, prep.job.storage)
    # exclusive: the whole tree, but the unit directories a late actor still holds
    resume: ResumeState = open_output(prep, restart=restart, ray_driver=True)
    done = resume.done_rows[resume.done_rows < prep.total_rows]
    remaining = prep.total_rows - len(done)
    if not remaining:  # nothing to start Ray and load models for
        write_batch_results(prep)
        release_output_dir(out)
        console.print(f"eaglebatch on Ray: all {prep.total_rows} rows are done in {out}")
        empty = RayRun(units=deque(), output_dir=str(out), max_attempts=1)
        return summary(empty, 0.0, 0) | {"startup_s": 0.0, "skipped": len(done)}, 0.0
    try:
        _init(ray, address)
        cuda = _on_cuda(prep)
        n, cpus = actor_plan(ray, prep.job, cuda)
        if not cuda:
            engine = prep.job.engine.model_copy(update={"num_threads": cpus})
            prep = replace(prep, job=prep.job.model_copy(update={"engine": engine}))
        size = prep.job.ray.unit_rows or unit_rows(remaining, n, prep.job.engine.max_batch_size)
        units = [replace(u, skip_samples=resume.partial_samples)
                 for u in cut_units(prep.total_rows, done, size, unit_ranges(out))]  # fmt: skip
        for u in units:  # before any actor runs: a rerun driver sees every unit of this cut
            (out / u.name).mkdir(exist_ok=True)
        release_subdirs(out)  # the actors lock their units
        console.print(
            f"eaglebatch on Ray: {prep.total_rows} rows ({remaining} to generate) in "
            f"{len(units)} units of about {size} rows over {n} actor(s) -> {out}",
            soft_wrap=True,
        )
        start = time.monotonic()
        cls = _actor_class(ray, prep, cpus)
        attempts = prep.job.ray.max_attempts
        pool = _Pool(ray, lambda: cls.remote(prep), n, attempts)
        run = RayRun(units=deque(units), output_dir=str(out), max_attempts=attempts)
        wait_started(ray, pool, run)
        loaded = time.monotonic() - start
        with ProgressView(remaining, console) as view:
            dispatch(ray, pool, run, view)
        wall = time.monotonic() - start - loaded
        stats = summary(run, wall, n) | {"startup_s": loaded, "skipped": len(done)}
        stats |= latency_stats(out, units)
        write_batch_results(prep)
        return stats, wall
    finally:
        if ray.is_initialized():
            ray.shutdown()
        release_output_dir(out)


def _init(ray, address: str | None) -> None:
    """Connects to the cluster (or starts one on this machine), quietly."""
    import logging

    kwargs = {"include_dashboard": False, "logging_level": logging.WARNING,
              "log_to_driver": True}  # fmt: skip
    try:
        if address in (None, "", "local"):
            ray.init(**kwargs)
        else:
            ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise JobError(f"ray.address: cannot connect to Ray at {address!r}: {e}") from None

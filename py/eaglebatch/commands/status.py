"""`eaglebatch status`: how much of a job is done, per shard and overall.

A job is complete when every row of [0, T) (T: the input's rows after input.limit) is in a part
file under output.path exactly once, whichever runs wrote them (one process, shards, Ray
units). Reads what is on disk without taking any lock: parts appear atomically, so a status
taken while runs are writing is a consistent lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eaglebatch.job.config import JobConfig
from eaglebatch.output.shards import Shard, shard_of_dir
from eaglebatch.storage import location


@dataclass(frozen=True)
class RangeStatus:
    name: str  # "shard 3/8", or "all"
    start: int
    end: int
    done: int
    errors: int

    @property
    def complete(self) -> bool:
        return self.done == self.end - self.start


@dataclass(frozen=True)
class JobStatus:
    output_path: str
    total: RangeStatus
    shards: list[RangeStatus] = field(default_factory=list)
    part_files: int = 0
    unit_dirs: int = 0

    @property
    def complete(self) -> bool:
        return self.total.complete


def job_status(job: JobConfig) -> JobStatus:
    """Checks the job as `run` does (a bad job is a JobError) and reads what is done."""
    # lazy: the engine pulls pyarrow; cli imports this module at start
    from eaglebatch.output.resume import scan_output
    from eaglebatch.prepare import prepare

    prep = prepare(job, check_memory=False)  # it may run on a bigger machine
    out = location(job.output.path, job.storage)
    state = scan_output(out, prep.identity)
    t = prep.total_rows

    def range_status(name: str, start: int, end: int) -> RangeStatus:
        done, errors = state.rows_done(end, start), state.errors_in(start, end)
        return RangeStatus(name, start, end, done, errors)

    counts = sorted({s.count for d in state.dirs if (s := shard_of_dir(d)) is not None})
    shards = [
        range_status(f"shard {Shard(i, n)}", *Shard(i, n).rows(t)) for n in counts for i in range(n)
    ]
    units = sum(1 for d in state.dirs if d.startswith("unit-"))
    return JobStatus(
        output_path=str(out),
        total=range_status("all", 0, t),
        shards=shards,
        part_files=state.part_files,
        unit_dirs=units,
    )


def status_lines(st: JobStatus) -> list[str]:
    """What `eaglebatch status` prints: a line per shard, then the whole job."""
    lines = [
        f"{r.name}: rows [{r.start}, {r.end}): {r.done}/{r.end - r.start} done, "
        f"{r.errors} error rows{' (complete)' if r.complete else ''}"
        for r in st.shards
    ]
    t = st.total
    where = f"{st.part_files} part file(s) in {st.output_path}"
    if st.unit_dirs:
        where += f" ({st.unit_dirs} Ray unit directories)"
    verdict = "complete" if st.complete else f"incomplete: {t.end - t.done} rows to go"
    lines.append(f"{t.done}/{t.end} rows done, {t.errors} error rows, {where}: {verdict}")
    return lines

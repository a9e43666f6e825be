"""Shards: "I am shard i of N" for array jobs (SLURM job arrays, Kubernetes Indexed Jobs).

Invariants:
- shard i of N generates the contiguous rows [i*T // N, (i+1)*T // N) of the input's global
  `row_index` (T: the rows after input.limit); over i = 0..N-1 these ranges partition [0, T)
  (a shard of an N larger than T may be empty);
- a shard writes only into its own subdirectory of output.path, `shard-0000i-of-0000N`, which
  it locks; every shard (and every later run) skips the rows finished anywhere under
  output.path, so a row is written once whatever mix of runs wrote the others;
- duplicate ids are judged as in one run over every row: the Rust reader reads the id column
  of the rows before a shard's range (that column alone) before it reaches its own rows.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import JobError

SHARD_DIR = re.compile(r"shard-(\d+)-of-(\d+)")


@dataclass(frozen=True)
class Shard:
    index: int  # i, 0-based
    count: int  # N

    def rows(self, total_rows: int) -> tuple[int, int]:
        """This shard's rows [start, end) of the input's `total_rows`."""
        return self.index * total_rows // self.count, (self.index + 1) * total_rows // self.count

    @property
    def dir_name(self) -> str:
        return f"shard-{self.index:05d}-of-{self.count:05d}"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def _int(text: str, what: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise JobError(f"--shard: {what} must be an integer, got {text!r}") from None


def _checked(index: int, count: int, source: str) -> Shard:
    if count < 1:
        raise JobError(f"--shard: the number of shards must be >= 1, got {count} ({source})")
    if not 0 <= index < count:
        raise JobError(
            f"--shard: shard index {index} is outside 0..{count - 1} ({source}); shards are "
            f"numbered from 0"
        )
    return Shard(index, count)


def _from_env(count: int | None, env: Mapping[str, str]) -> Shard:
    """--shard auto: SLURM_ARRAY_TASK_ID (relative to SLURM_ARRAY_TASK_MIN, in steps of
    SLURM_ARRAY_TASK_STEP) of SLURM_ARRAY_TASK_COUNT, or Kubernetes' JOB_COMPLETION_INDEX."""
    if "SLURM_ARRAY_TASK_ID" in env:
        task = _int(env["SLURM_ARRAY_TASK_ID"], "SLURM_ARRAY_TASK_ID")
        low = _int(env.get("SLURM_ARRAY_TASK_MIN", "0"), "SLURM_ARRAY_TASK_MIN")
        step = max(1, _int(env.get("SLURM_ARRAY_TASK_STEP", "1"), "SLURM_ARRAY_TASK_STEP"))
        if count is None:
            if "SLURM_ARRAY_TASK_COUNT" not in env:
                raise JobError("--shard auto: SLURM_ARRAY_TASK_COUNT is not set; pass --shards N")
            count = _int(env["SLURM_ARRAY_TASK_COUNT"], "SLURM_ARRAY_TASK_COUNT")
        return _checked((task - low) // step, count, "from SLURM_ARRAY_TASK_ID")
    if "JOB_COMPLETION_INDEX" in env:
        if count is None:
            raise JobError(
                "--shard auto: JOB_COMPLETION_INDEX is set but the number of shards is not; "
                "pass --shards N (the Indexed Job's completions)"
            )
        index = _int(env["JOB_COMPLETION_INDEX"], "JOB_COMPLETION_INDEX")
        return _checked(index, count, "from JOB_COMPLETION_INDEX")
    raise JobError(
        "--shard auto: neither SLURM_ARRAY_TASK_ID (a SLURM job array) nor JOB_COMPLETION_INDEX "
        "(a Kubernetes Indexed Job) is set; pass --shard i/N"
    )


def parse_shard(
    text: str | None, count: int | None = None, env: Mapping[str, str] | None = None
) -> Shard | None:
    """`--shard i/N` or `--shard auto` (with `--shards N` where the environment lacks the
    count); None without --shard. Raises JobError, naming the option, on anything else."""
    if text is None:
        if count is not None:
            raise JobError("--shards N needs --shard auto (or give --shard i/N alone)")
        return None
    if text.strip() == "auto":
        return _from_env(count, os.environ if env is None else env)
    index, sep, total = text.partition("/")
    if not sep:
        raise JobError(f"--shard: expected i/N (e.g. 3/8) or auto, got {text!r}")
    n = _int(total, "N")
    if count is not None and count != n:
        raise JobError(f"--shard {text} and --shards {count} disagree on the number of shards")
    return _checked(_int(index, "i"), n, f"--shard {text}")


def shard_of_dir(name: str) -> Shard | None:
    """The shard a subdirectory of output.path belongs to, from its name."""
    m = SHARD_DIR.fullmatch(name)
    return None if m is None else Shard(int(m.group(1)), int(m.group(2)))

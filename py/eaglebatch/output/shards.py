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
from pathlib import Path

from eaglebatch.errors import JobError

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


def _count(count: int | None, written: set[int], env: Mapping[str, str], source: str) -> int:
    """The number of shards: --shards, else the one the output's shard directories were
    written with, else a SLURM array that is provably the whole job (`--array=0-(N-1)`: ids
    0..COUNT-1 in steps of 1). Anything that cannot be proven is a JobError."""
    if count is not None:
        if written and written != {count}:
            raise JobError(f"--shard auto: --shards {count}, but output.path holds shards of "
                           f"{_counts(written)}; run every shard with the same N")  # fmt: skip
        return count
    if len(written) == 1:
        return next(iter(written))
    if len(written) > 1:
        raise JobError(f"--shard auto: output.path holds shards of {_counts(written)}; pass "
                       f"--shards N")  # fmt: skip
    if "SLURM_ARRAY_TASK_COUNT" in env:
        n = _int(env["SLURM_ARRAY_TASK_COUNT"], "SLURM_ARRAY_TASK_COUNT")
        full = (env.get("SLURM_ARRAY_TASK_MIN", "0").strip() == "0"
                and env.get("SLURM_ARRAY_TASK_MAX", str(n - 1)).strip() == str(n - 1)
                and env.get("SLURM_ARRAY_TASK_STEP", "1").strip() == "1")  # fmt: skip
        if full:
            return n
        raise JobError(
            "--shard auto: this SLURM array is not --array=0-(N-1) (a resubmitted subset?) and "
            "output.path holds no shard yet, so the number of shards is unknown: pass --shards N"
        )
    raise JobError(f"--shard auto: {source} is set but the number of shards is not; pass "
                   f"--shards N")  # fmt: skip


def _counts(written: set[int]) -> str:
    return " and ".join(f"N = {n}" for n in sorted(written))


def _from_env(count: int | None, env: Mapping[str, str], written: set[int]) -> Shard:
    """--shard auto: the shard is SLURM_ARRAY_TASK_ID itself (array ids are shard ids, so a
    resubmitted subset, `--array=1` or `--array=3,5`, runs exactly those shards), or
    Kubernetes' JOB_COMPLETION_INDEX; the count as `_count` proves it."""
    for var in ("SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX"):
        if var in env:
            index = _int(env[var], var)
            return _checked(index, _count(count, written, env, var), f"{var}={index}")
    raise JobError(
        "--shard auto: neither SLURM_ARRAY_TASK_ID (a SLURM job array) nor JOB_COMPLETION_INDEX "
        "(a Kubernetes Indexed Job) is set; pass --shard i/N"
    )


def written_counts(output_path: str | Path) -> set[int]:
    """The shard counts N of the shard directories under output.path."""
    out = output_path if hasattr(output_path, "url") else Path(output_path)  # storage.location
    if not out.is_dir():
        return set()
    try:
        return {s.count for d in out.iterdir() if (s := shard_of_dir(d.name)) and d.is_dir()}
    except OSError as e:
        raise JobError(f"output.path: cannot read {out}: {e}") from None


def parse_shard(
    text: str | None, count: int | None = None, env: Mapping[str, str] | None = None,
    written: set[int] = frozenset(),
) -> Shard | None:  # fmt: skip
    """`--shard i/N` or `--shard auto` (the count from `--shards N`, or `written`: the counts
    of the output's shard directories, or the environment); None without --shard. Raises
    JobError, naming the option, on anything else."""
    if text is None:
        if count is not None:
            raise JobError("--shards N needs --shard auto (or give --shard i/N alone)")
        return None
    if text.strip() == "auto":
        return _from_env(count, os.environ if env is None else env, set(written))
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

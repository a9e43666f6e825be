"""Shard arithmetic and the --shard / --shards forms (shards.py), without running a model."""

from __future__ import annotations

import pytest

from eaglebatch.errors import JobError
from eaglebatch.output.shards import Shard, parse_shard, shard_of_dir


@pytest.mark.parametrize("total", [0, 1, 2, 7, 10, 101])
def test_every_row_is_in_exactly_one_shard(total):
    for n in range(1, total + 4):
        ranges = [Shard(i, n).rows(total) for i in range(n)]
        covered = [r for start, end in ranges for r in range(start, end)]
        assert covered == list(range(total)), (total, n)  # contiguous, in order, once each
        sizes = [end - start for start, end in ranges]
        assert max(sizes) - min(sizes) <= 1  # balanced


def test_shard_forms():
    assert parse_shard(None) is None
    assert parse_shard("3/8") == Shard(3, 8)
    assert parse_shard(" 0 / 1 ") == Shard(0, 1)
    assert parse_shard("2/4", 4) == Shard(2, 4)
    assert Shard(3, 8).dir_name == "shard-00003-of-00008"
    assert shard_of_dir("shard-00003-of-00008") == Shard(3, 8)
    assert shard_of_dir("unit-000-010") is None and shard_of_dir("shard-1-of-2x") is None


@pytest.mark.parametrize(
    ("text", "count", "message"),
    [
        ("8/8", None, r"shard index 8 is outside 0\.\.7"),
        ("-1/4", None, r"shard index -1 is outside"),
        ("0/0", None, r"number of shards must be >= 1, got 0"),
        ("3", None, r"expected i/N"),
        ("a/4", None, r"i must be an integer"),
        ("1/b", None, r"N must be an integer"),
        ("1/4", 8, r"disagree"),
        (None, 4, r"--shards N needs --shard auto"),
    ],
)
def test_bad_shards_name_the_option(text, count, message):
    with pytest.raises(JobError, match=message):
        parse_shard(text, count, env={})


def test_auto_reads_slurm_and_kubernetes():
    full = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "7",
            "SLURM_ARRAY_TASK_COUNT": "8"}  # fmt: skip
    assert parse_shard("auto", env=full) == Shard(5, 8)  # --array=0-7: provably 8 shards
    assert parse_shard("auto", 16, env=full) == Shard(5, 16)  # --shards wins
    # a resubmitted subset (--array=1, --array=3,5): the array id is the shard, N from the
    # output's shard directories or --shards; never the id's rank within the subset
    retry = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "3", "SLURM_ARRAY_TASK_MAX": "5",
             "SLURM_ARRAY_TASK_COUNT": "2"}  # fmt: skip
    assert parse_shard("auto", env=retry, written={8}) == Shard(5, 8)
    assert parse_shard("auto", 8, env=retry) == Shard(5, 8)
    with pytest.raises(JobError, match="not --array=0-\\(N-1\\).*pass --shards N"):
        parse_shard("auto", env=retry)
    with pytest.raises(JobError, match="--shards 4, but output.path holds shards of N = 8"):
        parse_shard("auto", 4, env=retry, written={8})
    with pytest.raises(JobError, match="holds shards of N = 2 and N = 8"):
        parse_shard("auto", env=retry, written={2, 8})
    with pytest.raises(JobError, match="index 8 is outside 0..7"):  # --array=1-8: ids from 1
        parse_shard("auto", env={**full, "SLURM_ARRAY_TASK_ID": "8"}, written={8})
    assert parse_shard("auto", 4, env={"JOB_COMPLETION_INDEX": "3"}) == Shard(3, 4)
    assert parse_shard("auto", env={"JOB_COMPLETION_INDEX": "3"}, written={4}) == Shard(3, 4)
    with pytest.raises(JobError, match="pass --shards N"):
        parse_shard("auto", env={"JOB_COMPLETION_INDEX": "3"})
    with pytest.raises(JobError, match="outside 0..3"):
        parse_shard("auto", 4, env={"JOB_COMPLETION_INDEX": "4"})
    with pytest.raises(JobError, match="neither SLURM_ARRAY_TASK_ID .* nor JOB_COMPLETION_INDEX"):
        parse_shard("auto", env={})

"""How a Ray run cuts the remaining rows into units (ray_executor.py), without Ray."""

from __future__ import annotations

import numpy as np
import pytest

from eaglebatch.ray_executor import cut_units, unit_rows


@pytest.mark.parametrize("total", [1, 10, 97])
@pytest.mark.parametrize("size", [1, 3, 16, 200])
def test_units_cover_the_remaining_rows_once(total, size):
    rng = np.random.default_rng(total * size)
    for fraction in (0.0, 0.3, 0.9, 1.0):
        done = np.sort(rng.choice(total, int(total * fraction), replace=False)).astype(np.int64)
        units = cut_units(total, done, size)
        todo = [r for u in units for r in range(u.start, u.end) if r not in set(u.skip)]
        assert todo == sorted(set(range(total)) - set(done.tolist()))
        for u, nxt in zip(units, units[1:], strict=False):
            assert u.end <= nxt.start  # disjoint, in order
        for u in units:
            assert set(u.skip) == {r for r in done.tolist() if u.start <= r < u.end}
            assert 0 < u.rows <= size
            assert u.name == f"unit-{u.start:012d}-{u.end:012d}"
        assert all(u.rows == size for u in units[:-1])


def test_unit_rows_gives_every_actor_work():
    assert unit_rows(10, 4, 64) == 3  # small jobs: about one unit per actor
    assert unit_rows(100_000, 2, 8) == 512  # at most 64 batches
    assert unit_rows(2_000, 2, 8) == 250  # about four units per actor
    assert unit_rows(1, 8, 8) == 1


def test_missing_ray_and_unreachable_clusters_are_job_errors(monkeypatch):
    import sys

    from eaglebatch.errors import JobError
    from eaglebatch.ray_executor import check_address, import_ray

    with monkeypatch.context() as m:
        m.setitem(sys.modules, "ray", None)  # as if not installed
        with pytest.raises(JobError, match=r"needs Ray, which is not installed: pip install"):
            import_ray()
    with pytest.raises(JobError, match=r"ray.address: cannot reach a Ray cluster at '127.0.0.1:1'"):
        check_address("127.0.0.1:1")
    with pytest.raises(JobError, match=r"cannot reach"):
        check_address("no-such-host.invalid:6379")
    check_address(None)
    check_address("auto")


def test_a_rerun_keeps_the_unit_directories_it_finds():
    """Units of an earlier cut keep their ranges (and names); only rows outside them are cut
    anew, and every remaining row is in exactly one unit."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        total = int(rng.integers(1, 120))
        done = np.sort(rng.choice(total, int(rng.integers(0, total + 1)), replace=False))
        first = cut_units(total, np.empty(0, np.int64), int(rng.integers(1, 40)))
        existing = [(u.start, u.end) for u in first if rng.random() < 0.5]
        units = cut_units(total, done.astype(np.int64), int(rng.integers(1, 40)), existing)
        todo = [r for u in units for r in range(u.start, u.end) if r not in set(u.skip)]
        assert todo == sorted(set(range(total)) - set(done.tolist()))
        starts = {u.start: u for u in units}
        for a, b in existing:  # kept as they were, unless nothing is left to do in them
            assert a not in starts or (starts[a].start, starts[a].end) == (a, b)
        for u, nxt in zip(units, units[1:], strict=False):
            assert u.end <= nxt.start
        for u in units:
            inside = [(a, b) for a, b in existing if a < u.end and u.start < b]
            assert inside in ([], [(u.start, u.end)])  # never straddles a kept unit

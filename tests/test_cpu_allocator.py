"""glibc's malloc thresholds for CPU steps (cpu/allocator.py): a step's freed activations are
reused by the next step instead of being page-faulted in again."""

from __future__ import annotations

import resource

import pytest
import torch

from eaglebatch.cpu.allocator import keep_freed_memory


def _minor_faults(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_steps_freed_activations_are_reused() -> None:
    if not keep_freed_memory():
        pytest.skip("no glibc mallopt here")
    assert keep_freed_memory()  # once per process; a second call keeps the settings

    def step() -> None:  # 48 MiB of 6 MiB activations, written, then freed
        xs = [torch.ones(6 << 20, dtype=torch.uint8) for _ in range(8)]
        assert sum(int(x[-1]) for x in xs) == 8

    step()
    step()  # the heap has grown to a step's peak
    # 48 MiB is 12,288 pages a step (glibc's defaults fault every one in again, each step)
    assert sum(_minor_faults(step) for _ in range(5)) < 5_000

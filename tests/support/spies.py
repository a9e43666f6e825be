"""Worker wrappers shared by the engine tests."""

from __future__ import annotations

import time


class ReaderWaitSpy:
    """Wraps a worker: before its first `step` (the serial loop; overlapped launches are not
    delayed) it sleeps `wait_s`, time for the input reader thread to queue the few rows of a
    test's input, so that rows meant to run side by side do from the second step on even when
    the reader is scheduled late. A sleep, not a handshake: the worker cannot see the reader.
    A test that needs preemptions needs this: rows admitted one at a time, each running alone
    in a tight cache, are never preempted."""

    def __init__(self, worker, wait_s: float = 0.5) -> None:
        self.worker, self.wait_s, self.steps = worker, wait_s, 0

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def step(self, plan):
        if self.steps == 0:
            time.sleep(self.wait_s)
        self.steps += 1
        return self.worker.step(plan)

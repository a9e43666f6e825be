"""Worker wrappers shared by the engine tests."""

from __future__ import annotations

import time


class ReaderWaitSpy:
    """Wraps a worker: its first step waits for the input reader thread to queue the (few)
    rows of a test's input, so rows meant to run side by side do, however late the reader is
    scheduled. A test that needs preemptions needs this: rows admitted one at a time, each
    running alone in a tight cache, are never preempted."""

    def __init__(self, worker, wait_s: float = 0.5) -> None:
        self.worker, self.wait_s, self.steps = worker, wait_s, 0

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def step(self, plan):
        if self.steps == 0:
            time.sleep(self.wait_s)
        self.steps += 1
        return self.worker.step(plan)

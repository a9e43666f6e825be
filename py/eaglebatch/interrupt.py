"""Clean interrupts: SIGINT / SIGTERM during generation stop the job between two steps.

The first signal only sets a flag; the step loop sees it after the current step, stops
admitting work and closes the output (rows already finished are written into a last part file;
unfinished ones are dropped, and a later run of the same job generates them). A second signal
kills the process at once: the handlers are reset to the OS default on the first one, which
works even while the main thread is inside a long Rust or torch call. Either way no partial part
file is left, only hidden `.part-*.tmp` files that the next run deletes.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """The job stopped early on a signal; rows finished before it are on disk."""

    def __init__(self, signum: int, rows_written: int, output_dir: str):
        self.signum = signum
        self.rows_written = rows_written
        self.output_dir = output_dir
        name = signal.Signals(signum).name
        super().__init__(
            f"interrupted ({name}): {rows_written} rows written to {output_dir}; "
            f"run the same command again to resume"
        )

    @property
    def exit_status(self) -> int:
        """The shell convention: 128 + signal number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum


class StopSignals:
    """Context manager: while active, SIGINT / SIGTERM set `signum` instead of raising.
    Outside the main thread (where handlers cannot be installed) it does nothing."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        for s in SIGNALS:  # a second signal ends the process immediately
            signal.signal(s, signal.SIG_DFL)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

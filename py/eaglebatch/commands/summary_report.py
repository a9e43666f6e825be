"""`run --summary-json PATH`: the one JSON object a run leaves however it ends
(output/summary_json.py says what it holds and which paths are refused).

`-` and `/dev/stdout` name the standard output as a stream: the object is written there once,
at the end, and stdout holds nothing else (`eaglebatch run job.yaml --summary-json - | jq`).
Invariant, in that mode: from the moment the option is read until the object is written, every
write to stdout (Python's, the extension's, a library's at the file-descriptor level) goes to
stderr instead, where the progress and the summary table go anyway.
"""

from __future__ import annotations

import io
import json
import os
import sys

from eaglebatch.errors import JobError

STREAM_NAMES = ("-", "/dev/stdout")


class _StdoutStream:
    """The real stdout, set aside for the summary; stdout is stderr meanwhile."""

    def __init__(self) -> None:
        sys.stdout.flush()
        self.saved_fd, self.out = None, sys.stdout
        try:
            fd, err = sys.stdout.fileno(), sys.stderr.fileno()
        except (OSError, ValueError, io.UnsupportedOperation):  # no descriptors (in-process)
            fd = err = None
        if fd is not None and err is not None:
            self.saved_fd = os.dup(fd)
            os.dup2(err, fd)  # native code writing to descriptor 1 reaches stderr
        sys.stdout = sys.stderr

    def write(self, obj: dict) -> None:
        """Writes `obj` as one line of JSON to the real stdout, which is stdout again after."""
        from eaglebatch.output.summary_json import plain  # lazy: pyarrow, only at the end

        text = json.dumps(obj, default=plain) + "\n"
        sys.stderr.flush()
        if self.saved_fd is None:
            sys.stdout = self.out
            self.out.write(text)
            self.out.flush()
            return
        os.dup2(self.saved_fd, 1)
        os.close(self.saved_fd)
        sys.stdout = sys.__stdout__
        os.write(1, text.encode())


class SummaryReport:
    """Writes the summary once, however the run ends: to a file, or to stdout as a stream."""

    def __init__(self, path: str | None) -> None:
        # lazy: pyarrow, torch and rich load only for the command that uses them (fast --help)
        from eaglebatch.output.summary_json import check_summary_path

        self.stream = _StdoutStream() if path in STREAM_NAMES else None
        self.path = None
        if path is not None and self.stream is None:
            self.path = check_summary_path(path)  # JobError: exit 2
        self.job, self.written = None, False

    def check_apart(self, job) -> None:
        """The path against the job's output and input; a refused path is never written."""
        # lazy: pyarrow, torch and rich load only for the command that uses them (fast --help)
        from eaglebatch.output.summary_json import check_summary_apart

        if self.path is not None:
            path, self.path = self.path, None
            check_summary_apart(path, job)
            self.path = path

    def write(self, stats, wall_s, reason: str, status: int, error: str | None = None) -> None:
        if (self.path is None and self.stream is None) or self.written:
            return
        # lazy: pyarrow, torch and rich load only for the command that uses them (fast --help)
        from eaglebatch.output.summary_json import run_summary, write_json

        self.written = True
        summary = run_summary(self.job, stats, wall_s, reason, status, error)
        if self.stream is not None:
            self.stream.write(summary)
            return
        try:
            write_json(self.path, summary)
        except OSError as e:
            raise JobError(f"--summary-json: cannot write {self.path}: {e}") from None

    def exit(self, reason: str, status: int, error: str) -> None:
        self.write(None, None, reason, status, error)
        sys.exit(status)

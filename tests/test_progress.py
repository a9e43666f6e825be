"""progress.py: the log lines written when stderr is not a terminal."""

import io
import re

from rich.console import Console

from eaglebatch.progress import ProgressView


def _line(view: ProgressView, capsys, done: int) -> str:
    view._last_log = float("-inf")  # log on this call
    view({"requests_done": done, "requests_total": 4, "output_tokens": 10 * done,
          "running": 4 - done, "waiting": 0})  # fmt: skip
    return capsys.readouterr().err


def test_log_lines_give_no_eta_before_a_request_finishes(capsys):
    view = ProgressView(4, console=Console(file=io.StringIO()), log_every_s=0.0)
    view.start -= 30.0  # 30 s of prefill, nothing finished yet
    assert "0/4 requests" in (first := _line(view, capsys, 0))
    assert "ETA unknown" in first
    later = _line(view, capsys, 2)  # half done after ~30 s: ~30 s to go
    eta = int(re.search(r"ETA (\d+)s", later).group(1))
    assert "2/4 requests" in later and 25 <= eta <= 40

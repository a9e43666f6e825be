"""progress.py: the log lines written when stderr is not a terminal; the rate and the ETA
count from the first generated token, not from the model load and the first prefills."""

import io
import re

from rich.console import Console

from eaglebatch import progress
from eaglebatch.progress import ProgressView


def _line(view: ProgressView, capsys, done: int, tokens: int) -> str:
    view._last_log = float("-inf")  # log on this call
    view({"requests_done": done, "requests_total": 4, "output_tokens": tokens,
          "running": 4 - done, "waiting": 0})  # fmt: skip
    return capsys.readouterr().err


def test_the_eta_counts_from_the_first_generated_token(capsys, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    view = ProgressView(4, console=Console(file=io.StringIO()), log_every_s=0.0)
    clock[0] += 300.0  # the model loads, the first prompts prefill: nothing generated yet
    first = _line(view, capsys, 0, 0)
    assert "0/4 requests" in first and "ETA unknown" in first
    _line(view, capsys, 0, 4)  # the first tokens
    clock[0] += 10.0
    later = _line(view, capsys, 2, 84)  # half done 10 s after the first token: ~10 s to go
    eta = int(re.search(r"ETA (\d+)s", later).group(1))
    assert "2/4 requests" in later and eta == 10, later
    assert "8.0 output tok/s" in later  # 80 tokens in the 10 s since the first


def test_the_summary_reports_structured_output():
    from eaglebatch.progress import structured_line

    assert structured_line({"structured_rows": 0}) is None
    stats = {"structured_rows": 64, "grammar_compiles": 1, "mask_seconds_p50": 0.0047,
             "mask_seconds_p99": 0.0104, "output_tokens": 1000,
             "drafts": {"forced_accepted": 127}}  # fmt: skip
    assert structured_line(stats) == ("64 rows, 1 grammars compiled, masks 4.70 / 10.40 ms a "
                                      "step (p50 / p99), 12.7% of output tokens forced drafts")

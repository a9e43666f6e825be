"""Memory stays bounded whatever the input size: peak RSS of a 200,000-row job is within a
small margin of a 20,000-row job's (each measured in its own process)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("eaglebatch._native")
pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_peak_rss_independent_of_row_count():
    import streaming_memory

    small, large = streaming_memory.main(["--rows", "20000", "200000"])
    assert small["rows"] == 20_000 and large["rows"] == 200_000
    # 10x the rows; bounded queues mean the high-water mark barely moves.
    assert large["peak_rss_mb"] < small["peak_rss_mb"] + 64, (small, large)


def test_openai_batch_jsonl_streams_with_flat_memory():
    import streaming_memory

    small, large = streaming_memory.main(["--rows", "20000", "200000", "--format",
                                          "openai-batch"])  # fmt: skip
    assert small["rows"] == 20_000 and large["rows"] == 200_000
    assert large["peak_rss_mb"] < small["peak_rss_mb"] + 64, (small, large)

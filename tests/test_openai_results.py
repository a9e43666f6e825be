"""openai_results.py without a model: the results file is in input order (row_index) whatever
order the parts were written in, its memory stays flat in the number of requests, and usage
carries the prefix cache's cached_tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import eaglebatch
from eaglebatch.output.directory import OWNER_KEY

WRITE = r"""
import resource, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_openai_results import fake_output
from eaglebatch.output.openai_results import write_results
out = Path(sys.argv[2])
fake_output(out, int(sys.argv[3]), int(sys.argv[4]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
write_results(out, out / "_results.jsonl", "/v1/completions", "m", "hash")
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def fake_output(out: Path, rows: int, n: int, part_rows: int = 1000, seed: int = 0) -> None:
    """Parts as continuous batching writes them: rows finish roughly in input order, shuffled
    within a window, a few stragglers much later; n samples per row, spread over parts."""
    rng = np.random.default_rng(seed)
    keys = np.repeat(np.arange(rows), n) + rng.uniform(0, 50, rows * n)
    keys[rng.choice(rows * n, max(1, rows * n // 1000), replace=False)] += rows / 3
    order = np.argsort(keys, kind="stable")
    row, sample = order // n, order % n
    out.mkdir(parents=True, exist_ok=True)
    for k, start in enumerate(range(0, rows * n, part_rows)):
        r, s = row[start : start + part_rows], sample[start : start + part_rows]
        t = pa.table({"id": [f"c{i}" for i in r], "row_index": pa.array(r, pa.int64()),
                      "sample_index": pa.array(s, pa.int32()),
                      "output_text": [f"text {i}.{j}" for i, j in zip(r, s)],
                      "finish_reason": ["length"] * len(r),
                      "prompt_tokens": pa.array(np.full(len(r), 7), pa.int32()),
                      "output_tokens": pa.array(np.full(len(r), 3), pa.int32()),
                      "cached_tokens": pa.array(r % 5, pa.int32()),
                      "error": pa.array([None] * len(r), pa.string())})  # fmt: skip
        t = t.replace_schema_metadata({OWNER_KEY: b"hash"})
        pq.write_table(t, out / f"part-{k:05d}.parquet")


def test_results_are_in_input_order_with_every_sample(tmp_path):
    fake_output(tmp_path / "out", 3000, 3, part_rows=700, seed=4)
    from eaglebatch.output.openai_results import write_results

    out = tmp_path / "out"
    assert write_results(out, out / "_results.jsonl", "/v1/completions", "m", "hash") == 3000
    lines = [json.loads(t) for t in (out / "_results.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"c{i}" for i in range(3000)]
    for i, line in enumerate(lines):
        body = line["response"]["body"]
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert [c["text"] for c in body["choices"]] == [f"text {i}.{j}" for j in range(3)]
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": i % 5}


def test_each_choice_carries_vllms_stop_reason(tmp_path):
    """The stop string, else the stop token id, else null (EOS, length); parts written before
    the columns existed give null."""
    from eaglebatch.output.openai_results import write_results

    out = tmp_path / "out"
    fake_output(out, 4, 1)
    part = out / "part-00000.parquet"
    t = pq.read_table(part).sort_by("row_index")
    t = t.append_column("stop_reason", pa.array(["###", None, None, None], pa.string()))
    t = t.append_column("stop_token_id", pa.array([None, 7, None, None], pa.int32()))
    pq.write_table(t.replace_schema_metadata({OWNER_KEY: b"hash"}), part)
    write_results(out, out / "_results.jsonl", "/v1/chat/completions", "m", "hash")
    lines = [json.loads(t) for t in (out / "_results.jsonl").read_text().splitlines()]
    got = [line["response"]["body"]["choices"][0]["stop_reason"] for line in lines]
    assert got == ["###", 7, None, None]
    pq.write_table(pq.read_table(part).drop_columns(["stop_reason", "stop_token_id"]), part)
    write_results(out, out / "_results.jsonl", "/v1/completions", "m", "hash")
    lines = [json.loads(t) for t in (out / "_results.jsonl").read_text().splitlines()]
    assert all(line["response"]["body"]["choices"][0]["stop_reason"] is None for line in lines)


def test_memory_stays_flat_in_the_number_of_requests(tmp_path):
    """200,000 requests take about the memory of 20,000 (the rows held are those of the parts
    open at once, not all of them)."""
    here = str(Path(__file__).parent)
    env_path = str(Path(eaglebatch.__file__).resolve().parent.parent)

    def peak_growth_kib(rows: int) -> int:
        r = subprocess.run([sys.executable, "-c", WRITE, here, str(tmp_path / f"o{rows}"),
                            str(rows), "1"], capture_output=True, text=True,
                           env={"PYTHONPATH": env_path})  # fmt: skip
        assert r.returncode == 0, r.stderr
        return int(r.stdout.split()[-1])

    small, large = peak_growth_kib(20_000), peak_growth_kib(200_000)
    assert large < small + 60 * 1024, (small, large)  # KiB: well under all rows held at once
    lines = (tmp_path / "o200000" / "_results.jsonl").read_text().splitlines()
    assert len(lines) == 200_000 and json.loads(lines[-1])["custom_id"] == "c199999"

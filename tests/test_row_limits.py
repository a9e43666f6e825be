"""What one row may cost, end to end: a row that cannot fit the KV cache, max_model_len or a
sane chat-template render becomes an error row saying why (before the work, with bounded
memory) while every other row is generated exactly as it would be anyway; an input file that
turns out corrupt during the run is a user error naming it, and leaves only complete parts."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglebatch.job.config import load_job
from eaglebatch.job.scheduler_config import sectioned
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared

native = pytest.importorskip("eaglebatch._native")

MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def run_job(tmp: Path, model: Path, table: pa.Table, name: str, source: str, engine: str = ""):
    inp = tmp / f"{name}.parquet"
    pq.write_table(table, inp)
    job = tmp / f"{name}.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {inp}\n  {source}\n  id_column: id\n"
        f"output:\n  path: {tmp / name}\n  include_token_ids: true\n"
        f"sampling:\n  max_new_tokens: 8\nengine:\n  device: cpu\n  max_batch_size: 4\n"
        f"  block_size: 16\n{engine}"
    )
    res = run_prepared(prepare(load_job(job)))
    return {r["id"]: r for r in pq.read_table(tmp / name).to_pylist()}, res


def test_outputs_do_not_depend_on_the_kv_budget(tmp_path, tiny_model_dir):
    # Byte-level tokenizer without BOS: a prompt's tokens are its bytes. The longest fitting
    # prompt, 40 bytes + max_new_tokens 8, needs the whole tight budget of 48 tokens (3 blocks);
    # 45 + 8 = 53 cannot fit although the prompt alone would.
    prompts = [("abcdefghij" * 4)[:n] for n in (14, 15, 40, 23, 5, 31, 9)] + ["z" * 45]
    table = pa.table({"id": [f"r{i}" for i in range(len(prompts))], "prompt": prompts})
    src = "prompt_column: prompt"
    big, _ = run_job(tmp_path, tiny_model_dir, table, "big", src, "  kv_cache_tokens: 4096\n")
    tight, res = run_job(tmp_path, tiny_model_dir, table, "tight", src, "  kv_cache_tokens: 48\n")
    assert res.stats["preemptions"] > 0  # the budget really was tight
    assert big["r7"]["error"] is None
    bad = tight.pop("r7")
    assert bad["finish_reason"] == "error" and bad["output_tokens"] == 0
    assert bad["error"].startswith(
        "needs up to 53 tokens of KV cache (prompt 45 + max_new_tokens 8) but the cache holds "
        "48 tokens; raise engine.kv_cache_tokens or engine.kv_cache_memory_fraction"
    ), bad["error"]
    assert bad["prompt_tokens"] == 45
    for rid, row in tight.items():
        assert row["error"] is None
        for key in ("output_token_ids", "output_text", "finish_reason", "prompt_tokens"):
            assert row[key] == big[rid][key], (rid, key)


def test_error_rows_report_the_prompt_tokens_when_known(tmp_path, tiny_model_dir):
    table = pa.table({"id": ["long", "null", "ok"], "prompt": ["x" * 100, None, "hello"]})
    rows, _ = run_job(tmp_path, tiny_model_dir, table, "p", "prompt_column: prompt",
                      "  max_model_len: 64\n")
    assert "shorter than max_model_len (64)" in rows["long"]["error"]
    assert rows["long"]["prompt_tokens"] == 100
    assert rows["null"]["prompt_tokens"] == 0  # never tokenized
    assert rows["ok"]["error"] is None and rows["ok"]["prompt_tokens"] == 5


def run_cli(job: Path, timeout: float) -> tuple[subprocess.CompletedProcess, int]:
    """`eaglebatch run JOB` in a fresh interpreter; also returns its peak RSS in MiB (VmHWM:
    getrusage's ru_maxrss would include the forking pytest process's RSS; 0 without /proc)."""
    code = (
        "import sys\n"
        "from eaglebatch.cli import main\n"
        "try:\n"
        f"    main(['run', {str(job)!r}])\n"
        "except SystemExit as e:\n"
        "    rc = e.code\n"
        "try:\n"
        "    status = open('/proc/self/status').read().split('VmHWM:')[1]\n"
        "    peak = int(status.split()[0]) // 1024\n"
        "except (OSError, IndexError):\n"
        "    peak = 0\n"
        "print(f'PEAK_RSS_MIB={peak}')\n"
        "sys.exit(rc)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=timeout)
    peaks = [line for line in p.stdout.splitlines() if line.startswith("PEAK_RSS_MIB=")]
    assert peaks, p.stdout + p.stderr
    return p, int(peaks[-1].split("=")[1])


def write_job(tmp: Path, model: Path, inp: Path, source: str) -> Path:
    job = tmp / "job.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {inp}\n  {source}\n  id_column: id\n"
        f"output:\n  path: {tmp / 'out'}\nsampling:\n  max_new_tokens: 4\n"
        f"engine:\n  device: cpu\n  kv_cache_tokens: 1024\n"
    )
    return job


def test_a_20_mb_prompt_is_refused_without_tokenizing(tmp_path, tiny_model_dir):
    # Tokenizing 20 MB would take gigabytes; the limit is 4 x 13 (the longest token,
    # "<|endoftext|>") x max_model_len 512 = 26,624 characters.
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["huge", "ok"], "prompt": ["ab" * 10_000_000, "hello"]}), inp)
    t0 = time.monotonic()
    p, peak = run_cli(write_job(tmp_path, tiny_model_dir, inp, "prompt_column: prompt"), 300)
    elapsed = time.monotonic() - t0
    assert p.returncode == 0, p.stderr
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
    assert rows["huge"]["error"] == (
        "prompt has 20000000 characters: more than 26624 characters cannot fit max_model_len "
        "= 512 tokens (no token of this tokenizer is longer than 13 characters; the limit is "
        "4 x 13 x 512); it was not tokenized"
    )
    assert rows["ok"]["error"] is None and rows["ok"]["output_tokens"] > 0
    assert elapsed < 120, elapsed
    assert peak < 1500, f"peak RSS {peak} MiB"


# The ChatML template, except that "big" renders 100 MB and "loop" loops 10^10 times.
HOSTILE_TEMPLATE = (
    "{% if messages[0]['content'] == 'big' %}"
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endif %}"
    "{% if messages[0]['content'] == 'loop' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_runaway_chat_template_makes_error_rows(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(HOSTILE_TEMPLATE)
    inp = tmp_path / "in.parquet"
    messages = [[{"role": "user", "content": c}] for c in ("big", "loop", "hello")]
    table = pa.table({"id": ["big", "loop", "ok"], "messages": pa.array(messages, MESSAGES_TYPE)})
    pq.write_table(table, inp)
    p, peak = run_cli(write_job(tmp_path, model, inp, "messages_column: messages"), 300)
    assert p.returncode == 0, p.stderr
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
    assert rows["big"]["error"].startswith(
        "chat template output exceeds 26624 bytes: more than 26624 characters cannot fit "
        "max_model_len = 512 tokens"
    ), rows["big"]["error"]
    assert rows["loop"]["error"].startswith("chat template ran too long"), rows["loop"]["error"]
    assert rows["ok"]["error"] is None and rows["ok"]["output_tokens"] > 0
    assert peak < 1500, f"peak RSS {peak} MiB"


def corrupt_parquet(path: Path, rows: int, row_group_size: int, bad_group: int) -> None:
    """An uncompressed, plain-encoded string column whose row group `bad_group` has the second
    half of its data page overwritten; the footer stays valid."""
    prompts = [f"prompt number {i} " * 3 for i in range(rows)]
    table = pa.table({"id": [f"r{i}" for i in range(rows)], "prompt": prompts})
    pq.write_table(table, path, compression="none", use_dictionary=False,
                   row_group_size=row_group_size)
    col = pq.read_metadata(path).row_group(bad_group).column(1)
    # From the middle of the chunk (well past the page header) to its end: the length
    # prefixes of the plain-encoded strings there become 0xffffffff.
    start = col.data_page_offset + col.total_compressed_size // 2
    end = col.data_page_offset + col.total_compressed_size
    data = bytearray(path.read_bytes())
    data[start:end] = b"\xff" * (end - start)
    path.write_bytes(bytes(data))
    assert pq.read_metadata(path).num_rows == rows
    with pytest.raises((OSError, pa.ArrowException)):
        pq.read_table(path)


def test_a_corrupt_data_page_is_a_user_error_and_abort_keeps_finished_rows(
    tmp_path, tiny_model_dir
):
    inp = tmp_path / "in.parquet"
    corrupt_parquet(inp, rows=12, row_group_size=6, bad_group=1)
    out = tmp_path / "out"
    s = native.Scheduler(sectioned(
        input_files=[str(inp)], prompt_column="prompt", messages_column=None, id_column="id",
        limit=None, apply_chat_template=False,
        tokenizer_file=str(Path(tiny_model_dir) / "tokenizer.json"), chat_template=None,
        bos_token=None, eos_token=None, eos_token_ids=[], output_dir=str(out), part_rows=100,
        file_metadata={}, include_token_ids=False, max_new_tokens=1, stop=[], temperature=0.0,
        top_p=1.0, top_k=0, seed=0, num_blocks=64, block_size=16, max_batch_size=2,
        max_num_batched_tokens=4096, max_model_len=512, queue_rows=64,
    ))
    time.sleep(0.5)  # let the reader queue rows 0..5 and its failure
    finished = 0
    with pytest.raises(native.UserInputError) as err:
        while (plan := s.next_plan()) is not None:
            s.commit([65] * plan.num_seqs, [1] * plan.num_seqs)
            finished += plan.num_seqs  # max_new_tokens 1: a prefill finishes its rows
    msg = str(err.value)
    assert f"{inp}, row group 1: the input file is corrupt or unreadable" in msg, msg
    assert finished > 0
    written = s.abort()
    assert written["rows_written"] == finished
    names = sorted(f.name for f in out.iterdir())
    assert names == ["part-00000.parquet"], names  # complete, no .tmp, nothing empty
    assert sorted(pq.read_table(out)["id"].to_pylist()) == [f"r{i}" for i in range(finished)]


def test_the_cli_reports_a_corrupt_input_without_a_traceback_or_empty_part(
    tmp_path, tiny_model_dir
):
    inp = tmp_path / "in.parquet"
    corrupt_parquet(inp, rows=8, row_group_size=4, bad_group=0)
    p, _ = run_cli(write_job(tmp_path, tiny_model_dir, inp, "prompt_column: prompt"), 300)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    assert "row group 0: the input file is corrupt or unreadable" in p.stderr, p.stderr
    out = tmp_path / "out"
    parts = sorted(out.glob("*.parquet")) if out.exists() else []
    assert all(pq.read_metadata(f).num_rows > 0 for f in parts), parts

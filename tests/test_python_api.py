"""The Python API (eaglebatch.Engine, eaglebatch.run): a call is the job a user would write,
so its rows equal a CLI run's row for row, in input order; every input kind; streaming in
order with memory held flat over 200,000 rows; scores through the engine against
transformers; user errors as JobError."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import eaglebatch
from support.cli import cli, finish
from test_runner import hf_model, random_prompts  # noqa: F401 (fixture)
from test_scoring import hf_score, split

pytest.importorskip("eaglebatch._native")

ENGINE = {"device": "cpu", "kv_cache_tokens": 4096}
SAMPLING = {"max_new_tokens": 12}
# columns that differ between two runs of the same job (timings)
TIMED = {"queue_s", "ttft_s", "latency_s", "tpot_s"}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with eaglebatch.Engine(str(tiny_model_dir), engine=ENGINE) as eng:
        yield eng


def untimed(table: pa.Table) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMED} for r in table.to_pylist()]


def cli_rows(tmp: Path, model: Path, table: pa.Table, column: str = "prompt") -> pa.Table:
    """The same rows through `eaglebatch run` (a subprocess), sorted as the API returns them."""
    pq.write_table(table, tmp / "in.parquet")
    job = tmp / "job.yaml"
    job.write_text(textwrap.dedent(f"""\
        model: {model}
        input:
          path: {tmp / 'in.parquet'}
          {column}_column: {column}
        output:
          path: {tmp / 'out'}
          include_token_ids: true
        sampling:
          max_new_tokens: 12
        engine:
          device: cpu
          kv_cache_tokens: 4096
        """))  # fmt: skip
    finish(cli("run", str(job)))
    return pq.read_table(tmp / "out").sort_by([("row_index", "ascending")])


def test_generate_equals_a_cli_run_row_for_row(tmp_path, tiny_model_dir, engine):
    prompts = random_prompts(10, seed=4)
    got = engine.generate(prompts, sampling=SAMPLING, output={"include_token_ids": True})
    want = cli_rows(tmp_path, tiny_model_dir, pa.table({"prompt": prompts}))
    assert got.schema == want.schema
    assert untimed(got) == untimed(want)
    assert got.column("row_index").to_pylist() == list(range(10))  # input order


def test_every_input_kind_gives_the_same_rows(engine):
    pd = pytest.importorskip("pandas")
    prompts = random_prompts(6, seed=5)
    base = untimed(engine.generate(prompts, sampling=SAMPLING))
    table = pa.table({"text": prompts})
    keys = {"prompt_column": "text"}
    assert untimed(engine.generate(table, sampling=SAMPLING, input=keys)) == base
    frame = pd.DataFrame({"text": prompts})
    assert untimed(engine.generate(frame, sampling=SAMPLING, input=keys)) == base
    reader = pa.RecordBatchReader.from_batches(table.schema, table.to_batches(max_chunksize=2))
    assert untimed(engine.generate(reader, sampling=SAMPLING, input=keys)) == base


def test_messages_equal_a_cli_messages_job(tmp_path, tiny_model_dir, engine):
    convs = [[{"role": "user", "content": p}] for p in random_prompts(4, seed=6)]
    got = engine.generate(convs, sampling=SAMPLING, output={"include_token_ids": True})
    want = cli_rows(tmp_path, tiny_model_dir, pa.table({"messages": convs}), "messages")
    assert untimed(got) == untimed(want)
    assert all(r["error"] is None for r in got.to_pylist())


def test_per_row_columns_ids_and_kept_columns(engine):
    table = pa.table({"prompt": ["a b", "c d e"], "max": [3, 5], "key": ["k1", "k2"]})
    out = engine.generate(table, sampling={**SAMPLING, "ignore_eos": True},
                          input={"sampling_columns": {"max_new_tokens": "max"},
                                 "id_column": "key"},
                          output={"keep_columns": ["max"]})  # fmt: skip
    assert out.column("id").to_pylist() == ["k1", "k2"]
    assert out.column("output_tokens").to_pylist() == [3, 5]
    assert out.column("max").to_pylist() == [3, 5]


def test_generate_stream_yields_input_order_in_chunks(engine):
    prompts = random_prompts(11, seed=7)
    whole = untimed(engine.generate(prompts, sampling={"max_new_tokens": 4, "temperature": 1.0}))
    sampled = {"max_new_tokens": 4, "temperature": 1.0}
    batches = list(engine.generate_stream(prompts, chunk_rows=4, sampling=sampled))
    assert [b.num_rows for b in batches] == [4, 4, 3]
    streamed = untimed(pa.Table.from_batches(batches))
    assert streamed == whole  # sampled rows too: seeds follow the row index, not the chunk


STREAM_SCRIPT = """
import resource, sys
import pyarrow as pa
import eaglebatch
model, n = sys.argv[1], int(sys.argv[2])
schema = pa.schema([("prompt", pa.string()), ("payload", pa.string())])
def batches():
    for s in range(0, n, 5000):
        idx = range(s, min(n, s + 5000))
        yield pa.record_batch([pa.array([f"row {i}" for i in idx]),
                               pa.array([f"{i:08d}" * 64 for i in idx])], schema=schema)
reader = pa.RecordBatchReader.from_batches(schema, batches())
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
with eaglebatch.Engine(model, engine={"device": "cpu", "kv_cache_tokens": 65536,
                                      "max_batch_size": 256}) as eng:
    done, early = 0, None
    for b in eng.generate_stream(reader, sampling={"max_new_tokens": 1}, chunk_rows=10000,
                                 output={"keep_columns": ["payload"]}):
        rows = b.column("row_index").to_pylist()
        assert rows == list(range(done, done + len(rows))), "out of order"
        assert b.column("payload")[0].as_py() == f"{done:08d}" * 64
        done += len(rows)
        if early is None and done >= n // 4:
            early = peak()
print(done, early, peak())
"""


def test_streaming_200000_rows_holds_memory_flat(tmp_path, tiny_model_dir):
    # each row carries 512 bytes kept into its output: 100 MB of rows in all, which would show
    # as growth past the first quarter if rows accumulated anywhere
    proc = subprocess.run([sys.executable, "-c", STREAM_SCRIPT, str(tiny_model_dir), "200000"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    done, early, end = map(int, proc.stdout.split()[-3:])
    assert done == 200_000
    assert end - early < 40, (early, end)  # MiB


def test_score_equals_transformers_shared_and_unshared(engine, hf_model):  # noqa: F811
    contexts = ["the cat sat ", "the cat sat ", "hello", "", "the cat sat "]
    conts = ["on the mat", "down", " world", "abc", "on"]
    got = engine.score(contexts, conts).to_pylist()
    assert len(got) == 5
    for ctx, cont, row in zip(contexts, conts, got, strict=True):
        c, x = split(ctx, cont)
        want, greedy = hf_score(hf_model, c, x)
        assert abs(row["logprob"] - want) < 1e-4 and row["is_greedy"] == greedy
        assert row["num_tokens"] == len(x) and row["error"] is None
    rolling = engine.score_rolling(["the cat sat on the mat " * 4]).to_pylist()[0]
    c, x = split("", "the cat sat on the mat " * 4)
    assert abs(rolling["logprob"] - hf_score(hf_model, c, x)[0]) < 1e-4


def test_run_is_the_cli_run_and_resumes(tmp_path, tiny_model_dir):
    prompts = random_prompts(5, seed=8)
    pq.write_table(pa.table({"prompt": prompts}), tmp_path / "in.parquet")
    job = {"model": str(tiny_model_dir), "input": {"path": str(tmp_path / "in.parquet")},
           "output": {"path": str(tmp_path / "out")}, "sampling": SAMPLING,
           "engine": ENGINE}  # fmt: skip
    first = eaglebatch.run(job)
    assert first.stats["requests"] == 5 and first.output_tok_s > 0
    again = eaglebatch.run(job)  # resumes: nothing left
    assert again.stats["requests"] == 0 and len(pq.read_table(tmp_path / "out")) == 5
    restarted = eaglebatch.run(job, ["sampling.max_new_tokens=12"], restart=True)
    assert restarted.stats["requests"] == 5


@pytest.mark.parametrize(("call", "message"), [
    (lambda e: e.generate(123), "inputs: expected a list of prompt strings"),
    (lambda e: e.generate(["a", 3]), r"inputs\[1\]"),
    (lambda e: e.generate(["a"], sampling={"temprature": 1}), "sampling.temprature"),
    (lambda e: e.generate(["a"], input={"prompt_column": "nope"}), "nope"),
    (lambda e: e.score(["a"], ["b", "c"]), "1 contexts but 2 continuations"),
    (lambda e: e.score(["a", None], ["b", "c"]), "pair 1 is not two strings"),
    (lambda e: list(e.generate_stream(["a"], chunk_rows=0)), "chunk_rows"),
])  # fmt: skip
def test_user_errors_are_job_errors(engine, call, message):
    with pytest.raises(eaglebatch.JobError, match=message):
        call(engine)


@pytest.mark.parametrize(("call", "message"), [
    (lambda e: e.score_rolling("abc"), "texts: expected a list of strings, not str"),
    (lambda e: e.score("ab", ["c", "d"]), "contexts: expected a list of strings, not str"),
    (lambda e: e.score(["a", "b"], "cd"), "continuations: expected a list of strings, not str"),
    (lambda e: e.generate_stream(["a"], chunk_rows=1.5), r"chunk_rows: .* got 1\.5"),
    (lambda e: e.generate_stream(["a"], chunk_rows=True), "chunk_rows"),
])  # fmt: skip
def test_bare_strings_and_odd_types_are_refused_by_name(engine, call, message):
    with pytest.raises(eaglebatch.JobError, match=message):
        call(engine)  # generate_stream too: refused when called, not at the first batch


def test_each_scored_pair_gets_its_own_result(engine):
    alone = engine.score(["ctx", "other"], [" good", " fine"]).to_pylist()
    too_long = " x" * (engine.max_model_len + 8)
    for bad in ("", too_long):
        got = engine.score(["ctx", "ctx", "other"], [" good", bad, " fine"]).to_pylist()
        assert [got[0], got[2]] == alone  # the siblings' scores, as if scored without `bad`
        assert got[1]["logprob"] is None and got[1]["error"]
        assert "column" not in got[1]["error"] and "choices" not in got[1]["error"]
    assert engine.score(["c"], [""]).column("error").to_pylist() == ["the continuation is empty"]


def test_empty_score_calls_return_no_rows(engine):
    assert engine.score([], []).num_rows == 0 == engine.score_rolling([]).num_rows
    assert engine.score([], []).column_names == ["logprob", "num_tokens", "is_greedy", "error"]


def test_a_closed_engine_says_so(tiny_model_dir):
    eng = eaglebatch.Engine(str(tiny_model_dir), engine=ENGINE)
    eng.close()
    for call in (lambda: eng.generate(["a"]), lambda: eng.score(["a"], ["b"]),
                 lambda: eng.score_rolling(["a"]), lambda: eng.generate_stream(["a"]),
                 lambda: eng.tokenizer):  # fmt: skip
        with pytest.raises(eaglebatch.JobError, match="this Engine is closed"):
            call()
    eng.close()  # twice is fine


def test_run_arguments_of_the_wrong_type_are_named(tmp_path, tiny_model_dir):
    with pytest.raises(eaglebatch.JobError, match="job: expected a job file's path or a job"):
        eaglebatch.run(None)
    with pytest.raises(eaglebatch.JobError, match=r"overrides\[0\]: expected"):
        eaglebatch.run({"model": "x"}, [3])
    pq.write_table(pa.table({"prompt": ["a b c"]}), tmp_path / "in.parquet")
    job = {"model": str(tiny_model_dir), "input": {"path": str(tmp_path / "in.parquet")},
           "output": {"path": str(tmp_path / "out")}, "sampling": SAMPLING,
           "engine": ENGINE}  # fmt: skip
    with pytest.raises(eaglebatch.JobError, match="sampling.temprature"):
        eaglebatch.run(job, "sampling.temprature=1")  # one string: one override, by its key
    summary = eaglebatch.run(job, "output.include_token_ids=true")
    assert summary.stats["requests"] == 1
    assert "output_token_ids" in pq.read_table(tmp_path / "out").column_names


def test_bad_engine_arguments_and_jobs_are_job_errors(tmp_path, tiny_model_dir):
    with pytest.raises(eaglebatch.JobError, match="model"):
        eaglebatch.Engine(str(tmp_path / "missing"))
    with pytest.raises(eaglebatch.JobError, match="engine.max_batch_size"):
        eaglebatch.Engine(str(tiny_model_dir), engine={"max_batch_size": 0})
    with pytest.raises(eaglebatch.JobError, match="input"):
        eaglebatch.run({"model": str(tiny_model_dir), "output": {"path": str(tmp_path)}})
    with pytest.raises(eaglebatch.JobError, match="cannot read job file"):
        eaglebatch.run(tmp_path / "no-such-job.yaml")


def test_importing_the_package_stays_cheap():
    code = ("import sys, eaglebatch; assert 'torch' not in sys.modules and "
            "'pyarrow' not in sys.modules; eaglebatch.JobError; print('ok')")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True).stdout.strip() == "ok"  # fmt: skip


def test_engine_embed_classify_and_reward_equal_their_jobs(tmp_path):
    """Engine.embed / classify / reward return the rows of the job they are (task embed,
    classify, reward), in input order; a classifier loads into an Engine (no LM head)."""
    from support.tiny import make_tiny_model
    from test_embed import mixed_texts, run, write_job, write_st_files

    texts = mixed_texts(12, seed=5)
    embedder = make_tiny_model(tmp_path / "embedder", model_type="qwen3", head_dim=16)
    write_st_files(embedder, "last", True)
    with eaglebatch.Engine(str(embedder), engine=ENGINE) as eng:
        got = eng.embed(texts, embed={"dimensions": 32})
    (tmp_path / "e").mkdir()
    want = run(write_job(tmp_path / "e", embedder, texts, "embed",
                         tail="embed:\n  dimensions: 32\n"))  # fmt: skip
    assert got.column("embedding").to_pylist() == [r["embedding"] for r in want]
    assert got.schema.field("embedding").type == pa.list_(pa.float32(), 32)
    for labels, task in [(3, "classify"), (1, "reward")]:
        model = make_tiny_model(tmp_path / task, num_labels=labels)
        with eaglebatch.Engine(str(model), engine=ENGINE) as eng:
            got = getattr(eng, task)(texts)
        (tmp_path / f"job-{task}").mkdir()
        want = run(write_job(tmp_path / f"job-{task}", model, texts, task))
        cols = ["label", "probs"] if task == "classify" else ["score"]
        assert got.select(cols).to_pylist() == [{c: r[c] for c in cols} for r in want]

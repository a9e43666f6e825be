"""OpenAI Batch lines as OpenAI's SDK and vLLM clients write them: every no-op value the SDKs
emit generates its line (no 400), and the same line without them generates the same text; vLLM's
per-line keys give the rows the same job keys give."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared
from test_openai_batch import CHAT, COMPLETIONS, batch_job, request, results
from test_runner import random_prompts

pytest.importorskip("eaglebatch._native")

# Chat keys an SDK or a client library sends with the value that asks for nothing, and
# metadata keys that never change the output.
CHAT_NO_OPS = {
    "model": "gpt-4o-mini", "response_format": {"type": "text"}, "logit_bias": {},
    "tools": None, "tool_choice": "none", "functions": None, "function_call": None,
    "parallel_tool_calls": False, "stream": False, "stream_options": None, "logprobs": False,
    "top_logprobs": None, "user": "user-1", "metadata": {"run": "a"}, "store": False,
    "service_tier": "auto", "n": 1, "seed": None, "temperature": None, "modalities": ["text"],
    "audio": None, "prediction": None, "reasoning_effort": None, "safety_identifier": "s",
    "prompt_cache_key": "k", "echo": False, "ignore_eos": False, "stop_token_ids": [],
    "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False, "min_p": 0, "add_generation_prompt": True,
    "chat_template_kwargs": {}, "priority": 0, "request_id": "r",
}  # fmt: skip
COMPLETION_NO_OPS = {
    "model": "gpt-3.5-turbo-instruct", "echo": False, "suffix": None, "best_of": 1,
    "logit_bias": {}, "logprobs": None, "stream": False, "user": "u", "n": 1,
    "response_format": {"type": "text"}, "add_special_tokens": True, "use_beam_search": False,
}  # fmt: skip


def test_every_no_op_value_generates_its_line(tmp_path, tiny_model_dir):
    prompts = random_prompts(6, seed=11)
    bare, noisy = [], []
    for i, p in enumerate(prompts):
        if i % 2:
            body = {"prompt": p, "max_tokens": 8}
            extra, url = COMPLETION_NO_OPS, COMPLETIONS
        else:
            body = {"messages": [{"role": "user", "content": p}], "max_tokens": 8}
            extra, url = CHAT_NO_OPS, CHAT
        if i == 2:  # an assistant turn as an SDK writes it back: content null, no tool calls
            body["messages"] = [{"role": "user", "content": p, "name": "ann"},
                                {"role": "assistant", "content": None, "tool_calls": [],
                                 "refusal": None},
                                {"role": "user", "content": "go on"}]  # fmt: skip
        bare.append(request(f"r{i}", url, body))
        noisy.append(request(f"r{i}", url, {**body, **extra}))
    # one endpoint per file today: the chat lines and the completion lines apart
    for name, lines in [("bare", bare), ("noisy", noisy)]:
        for kind in (0, 1):
            job = batch_job(tmp_path, tiny_model_dir, lines[kind::2], name=f"{name}{kind}")
            run_prepared(prepare(load_job(job)))
    for kind in (0, 1):
        want, got = results(tmp_path, f"bare{kind}"), results(tmp_path, f"noisy{kind}")
        assert sorted(got) == sorted(want) and len(got) == 3
        for cid, line in got.items():
            assert line["response"]["status_code"] == 200, line["response"]
            choices = line["response"]["body"]["choices"]
            assert choices == want[cid]["response"]["body"]["choices"], cid


def _rows(tmp, name) -> dict:
    cols = ["id", "output_text", "output_token_ids", "finish_reason", "output_tokens"]
    return {r["id"]: r for r in pq.read_table(tmp / name, columns=cols).to_pylist()}


def _run(tmp, model, lines, name, sampling="") -> dict:
    job = batch_job(tmp, model, lines, name=name)
    job.write_text(job.read_text().replace("sampling:\n", "sampling:\n" + sampling))
    run_prepared(prepare(load_job(job)))
    return _rows(tmp, name)


def _clean_pair(text: str, start: int) -> str | None:
    """Two printable ASCII characters of `text` from `start` on (a stop string that occurs)."""
    for j in range(start, len(text) - 1):
        pair = text[j:j + 2]
        if pair.isascii() and pair.isprintable():
            return pair
    return None


def test_vllm_keys_per_line_equal_the_same_job_keys(tmp_path, tiny_model_dir):
    """top_k -1, ignore_eos, stop_token_ids, min_tokens and include_stop_str_in_output on each
    line give the rows the same values as job keys give (greedy lines, and two sampled ones
    with their own temperature and seed in both files)."""
    prompts = random_prompts(6, seed=12)
    own = [{"temperature": 0.8, "seed": 3} if i >= 4 else {} for i in range(6)]
    lines = lambda keys: [request(f"v{i}", COMPLETIONS, {"prompt": p, **own[i], **keys})  # noqa: E731
                          for i, p in enumerate(prompts)]  # fmt: skip
    keys = {"top_k": -1, "ignore_eos": True, "min_tokens": 2}
    pre = _run(tmp_path, tiny_model_dir, lines(keys), "pre")
    # a stop token row 0 emits after its first two tokens (not one of them: masking it there
    # changes nothing greedy), and a stop string another greedy row's text holds
    first = pre["v0"]["output_token_ids"]
    stop_id = next(t for t in first[3:] if t not in first[:2])
    stop_str = next(filter(None, (_clean_pair(pre[f"v{i}"]["output_text"], 2) for i in (1, 2, 3))))
    keys |= {"stop_token_ids": [stop_id], "include_stop_str_in_output": True, "stop": [stop_str]}
    got = _run(tmp_path, tiny_model_dir, lines(keys), "vllm")
    job_keys = (f"  top_k: 0\n  ignore_eos: true\n  stop_token_ids: [{stop_id}]\n"
                f"  min_new_tokens: 2\n  include_stop_str_in_output: true\n"
                f"  stop: [{json.dumps(stop_str)}]\n")  # fmt: skip
    want = _run(tmp_path, tiny_model_dir, lines({}), "ref", job_keys)
    assert got == want
    ends = [r for r in got.values() if r["finish_reason"] == "stop"]
    assert any(r["output_token_ids"][-1] == stop_id for r in ends), got
    assert any(r["output_text"].endswith(stop_str) for r in ends), got
    assert all(r["output_tokens"] >= 2 for r in got.values())


def test_one_file_mixes_endpoints(tmp_path, tiny_model_dir):
    """Chat and completion lines in one file: each line's results body is shaped by its own
    url and holds what a file of that endpoint alone generates; a line to an endpoint
    eaglebatch does not serve is a 400 line naming the url."""
    prompts = random_prompts(6, seed=13)
    chat = [request(f"c{i}", CHAT, {"messages": [{"role": "user", "content": p}]})
            for i, p in enumerate(prompts[:3])]  # fmt: skip
    completions = [request(f"p{i}", COMPLETIONS, {"prompt": p}) for i, p in enumerate(prompts[3:])]
    mixed = [chat[0], completions[0], completions[1], chat[1], chat[2], completions[2],
             request("e", "/v1/responses", {"input": "x"})]  # fmt: skip
    for name, lines in [("mixed", mixed), ("chat", chat), ("completions", completions)]:
        run_prepared(prepare(load_job(batch_job(tmp_path, tiny_model_dir, lines, name=name))))
    got = results(tmp_path, "mixed")
    alone = {**results(tmp_path, "chat"), **results(tmp_path, "completions")}
    assert sorted(got) == sorted([*alone, "e"])
    for cid, want in alone.items():
        body = got[cid]["response"]["body"]
        assert body["object"] == ("chat.completion" if cid[0] == "c" else "text_completion")
        assert body["choices"] == want["response"]["body"]["choices"], cid
    error = got["e"]["response"]
    assert error["status_code"] == 400
    assert "url must be" in error["body"]["error"]["message"]


def test_lines_of_openai_sdk_types_and_results_its_types_read(tmp_path, tiny_model_dir):
    """Bodies typed by the openai SDK's request types (checked by pydantic against them), one
    file of chat and completion lines; every results body validates as the SDK's
    ChatCompletion or Completion."""
    openai = pytest.importorskip("openai")
    from openai.types import completion_create_params as completion_params
    from openai.types.chat import completion_create_params as chat_params
    from pydantic import TypeAdapter

    prompts = random_prompts(4, seed=14)
    chat_bodies = [
        {"model": "gpt-4o-mini", "messages": [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": prompts[0]}],
         "max_completion_tokens": 6, "temperature": 0.7, "seed": 1, "logprobs": True,
         "top_logprobs": 2, "response_format": {"type": "text"}, "tool_choice": "none",
         "store": False, "user": "u", "metadata": {"k": "v"}, "n": 1, "stop": ["\n\n"]},
        {"model": "gpt-4o-mini", "messages": [
            {"role": "user", "content": [{"type": "text", "text": prompts[1]}]},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "user", "content": "and?"}], "max_tokens": 5, "logit_bias": {},
         "parallel_tool_calls": False, "service_tier": "auto"},
    ]  # fmt: skip
    completion_bodies = [
        {"model": "gpt-3.5-turbo-instruct", "prompt": prompts[2], "max_tokens": 6,
         "logprobs": 2, "echo": False, "suffix": None, "best_of": 1, "stop": "zz"},
        {"model": "gpt-3.5-turbo-instruct", "prompt": prompts[3], "max_tokens": 4,
         "temperature": 0.5, "presence_penalty": 0.5, "user": "u"},
    ]  # fmt: skip
    for typed, bodies in [(chat_params.CompletionCreateParamsNonStreaming, chat_bodies),
                          (completion_params.CompletionCreateParamsNonStreaming,
                           completion_bodies)]:  # fmt: skip
        for b in bodies:
            TypeAdapter(typed).validate_python(b)  # a body the SDK's types accept
    lines = [request(f"c{i}", CHAT, b) for i, b in enumerate(chat_bodies)]
    lines += [request(f"p{i}", COMPLETIONS, b) for i, b in enumerate(completion_bodies)]
    run_prepared(prepare(load_job(batch_job(tmp_path, tiny_model_dir, lines, name="sdk"))))
    got = results(tmp_path, "sdk")
    assert sorted(got) == ["c0", "c1", "p0", "p1"]
    for cid, line in got.items():
        assert line["response"]["status_code"] == 200, line["response"]
        body = line["response"]["body"]
        typed = openai.types.chat.ChatCompletion if cid[0] == "c" else openai.types.Completion
        parsed = typed.model_validate(body)
        assert parsed.choices and parsed.usage.completion_tokens >= 1
    chat_lp = openai.types.chat.ChatCompletion.model_validate(got["c0"]["response"]["body"])
    assert chat_lp.choices[0].logprobs.content[0].top_logprobs


def test_a_lines_own_n_gives_the_samples_a_job_n_gives_and_resumes(tmp_path, tiny_model_dir):
    """Lines with n 1, 3 and the job's 2 in one file: each line's choices are the samples a
    job with that sampling.n generates for it (samples are seeded by row and sample, not by
    the batch); with one sample deleted from the parts, a rerun generates exactly that one,
    and `status` counts a line done only with its own n samples."""
    import pyarrow as pa
    from click.testing import CliRunner

    from eaglebatch.cli import main
    from eaglebatch.output.directory import OWNER_KEY

    prompts = random_prompts(3, seed=15)
    own = [{"n": 1}, {"n": 3}, {}]
    lines = [request(f"n{i}", COMPLETIONS, {"prompt": p, "temperature": 1.0, "seed": 7, **own[i]})
             for i, p in enumerate(prompts)]  # fmt: skip
    job = batch_job(tmp_path, tiny_model_dir, lines, name="own", extra="  part_rows: 2\n")
    job.write_text(job.read_text().replace("sampling:\n", "sampling:\n  n: 2\n  temperature: 1\n"))
    run_prepared(prepare(load_job(job)))
    got = results(tmp_path, "own")
    for i, n in enumerate([1, 3, 2]):
        ref = batch_job(tmp_path, tiny_model_dir, [lines[i]], name=f"ref{i}")
        ref.write_text(ref.read_text().replace("sampling:\n", f"sampling:\n  n: {n}\n"
                                                                 "  temperature: 1\n"))
        if "n" in own[i]:  # the line's n would have to equal the job's: drop it
            body = json.loads(lines[i])["body"]
            del body["n"]
            (tmp_path / f"ref{i}-requests.jsonl").write_text(
                request(f"n{i}", COMPLETIONS, body) + "\n")
        run_prepared(prepare(load_job(ref)))
        want = results(tmp_path, f"ref{i}")[f"n{i}"]["response"]["body"]["choices"]
        assert got[f"n{i}"]["response"]["body"]["choices"] == want, i
        assert len(want) == n
    table = pq.read_table(tmp_path / "own")
    assert sorted(table.column("n").to_pylist()) == [1, 2, 2, 3, 3, 3]
    # delete sample 2 of line n1 from its part: the job is no longer complete
    for part in sorted((tmp_path / "own").glob("part-*.parquet")):
        t = pq.read_table(part)
        keep = [not (r == 1 and s == 2) for r, s in zip(t.column("row_index").to_pylist(),
                                                         t.column("sample_index").to_pylist())]
        if not all(keep):
            meta = pq.ParquetFile(part).metadata.metadata  # the file's key-value metadata
            pq.write_table(t.filter(pa.array(keep)).replace_schema_metadata(meta), part)
            assert OWNER_KEY in meta
    assert CliRunner().invoke(main, ["status", str(job)]).exit_code == 1
    r = CliRunner().invoke(main, ["run", str(job)])
    assert r.exit_code == 0, r.output
    assert CliRunner().invoke(main, ["status", str(job)]).exit_code == 0
    assert pq.read_table(tmp_path / "own").num_rows == 6
    choices = lambda res: {k: v["response"]["body"]["choices"] for k, v in res.items()}  # noqa: E731
    assert choices(results(tmp_path, "own")) == choices(got)

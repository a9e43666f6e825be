"""OpenAI Batch lines as OpenAI's SDK and vLLM clients write them: every no-op value the SDKs
emit generates its line (no 400), and the same line without them generates the same text."""

from __future__ import annotations

import pytest

from eaglebatch.config import load_job
from eaglebatch.engine import prepare, run_prepared
from test_engine import random_prompts
from test_openai_batch import CHAT, COMPLETIONS, batch_job, request, results

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

"""lm-evaluation-harness on eaglebatch: local tasks (files written here, no hub), run with
`simple_evaluate` once with lm-eval's own `hf` model and once with `EaglebatchLM` on the same
weights: multiple choice (loglikelihood), generation (generate_until, greedy, stop sequences)
and perplexity (loglikelihood_rolling over texts longer than the window) give the same
per-sample results (1e-4) and metrics."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from eaglebatch.speculative import init_random_draft
from support.tiny import CHAT_TEMPLATE, make_tiny_model
from test_runner import random_prompts

pytest.importorskip("eaglebatch._native")
lm_eval = pytest.importorskip("lm_eval")

MAX_LEN = 128  # the engine's max_model_len; lm-eval's max_length is one less
TASKS = ["eb_mc", "eb_gen", "eb_ppl"]


def task_files(root):
    qs = random_prompts(12, seed=5)
    rows = {
        "mc": [{"question": q + " ", "choices": ["cat", "the mat", "42", "über alles"],
                "answer": i % 4} for i, q in enumerate(qs)],
        "gen": [{"question": q, "answer": "x"} for q in qs[:6]],
        "ppl": [{"text": (q + " ") * 30} for q in qs[:4]],
    }  # fmt: skip
    for name, items in rows.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    head = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    specs = {
        "eb_mc": ("mc", "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
                  "doc_to_choice: '{{choices}}'\ndoc_to_target: answer\n"
                  "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"),
        "eb_gen": ("gen", "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
                   "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['ab', 'Q']\n"
                   "  max_gen_toks: 12\n  do_sample: false\n"
                   "metric_list:\n  - metric: exact_match\n"),
        "eb_ppl": ("ppl", "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
                   "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
                   "  - metric: bits_per_byte\n"),
    }  # fmt: skip
    for task, (data, body) in specs.items():
        text = f"task: {task}\n" + head.format(root / f"{data}.jsonl") + body
        (root / f"{task}.yaml").write_text(text)
    return root


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = make_tiny_model(tmp_path_factory.mktemp("lm-eval-model"),
                            max_position_embeddings=MAX_LEN)  # fmt: skip
    return model, task_files(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def results(setup):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from eaglebatch.integrations.lm_eval import EaglebatchLM

    model, tasks = setup
    manager = TaskManager(include_path=str(tasks))
    hf_model = LlamaForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"),
                                  bos_token="<|im_start|>", eos_token="<|im_end|>")  # fmt: skip
    hf = HFLM(pretrained=hf_model, tokenizer=tok, batch_size=4, max_length=MAX_LEN - 1)
    # with a draft head: generate_until speculates, and its greedy outputs stay hf's
    head = init_random_draft(model.parent / "head", model, kind="eagle3", seed=2,
                             draft_vocab_size=200, aux_layer_ids=(0, 1, 2))  # fmt: skip
    ours = EaglebatchLM(model=str(model), draft=str(head),
                        engine={"device": "cpu", "kv_cache_tokens": 8192})  # fmt: skip
    assert ours.max_length == MAX_LEN - 1

    def run(lm):
        return lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=manager,
                                       log_samples=True)  # fmt: skip

    return run(hf), run(ours), ours


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-7, abs_tol=1e-4)


def test_multiple_choice_loglikelihoods_and_metrics_equal_hf(results):
    hf, ours, _ = results
    pairs = list(zip(hf["samples"]["eb_mc"], ours["samples"]["eb_mc"], strict=True))
    assert len(pairs) == 12
    for a, b in pairs:
        for (lp_a, greedy_a), (lp_b, greedy_b) in zip(
            [r[0] for r in a["resps"]], [r[0] for r in b["resps"]], strict=True
        ):
            assert close(lp_a, lp_b) and greedy_a == greedy_b
    for metric in ("acc,none", "acc_norm,none"):
        assert hf["results"]["eb_mc"][metric] == ours["results"]["eb_mc"][metric]


def test_generation_outputs_equal_hf_greedy(results):
    hf, ours, lm = results
    assert lm.engine._worker.draft_stats() is not None  # the rounds were speculative
    got = [s["resps"][0][0] for s in ours["samples"]["eb_gen"]]
    want = [s["resps"][0][0] for s in hf["samples"]["eb_gen"]]
    assert got == want and any(got)
    assert hf["results"]["eb_gen"]["exact_match,none"] == ours["results"]["eb_gen"][
        "exact_match,none"]


def test_rolling_loglikelihoods_over_several_windows_equal_hf(results):
    hf, ours, _ = results
    for a, b in zip(hf["samples"]["eb_ppl"], ours["samples"]["eb_ppl"], strict=True):
        assert close(a["resps"][0][0], b["resps"][0][0])
        assert len(a["doc"]["text"]) > MAX_LEN  # bytes = tokens: more than one window
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        assert math.isclose(hf["results"]["eb_ppl"][metric], ours["results"]["eb_ppl"][metric],
                            rel_tol=1e-6)  # fmt: skip


def test_lm_eval_command_line_reaches_the_model(setup, tmp_path):
    model, tasks = setup
    args = ["--model", "eaglebatch", "--model_args",
            f"model={model},engine.device=cpu,engine.kv_cache_tokens=4096",
            "--tasks", "eb_mc", "--include_path", str(tasks), "--output_path", str(tmp_path),
            "--limit", "3"]  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "eaglebatch.integrations.lm_eval", *args],
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eb_mc" in proc.stdout and "acc" in proc.stdout


def test_chat_template_and_generation_arguments(results):
    import jinja2

    lm = results[2]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    want = jinja2.Template(CHAT_TEMPLATE).render(messages=chat, add_generation_prompt=True)
    assert lm.apply_chat_template(chat) == want
    sampling = lm.sampling_of({"until": "\n\n", "max_gen_toks": 7, "do_sample": True,
                               "temperature": 0.7, "top_p": 0.9})  # fmt: skip
    assert sampling == {"max_new_tokens": 7, "stop": ["\n\n"], "temperature": 0.7, "top_p": 0.9}
    greedy = lm.sampling_of({"until": ["Q:"], "temperature": 0.7, "do_sample": False})
    assert greedy["temperature"] == 0.0 and greedy["max_new_tokens"] == 256


def test_contexts_that_start_with_bos_get_no_second_bos(results, monkeypatch):
    import pyarrow as pa

    lm, calls = results[2], []

    def generate(contexts, sampling, input):
        calls.append((contexts, input["add_special_tokens"]))
        return pa.table({"output_text": ["x"] * len(contexts), "error": [None] * len(contexts)})

    monkeypatch.setattr(lm.engine, "generate", generate)
    bos = lm.engine.bos_token
    assert bos
    assert lm._generate([bos + "a", "b"], {"until": ["\n"], "max_gen_toks": 2}) == ["x", "x"]
    assert calls == [(["b"], True), ([bos + "a"], False)]

"""Pooled tasks (`task: embed | classify | reward`, docs/embeddings.md) on tiny random Qwen3
and Llama checkpoints against transformers: embeddings equal the pooled last_hidden_state of
transformers' base model (pooling computed here: last token, mean, first) with cosine >=
0.99999 over 100 rows of mixed lengths at several batch sizes, with prefix caching on and off
and chunked prefill; sequence-classification heads' probabilities and reward scores within
1e-4 of transformers' logits; the model's instruction prompt, Matryoshka dimensions and
truncation; the refusals (exit 2 naming the key); a killed job resumed writes every row once."""

from __future__ import annotations

import json
import random
import re
import signal
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

import eaglebatch
from eaglebatch.cli import main
from support.tiny import byte_tokenizer, make_tiny_model
from test_resume import check_readable, parts, start_run

pytest.importorskip("eaglebatch._native")

WORDS = ["the", "cat", "sat", "on", "a", "mat", "42", "code", "über", "naïve", "—"]
SHARED = "Represent this sentence for retrieval of similar passages: "  # > one KV block


def mixed_texts(n: int, seed: int = 0) -> list[str]:
    """Texts of 1 to ~300 tokens; a third start with the same long instruction."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 10, 40, 60])))
        out.append(SHARED + words if i % 3 == 0 else words)
    return out


def write_st_files(model: Path, pooling: str, normalize: bool, prompts: dict | None = None):
    """sentence-transformers' modules.json and 1_Pooling/config.json (and prompts)."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})  # fmt: skip
    (model / "modules.json").write_text(json.dumps(modules))
    (model / "1_Pooling").mkdir(exist_ok=True)
    modes = {"pooling_mode_cls_token": pooling == "cls",
             "pooling_mode_mean_tokens": pooling == "mean",
             "pooling_mode_lasttoken": pooling == "last"}  # fmt: skip
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                 **modes}))  # fmt: skip
    if prompts is not None:
        (model / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))


@pytest.fixture(scope="module")
def embedders(tmp_path_factory):
    """Qwen3 (last token, normalised, a query prompt) and Llama (mean, not normalised)."""
    qwen = make_tiny_model(tmp_path_factory.mktemp("qwen3-embed"), model_type="qwen3", seed=3,
                           head_dim=16, init_std=0.05)  # fmt: skip
    write_st_files(qwen, "last", True, {"query": "Query: ", "document": ""})
    llama = make_tiny_model(tmp_path_factory.mktemp("llama-embed"), seed=4, init_std=0.05)
    write_st_files(llama, "mean", False)
    return {"qwen3": qwen, "llama": llama}


def hf_hidden(model_dir: Path, texts: list[str]) -> list[torch.Tensor]:
    """transformers' base model's last_hidden_state [L, H] of each text (BOS-less byte ids)."""
    import transformers

    model = transformers.AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = byte_tokenizer()
    with torch.inference_mode():
        return [model(torch.tensor([tok.encode(t).ids])).last_hidden_state[0] for t in texts]


def pool(h: torch.Tensor, pooling: str, normalize: bool, dims: int = 0) -> np.ndarray:
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
    v = v[:dims] if dims else v
    return (torch.nn.functional.normalize(v, dim=0) if normalize else v).numpy()


def write_job(tmp: Path, model: Path, texts: list, task: str, *input_keys: str,
              column: str = "prompt", tail: str = "") -> Path:  # fmt: skip
    """A job over `texts`; `input_keys`: lines of its input section; `tail`: more YAML."""
    pq.write_table(pa.table({column: texts}), tmp / "in.parquet")
    lines = [f"model: {model}", f"task: {task}", "input:", f"  path: {tmp / 'in.parquet'}",
             *input_keys, "output:", f"  path: {tmp / 'out'}", "  part_rows: 16", "engine:",
             "  device: cpu", "  kv_cache_tokens: 8192"]  # fmt: skip
    (tmp / "job.yaml").write_text("\n".join(lines) + "\n" + tail)
    return tmp / "job.yaml"


def run(job: Path, *overrides: str) -> list[dict]:
    eaglebatch.run(job, list(overrides))
    return pq.read_table(job.parent / "out").sort_by("row_index").to_pylist()


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def references(embedders):
    texts = mixed_texts(100)
    return texts, {name: hf_hidden(d, texts) for name, d in embedders.items()}


@pytest.mark.parametrize("name", ["qwen3", "llama"])
@pytest.mark.parametrize(("batch", "caching", "chunk"), [
    (1, True, None), (7, False, None), (32, True, None), (32, False, None), (7, True, 48),
])  # fmt: skip
def test_embeddings_equal_transformers_pooled_states(tmp_path, embedders, references, name,
                                                     batch, caching, chunk):  # fmt: skip
    texts, hidden = references
    pooling, normalize = {"qwen3": ("last", True), "llama": ("mean", False)}[name]
    over = [f"engine.max_batch_size={batch}", f"engine.prefix_caching={str(caching).lower()}"]
    if chunk:
        over += ["engine.chunked_prefill=true", f"engine.max_num_batched_tokens={chunk}"]
    rows = run(write_job(tmp_path, embedders[name], texts, "embed"), *over)
    assert len(rows) == 100
    for h, row in zip(hidden[name], rows, strict=True):
        assert row["error"] is None and row["output_tokens"] == 0
        assert row["prompt_tokens"] == h.shape[0]
        want = pool(h, pooling, normalize)
        assert cosine(row["embedding"], want) >= 0.99999
        np.testing.assert_allclose(row["embedding"], want, rtol=1e-3, atol=1e-4)
    schema = pq.read_schema(next((tmp_path / "out").glob("part-*.parquet")))
    assert schema.field("embedding").type == pa.list_(pa.float32(), 64)
    if caching and pooling == "last" and not chunk:
        assert sum(r["cached_tokens"] for r in rows) > 0  # the shared instruction, once


def test_prompt_dimensions_cls_and_truncation(tmp_path, embedders):
    texts = ["the cat sat", "über " * 40, "a"]
    qwen = embedders["qwen3"]
    job = write_job(tmp_path, qwen, texts, "embed",
                    tail="embed:\n  prompt_name: query\n  dimensions: 16\n  pooling: cls\n")
    rows = run(job)
    hidden = hf_hidden(qwen, ["Query: " + t for t in texts])
    for h, row in zip(hidden, rows, strict=True):
        assert len(row["embedding"]) == 16
        assert cosine(row["embedding"], pool(h, "cls", True, 16)) >= 0.99999
        assert abs(np.linalg.norm(row["embedding"]) - 1) < 1e-5
    # over max_model_len: the end (default) or the start cut, or an error row
    long = ["a b c d " * 20, "short"]
    for mode in ("end", "start", "error"):
        (tmp_path / mode).mkdir()
        job = write_job(tmp_path / mode, qwen, long, "embed", tail=f"embed:\n  truncate: {mode}\n")
        rows = run(job, "engine.max_model_len=32")
        ids = byte_tokenizer().encode(long[0]).ids
        if mode == "error":
            assert "max_model_len (32)" in rows[0]["error"] and rows[0]["embedding"] is None
        else:
            kept = ids[:32] if mode == "end" else ids[-32:]
            text = byte_tokenizer().decode(kept)
            want = pool(hf_hidden(qwen, [text])[0], "last", True)
            assert rows[0]["prompt_tokens"] == 32
            assert cosine(rows[0]["embedding"], want) >= 0.99999
        assert rows[1]["error"] is None


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory):
    out = {}
    for model_type, labels in [("qwen3", 5), ("llama", 1), ("qwen3", 1), ("llama", 5)]:
        extra = {"head_dim": 16} if model_type == "qwen3" else {}
        d = tmp_path_factory.mktemp(f"{model_type}-cls{labels}")
        out[model_type, labels] = make_tiny_model(d, model_type=model_type, num_labels=labels,
                                                  seed=labels, init_std=0.05, **extra)  # fmt: skip
    return out


def hf_logits(model_dir: Path, ids: list[list[int]]) -> list[torch.Tensor]:
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([i])).logits[0] for i in ids]


@pytest.mark.parametrize(("model_type", "labels"), [("qwen3", 5), ("llama", 1), ("qwen3", 1),
                                                     ("llama", 5)])  # fmt: skip
def test_classify_and_reward_equal_transformers(tmp_path, classifiers, model_type, labels):
    texts = mixed_texts(24, seed=labels)
    task = "classify" if labels > 1 else "reward"
    rows = run(write_job(tmp_path, classifiers[model_type, labels], texts, task),
               "engine.max_batch_size=7")  # fmt: skip
    want = hf_logits(classifiers[model_type, labels], [byte_tokenizer().encode(t).ids
                                                       for t in texts])  # fmt: skip
    for w, row in zip(want, rows, strict=True):
        assert row["error"] is None
        if task == "reward":
            assert abs(row["score"] - w[0].item()) < 1e-4
            assert "label" not in row
        else:
            np.testing.assert_allclose(row["probs"], torch.softmax(w, 0).numpy(), atol=1e-4)
            assert row["label"] == f"label_{int(w.argmax())}"


def test_reward_models_score_whole_conversations(tmp_path, classifiers):
    model = classifiers["llama", 1]
    chats = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}],
             [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]]
    job = write_job(tmp_path, model, chats, "reward", "  messages_column: messages",
                    column="messages")  # fmt: skip
    rows = run(job)
    tok = byte_tokenizer()
    rendered = ["".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in c)
                for c in chats]  # fmt: skip
    want = hf_logits(model, [tok.encode(r).ids for r in rendered])
    for w, row in zip(want, rows, strict=True):
        assert abs(row["score"] - w[0].item()) < 1e-4


@pytest.mark.parametrize(("task", "model", "extra", "key"), [
    ("classify", "embed", "", "task: classify needs a sequence-classification checkpoint"),
    ("reward", "cls5", "", "task: reward needs a head with one output"),
    ("generate", "cls5", "", "task: model .* is a sequence classifier"),
    ("embed", "bare", "", "embed.pooling: model .* states no pooling"),
    ("embed", "embed", "embed:\n  dimensions: 65\n", "embed.dimensions: 65 is more than"),
    ("embed", "embed", "embed:\n  prompt_name: passage\n", "embed.prompt_name: 'passage'"),
    ("classify", "cls5", "embed:\n  pooling: mean\n", "embed.pooling: not for task: classify"),
    ("embed", "embed", "sampling:\n  n: 2\n  temperature: 0.7\n", "sampling.n and output"),
])  # fmt: skip
def test_a_task_the_model_cannot_do_is_refused(tmp_path, embedders, classifiers, task, model,
                                               extra, key):  # fmt: skip
    bare = tmp_path / "bare"
    if model == "bare":
        make_tiny_model(bare, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    path = {"embed": embedders["qwen3"], "cls5": classifiers["qwen3", 5], "bare": bare}[model]
    job = write_job(tmp_path, path, ["a"], task, tail=extra)
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert re.search(key, r.output), r.output
    assert not (tmp_path / "out").exists()


def test_a_killed_embedding_job_resumed_writes_every_row_once(tmp_path, embedders):
    rows = 3000
    texts = [f"{i} " + " ".join(random.Random(i).choice(WORDS) for _ in range(i % 7 + 1))
             for i in range(rows)]  # fmt: skip
    pq.write_table(pa.table({"prompt": texts, "id": [f"r{i}" for i in range(rows)]}),
                   tmp_path / "in.parquet")  # fmt: skip
    job = tmp_path / "job.yaml"
    out = tmp_path / "out"
    job.write_text(f"model: {embedders['llama']}\ntask: embed\ninput:\n  path: "
                   f"{tmp_path / 'in.parquet'}\n  id_column: id\noutput:\n  path: {out}\n"
                   "  part_rows: 50\n  flush_interval_s: 0.2\nengine:\n  device: cpu\n"
                   "  kv_cache_tokens: 2048\n  max_batch_size: 4\n  num_threads: 1\n")  # fmt: skip
    kills = 0
    for _ in range(6):
        before = len(parts(out)) if out.exists() else 0
        proc = start_run(job)
        t0 = time.monotonic()
        while proc.poll() is None and (not out.exists() or len(parts(out)) <= before):
            assert time.monotonic() - t0 < 120, "no progress"
            time.sleep(0.01)
        time.sleep(0.1)
        proc.kill()
        _, err = proc.communicate()
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, err
        kills += 1
        if kills == 3:
            break
    assert kills >= 2
    assert check_readable(out) < rows
    proc = start_run(job)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    table = pq.read_table(out, columns=["id", "embedding"])
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(f"r{i}" for i in range(rows))
    got = dict(zip(ids, table.column("embedding").to_pylist(), strict=True))
    for i in (0, rows // 2, rows - 1):  # the resumed rows equal transformers'
        want = pool(hf_hidden(embedders["llama"], [texts[i]])[0], "mean", False)
        assert cosine(got[f"r{i}"], want) >= 0.99999


def embedding_lines_job(tmp: Path, model: Path, lines: list[dict]) -> Path:
    inp = tmp / "requests.jsonl"
    inp.write_text("".join(json.dumps({"method": "POST", **line}) + "\n" for line in lines))
    job = tmp / "job.yaml"
    job.write_text(f"model: {model}\ntask: embed\ninput:\n  path: {inp}\noutput:\n"
                   f"  path: {tmp / 'out'}\n  format: openai-batch\n  part_rows: 2\n"
                   "engine:\n  device: cpu\n  kv_cache_tokens: 4096\n")  # fmt: skip
    return job


def test_openai_embedding_lines_validate_with_the_sdk_types(tmp_path, embedders):
    import base64

    from openai.types import CreateEmbeddingResponse

    url = "/v1/embeddings"
    lines = [
        {"custom_id": "one", "url": url, "body": {"input": "the cat sat", "model": "m"}},
        {"custom_id": "many", "url": url, "body": {"input": ["a", "the mat", "über 42"],
                                                    "dimensions": 8}},
        {"custom_id": "b64", "url": url, "body": {"input": ["code"], "encoding_format": "base64"}},
        {"custom_id": "empty", "url": url, "body": {"input": []}},
        {"custom_id": "chat", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "x"}]}},
        {"custom_id": "wide", "url": url, "body": {"input": "a", "dimensions": 65}},
        {"custom_id": "bad-key", "url": url, "body": {"input": "a", "temperature": 1}},
    ]  # fmt: skip
    eaglebatch.run(embedding_lines_job(tmp_path, embedders["qwen3"], lines))
    out = {}
    for text in (tmp_path / "out" / "_results.jsonl").read_text().splitlines():
        line = json.loads(text)
        out[line["custom_id"]] = line["response"]
    assert list(out) == [line["custom_id"] for line in lines]  # input order, each once
    # base64: a string per embedding, which the SDK decodes before its types see it
    b64 = out["b64"]["body"]
    assert isinstance(b64["data"][0]["embedding"], str)
    for d in b64["data"]:
        d["embedding"] = np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist()
    ok = {cid: CreateEmbeddingResponse.model_validate(out[cid]["body"])
          for cid in ("one", "many", "b64")}  # fmt: skip
    texts = {"one": ["the cat sat"], "many": ["a", "the mat", "über 42"], "b64": ["code"]}
    for cid, resp in ok.items():
        assert [d.index for d in resp.data] == list(range(len(texts[cid])))
        hidden = hf_hidden(embedders["qwen3"], texts[cid])
        assert resp.usage.prompt_tokens == sum(h.shape[0] for h in hidden)
        for d, h in zip(resp.data, hidden, strict=True):
            got = d.embedding
            want = pool(h, "last", True, 8 if cid == "many" else 0)
            assert len(got) == len(want) and cosine(got, want) >= 0.99999
    assert "1 to 4096" in out["empty"]["body"]["error"]["message"]
    assert "task embed answers /v1/embeddings" in out["chat"]["body"]["error"]["message"]
    assert "hidden_size (64)" in out["wide"]["body"]["error"]["message"]
    assert "body.temperature is not" in out["bad-key"]["body"]["error"]["message"]
    assert all(out[c]["status_code"] == 400 for c in ("empty", "chat", "wide", "bad-key"))


def test_an_embedding_job_without_an_embeddings_line_is_refused(tmp_path, embedders):
    chat = {"custom_id": "c", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}]}}  # fmt: skip
    job = embedding_lines_job(tmp_path, embedders["qwen3"], [chat])
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 2, r.output
    assert "no line of" in r.output and "/v1/embeddings (task: embed)" in r.output


def test_a_reward_input_over_max_model_len_is_an_error_unless_cut(tmp_path, classifiers):
    model, texts = classifiers["qwen3", 1], ["a b c d " * 20, "short"]
    rows = run(write_job(tmp_path, model, texts, "reward"), "engine.max_model_len=32")
    assert "max_model_len (32)" in rows[0]["error"] and rows[1]["error"] is None
    (tmp_path / "cut").mkdir()
    job = write_job(tmp_path / "cut", model, texts, "reward", tail="embed:\n  truncate: start\n")
    rows = run(job, "engine.max_model_len=32")
    want = hf_logits(model, [byte_tokenizer().encode(texts[0]).ids[-32:]])[0]
    assert abs(rows[0]["score"] - want[0].item()) < 1e-4

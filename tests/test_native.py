"""Tests of the Rust extension's Python surface (`eaglebatch._native`, see _native.pyi).

A fake "model" drives the Scheduler: for every plan row the next token is (last query token +
1) % VOCAB, so the expected outputs are known in closed form.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglebatch.job.scheduler_config import sectioned

tokenizers = pytest.importorskip("tokenizers")
native = pytest.importorskip("eaglebatch._native")

VOCAB = 64
BOS, EOS = 1, 2

# --------------------------------------------------------------------------- fixtures


def word_level_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, "<pad>": 3}
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<bos>", "<eos>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS)]
    )
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


@pytest.fixture()
def tok_file(tmp_path: Path) -> Path:
    return word_level_tokenizer(tmp_path)


def write_input(path: Path, prompts, ids=None, **extra) -> Path:
    cols = {"prompt": pa.array(prompts, pa.string())}
    if ids is not None:
        cols["id"] = ids
    cols.update(extra)
    pq.write_table(pa.table(cols), path, row_group_size=3, compression="snappy")
    return path


def make(tok_file: Path, inputs, out: Path, **kw) -> native.Scheduler:
    args = dict(
        input_files=[str(p) for p in inputs],
        prompt_column="prompt",
        messages_column=None,
        id_column=None,
        limit=None,
        apply_chat_template=False,
        tokenizer_file=str(tok_file),
        chat_template=None,
        bos_token=None,
        eos_token=None,
        eos_token_ids=[EOS],
        output_dir=str(out),
        part_rows=4,
        file_metadata={"eaglebatch.test": "1"},
        include_token_ids=True,
        max_new_tokens=8,
        stop=[],
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=1234,
        num_blocks=64,
        block_size=4,
        max_batch_size=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        read_batch_rows=2,
        queue_rows=4,
    )
    args.update(kw)
    return native.Scheduler(sectioned(**args))


def check_plan(p) -> None:
    b, t = p.num_seqs, p.num_tokens
    assert p.kind in ("prefill", "decode", "verify")
    for name, dtype, shape in [
        ("request_slots", np.int32, (b,)),
        ("input_ids", np.int64, (t,)),
        ("positions", np.int64, (t,)),
        ("cu_seqlens_q", np.int32, (b + 1,)),
        ("seq_lens", np.int32, (b,)),
        ("slot_mapping", np.int64, (t,)),
        ("temperature", np.float32, (b,)),
        ("top_p", np.float32, (b,)),
        ("top_k", np.int32, (b,)),
        ("seeds", np.int64, (b,)),
        ("num_generated", np.int32, (b,)),
        ("cu_prefix", np.int32, (b + 1,)),
        ("block_copies", np.int32, (len(p.block_copies), 2)),
        ("prefix_ids", np.int64, (int(p.cu_prefix[-1]),)),
    ]:
        a = getattr(p, name)
        assert isinstance(a, np.ndarray), name
        assert a.dtype == dtype, (name, a.dtype)
        assert a.shape == shape, (name, a.shape)
    assert p.block_tables.dtype == np.int32
    assert p.block_tables.ndim == 2 and p.block_tables.shape[0] == b
    assert p.cu_seqlens_q[0] == 0 and p.cu_seqlens_q[-1] == t
    q = np.diff(p.cu_seqlens_q)
    assert p.max_seqlen_q == q.max()
    assert p.max_seqlen_k == p.seq_lens.max()
    assert len(set(p.request_slots.tolist())) == b
    assert len(set(p.slot_mapping.tolist())) == t
    prefix = np.diff(p.cu_prefix)  # prefill: cached tokens before the query, else none
    assert (q + prefix == p.seq_lens).all() if p.kind == "prefill" else (prefix == 0).all()


def drive(sched, k: int = 1, accepted: bool = False) -> int:
    steps = 0
    while (p := sched.next_plan()) is not None:
        check_plan(p)
        last = p.input_ids[p.cu_seqlens_q[1:] - 1]
        toks = ((last[:, None] + np.arange(1, k + 1)[None, :]) % VOCAB).astype(np.int32)
        n = np.full(p.num_seqs, k, dtype=np.int32)
        acc = np.full(p.num_seqs, k - 1, dtype=np.int32) if accepted else None
        sched.commit(toks.reshape(-1), n, acc)
        steps += 1
        assert steps < 100_000
    return steps


def words(start: int, n: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


# --------------------------------------------------------------------------- scheduler


def test_module_surface():
    assert isinstance(native.__version__, str) and native.__version__
    assert issubclass(native.UserInputError, native.NativeError)
    assert issubclass(native.NativeError, Exception)


@pytest.mark.parametrize("id_kind", ["int", "string", "none"])
def test_every_row_written_once_ids_keep_type(tmp_path, tok_file, id_kind):
    n = 11
    prompts = [words(4 + i, 1 + i % 3) for i in range(n)]
    prompts[3] = None
    prompts[7] = ""
    ids = {
        "int": pa.array([100 + i for i in range(n)], pa.int32()),
        "string": pa.array([f"row-{i}" for i in range(n)], pa.string()),
        "none": None,
    }[id_kind]
    inp = write_input(tmp_path / "in.parquet", prompts, ids)
    out = tmp_path / "out"
    s = make(tok_file, [inp], out, id_column=None if id_kind == "none" else "id")
    assert s.progress()["requests_total"] == n
    drive(s)
    summary = s.finish()
    assert summary["requests"] == n and summary["errors"] == 2
    assert all(Path(f).exists() for f in summary["part_files"])
    assert sorted(os.listdir(out)) == sorted(Path(f).name for f in summary["part_files"])

    t = pq.read_table(out)
    assert t.num_rows == n
    assert t.column_names[:16] == [
        "id",
        "row_index",
        "sample_index",
        "output_text",
        "finish_reason",
        "prompt_tokens",
        "output_tokens",
        "cached_tokens",
        "queue_s",
        "ttft_s",
        "latency_s",
        "tpot_s",
        "error",
        "spec_steps",
        "accepted_tokens",
        "accept_length",
    ]
    expected_id_type = {"int": pa.int32(), "string": pa.string(), "none": pa.int64()}[id_kind]
    assert t.schema.field("id").type == expected_id_type
    rows = sorted(t.to_pylist(), key=lambda r: r["row_index"])
    assert [r["row_index"] for r in rows] == list(range(n))
    want_ids = ids.to_pylist() if ids is not None else list(range(n))
    assert [r["id"] for r in rows] == want_ids
    for i, r in enumerate(rows):
        if i in (3, 7):
            assert r["finish_reason"] == "error"
            assert ("null" if i == 3 else "empty") in r["error"]
            assert r["output_tokens"] == 0 and r["latency_s"] is None
            continue
        last = 4 + i + i % 3
        assert r["output_text"] == words(last + 1, 8)
        assert r["finish_reason"] == "length"
        assert r["prompt_tokens"] == 2 + i % 3
        assert r["output_tokens"] == 8
        assert r["output_token_ids"] == list(range(last + 1, last + 9))
        assert r["error"] is None
        assert r["latency_s"] >= r["ttft_s"] >= 0 and r["queue_s"] >= 0
        assert r["tpot_s"] == pytest.approx((r["latency_s"] - r["ttft_s"]) / 7)
        assert r["spec_steps"] is None and r["accept_length"] is None
    md = pq.read_metadata(summary["part_files"][0]).metadata
    assert md[b"eaglebatch.test"] == b"1"


def test_eos_stop_strings_and_max_new_tokens(tmp_path, tok_file):
    inp = write_input(tmp_path / "in.parquet", ["w60", "w5", "w20", "w40 w41"])
    out = tmp_path / "out"
    s = make(tok_file, [inp], out, stop=["w9", "w24 w2"], max_new_tokens=6)
    drive(s, k=3)  # several tokens per commit: tokens after a stop are dropped
    s.finish()
    rows = sorted(pq.read_table(out).to_pylist(), key=lambda r: r["row_index"])
    # w61 w62 w63 <unk> <bos> <eos>: EOS counted, not in text; specials skipped.
    assert rows[0]["finish_reason"] == "stop"
    assert rows[0]["output_text"] == "w61 w62 w63"
    assert rows[0]["output_token_ids"] == [61, 62, 63, 0, 1, 2]
    # w6 w7 w8 w9 -> truncated before the stop string; w10, w11 of that commit dropped.
    assert rows[1]["output_text"] == "w6 w7 w8 "
    assert rows[1]["output_tokens"] == 4 and rows[1]["finish_reason"] == "stop"
    # "w21 w22 w23 w24 w25": stop "w24 w2" spans two tokens.
    assert rows[2]["output_text"] == "w21 w22 w23 "
    assert rows[3]["output_text"] == words(42, 6) and rows[3]["finish_reason"] == "length"


def test_too_long_prompts_are_error_rows(tmp_path, tok_file):
    inp = write_input(tmp_path / "in.parquet", [words(4, 12), "w4", words(4, 30)])
    out = tmp_path / "out"
    s = make(tok_file, [inp], out, max_model_len=12, num_blocks=4, block_size=4)
    drive(s)
    s.finish()
    rows = sorted(pq.read_table(out).to_pylist(), key=lambda r: r["row_index"])
    assert rows[0]["finish_reason"] == "error" and "max_model_len" in rows[0]["error"]
    assert rows[1]["finish_reason"] == "length" and rows[1]["output_tokens"] == 8
    assert rows[2]["finish_reason"] == "error"


def test_preemption_matches_large_cache(tmp_path, tok_file):
    prompts = [words(4 + 5 * i, 1 + i % 4) for i in range(10)]
    inp = write_input(tmp_path / "in.parquet", prompts)
    results = []
    for blocks in (512, 8):
        out = tmp_path / f"out{blocks}"
        s = make(
            tok_file,
            [inp],
            out,
            num_blocks=blocks,
            block_size=2,
            max_new_tokens=9,
            eos_token_ids=[],
        )
        drive(s)
        prog = s.progress()
        summary = s.finish()
        assert prog["free_blocks"] == blocks and prog["running"] == prog["waiting"] == 0
        assert (summary["preemptions"] > 0) == (blocks == 8)
        t = pq.read_table(out).sort_by("row_index")
        results.append(t.select(["id", "output_text", "output_token_ids", "finish_reason"]))
    assert results[0].equals(results[1])


def test_spec_decoding_counters(tmp_path, tok_file):
    inp = write_input(tmp_path / "in.parquet", ["w4", "w30"])
    out = tmp_path / "out"
    s = make(tok_file, [inp], out, max_new_tokens=9, eos_token_ids=[], max_draft_tokens=2)
    while (p := s.next_plan()) is not None:
        check_plan(p)
        cu = p.cu_seqlens_q
        if p.kind == "verify":
            # query = last committed token + 2 placeholders; accept both drafts + 1 bonus
            assert (np.diff(cu) == 3).all()
            last, k = p.input_ids[cu[:-1]], 3
        else:
            last, k = p.input_ids[cu[1:] - 1], 1
        toks = ((last[:, None] + np.arange(1, k + 1)[None, :]) % VOCAB).astype(np.int32)
        s.commit(toks.reshape(-1), np.full(p.num_seqs, k, np.int32),
                 np.full(p.num_seqs, k - 1, np.int32))
    s.finish()
    for r in pq.read_table(out).to_pylist():
        # 1 token from the prefill, then verify rounds of 3, 3 and 3 cut to 2 by max_new_tokens
        assert r["output_tokens"] == 9
        assert r["spec_steps"] == 3 and r["accepted_tokens"] == 6
        assert r["accept_length"] == pytest.approx(8 / 3)


def test_commit_misuse_raises(tmp_path, tok_file):
    inp = write_input(tmp_path / "in.parquet", ["w4", "w5"])
    s = make(tok_file, [inp], tmp_path / "out")
    with pytest.raises(native.NativeError):
        s.commit(np.array([5], np.int32), np.array([1], np.int32))
    p = s.next_plan()
    with pytest.raises(native.NativeError, match="rows"):
        s.commit(np.zeros(p.num_seqs + 1, np.int32), np.ones(p.num_seqs + 1, np.int32))
    with pytest.raises(native.NativeError):
        s.next_plan()  # previous plan not committed
    s.commit(np.full(p.num_seqs, 9, np.int32), np.ones(p.num_seqs, np.int32))
    drive(s)
    s.finish()


def test_user_input_errors_name_file_and_column(tmp_path, tok_file):
    good = write_input(tmp_path / "good.parquet", ["w4"], ints=pa.array([1]))
    with pytest.raises(native.UserInputError, match="missing.parquet"):
        make(tok_file, [tmp_path / "missing.parquet"], tmp_path / "o1")
    with pytest.raises(native.UserInputError, match="'text'"):
        make(tok_file, [good], tmp_path / "o2", prompt_column="text")
    with pytest.raises(native.UserInputError, match="ints.*string"):
        make(tok_file, [good], tmp_path / "o3", prompt_column="ints")
    bad = tmp_path / "bad.parquet"
    bad.write_text("nope")
    with pytest.raises(native.UserInputError, match="bad.parquet"):
        make(tok_file, [bad], tmp_path / "o4")
    with pytest.raises(native.UserInputError, match="tokenizer"):
        make(tmp_path / "no-tokenizer.json", [good], tmp_path / "o5")
    with pytest.raises(native.UserInputError, match="messages"):
        make(
            tok_file,
            [good],
            tmp_path / "o6",
            prompt_column=None,
            messages_column="messages",
            chat_template="{{ x }}",
        )


@pytest.mark.parametrize("codec", ["snappy", "zstd", "gzip", "lz4", "lz4_raw", "none", "brotli"])
def test_input_codecs(tmp_path, tok_file, codec):
    """Every codec pyarrow writes is decoded (reader/validate.rs `codec_supported`)."""
    inp = tmp_path / f"in-{codec}.parquet"
    pq.write_table(pa.table({"prompt": ["w4", "w5"]}), inp, compression=codec)
    s = make(tok_file, [inp], tmp_path / "out", max_new_tokens=1)
    drive(s)
    s.finish()
    assert pq.read_table(tmp_path / "out").sort_by("row_index")["output_text"].to_pylist() == [
        "w5",
        "w6",
    ]


def test_limit_and_multiple_files(tmp_path, tok_file):
    a = write_input(tmp_path / "a.parquet", ["w4", "w5", "w6"])
    b = write_input(tmp_path / "b.parquet", ["w7", "w8", "w9"])
    out = tmp_path / "out"
    s = make(tok_file, [a, b], out, limit=5, max_new_tokens=1)
    assert s.progress()["requests_total"] == 5
    drive(s)
    s.finish()
    rows = pq.read_table(out).sort_by("row_index").to_pylist()
    assert [r["id"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["output_text"] for r in rows] == ["w5", "w6", "w7", "w8", "w9"]
    # A second run into the same directory never overwrites the first run's parts.
    s = make(tok_file, [a], out, max_new_tokens=1)
    drive(s)
    s.finish()
    assert pq.read_table(out).num_rows == 8


def test_messages_column_with_chat_template(tmp_path, tok_file):
    msg_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    messages = pa.array(
        [
            [{"role": "user", "content": "w10 w11"}],
            None,
            [{"role": "user", "content": None}],
        ],
        msg_type,
    )
    inp = tmp_path / "m.parquet"
    pq.write_table(pa.table({"messages": messages}), inp)
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w20{% endif %}"
    )
    out = tmp_path / "out"
    s = make(
        tok_file,
        [inp],
        out,
        prompt_column=None,
        messages_column="messages",
        chat_template=template,
        bos_token="<bos>",
        max_new_tokens=2,
    )
    drive(s)
    s.finish()
    rows = pq.read_table(out).sort_by("row_index").to_pylist()
    # "<bos>w10 w11 w20": the template adds BOS, the tokenizer adds none.
    assert rows[0]["prompt_tokens"] == 4 and rows[0]["output_text"] == "w21 w22"
    assert rows[1]["finish_reason"] == "error" and "null" in rows[1]["error"]
    assert rows[2]["finish_reason"] == "error" and "malformed" in rows[2]["error"]


def test_byte_level_bpe_detokenization_matches_decode(tmp_path):
    """A GPT-2/Llama-style byte-level BPE tokenizer.json: incremental detokenization of
    multi-byte characters equals tokenizer.decode(skip_special_tokens=True)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|eot|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer)
    path = tmp_path / "bpe.json"
    tok.save(str(path))
    eot = tok.token_to_id("<|eot|>")
    target = "Héllo wörld — 日本語 🦀 done"
    ids = tok.encode(target).ids + [eot]
    inp = write_input(tmp_path / "in.parquet", ["hello", "the fox"])
    out = tmp_path / "out"
    s = make(path, [inp], out, eos_token_ids=[eot], max_new_tokens=len(ids) + 5)
    while (p := s.next_plan()) is not None:
        s.commit(
            np.array([ids[g] for g in p.num_generated], np.int32), np.ones(p.num_seqs, np.int32)
        )
    s.finish()
    for r in pq.read_table(out).to_pylist():
        assert r["finish_reason"] == "stop"
        assert r["output_tokens"] == len(ids)
        assert r["output_text"] == tok.decode(ids, skip_special_tokens=True) == target


def test_empty_input_still_readable(tmp_path, tok_file):
    inp = write_input(tmp_path / "in.parquet", [])
    out = tmp_path / "out"
    s = make(tok_file, [inp], out)
    assert s.next_plan() is None
    s.finish()
    t = pq.read_table(out)
    assert t.num_rows == 0 and "output_text" in t.column_names


# --------------------------------------------------------------------------- chat templates

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

QWEN2 = "\n".join(
    [
        "{%- if messages[0]['role'] == 'system' %}",
        "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}",
        "{%- else %}",
        "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
        "You are a helpful assistant.<|im_end|>\\n' }}",
        "{%- endif %}",
        "{%- for message in messages %}",
        '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) '
        'or (message.role == "assistant") %}',
        "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' "
        "+ '\\n' }}",
        "    {%- endif %}",
        "{%- endfor %}",
        "{%- if add_generation_prompt %}",
        "    {{- '<|im_start|>assistant\\n' }}",
        "{%- endif %}",
        "",
    ]
)

# Zephyr: no whitespace control at all, so it depends on trim_blocks / lstrip_blocks.
ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>
' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>
' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>
'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""

# Mistral-style: raise_exception, namespace-free loop checks, .strip().
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'].strip() + ' [/INST]' }}{% elif message['role'] == "
    "'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)

TOJSON = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}"

TEMPLATES = {
    "smollm2": SMOLLM2,
    "llama3": LLAMA3,
    "qwen2": QWEN2,
    "zephyr": ZEPHYR,
    "mistral": MISTRAL,
    "tojson": TOJSON,
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": 'Unicode: héllo 日本 "quoted" <tag>\n'},
    ],
]


def jinja2_render(template, messages, add_generation_prompt, bos, eos):
    """Renders like transformers' apply_chat_template (its Jinja2 environment settings)."""
    import json

    pytest.importorskip("jinja2")
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    kw = {}
    if bos is not None:
        kw["bos_token"] = bos
    if eos is not None:
        kw["eos_token"] = eos
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **kw
    )


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_render_chat_template_matches_jinja2(name, conv, gen):
    messages = CONVERSATIONS[conv]
    if name == "mistral":
        messages = [m for m in messages if m["role"] != "system"]
    bos, eos = "<s>", "</s>"
    want = jinja2_render(TEMPLATES[name], messages, gen, bos, eos)
    got = native.render_chat_template(TEMPLATES[name], messages, gen, bos, eos)
    assert got == want


def test_render_chat_template_raise_exception():
    msgs = [{"role": "assistant", "content": "x"}]
    with pytest.raises(native.NativeError, match="must alternate"):
        native.render_chat_template(MISTRAL, msgs, True, "<s>", "</s>")


@pytest.mark.parametrize("name", ["smollm2", "llama3", "qwen2", "zephyr"])
def test_render_chat_template_matches_transformers(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    tok_file = word_level_tokenizer(tmp_path)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tok_file), bos_token="<s>", eos_token="</s>"
    )
    hf.chat_template = TEMPLATES[name]
    for messages in CONVERSATIONS:
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        got = native.render_chat_template(TEMPLATES[name], messages, True, "<s>", "</s>")
        assert got == want

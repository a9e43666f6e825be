"""Structured output end to end on the tiny random model (every byte one token): greedy
constrained outputs equal a reference loop over transformers' logits masked by the `llguidance`
Python package; speculative decoding (both head formats, prompt lookup, forced drafts on and
off, batch 1 and 8, a KV budget that preempts) equals constrained plain decoding; a bad format is
its row's error (the job's: a JobError before the model loads); overlap and a resumed job keep
the outputs; OpenAI Batch lines carry response_format."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eaglebatch.errors import JobError
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared
from eaglebatch.speculative import init_random_draft
from test_runner import random_prompts

pytest.importorskip("eaglebatch._native")
llguidance = pytest.importorskip("llguidance")

MAX_NEW = 24
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
# one of each kind, cycled over the rows
FORMATS = [
    {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    {"type": "regex", "pattern": "[a-c]{2,5}(-[0-9]{1,3})?"},
    {"type": "choice", "choices": ["yes", "no", "maybe not"]},
    {"type": "grammar", "lark": 'start: "(" item ("," item)* ")"\nitem: /[xyz]+/'},
    {"type": "json_object"},
    {"type": "regex", "pattern": "[a-z]+"},  # accepting after one letter: EOS may end it
]


def formats_for(n: int) -> list[str]:
    return [json.dumps(FORMATS[i % len(FORMATS)]) for i in range(n)]


def run(tmp, model_dir, n=12, name="out", formats=None, extra="", engine="", overrides=(),
        prompts=None):  # fmt: skip
    prompts = random_prompts(n, seed=7) if prompts is None else prompts
    formats = formats_for(n) if formats is None else formats
    inp = tmp / f"{name}-in.parquet"
    pq.write_table(pa.table({"prompt": prompts, "rf": pa.array(formats, pa.string())}), inp)
    job = tmp / f"{name}.yaml"
    job.write_text(
        f"model: {model_dir}\ninput:\n  path: {inp}\n  sampling_columns:\n    response_format: rf\n"
        f"output:\n  path: {tmp / name}\n  include_token_ids: true\n"
        f"sampling:\n  max_new_tokens: {MAX_NEW}\n"
        f"engine:\n  device: cpu\n  kv_cache_tokens: 4096\n{engine}{extra}"
    )
    res = run_prepared(prepare(load_job(job, list(overrides))))
    return pq.read_table(tmp / name).sort_by("row_index").to_pylist(), res


@pytest.fixture(scope="module")
def plain(tiny_model_dir, tmp_path_factory):
    rows, _ = run(tmp_path_factory.mktemp("plain"), tiny_model_dir)
    return rows


def with_default_whitespace(schema: dict) -> dict:
    """A JSON schema as eaglebatch compiles it: the bounded whitespace unless its x-guidance
    names its own."""
    from eaglebatch import _native

    options = dict(schema.get("x-guidance", {}))
    if not {"whitespace_flexible", "whitespace_pattern"} & set(options):
        options["whitespace_pattern"] = _native.JSON_WHITESPACE
    return {**schema, "x-guidance": options}


def reference_grammar(fmt: dict) -> str:
    """The format as the llguidance package's own grammar constructors read it."""
    kind = fmt["type"]
    if kind in ("json_schema", "json_object"):
        schema = fmt["json_schema"]["schema"] if kind == "json_schema" else {"type": "object"}
        return llguidance.grammar_from("json_schema", json.dumps(with_default_whitespace(schema)))
    if kind == "regex":
        return llguidance.grammar_from("regex", fmt["pattern"])
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(fmt["choices"]))
    return llguidance.grammar_from("lark", fmt["lark"])


def reference_tokens(model, lltok, prompt_ids: list[int], fmt: dict, eos: int) -> list[int]:
    """Greedy decoding over transformers' logits masked by llguidance's matcher: stops at EOS,
    where the grammar admits nothing more, or at MAX_NEW tokens."""
    import llguidance.torch as llt

    matcher = llguidance.LLMatcher(lltok, reference_grammar(fmt))
    assert not matcher.is_error(), matcher.get_error()
    mask = llt.allocate_token_bitmask(1, lltok.vocab_size)
    ids, out = list(prompt_ids), []
    while len(out) < MAX_NEW:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        llt.fill_next_token_bitmask(matcher, mask, 0)
        llt.apply_token_bitmask_inplace(logits, mask.to(logits.device))
        t = int(logits.argmax())
        out.append(t)
        if t == eos:
            break
        assert matcher.consume_token(t)
        ids.append(t)
        if matcher.is_stopped():
            break
    return out


def test_greedy_constrained_equals_the_llguidance_reference(plain, tiny_model_dir):
    import llguidance.hf
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(tiny_model_dir / "tokenizer.json"))
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=320, eos_token=258)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    prompts = random_prompts(len(plain), seed=7)
    for i, row in enumerate(plain):
        fmt = FORMATS[i % len(FORMATS)]
        prompt_ids = tok.encode(prompts[i])
        want = reference_tokens(model, lltok, prompt_ids, fmt, eos=258)
        assert row["output_token_ids"] == want, (i, fmt["type"])
        assert row["structured"] == ("complete" if row["finish_reason"] == "stop" else "incomplete")
    assert {r["finish_reason"] for r in plain} == {"stop", "length"}  # both kinds are covered


def test_complete_json_rows_parse_and_match_their_schema(plain):
    jsonschema = pytest.importorskip("jsonschema")
    complete = [r for i, r in enumerate(plain) if i % len(FORMATS) == 0 and
                r["structured"] == "complete"]  # fmt: skip
    for r in complete:
        jsonschema.validate(json.loads(r["output_text"]), PERSON)
    choices = [r["output_text"] for i, r in enumerate(plain) if i % len(FORMATS) == 2]
    assert set(choices) <= {"yes", "no", "maybe not"}


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize(
    "k, batch, lookup, forced",
    [(3, 8, False, True), (5, 1, False, True), (3, 8, True, True), (4, 8, False, False)],
)
def test_speculative_equals_plain(plain, tiny_model_dir, drafts, tmp_path, kind, k, batch,
                                  lookup, forced):  # fmt: skip
    spec = (f"draft: {drafts[kind]}\nspeculative:\n  num_steps: {k}\n  adaptive: false\n"
            f"  forced_drafts: {str(forced).lower()}\n"
            f"  prompt_lookup_min: {1 if lookup else 0}\n")  # fmt: skip
    rows, res = run(tmp_path, tiny_model_dir, engine=f"  max_batch_size: {batch}\n", extra=spec)
    for got, want in zip(rows, plain, strict=True):
        assert got["output_token_ids"] == want["output_token_ids"], got["row_index"]
        assert (got["finish_reason"], got["structured"]) == (want["finish_reason"],
                                                             want["structured"])  # fmt: skip
    draft = res.stats["drafts"]
    assert draft["grammar_cut"] > 0  # random drafts: many are refused, some at the first token
    if forced:
        assert draft["forced_drafted"] > 0 and draft["forced_accepted"] > 0
    else:
        assert draft["forced_drafted"] == 0


def test_preempted_rows_keep_their_grammar_state(plain, tiny_model_dir, drafts, tmp_path):
    spec = f"draft: {drafts['eagle1']}\nspeculative:\n  num_steps: 3\n"
    rows, res = run(tmp_path, tiny_model_dir, extra=spec,
                    overrides=["engine.kv_cache_tokens=160", "engine.block_size=4"])  # fmt: skip
    assert res.stats["preemptions"] > 0
    assert [r["output_token_ids"] for r in rows] == [r["output_token_ids"] for r in plain]


def test_overlap_plans_constrained_rows_one_step_at_a_time(plain, tiny_model_dir, tmp_path):
    rows, _ = run(tmp_path, tiny_model_dir, engine="  overlap: true\n")
    assert [r["output_token_ids"] for r in rows] == [r["output_token_ids"] for r in plain]


def test_a_resumed_job_generates_the_rest_the_same(plain, tiny_model_dir, tmp_path):
    run(tmp_path, tiny_model_dir, overrides=["output.part_rows=4"])
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    assert len(parts) == 3
    parts[1].unlink()  # as if the run had died before writing it
    rows, res = run(tmp_path, tiny_model_dir, overrides=["output.part_rows=4"])
    assert res.stats["requests"] == 4
    assert [r["output_token_ids"] for r in rows] == [r["output_token_ids"] for r in plain]


def test_a_format_that_does_not_compile_is_its_rows_error(plain, tiny_model_dir, tmp_path):
    formats = formats_for(12)
    formats[3] = json.dumps({"type": "regex", "pattern": "(unclosed"})
    formats[4] = '{"type": "xml"}'
    rows, res = run(tmp_path, tiny_model_dir, formats=formats)
    assert res.stats["errors"] == 2
    assert rows[3]["finish_reason"] == "error" and "does not compile" in rows[3]["error"]
    assert "response_format type \"xml\"" in rows[4]["error"]
    assert rows[4]["structured"] is None
    for i in (0, 1, 2, 5, 6):
        assert rows[i]["output_token_ids"] == plain[i]["output_token_ids"]


def test_the_jobs_format_is_checked_before_the_model_loads(tiny_model_dir, tmp_path):
    job = tmp_path / "job.yaml"
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "in.parquet")
    job.write_text(
        f"model: {tiny_model_dir}\ninput:\n  path: {tmp_path / 'in.parquet'}\noutput:\n"
        f"  path: {tmp_path / 'out'}\nsampling:\n  response_format:\n    type: grammar\n"
        "    lark: 'start: missing_rule'\n"
    )
    with pytest.raises(JobError, match="sampling.response_format does not compile"):
        prepare(load_job(job, []))


def test_job_level_format_applies_to_every_row(tiny_model_dir, tmp_path):
    formats = [None] * 6  # no column value: the job's format
    job_rf = ["sampling.response_format={type: choice, choices: [left, right]}"]
    rows, res = run(tmp_path, tiny_model_dir, n=6, formats=formats, overrides=job_rf)
    assert {r["output_text"] for r in rows} <= {"left", "right"}
    assert {r["structured"] for r in rows} == {"complete"}
    assert res.stats["grammar_compiles"] == 1 and res.stats["structured_rows"] == 6


@pytest.mark.parametrize("speculative", [False, True])
def test_sampled_rows_follow_the_masked_distribution(tiny_model_dir, drafts, tmp_path,
                                                     speculative):  # fmt: skip
    """2000 samples of one prompt under the regex x[a-e]: the first token is forced (x), the
    second is sampled (by a verify round when speculating) from the softmax over a..e only;
    its frequencies pass a chi-square test against that masked softmax from transformers."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    samples, prompt = 2000, "the cat sat on"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tiny_model_dir / "tokenizer.json"))
    allowed = [tok.convert_tokens_to_ids(c) for c in "abcde"]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    ids = tok.encode(prompt) + [tok.convert_tokens_to_ids("x")]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    expected = torch.softmax(logits[allowed], dim=0) * samples
    spec = (f"draft: {drafts['eagle1']}\nspeculative:\n  num_steps: 3\n  adaptive: false\n"
            if speculative else "")  # fmt: skip
    rows, _ = run(tmp_path, tiny_model_dir, n=1, formats=[json.dumps({"type": "regex",
                  "pattern": "x[a-e]"})], extra=spec, engine="  max_batch_size: 64\n",
                  prompts=[prompt],
                  overrides=[f"sampling.n={samples}", "sampling.temperature=1.0"])  # fmt: skip
    assert all(r["output_token_ids"][0] == ids[-1] for r in rows)
    counts = torch.zeros(5, dtype=torch.float64)
    for r in rows:
        counts[allowed.index(r["output_token_ids"][1])] += 1
    keep = expected >= 5  # bins expected this rarely are pooled
    obs = torch.cat((counts[keep], counts[~keep].sum()[None]))
    exp = torch.cat((expected[keep], expected[~keep].sum()[None]))
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < 18.47, (counts.tolist(), expected.tolist())  # df <= 4, p = 0.001


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    """The tiny model with <think> and </think> as special tokens (ids 259, 260) and the end
    tag's lm_head row scaled up, so that rows close their reasoning after a few tokens."""
    from safetensors.torch import load_file, save_file

    from support.tiny import make_tiny_model

    d = make_tiny_model(tmp_path_factory.mktemp("thinking"), seed=3)
    tok = json.loads((d / "tokenizer.json").read_text())
    for i, tag in ((259, "<think>"), (260, "</think>")):
        tok["added_tokens"].append({"id": i, "content": tag, "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False,
                                    "special": True})  # fmt: skip
    (d / "tokenizer.json").write_text(json.dumps(tok))
    weights = load_file(str(d / "model.safetensors"))
    weights["lm_head.weight"][260] *= THINK_SCALE
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


THINK_SCALE = 4.0


def test_reasoning_rows_think_freely_then_answer_in_their_format(thinking_model, tmp_path):
    formats = [json.dumps({"type": "choice", "choices": ["yes", "no"]}),
               json.dumps({"type": "regex", "pattern": "[0-9]{2}"})] * 4  # fmt: skip
    rows, res = run(tmp_path, thinking_model, n=8, formats=formats,
                    overrides=["output.reasoning=think"])  # fmt: skip
    closed = [r for r in rows if 260 in r["output_token_ids"]]
    ends = [r["output_token_ids"].index(260) for r in closed]
    assert len(closed) >= 4 and max(ends) >= 2, [r["output_token_ids"] for r in rows]
    for r in closed:
        assert r["reasoning_text"] is not None
        answer = r["output_text"]
        if r["structured"] == "complete":
            assert answer in ("yes", "no") or (len(answer) == 2 and answer.isdigit())
    for r in rows:
        if 260 not in r["output_token_ids"]:  # never closed: all reasoning, no answer
            assert r["output_text"] == "" and r["structured"] == "incomplete"


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_reasoning_end_inside_a_draft_window_keeps_outputs(thinking_model, tmp_path, kind):
    formats = [json.dumps({"type": "choice", "choices": ["yes", "no"]}),
               json.dumps(FORMATS[0])] * 4  # fmt: skip
    plain, _ = run(tmp_path, thinking_model, n=8, formats=formats, name="plain",
                   overrides=["output.reasoning=think"])  # fmt: skip
    draft = init_random_draft(tmp_path / "d", thinking_model, kind=kind, seed=4,
                              **({"draft_vocab_size": 280, "aux_layer_ids": (0, 1, 2)}
                                 if kind == "eagle3" else {}))  # fmt: skip
    spec = (f"draft: {draft}\nspeculative:\n  num_steps: 4\n  adaptive: false\n"
            "  prompt_lookup_min: 0\n")  # fmt: skip
    rows, res = run(tmp_path, thinking_model, n=8, formats=formats, name="spec", extra=spec,
                    overrides=["output.reasoning=think"])  # fmt: skip
    for got, want in zip(rows, plain, strict=True):
        assert got["output_token_ids"] == want["output_token_ids"]
        assert (got["reasoning_text"], got["output_text"]) == (want["reasoning_text"],
                                                               want["output_text"])  # fmt: skip


# ---- formats no row can follow, rows left without a token, many alternatives, whitespace ----

EMPTY_LANGUAGES = {
    "ref-cycle": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
        "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}}},
    "self-anyof": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "anyOf": [{"$ref": "#"}]}}},
    "no-char": {"type": "regex", "pattern": "[^\\s\\S]"},
    "self-rule": {"type": "grammar", "lark": "start: start"},
    "endless": {"type": "grammar", "lark": 'start: "a" start'},  # text, but never a whole match
    "endless-nest": {"type": "grammar", "lark": 'start: "x" item\nitem: "(" item ")"'},
    "dead-end": {"type": "regex", "pattern": "ab[^\\s\\S]"},
}  # fmt: skip


def job_file(tmp, model_dir, fmt: dict, extra: str = "") -> str:
    pq.write_table(pa.table({"prompt": random_prompts(4, seed=3)}), tmp / "in.parquet")
    job = tmp / "job.yaml"
    job.write_text(
        f"model: {model_dir}\ninput:\n  path: {tmp / 'in.parquet'}\noutput:\n"
        f"  path: {tmp / 'out'}\n  include_token_ids: true\nsampling:\n"
        f"  max_new_tokens: {MAX_NEW}\n  response_format: {json.dumps(fmt)}\n{extra}"
        "engine:\n  device: cpu\n  kv_cache_tokens: 4096\n"
    )
    return str(job)


@pytest.mark.parametrize("name", list(EMPTY_LANGUAGES))
def test_a_format_no_text_matches_is_refused(tiny_model_dir, tmp_path, name, capfd):
    """The job's: exit 2 at validate naming sampling.response_format; a row's: its error row
    while the other rows generate; no llguidance internals on stderr either way."""
    from click.testing import CliRunner

    from eaglebatch.cli import main

    fmt = EMPTY_LANGUAGES[name]
    r = CliRunner().invoke(main, ["validate", job_file(tmp_path, tiny_model_dir, fmt)])
    assert r.exit_code == 2, r.output
    assert "sampling.response_format matches no text" in r.output
    assert "Traceback" not in r.output and len(r.output) < 600, r.output
    formats = formats_for(4)
    formats[1] = json.dumps(fmt)
    rows, res = run(tmp_path, tiny_model_dir, n=4, formats=formats)
    assert rows[1]["finish_reason"] == "error" and "matches no text" in rows[1]["error"]
    assert [r["finish_reason"] == "error" for r in rows] == [False, True, False, False]
    err = capfd.readouterr().err
    assert "<state>" not in err and "Parser" not in err, err


def test_an_openai_line_with_an_empty_format_is_its_error_line(tiny_model_dir, tmp_path):
    from test_openai_batch import COMPLETIONS, batch_job, request, results

    lines = [request(name, COMPLETIONS, {"prompt": "hi", "response_format": fmt})
             for name, fmt in EMPTY_LANGUAGES.items()]  # fmt: skip
    lines.append(request("ok", COMPLETIONS, {"prompt": "hi", "response_format": FORMATS[2]}))
    run_prepared(prepare(load_job(batch_job(tmp_path, tiny_model_dir, lines))))
    got = results(tmp_path)
    for name in EMPTY_LANGUAGES:
        assert got[name]["response"]["status_code"] != 200, name
        assert "matches no text" in got[name]["response"]["body"]["error"]["message"]
    assert got["ok"]["response"]["status_code"] == 200


SAMPLING_PATHS = {
    "greedy": [],
    "sampled": ["sampling.temperature=1.0"],
    "top_k": ["sampling.temperature=0.8", "sampling.top_k=5"],
    "top_p_logprobs": ["sampling.temperature=1.0", "sampling.top_p=0.9", "output.logprobs=3"],
    "greedy_logprobs": ["output.logprobs=2", "output.logprobs_mode=processed"],
}


@pytest.mark.parametrize("draft", [None, "eagle1", "eagle3"])
@pytest.mark.parametrize("path", list(SAMPLING_PATHS))
def test_a_grammar_that_can_only_end_ends_its_row_before_min_new_tokens(
        tiny_model_dir, drafts, tmp_path, path, draft):  # fmt: skip
    """`a{0}` matches only the empty text: with min_new_tokens the row still ends (`stop`,
    empty, complete), as a completed choice does; the other rows generate as without it."""
    formats = formats_for(6)
    formats[2] = formats[5] = json.dumps({"type": "regex", "pattern": "a{0}"})
    extra = "" if draft is None else (f"draft: {drafts[draft]}\nspeculative:\n  num_steps: 3\n"
                                      "  adaptive: false\n")  # fmt: skip
    over = ["sampling.min_new_tokens=4", *SAMPLING_PATHS[path]]
    rows, res = run(tmp_path, tiny_model_dir, n=6, formats=formats, extra=extra, overrides=over)
    for i in (2, 5):
        assert (rows[i]["finish_reason"], rows[i]["output_text"], rows[i]["structured"]) == (
            "stop", "", "complete"), rows[i]
    others = [r for i, r in enumerate(rows) if i not in (2, 5)]
    assert all(r["finish_reason"] in ("stop", "length") for r in others), others
    assert res.stats["errors"] == 0


def after_x_many_alternatives(n: int) -> dict:
    """Compiles and starts (only "xyz" is allowed), then offers n alternatives: a row reaching
    them has no mask (llguidance's row limit) and so no token."""
    words = " | ".join(f'"w{i}"' for i in range(n))
    return {"type": "grammar", "lark": f'start: "xyz" alt\nalt: {words}'}


@pytest.mark.parametrize("draft", [None, "eagle1", "eagle3"])
@pytest.mark.parametrize("path", list(SAMPLING_PATHS))
def test_a_row_left_without_a_token_is_its_error_row(tiny_model_dir, drafts, tmp_path, path,
                                                      draft, capfd):  # fmt: skip
    """A row whose every logit is -inf after processing (here: its grammar fails at its second
    token) is an error row saying why, on every sampling path and with a draft head; every
    other row of the batch is generated as it is without that row."""
    formats = formats_for(6)
    formats[3] = json.dumps(after_x_many_alternatives(MOST_ALTERNATIVES + 500))
    extra = "" if draft is None else (f"draft: {drafts[draft]}\nspeculative:\n  num_steps: 3\n"
                                      "  adaptive: false\n")  # fmt: skip
    over = SAMPLING_PATHS[path]
    rows, res = run(tmp_path, tiny_model_dir, n=6, formats=formats, extra=extra, overrides=over)
    assert rows[3]["finish_reason"] == "error", rows[3]
    assert "alternatives at one point" in rows[3]["error"] and len(rows[3]["error"]) < 300
    assert res.stats["errors"] == 1
    ref_formats = [f for i, f in enumerate(formats) if i != 3]
    ref, _ = run(tmp_path, tiny_model_dir, n=5, formats=ref_formats, name="ref", extra=extra,
                 overrides=over, prompts=[p for i, p in enumerate(random_prompts(6, seed=7))
                                          if i != 3])  # fmt: skip
    if path.startswith("greedy"):  # sampled rows' draws are keyed by row index
        got = [r["output_token_ids"] for i, r in enumerate(rows) if i != 3]
        assert got == [r["output_token_ids"] for r in ref]
    assert all(r["finish_reason"] in ("stop", "length") for i, r in enumerate(rows) if i != 3)
    assert "<state>" not in capfd.readouterr().err


MOST_ALTERNATIVES = 10_000


def test_the_alternatives_bound_is_the_native_one():
    from eaglebatch import _native

    assert _native.MOST_ALTERNATIVES == MOST_ALTERNATIVES


@pytest.mark.parametrize("n", [2_500, MOST_ALTERNATIVES])
def test_formats_with_thousands_of_alternatives_generate(tiny_model_dir, tmp_path, n):
    words = [f"w{i}" for i in range(n)]
    objects = [{"type": "object", "properties": {"k": {"const": i}}, "required": ["k"],
                "additionalProperties": False} for i in range(min(n, 2_500))]  # fmt: skip
    # (10,000 whole objects exceed llguidance's grammar size: "schema too large", refused)
    formats = [
        {"type": "choice", "choices": words},
        {"type": "grammar", "lark": "start: " + " | ".join(json.dumps(w) for w in words)},
        {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": list(range(n))}}},
        {"type": "json_schema", "json_schema": {"name": "o", "schema": {"anyOf": objects}}},
    ]  # fmt: skip
    rows, res = run(tmp_path, tiny_model_dir, n=4, formats=[json.dumps(f) for f in formats],
                    overrides=["sampling.max_new_tokens=64"])  # fmt: skip
    assert [r["error"] for r in rows] == [None] * 4
    assert rows[0]["output_text"] in words and rows[1]["output_text"] in words
    for r in rows[:2]:
        assert r["finish_reason"] == "stop" and r["structured"] == "complete"
    if rows[2]["finish_reason"] == "stop":
        assert int(rows[2]["output_text"]) in range(n)
    if rows[3]["finish_reason"] == "stop":
        assert json.loads(rows[3]["output_text"])["k"] in range(n)


def test_more_alternatives_than_the_bound_are_refused_in_words(tiny_model_dir, tmp_path):
    n = MOST_ALTERNATIVES + 1
    words = [f"w{i}" for i in range(n)]
    over = {"type": "choice", "choices": words}
    with pytest.raises(JobError, match=f"offers {n} alternatives") as e:
        prepare(load_job(job_file(tmp_path, tiny_model_dir, over), []))
    assert len(str(e.value)) < 400
    # a grammar's bound is on parser items: its alternatives plus the rules around them (64)
    many = [f"w{i}" for i in range(MOST_ALTERNATIVES + 100)]
    lark = {"type": "grammar", "lark": "start: " + " | ".join(json.dumps(w) for w in many)}
    rows, _ = run(tmp_path, tiny_model_dir, n=3,
                  formats=[json.dumps(over), json.dumps(lark), json.dumps(FORMATS[2])])
    for r in rows[:2]:
        assert r["finish_reason"] == "error" and "alternatives at one point" in r["error"]
        assert len(r["error"]) < 300, r["error"]
    assert rows[2]["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def newline_model(tmp_path_factory):
    """The tiny model with the newline's lm_head row scaled up: wherever a newline is allowed
    it is the argmax, as a small model stuck in a whitespace loop."""
    from safetensors.torch import load_file, save_file
    from transformers import PreTrainedTokenizerFast

    from support.tiny import make_tiny_model

    d = make_tiny_model(tmp_path_factory.mktemp("newline"), seed=5)
    nl = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json")).encode("\n")
    weights = load_file(str(d / "model.safetensors"))
    weights["lm_head.weight"][nl[-1]] *= 50.0
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_json_whitespace_is_bounded_unless_the_schema_asks(newline_model, tmp_path):
    """By default a JSON row cannot spend its budget on line breaks (one per gap); a schema whose
    x-guidance asks for flexible whitespace gets it (and loops, as before)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 9}}, "required": ["n"], "additionalProperties": False}  # fmt: skip
    flexible = {**schema, "x-guidance": {"whitespace_flexible": True}}
    compact = {**schema, "x-guidance": {"whitespace_flexible": False}}
    fmts = [{"type": "json_schema", "json_schema": {"name": "n", "schema": s}}
            for s in (schema, flexible, compact)] + [{"type": "json_object"}]  # fmt: skip
    rows, _ = run(tmp_path, newline_model, n=4, formats=[json.dumps(f) for f in fmts],
                  overrides=["sampling.max_new_tokens=200"])  # fmt: skip
    bounded, loose, tight, obj = rows
    assert bounded["finish_reason"] == "stop", bounded["output_text"]
    assert json.loads(bounded["output_text"])["n"] in range(10)
    assert "\n\n" not in bounded["output_text"] and "\n" in bounded["output_text"]
    assert loose["finish_reason"] == "length" and "\n\n\n" in loose["output_text"]
    assert tight["finish_reason"] == "stop" and not any(c.isspace() for c in tight["output_text"])
    assert "\n\n" not in obj["output_text"]

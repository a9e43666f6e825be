"""Stage 1: training prompts and their answers.

Prompts come from the job's input after the first `holdout_rows` rows (kept for evaluation),
of `min_prompt_tokens` to `max_prompt_tokens` tokens. Two sources of answers:
- self-distillation: the first `num_prompts` such rows, answered greedily by eaglebatch itself as an
  ordinary batch job whose output (with token ids) lands in `work/gen/`;
- reference answers: the next `num_reference` rows with a non-empty `answer_column`, tokenized
  as written (`work/reference.parquet`); their labels are the target's own predictions
  (stage 2), so both sources teach the head the target's greedy choice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eaglebatch._native import render_chat_template
from eaglebatch.errors import JobError
from eaglebatch.job.config import EngineConfig, JobConfig, OutputConfig, SamplingConfig
from eaglebatch.job.inputs import check_input
from eaglebatch.job.model_files import ModelFiles
from eaglebatch.prepare import prepare
from eaglebatch.progress import ProgressView
from eaglebatch.runner import run_prepared
from eaglebatch.train.job import TrainJob


class PromptEncoder:
    """Prompt text/messages -> token ids exactly as the Rust reader does: chat messages rendered
    with the model's template and encoded without special tokens; raw prompts encoded with them."""

    def __init__(self, job: TrainJob, mf: ModelFiles) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(mf.tokenizer_file))
        self.mf = mf
        self.chat = job.input.messages_column is not None or job.input.apply_chat_template
        self.column = job.input.messages_column or job.input.text_column

    def __call__(self, value) -> list[int] | None:
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        if not self.chat:
            return self.tok.encode(value, add_special_tokens=True).ids
        messages = value if isinstance(value, list) else [{"role": "user", "content": value}]
        if not messages or any(m.get("content") is None for m in messages):
            return None
        text = render_chat_template(
            self.mf.chat_template, messages, True, self.mf.bos_token, self.mf.eos_token
        )
        return self.tok.encode(text, add_special_tokens=False).ids


def _select(job: TrainJob, enc: PromptEncoder, start_row: int, count: int,
            answer_column: str | None) -> dict[str, list]:
    """Up to `count` input rows at or after `start_row` whose prompt has min_prompt_tokens to
    max_prompt_tokens tokens (and that have a non-empty answer when `answer_column` is given),
    in input order."""
    files, _ = check_input(job.input)
    columns = [enc.column] + ([answer_column] if answer_column else [])
    out: dict[str, list] = {"id": [], enc.column: []}
    if answer_column:
        out[answer_column] = []
    row = 0
    for f in files:
        pf = pq.ParquetFile(f)
        missing = [c for c in columns if c not in pf.schema_arrow.names]
        if missing:
            raise JobError(f"{f}: no column {missing[0]!r} (data.answer_column / input)")
        for batch in pf.iter_batches(columns=columns, batch_size=1024):
            cols = [batch.column(i).to_pylist() for i in range(len(columns))]
            for values in zip(*cols):
                if row >= start_row and len(out["id"]) < count:
                    answer = values[1] if answer_column else None
                    ok = not answer_column or (isinstance(answer, str) and answer.strip())
                    toks = enc(values[0]) if ok else None
                    if toks is not None and (job.data.min_prompt_tokens <= len(toks)
                                             <= job.data.max_prompt_tokens):
                        out["id"].append(row)
                        out[enc.column].append(values[0])
                        if answer_column:
                            out[answer_column].append(answer)
                row += 1
            if len(out["id"]) >= count:
                return out
    return out


def _write(out: Path, columns: dict[str, list], key: dict) -> None:
    table = pa.table({k: pa.array(v, pa.int64()) if k == "id" else v for k, v in columns.items()})
    table = table.replace_schema_metadata({"eaglebatch.selection": json.dumps(key, sort_keys=True)})
    tmp = out.with_suffix(".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, out)


def _saved_key(out: Path) -> dict | None:
    """The selection key `out` was written with; {} for a file of an older version (before
    2026-11-30 it recorded only the requested count); None if there is no file."""
    if not out.is_file():
        return None
    meta = pq.read_schema(out).metadata or {}
    if b"eaglebatch.selection" in meta:
        return json.loads(meta[b"eaglebatch.selection"])
    legacy = meta.get(b"eaglebatch.requested")
    return {"requested": int(legacy)} if legacy else {}


# Keys added to the selection key after files were first written, with the value every older
# file was selected with.
_KEY_DEFAULTS = {"min_prompt_tokens": 0}


def _selection_key(job: TrainJob, count: int, start_row: int) -> dict:
    """Everything the selected rows depend on."""
    return {"input": str(job.input.path), "column": job.input.messages_column
            or job.input.text_column, "max_prompt_tokens": job.data.max_prompt_tokens,
            "min_prompt_tokens": job.data.min_prompt_tokens, "start_row": start_row,
            "requested": count}


def _recorded(saved: dict) -> dict:
    """A saved key with the keys it predates filled in with the values it was selected with."""
    return {**_KEY_DEFAULTS, **saved}


def select_prompts(job: TrainJob, mf: ModelFiles, out: Path) -> int:
    """Writes `out` (columns: id = input row index, the prompt column) with up to num_prompts
    rows after the held-out ones whose prompts have min_prompt_tokens to max_prompt_tokens
    tokens. Returns the row count. Answers are generated for the selection once: a job that
    selects differently (another num_prompts, holdout_rows, min/max_prompt_tokens or input) is
    refused, not silently given the old selection."""
    key = _selection_key(job, job.data.num_prompts, job.data.holdout_rows)
    saved = _saved_key(out)
    if saved is not None:
        recorded = _recorded(saved)  # the oldest files record only `requested`: trusted
        if saved and saved.get("requested") == key["requested"] and all(
            recorded.get(k, v) == v for k, v in key.items()
        ):
            return pq.read_metadata(out).num_rows
        raise JobError(
            f"data: {out.parent} holds answers generated for another prompt selection "
            f"({saved or 'unrecorded'}; this job: {key}); use another output.path, or delete "
            f"{out.name}, gen/, gen.done, features/ and ckpt/ there to regenerate"
        )
    _write(out, _select(job, PromptEncoder(job, mf), job.data.holdout_rows,
                        job.data.num_prompts, None), key)
    return pq.read_metadata(out).num_rows


def select_reference(job: TrainJob, enc: PromptEncoder, prompts: Path, out: Path) -> int:
    """Writes `out` (id, prompt column, answer column) with up to num_reference rows after the
    held-out and the self-distillation rows. Returns the row count. Re-selected whenever what it
    depends on changed; selection is in input order, so a larger num_reference extends a
    smaller one and the feature shards of the rows both share stay valid."""
    start = job.data.holdout_rows
    if prompts.is_file():
        ids = pq.read_table(prompts, columns=["id"]).column(0).to_pylist()
        start = max([start] + [i + 1 for i in ids])
    key = _selection_key(job, job.data.num_reference, start)
    key["answer_column"] = job.data.answer_column
    saved = _saved_key(out)
    # a file of an older version recorded only the count: it was selected after the prompts
    if saved is not None and (_recorded(saved) == key or saved == {"requested": key["requested"]}):
        return pq.read_metadata(out).num_rows
    _write(out, _select(job, enc, start, job.data.num_reference, job.data.answer_column), key)
    return pq.read_metadata(out).num_rows


def reference_sequences(job: TrainJob, enc: PromptEncoder, path: Path) -> list[tuple]:
    """(prompt_ids, answer_ids) per reference row: the answer tokenized as written, cut at
    max_answer_tokens; an answer that fits ends with the model's EOS, as a finished turn does."""
    eos = enc.mf.eos_token_ids
    tab = pq.read_table(path)
    seqs = []
    for prompt, answer in zip(tab.column(enc.column).to_pylist(),
                              tab.column(job.data.answer_column).to_pylist()):
        ids = enc.tok.encode(answer, add_special_tokens=False).ids
        if len(ids) >= job.data.max_answer_tokens:
            ids = ids[: job.data.max_answer_tokens]
        elif eos:
            ids = ids + [eos[0]]
        seqs.append((enc(prompt), ids))
    return seqs


def generation_job(job: TrainJob, prompts: Path, gen_dir: Path) -> JobConfig:
    inp = job.input.model_copy(update={"path": str(prompts), "id_column": "id", "limit": None})
    return JobConfig(
        model=job.model,
        input=inp,
        output=OutputConfig(path=str(gen_dir), include_token_ids=True, part_rows=256),
        sampling=SamplingConfig(max_new_tokens=job.data.max_new_tokens, temperature=0.0),
        engine=EngineConfig(max_batch_size=job.data.max_batch_size),
    )


def generate_answers(job: TrainJob, mf: ModelFiles, console) -> Path:
    """Runs stage 1 unless `work/gen.done` says it finished. Returns the generation folder."""

    work = job.work_dir
    work.mkdir(parents=True, exist_ok=True)
    gen_dir, done = work / "gen", work / "gen.done"
    prompts = work / "prompts.parquet"
    n = select_prompts(job, mf, prompts)  # refuses a work folder of another selection
    if done.is_file():
        return gen_dir
    if n == 0:
        done.write_text(json.dumps({"rows": 0}) + "\n")
        return gen_dir
    prep = prepare(generation_job(job, prompts, gen_dir))
    dtype = prep.identity["engine"]["dtype"]
    console.print(f"[1/3] generating answers for {n} training prompts with the target "
                  f"({dtype}) ...")
    with ProgressView(prep.total_rows, console) as view:
        res = run_prepared(prep, progress=view, restart=True)
    done.write_text(json.dumps({"rows": res.stats["requests"], "dtype": dtype}) + "\n")
    return gen_dir


def answers_are_greedy(work: Path) -> bool:
    """True if the self-distilled answers in `work/gen` are the float32 target's greedy text, so
    their next tokens are its greedy labels. Answers generated in bf16/fp16 (the CUDA default) can
    part from it at near-ties: their labels must come from a float32 forward. gen.done files
    written before the dtype was recorded come from float32 runs (CPU-only then)."""
    return json.loads((work / "gen.done").read_text()).get("dtype", "float32") == "float32"

"""Stage 1: training prompts and the target's own answers (self-distillation).

Prompts come from the job's input after the first `holdout_rows` rows (kept for evaluation),
limited to `max_prompt_tokens` tokens. Answers are generated greedily by eaglebatch itself, as an
ordinary batch job whose output (with token ids) lands in `work/gen/`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eaglebatch.config import EngineConfig, JobConfig, OutputConfig, SamplingConfig
from eaglebatch.inputs import check_input
from eaglebatch.model_files import ModelFiles

from .job import TrainJob


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
        from eaglebatch._native import render_chat_template

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


def select_prompts(job: TrainJob, mf: ModelFiles, out: Path) -> int:
    """Writes `out` (columns: id = input row index, the prompt column) with up to num_prompts
    rows after the held-out ones whose prompts fit max_prompt_tokens. Returns the row count."""
    if out.is_file():
        return pq.read_metadata(out).num_rows
    files, _ = check_input(job.input)
    enc = PromptEncoder(job, mf)
    ids, values = [], []
    row = 0
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(columns=[enc.column], batch_size=1024):
            for value in batch.column(0).to_pylist():
                if row >= job.data.holdout_rows and len(ids) < job.data.num_prompts:
                    toks = enc(value)
                    if toks is not None and len(toks) <= job.data.max_prompt_tokens:
                        ids.append(row)
                        values.append(value)
                row += 1
            if len(ids) >= job.data.num_prompts:
                break
        if len(ids) >= job.data.num_prompts:
            break
    table = pa.table({"id": pa.array(ids, pa.int64()), enc.column: values})
    tmp = out.with_suffix(".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, out)
    return len(ids)


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
    from eaglebatch.engine import prepare, run_prepared
    from eaglebatch.progress import ProgressView

    work = job.work_dir
    work.mkdir(parents=True, exist_ok=True)
    gen_dir, done = work / "gen", work / "gen.done"
    if done.is_file():
        return gen_dir
    prompts = work / "prompts.parquet"
    n = select_prompts(job, mf, prompts)
    console.print(f"[1/3] generating answers for {n} training prompts with the target ...")
    prep = prepare(generation_job(job, prompts, gen_dir))
    with ProgressView(prep.total_rows, console) as view:
        res = run_prepared(prep, progress=view, restart=True)
    done.write_text(json.dumps({"rows": res.stats["requests"]}) + "\n")
    return gen_dir

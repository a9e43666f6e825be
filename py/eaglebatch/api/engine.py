"""`Engine`: a model loaded once, serving many calls from Python.

Each call is a job like any other (the same checks, scheduler, worker and output columns): its
inputs are written to a temporary Parquet file, the job runs on the engine's loaded worker
into a temporary output directory, and the rows come back as a `pyarrow.Table` in input order
(`row_index`, then `sample_index`). Temporary files live under the engine's work directory and
are removed when the call returns.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eaglebatch.api.inputs import write_inputs
from eaglebatch.api.scoring import (
    EMPTY,
    PairResults,
    by_context,
    checked_pairs,
    choices_table,  # fmt: skip
    text_list,
)
from eaglebatch.errors import JobError, echo, native_error
from eaglebatch.job.config import job_from_dict
from eaglebatch.prepare import PreparedJob, prepare
from eaglebatch.runner import RunScope, RunSummary, build_worker
from eaglebatch.runner import run_prepared as _run_prepared

Section = Mapping[str, Any] | None
ORDER = [("row_index", "ascending"), ("sample_index", "ascending")]


class Engine:
    """A model (and optionally an EAGLE draft head) loaded once. `engine` and `speculative`
    are the job file's sections of those names; `model` and `draft` take what the job's keys
    take (a folder, a .gguf file, a builtin name; `draft` also `mtp`, the model's own MTP
    layer). Use as a context manager, or call close()."""

    def __init__(self, model: str, draft: str | None = None, *, engine: Section = None,
                 speculative: Section = None, model_chat_template: str | None = None,
                 progress: bool = False) -> None:  # fmt: skip
        self._base = {"model": str(model), "engine": dict(engine or {}),
                      "speculative": dict(speculative or {})}  # fmt: skip
        if draft is not None:
            self._base["draft"] = str(draft)
        if model_chat_template is not None:
            self._base["model_chat_template"] = str(model_chat_template)
        self._progress, self._closed = progress, False
        self._dir = Path(tempfile.mkdtemp(prefix="eaglebatch-engine-"))
        self._worker, self._worker_key = None, None
        try:
            prep, call = self._prepare(["x"], _probe_task(model), {}, {}, {})
            shutil.rmtree(call, ignore_errors=True)
            self._ensure_worker(prep)
            self.max_model_len: int = prep.engine.max_model_len
            self.model_dir: Path = prep.model.dir
            self.chat_template: str | None = prep.model.chat_template
            self.bos_token, self.eos_token = prep.model.bos_token, prep.model.eos_token
            self.tokenizer_file: Path = prep.model.tokenizer_file
        except BaseException:
            self.close()
            raise

    # -- the calls ---------------------------------------------------------------------------

    def generate(self, inputs, *, sampling: Section = None, output: Section = None,
                 input: Section = None) -> pa.Table:  # fmt: skip
        """Generates every input row; returns the job's output columns, in input order.
        `sampling`, `output`, `input`: the job's sections (`output.path` is the engine's)."""
        return self._call(inputs, "generate", input, sampling, output)

    def generate_stream(self, inputs, *, sampling: Section = None, output: Section = None,
                        input: Section = None,
                        chunk_rows: int = 4096) -> Iterator[pa.RecordBatch]:  # fmt: skip
        """As `generate`, yielding the rows in input order as record batches of `chunk_rows`
        input rows at most: the inputs go to disk first (a RecordBatchReader batch by batch),
        then each chunk of rows is generated and yielded, so memory holds one chunk. The
        arguments are checked when called, before the first batch is asked for."""
        self._check_open()
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise JobError(f"chunk_rows: expected an integer >= 1, got {echo(chunk_rows)}")
        return self._stream(inputs, input, sampling, output, chunk_rows)

    def _stream(self, inputs, keys: Section, sampling: Section, output: Section,
                chunk_rows: int) -> Iterator[pa.RecordBatch]:  # fmt: skip
        call = Path(tempfile.mkdtemp(dir=self._dir))
        try:
            prep, _ = self._prepare(inputs, "generate", keys, sampling, output, call)
            for start in range(0, prep.total_rows, chunk_rows):
                scope = RunScope(row_range=(start, min(start + chunk_rows, prep.total_rows)))
                chunk = _with_output(prep, call / f"out-{start}")
                self._run(chunk, scope)
                table = pq.read_table(chunk.job.output.path).sort_by(ORDER)
                shutil.rmtree(chunk.job.output.path, ignore_errors=True)
                yield from table.to_batches()
        finally:
            shutil.rmtree(call, ignore_errors=True)

    def score(self, contexts: Sequence[str], continuations: Sequence[str], *,
              add_special_tokens: bool = True) -> pa.Table:  # fmt: skip
        """One row per (context, continuation) pair: `logprob` (the continuation tokens' summed
        log-probability), `num_tokens`, `is_greedy` (each is the argmax) and `error`, each pair
        its own (scoring.py). The split is lm-evaluation-harness's; a context shared by several
        pairs is computed once."""
        self._check_open()
        pairs = checked_pairs(contexts, continuations)
        results = PairResults(len(pairs))
        todo = [i for i, (_, cont) in enumerate(pairs) if cont]
        for i in sorted(set(range(len(pairs))) - set(todo)):
            results.fail(i, EMPTY)
        again = self._score_groups(pairs, by_context(pairs, todo), add_special_tokens, results)
        self._score_groups(pairs, [[i] for i in again], add_special_tokens, results)
        return results.table()

    def score_rolling(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> pa.Table:
        """Per text: `logprob` (the whole text's log-probability, lm-eval's rolling windows of
        `max_model_len` tokens when longer), `num_tokens` and `error`."""
        keys = {"prompt_column": "prompt", "add_special_tokens": add_special_tokens}
        table = pa.table({"prompt": pa.array(text_list("texts", texts), pa.string())})
        out = self._call(table, "perplexity", keys, None, None)
        return out.select(["logprob", "num_tokens", "error"])

    def embed(self, inputs, *, embed: Section = None, input: Section = None,
              output: Section = None) -> pa.Table:  # fmt: skip
        """Per input row its `embedding` (`task: embed`, docs/embeddings.md), in input order.
        `embed`: the job's embed section (pooling, normalize, dimensions, prompt_name,
        truncate); by default the model's sentence-transformers files decide."""
        return self._call(inputs, "embed", input, None, output, {"embed": dict(embed or {})})

    def classify(self, inputs, *, input: Section = None, output: Section = None,
                 truncate: str | None = None) -> pa.Table:  # fmt: skip
        """Per input row (a text or a conversation) its `label` and `probs` from the model's
        sequence-classification head (`task: classify`)."""
        return self._call(inputs, "classify", input, None, output, _truncate(truncate))

    def reward(self, inputs, *, input: Section = None, output: Section = None,
               truncate: str | None = None) -> pa.Table:  # fmt: skip
        """Per input row (a conversation, or a text) the `score` of the model's single-output
        head (`task: reward`)."""
        return self._call(inputs, "reward", input, None, output, _truncate(truncate))

    def close(self) -> None:
        """Frees the worker (weights, KV cache, threads' buffers) and the work directory."""
        self._closed = True
        self._worker = self._worker_key = None
        gc.collect()
        try:
            import torch  # lazy: only to give the device's cached memory back

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        """The model's tokenizer (a `tokenizers.Tokenizer`), loaded when first asked for."""
        self._check_open()
        if getattr(self, "_tokenizer", None) is None:
            # lazy: the tokenizers library, only when a caller wants the tokenizer
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.tokenizer_file))
        return self._tokenizer

    # -- how a call runs ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise JobError("this Engine is closed (close() or the end of its `with` block "
                           "freed the model); create a new Engine")  # fmt: skip

    def _score_groups(self, pairs: list[tuple[str, str]], groups: list[list[int]],
                      add_special: bool, results: PairResults) -> list[int]:  # fmt: skip
        """Scores `groups` of pairs as choices rows into `results`; returns the pairs whose
        row failed with several choices (to score again alone)."""
        if not groups:
            return []
        keys = {"prompt_column": "prompt", "choices_column": "choices",
                "add_special_tokens": add_special}  # fmt: skip
        out = self._call(choices_table(pairs, groups), "score", keys, None, None)
        return results.take(groups, out)

    def _call(self, inputs, task: str, keys: Section, sampling: Section,
              output: Section, extra: Section = None) -> pa.Table:  # fmt: skip
        self._check_open()
        call = Path(tempfile.mkdtemp(dir=self._dir))
        try:
            prep, _ = self._prepare(inputs, task, keys, sampling, output, call, extra)
            self._run(prep, RunScope())
            return pq.read_table(prep.job.output.path).sort_by(ORDER)
        finally:
            shutil.rmtree(call, ignore_errors=True)

    def _prepare(self, inputs, task: str, keys: Section, sampling: Section, output: Section,
                 call: Path | None = None,
                 extra: Section = None) -> tuple[PreparedJob, Path]:  # fmt: skip
        call = call or Path(tempfile.mkdtemp(dir=self._dir))
        section = write_inputs(inputs, call / "input.parquet", dict(keys or {}))
        data = {**self._base, **dict(extra or {}), "task": task, "input": section,
                "output": {**dict(output or {}), "path": str(call / "out")},
                "sampling": dict(sampling or {})}  # fmt: skip
        return _user_errors(lambda: prepare(job_from_dict(data)))(), call

    def _ensure_worker(self, prep: PreparedJob):
        """The loaded worker, built again only when a job needs a wider speculative round
        (structured output's forced drafts) than the one it was built for."""
        key = (prep.engine.max_draft_tokens, prep.job.forced_draft_tokens)
        if self._worker is None or key != self._worker_key:
            self._worker = None
            gc.collect()
            # calls of any size share it: the free-memory rule, not the first call's job's
            self._worker = _user_errors(lambda: build_worker(prep, for_job=False))()
            self._worker_key = key
        return self._worker

    def _run(self, prep: PreparedJob, scope: RunScope) -> RunSummary:
        worker = self._ensure_worker(prep)
        view = _progress_view(prep, scope) if self._progress else None
        run = lambda: _run_prepared(prep, worker=worker, progress=view, scope=scope)  # noqa: E731
        if view is None:
            return _user_errors(run)()
        with view:
            return _user_errors(run)()


def _truncate(truncate: str | None) -> dict:
    """The job keys of classify / reward's `truncate` (None: the task's default, error)."""
    return {} if truncate is None else {"embed": {"truncate": truncate}}


def _probe_task(model: str) -> str:
    """The task the engine's first job checks the model with: classify for a local
    sequence-classification checkpoint (it has no LM head to generate with), else generate."""
    try:
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
        archs = config.get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return "generate"
    return "classify" if any(str(a).endswith("ForSequenceClassification") for a in archs) else (
        "generate")  # fmt: skip


def _with_output(prep: PreparedJob, path: Path) -> PreparedJob:
    """The prepared job writing to `path` (the same identity: the outputs do not change)."""
    out = prep.job.output.model_copy(update={"path": str(path)})
    return dataclasses.replace(prep, job=prep.job.model_copy(update={"output": out}))


def _progress_view(prep: PreparedJob, scope: RunScope):
    # lazy: rich, only when the engine shows progress
    from eaglebatch.progress import ProgressView

    first, end = scope.rows(prep.total_rows)
    return ProgressView((end - first) * prep.job.sampling.n)


def _user_errors(fn):
    """`fn` with the extension's user errors raised as JobError (the CLI's exit-2 message)."""

    def call():
        try:
            return fn()
        except Exception as e:
            if native_error(e) == "user":
                raise JobError(str(e)) from None
            raise

    return call


"""Ray Data: eaglebatch as a stage of a `ray.data.Dataset` pipeline, in the shape of Ray Data
LLM's processors (`build_processor(config, preprocess, postprocess)` returns a callable that
maps a Dataset to a Dataset). Each engine actor loads one `Engine`; each batch is one
`Engine.generate` call whose rows keep the batch's columns (output.keep_columns "*").

For a job whose input and output are files, `eaglebatch run --ray` is the better tool: it
resumes exactly once after failures. A Dataset pipeline has Ray Data's guarantees instead (a
failed task is retried, its rows regenerated). docs/python-api.md#ray-data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

Row = dict[str, Any]


@dataclass(frozen=True)
class ProcessorConfig:
    """What each engine actor loads and how batches are cut. `engine`, `speculative`,
    `sampling`, `input` (column names: `prompt_column`, `messages_column`, sampling columns)
    and `output` are the job file's sections."""

    model: str
    draft: str | None = None
    engine: dict = field(default_factory=dict)
    speculative: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)
    input: dict = field(default_factory=dict)
    output: dict = field(default_factory=dict)
    # generate, or a pooled task (embed | classify | reward: Engine.embed / classify / reward,
    # docs/embeddings.md) with `embed` its job section
    task: str = "generate"
    embed: dict = field(default_factory=dict)
    batch_size: int = 256  # rows per Engine call
    concurrency: int = 1  # engine actors
    num_cpus: float | None = None  # per actor (default: engine.num_threads, else 1)
    num_gpus: float = 0  # per actor


class EngineStage:
    """The callable class each actor runs (`Dataset.map_batches`)."""

    def __init__(self, config: ProcessorConfig) -> None:
        # lazy: the engine (torch, the extension) loads in the actor, not the driver
        from eaglebatch.api.engine import Engine

        self.config = config
        self.engine = Engine(config.model, config.draft, engine=config.engine,
                             speculative=config.speculative)  # fmt: skip

    def __call__(self, batch: pa.Table) -> pa.Table:
        c = self.config
        output = {**c.output, "keep_columns": "*"}
        if c.task == "embed":
            return self.engine.embed(batch, embed=c.embed, input=c.input, output=output)
        if c.task in ("classify", "reward"):
            call = getattr(self.engine, c.task)
            return call(batch, input=c.input, output=output, **c.embed)
        return self.engine.generate(batch, sampling=c.sampling, input=c.input, output=output)


class Processor:
    """preprocess (a row function) -> eaglebatch (engine actors) -> postprocess."""

    def __init__(self, config: ProcessorConfig, preprocess: Callable[[Row], Row] | None,
                 postprocess: Callable[[Row], Row] | None) -> None:  # fmt: skip
        self.config, self.preprocess, self.postprocess = config, preprocess, postprocess

    def __call__(self, ds):
        c = self.config
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        cpus = c.num_cpus if c.num_cpus is not None else c.engine.get("num_threads") or 1
        ds = ds.map_batches(EngineStage, fn_constructor_kwargs={"config": c},
                            batch_format="pyarrow", batch_size=c.batch_size,
                            concurrency=c.concurrency, num_cpus=cpus,
                            num_gpus=c.num_gpus)  # fmt: skip
        if self.postprocess is not None:
            ds = ds.map(self.postprocess)
        return ds


def build_processor(config: ProcessorConfig, preprocess: Callable[[Row], Row] | None = None,
                    postprocess: Callable[[Row], Row] | None = None) -> Processor:  # fmt: skip
    """`processor(ds)` maps a Dataset of prompts (or messages) to one of generated rows: the
    job's output columns beside the input's (after `preprocess`), then `postprocess`."""
    return Processor(config, preprocess, postprocess)

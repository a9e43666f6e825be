"""The train-draft job file: YAML -> frozen `TrainJob` (unknown keys are errors)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from eaglebatch.config import (
    InputConfig,
    JobError,
    _Section,
    load_validated,
    resolve_model_ref,
    resolve_path,
)


class DataConfig(_Section):
    # The first `holdout_rows` input rows are never trained on (evaluation prompts).
    holdout_rows: int = Field(default=200, ge=0)
    # Self-distillation: prompts whose answers the target regenerates (greedy).
    num_prompts: int = Field(default=1000, ge=0)
    max_prompt_tokens: int = Field(default=256, ge=1)
    # Only prompts of at least this many tokens (e.g. to fine-tune on long contexts).
    min_prompt_tokens: int = Field(default=0, ge=0)
    max_new_tokens: int = Field(default=128, ge=1)
    max_batch_size: int = Field(default=64, ge=1)
    # Reference answers: the next `num_reference` rows' recorded answers (`answer_column`),
    # relabelled with the target's own greedy prediction at every position. No generation, so
    # several times more training tokens per CPU second; the contexts are not the target's own.
    answer_column: str | None = None
    num_reference: int = Field(default=0, ge=0)
    max_answer_tokens: int = Field(default=256, ge=1)

    @model_validator(mode="after")
    def _check_sources(self):
        if self.num_reference and not self.answer_column:
            raise ValueError("data.answer_column is required when data.num_reference > 0")
        if self.min_prompt_tokens > self.max_prompt_tokens:
            raise ValueError(f"data.min_prompt_tokens ({self.min_prompt_tokens}) exceeds "
                             f"data.max_prompt_tokens ({self.max_prompt_tokens}): no prompt fits")
        if self.num_prompts + self.num_reference == 0:
            raise ValueError("data.num_prompts and data.num_reference are both 0: no training data")
        return self


class HeadConfig(_Section):
    draft_vocab_size: int = Field(default=8192, ge=16)
    # Target hidden-state indices (HF output_hidden_states) read by fc; default (2, L//2, L-3).
    aux_layer_ids: tuple[int, int, int] | None = None
    # Fine-tune an existing EAGLE-3 head (folder or builtin draft name) instead of starting from
    # a fresh one: its weights, draft vocabulary and aux layers are the start, so the two keys
    # above must not be given with it.
    init_from: str | None = None

    @model_validator(mode="after")
    def _check_init(self):
        given = {"draft_vocab_size", "aux_layer_ids"} & self.model_fields_set
        if self.init_from is not None and given:
            raise ValueError(f"{sorted(given)[0]} cannot be set with init_from: the head being "
                             "fine-tuned fixes it")
        return self


class OptimConfig(_Section):
    epochs: float = Field(default=3.0, gt=0)
    lr: float = Field(default=1e-3, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_steps: int = Field(default=50, ge=0)
    batch_tokens: int = Field(default=4096, ge=64)  # padded tokens per optimizer step
    unroll: int = Field(default=3, ge=1, le=8)  # training-time-test draft steps
    grad_clip: float = Field(default=1.0, gt=0)
    checkpoint_every: int = Field(default=100, ge=1)  # optimizer steps
    # Sequences kept out of training to measure the head at every checkpoint; the exported head
    # is the checkpoint with the best held-out expected acceptance length (early stopping).
    val_sequences: int = Field(default=64, ge=0)
    seed: int = 0
    num_threads: int | None = Field(default=None, ge=1)


class TrainJob(_Section):
    model: str
    input: InputConfig
    output: dict[str, str]  # {"path": folder of the exported head}
    data: DataConfig = DataConfig()
    head: HeadConfig = HeadConfig()
    train: OptimConfig = OptimConfig()

    @property
    def output_path(self) -> Path:
        return Path(self.output["path"])

    @property
    def work_dir(self) -> Path:
        return self.output_path / "work"


def load_train_job(path: str | Path, overrides: list[str] = ()) -> TrainJob:
    path = Path(path)
    job = load_validated(path, list(overrides), TrainJob)
    if set(job.output) != {"path"}:
        raise JobError(f"{path}: output takes exactly one key, 'path'")
    base = path.parent.resolve()
    return job.model_copy(
        update={
            "model": resolve_model_ref(job.model, base),
            "input": job.input.model_copy(update={"path": resolve_path(job.input.path, base)}),
            "output": {"path": resolve_path(job.output["path"], base)},
            "head": job.head.model_copy(
                update={"init_from": resolve_model_ref(job.head.init_from, base)}
            ),
        }
    )

"""The train-draft job file: YAML -> frozen `TrainJob` (unknown keys are errors)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

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
    num_prompts: int = Field(default=1000, ge=1)
    max_prompt_tokens: int = Field(default=256, ge=1)
    max_new_tokens: int = Field(default=128, ge=1)
    max_batch_size: int = Field(default=64, ge=1)


class HeadConfig(_Section):
    draft_vocab_size: int = Field(default=8192, ge=16)
    # Target hidden-state indices (HF output_hidden_states) read by fc; default (2, L//2, L-3).
    aux_layer_ids: tuple[int, int, int] | None = None


class OptimConfig(_Section):
    epochs: float = Field(default=3.0, gt=0)
    lr: float = Field(default=1e-3, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_steps: int = Field(default=50, ge=0)
    batch_tokens: int = Field(default=4096, ge=64)  # padded tokens per optimizer step
    unroll: int = Field(default=3, ge=1, le=8)  # training-time-test draft steps
    grad_clip: float = Field(default=1.0, gt=0)
    checkpoint_every: int = Field(default=100, ge=1)  # optimizer steps
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
        }
    )

"""The train-draft job file: YAML -> frozen `TrainJob` (unknown keys are errors)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, ValidationError

from eaglebatch.config import (
    InputConfig,
    JobError,
    _format_error,
    _Section,
    apply_overrides,
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
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise JobError(f"cannot read job file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise JobError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise JobError(f"{path}: the job must be a mapping of keys")
    data = apply_overrides(data, list(overrides))
    try:
        job = TrainJob.model_validate(data)
    except ValidationError as e:
        raise JobError(_format_error(e, str(path))) from None
    if set(job.output) != {"path"}:
        raise JobError(f"{path}: output takes exactly one key, 'path'")
    base = path.parent.resolve()

    def fix(p: str) -> str:
        return p if p.startswith("builtin:") or Path(p).is_absolute() else str(base / p)

    model = job.model
    if "/" in model or model.startswith("."):
        model = fix(model)
    return job.model_copy(
        update={
            "model": model,
            "input": job.input.model_copy(update={"path": fix(job.input.path)}),
            "output": {"path": fix(job.output["path"])},
        }
    )

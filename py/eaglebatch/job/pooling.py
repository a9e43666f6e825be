"""The head of a pooled task (`task: embed | classify | reward`, docs/embeddings.md), resolved
from the job and the model folder before any work: which positions are pooled, the width of
the worker's per-row contributions, normalisation, the Matryoshka cut, the instruction prompt,
and a sequence-classification checkpoint's labels. A task the model cannot do is a JobError
naming the key (validate exits 2).

embed reads sentence-transformers' files where the checkpoint has them: `modules.json` (its
Pooling module's folder, and a Normalize module), the Pooling module's `config.json`
(`pooling_mode_lasttoken` / `_mean_tokens` / `_cls_token`) and
`config_sentence_transformers.json` (`prompts`, `default_prompt_name`); the job's `embed`
keys win over them. classify and reward need a `*ForSequenceClassification` checkpoint (its
`score.weight` head over the last token; `id2label`, `problem_type`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eaglebatch.errors import JobError, echo
from eaglebatch.job.config import JobConfig

_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_cls_token": "cls"}  # fmt: skip


@dataclass(frozen=True)
class PoolSpec:
    task: str  # embed | classify | reward
    pooling: str  # last | mean | cls
    width: int  # the contributions' width: hidden_size (embed) or the head's outputs
    normalize: bool = False
    dimensions: int = 0  # 0: all
    prompt_prefix: str = ""
    labels: tuple[str, ...] = ()
    multi_label: bool = False

    @property
    def head_outputs(self) -> int:
        """The sequence-classification head's outputs (0: embed, no head)."""
        return 0 if self.task == "embed" else self.width


def _json(path: Path) -> dict | None:
    """A JSON object file, None when absent or unreadable as one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _modules(model_dir: Path) -> list[dict]:
    try:
        data = json.loads((model_dir / "modules.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return []
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []


def st_pooling(model_dir: Path) -> tuple[str | None, bool]:
    """The sentence-transformers files' pooling mode (None: none stated) and whether they
    normalise."""
    modules = _modules(model_dir)
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    for m in modules:
        if str(m.get("type", "")).endswith("Pooling"):
            conf = _json(model_dir / str(m.get("path", "")) / "config.json") or {}
            modes = [mode for key, mode in _POOLING_MODES.items() if conf.get(key) is True]
            if len(modes) == 1:
                return modes[0], normalize
    return None, normalize


def _prompt_prefix(job: JobConfig, model_dir: Path) -> str:
    conf = _json(model_dir / "config_sentence_transformers.json") or {}
    prompts = conf.get("prompts") if isinstance(conf.get("prompts"), dict) else {}
    name = job.embed.prompt_name or conf.get("default_prompt_name")
    if name is None:
        return ""
    if name not in prompts or not isinstance(prompts[name], str):
        if job.embed.prompt_name is None:
            return ""
        known = ", ".join(sorted(map(str, prompts))) or "none"
        raise JobError(f"embed.prompt_name: {echo(name)} is not one of the model's prompts "
                       f"(config_sentence_transformers.json: {known})")  # fmt: skip
    return prompts[name]


def _embed_spec(job: JobConfig, model_dir: Path, hidden: int) -> PoolSpec:
    mode, normalize = st_pooling(model_dir)
    mode = job.embed.pooling or mode
    if mode is None:
        raise JobError(f"embed.pooling: model {model_dir} states no pooling (no "
                       "sentence-transformers modules.json with a Pooling module of one "
                       "mode); set embed.pooling to last, mean or cls")  # fmt: skip
    dims = job.embed.dimensions or 0
    if dims > hidden:
        raise JobError(f"embed.dimensions: {dims} is more than the model's hidden_size "
                       f"({hidden})")  # fmt: skip
    norm = normalize if job.embed.normalize is None else job.embed.normalize
    return PoolSpec("embed", mode, hidden, norm, dims, _prompt_prefix(job, model_dir))


def _head_spec(job: JobConfig, model_dir: Path, raw: dict) -> PoolSpec:
    archs = raw.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise JobError(f"task: {job.task} needs a sequence-classification checkpoint (a "
                       f"*ForSequenceClassification with a score head); model {model_dir} is "
                       f"{', '.join(map(str, archs)) or 'of no stated architecture'}")  # fmt: skip
    id2label = raw.get("id2label") if isinstance(raw.get("id2label"), dict) else {}
    n = raw.get("num_labels") or len(id2label) or 2
    labels = tuple(str(id2label.get(str(i), id2label.get(i, i))) for i in range(n))
    if job.task == "reward" and n != 1:
        raise JobError(f"task: reward needs a head with one output; model {model_dir} has "
                       f"{n} labels (use task: classify)")  # fmt: skip
    multi = raw.get("problem_type") == "multi_label_classification"
    return PoolSpec(job.task, "last", n, labels=labels, multi_label=multi)


def scheduler_settings(job: JobConfig, spec: PoolSpec | None) -> dict:
    """The scheduler config's fields of the head (job/scheduler_config.py; none for other
    tasks)."""
    if spec is None:
        return {}
    truncate = job.embed.truncate or ("end" if job.task == "embed" else "error")
    return dict(prompt_prefix=spec.prompt_prefix, truncate=truncate,
                pooling=spec.pooling, pool_width=spec.width, pool_normalize=spec.normalize,
                pool_dimensions=spec.dimensions, labels=list(spec.labels),
                multi_label=spec.multi_label)  # fmt: skip


def pool_spec(job: JobConfig, model_dir: Path) -> PoolSpec | None:
    """The job's pooled head (None: another task). Raises JobError naming the key."""
    if not job.pooled:
        return None
    raw = _json(model_dir / "config.json") or {}
    if job.task == "embed":
        conf = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        return _embed_spec(job, model_dir, int(conf.get("hidden_size") or 0))
    return _head_spec(job, model_dir, raw)

"""Resuming a job: its identity (everything that decides its outputs) and the rows already done.

Invariants:
- every part file a run writes carries `eaglebatch.job_hash`, the sha256 of the canonical JSON
  of the job's identity (kept in full under `eaglebatch.job_identity` for error messages);
- a run continues a directory only if every part file in it carries its own hash; the rows in
  those parts (by `row_index`, the stable input position) are skipped by the Rust reader, so
  over all runs of a job each input row is written exactly once;
- part files are complete by construction (see output_dir.py); one that cannot be read is
  reported, never silently ignored or overwritten.

The identity covers what changes an output row: the model files, the input files and columns,
the sampling section, max_model_len, the resolved dtype, include_token_ids, and the draft head
only when sampling (greedy speculative decoding is lossless: same tokens as plain decoding). It
leaves out what only changes speed or memory (batch size, KV budget, part_rows, threads).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .config import JobConfig, JobError
from .output_dir import part_files

HASH_KEY = "eaglebatch.job_hash"
IDENTITY_KEY = "eaglebatch.job_identity"
IDENTITY_VERSION = 1

# Small text files of a model / draft folder whose exact content matters.
_MODEL_TEXT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def folder_fingerprint(d: Path) -> dict:
    """Content hashes of the small files; name, size and mtime of the weight files (hashing
    gigabytes of weights on every start would be too slow; an in-place overwrite changes the
    mtime)."""
    texts = {n: sha256_file(d / n) for n in _MODEL_TEXT_FILES if (d / n).is_file()}
    weights = sorted(
        [f.name, f.stat().st_size, f.stat().st_mtime_ns // 1_000_000_000]
        for pattern in ("*.safetensors", "*.bin")
        for f in d.glob(pattern)
    )
    return {"files": texts, "weights": weights}


def job_identity(
    job: JobConfig, input_files: list[Path], model_dir: Path, draft_dir: Path | None, dtype: str
) -> dict:
    """What decides the output rows (see the module docstring). JSON-serialisable."""
    inp, files = job.input, input_files
    identity = {
        "version": IDENTITY_VERSION,
        "model": folder_fingerprint(model_dir),
        "input": {
            "path": inp.path,
            "files": [[str(f), pq.read_metadata(f).num_rows, f.stat().st_size] for f in files],
            "prompt_column": inp.text_column,
            "messages_column": inp.messages_column,
            "id_column": inp.id_column,
            "apply_chat_template": inp.apply_chat_template,
            "limit": inp.limit,
        },
        "sampling": job.sampling.model_dump(mode="json"),
        "engine": {"max_model_len": job.engine.max_model_len, "dtype": dtype},
        "output": {"include_token_ids": job.output.include_token_ids},
    }
    if draft_dir is not None and job.sampling.temperature > 0:
        identity["draft"] = {
            "files": folder_fingerprint(draft_dir),
            "speculative": job.speculative.model_dump(mode="json"),
        }
    return identity


def identity_hash(identity: dict) -> str:
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class ResumeState:
    """What earlier runs of this job left in its output directory."""

    done_rows: np.ndarray  # int64 row indices already written (sorted, unique)
    part_files: int

    def rows_done(self, total_rows: int) -> int:
        return int(np.count_nonzero(self.done_rows < total_rows))


def _flatten(d: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, object] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _what_changed(ours: dict, theirs_json: bytes | None) -> str:
    if theirs_json is None:
        return "it has no eaglebatch job hash (written by another program or an older version)"
    try:
        theirs = json.loads(theirs_json)
    except ValueError:
        return "its job identity is unreadable"
    a, b = _flatten(theirs), _flatten(ours)
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if not keys:
        return "its job hash differs"
    shown = []
    for k in keys[:4]:
        old, new = json.dumps(a.get(k))[:60], json.dumps(b.get(k))[:60]
        shown.append(f"{k}: {old} -> {new}")
    more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
    return "it differs in " + "; ".join(shown) + more


def scan_output(path: Path, identity: dict) -> ResumeState:
    """Reads the row indices of the complete part files in `path`, after checking they belong to
    this job. Raises JobError (naming the file and what differs) when one does not."""
    ours = identity_hash(identity)
    parts = part_files(path)
    done: list[np.ndarray] = []
    for part in parts:
        try:
            pf = pq.ParquetFile(part)
            meta = pf.metadata.metadata or {}
            if meta.get(HASH_KEY.encode()) == ours.encode():
                done.append(pf.read(columns=["row_index"]).column(0).to_numpy())
                continue
        except (pa.ArrowException, OSError, KeyError) as e:
            raise JobError(
                f"output.path: {part} is not a readable eaglebatch part file ({e}); "
                f"delete it, or pass --restart to delete all results and start over"
            ) from None
        why = _what_changed(identity, meta.get(IDENTITY_KEY.encode()))
        raise JobError(
            f"output.path: {path} holds results of a different job ({part.name}: {why}); "
            f"pass --restart to delete them and start over, or choose another output.path"
        )
    rows = np.unique(np.concatenate(done)) if done else np.empty(0, np.int64)
    return ResumeState(done_rows=rows.astype(np.int64), part_files=len(parts))

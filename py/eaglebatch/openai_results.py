"""The OpenAI Batch results file (output.format: openai-batch): one JSON line per request,
`{id, custom_id, response: {status_code, request_id, body}, error}`, written from the Parquet
parts once every row is done.

The parts stay the source of truth (resume, exactly-once and atomicity are theirs); the
results file is derived from them: streamed part by part (bounded memory: only rows whose n
samples are not all read yet are held), written to a hidden temporary file, fsynced and renamed
over `output.results_path` (results_file.py: where it may go and proof it is ours to replace).
It reads exactly the parts resume reads (output_dir.scan_tree: `_x` / `.x` copies are not).
A rerun of a finished job rewrites the same lines. A request's samples are its `choices`
(index = sample_index); an error row is a 400 response whose body holds the error, as the
OpenAI Batch API reports a request it refused. A line's body is shaped by its own endpoint:
the parts' `endpoint` column (OpenAI Batch input, whose lines may mix endpoints), else the
job's (`default_endpoint`: a Parquet input's, or parts written before the column existed).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pyarrow.parquet as pq

from .output_dir import scan_tree
from .results_file import replace_results

CHAT = "/v1/chat/completions"
_COLUMNS = ["id", "row_index", "sample_index", "output_text", "finish_reason", "prompt_tokens",
            "output_tokens", "error"]  # fmt: skip


def write_results(
    output_path: Path, results: Path, default_endpoint: str, model: str, n: int, job_hash: str
) -> int:
    """Writes `results` from every part under `output_path`; returns the lines written."""
    tmp = results.with_name(f".{results.name}.tmp")
    results.parent.mkdir(parents=True, exist_ok=True)
    created = int(time.time())
    lines = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for samples in _requests(output_path, n):
            endpoint = samples[0].get("endpoint") or default_endpoint
            f.write(json.dumps(_line(samples, endpoint, model, created), ensure_ascii=False))
            f.write("\n")
            lines += 1
        f.flush()
        os.fsync(f.fileno())
    replace_results(tmp, results, job_hash, output_path)
    return lines


def _requests(output_path: Path, n: int):
    """Each request's rows (its samples), in the order their last sample was written."""
    pending: dict[int, list[dict]] = {}
    parts = sorted(p for contents in scan_tree(output_path).values() for p in contents.ours)
    for part in parts:
        pf = pq.ParquetFile(part)
        columns = [c for c in [*_COLUMNS, "logprobs", "endpoint"] if c in pf.schema_arrow.names]
        for batch in pf.iter_batches(batch_size=1024, columns=columns):
            for row in batch.to_pylist():
                samples = pending.setdefault(row["row_index"], [])
                samples.append(row)
                if len(samples) == n:
                    yield sorted(pending.pop(row["row_index"]), key=lambda r: r["sample_index"])
    for samples in pending.values():  # an incomplete run's leftovers: what there is
        yield sorted(samples, key=lambda r: r["sample_index"])


def _line(samples: list[dict], endpoint: str, model: str, created: int) -> dict:
    first = samples[0]
    row = first["row_index"]
    custom_id = None if first["id"] is None else str(first["id"])
    line = {"id": f"batch_req_{row}", "custom_id": custom_id, "error": None}
    request_id = f"req_{row}"
    failed = next((s for s in samples if s["finish_reason"] == "error"), None)
    if failed is not None:
        error = {"message": failed["error"], "type": "invalid_request_error", "param": None,
                 "code": None}  # fmt: skip
        line["response"] = {"status_code": 400, "request_id": request_id,
                            "body": {"error": error}}  # fmt: skip
        return line
    chat = endpoint == CHAT
    completion = sum(s["output_tokens"] for s in samples)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{row}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [_choice(s, chat) for s in samples],
        "usage": {"prompt_tokens": first["prompt_tokens"], "completion_tokens": completion,
                  "total_tokens": first["prompt_tokens"] + completion},
    }  # fmt: skip
    line["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    return line


def _choice(s: dict, chat: bool) -> dict:
    lps = s.get("logprobs")
    choice: dict = {"index": s["sample_index"], "finish_reason": s["finish_reason"]}
    if chat:
        choice["message"] = {"role": "assistant", "content": s["output_text"]}
        choice["logprobs"] = None if lps is None else {"content": [_chat_lp(e) for e in lps]}
    else:
        choice["text"] = s["output_text"]
        choice["logprobs"] = None if lps is None else _completion_lp(lps)
    return choice


def _finite(x: float) -> float:
    """JSON has no -Infinity: a token top-k / top-p cut gets OpenAI's floor, -9999."""
    return x if math.isfinite(x) else -9999.0


def _chat_lp(e: dict) -> dict:
    def one(t):
        return {"token": t["token"], "logprob": _finite(t["logprob"]),
                "bytes": list(t["token"].encode("utf-8"))}  # fmt: skip

    return {**one(e), "top_logprobs": [one(t) for t in e["top_logprobs"]]}


def _completion_lp(entries: list[dict]) -> dict:
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [_finite(e["logprob"]) for e in entries],
        "top_logprobs": [{t["token"]: _finite(t["logprob"]) for t in e["top_logprobs"]}
                         for e in entries],
        "text_offset": offsets,
    }  # fmt: skip

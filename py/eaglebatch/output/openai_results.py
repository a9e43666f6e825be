"""The OpenAI Batch results file (output.format: openai-batch): one JSON line per request,
`{id, custom_id, response: {status_code, request_id, body}, error}`, written from the Parquet
parts once every row is done.

The parts stay the source of truth (resume, exactly-once and atomicity are theirs); the
results file is derived from them: one line per request in input order (row_index), as vLLM's
run-batch writes them, streamed part by part (`_requests`: bounded memory), with
`usage.prompt_tokens_details.cached_tokens` from the prefix cache and each choice's
`stop_reason` as vLLM's (the stop string or stop token id that ended it); written to a hidden
temporary file, fsynced and renamed
over `output.results_path` (results_file.py: where it may go and proof it is ours to replace).
It reads exactly the parts resume reads (output_dir.scan_tree: `_x` / `.x` copies are not).
A rerun of a finished job rewrites the same lines. A request's samples are its `choices`
(index = sample_index); an error row is a 400 response whose body holds the error, as the
OpenAI Batch API reports a request it refused. A line's body is shaped by its own endpoint:
the parts' `endpoint` column (OpenAI Batch input, whose lines may mix endpoints), else the
job's (`default_endpoint`: a Parquet input's, or parts written before the column existed).
"""

from __future__ import annotations

import base64
import heapq
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from eaglebatch.output.directory import scan_tree
from eaglebatch.output.results_file import replace_results
from eaglebatch.temp_file import new_temp_file

CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
_COLUMNS = ["id", "row_index", "sample_index", "output_text", "finish_reason", "prompt_tokens",
            "output_tokens", "error"]  # fmt: skip


def write_results(
    output_path: Path, results: Path, default_endpoint: str, model: str, job_hash: str
) -> int:
    """Writes `results` from every part under `output_path`; returns the lines written."""
    results.parent.mkdir(parents=True, exist_ok=True)
    # a new name of our own: no file beside the results is ever truncated
    fd, tmp = new_temp_file(results)  # the parts' mode rule (temp_file.py)
    created = int(time.time())
    lines = 0
    try:
        with open(fd, "w", encoding="utf-8") as f:
            for samples in _requests(output_path):
                endpoint = samples[0].get("endpoint") or default_endpoint
                f.write(json.dumps(_line(samples, endpoint, model, created), ensure_ascii=False))
                f.write("\n")
                lines += 1
            f.flush()
            os.fsync(f.fileno())
        replace_results(tmp, results, job_hash, output_path)
    finally:
        tmp.unlink(missing_ok=True)  # gone after the rename; left only by a failure
    return lines


def _requests(output_path: Path):
    """Each request's rows (its samples), in input order (row_index), streamed: the parts are
    opened in the order of their smallest row_index, and a request is yielded once no part
    still unopened can hold a row before it. Memory holds the rows of the opened parts not yet
    yielded: about one part when parts follow the input order, as continuous batching writes
    them (a straggler row keeps its part's rows until the others catch up)."""
    parts = sorted((_first_row(p), p) for contents in scan_tree(output_path).values()
                   for p in contents.ours)  # fmt: skip
    heap: list[tuple[int, int, int, dict]] = []  # (row_index, sample_index, seq, row)
    seq = 0
    for k in range(len(parts) + 1):
        frontier = parts[k][0] if k < len(parts) else math.inf
        while heap and heap[0][0] < frontier:  # no unopened part holds this row_index
            row = heap[0][0]
            samples = []
            while heap and heap[0][0] == row:
                samples.append(heapq.heappop(heap)[3])
            yield samples
        if k < len(parts):
            for r in _rows(parts[k][1]):
                heapq.heappush(heap, (r["row_index"], r["sample_index"], seq, r))
                seq += 1


def _first_row(part: Path) -> int:
    """The smallest row_index of a part (its footer's statistics when written, else read)."""
    md = pq.ParquetFile(part).metadata
    i = md.schema.to_arrow_schema().get_field_index("row_index")
    mins = [md.row_group(g).column(i).statistics for g in range(md.num_row_groups)]
    if mins and all(s is not None and s.has_min_max for s in mins):
        return min(int(s.min) for s in mins)
    col = pq.read_table(part, columns=["row_index"]).column("row_index")
    return min(col.to_pylist(), default=0)


def _rows(part: Path):
    pf = pq.ParquetFile(part)
    wanted = [*_COLUMNS, "cached_tokens", "logprobs", "endpoint", "stop_reason", "stop_token_id",
              "reasoning_text", "embedding", "encoding_format"]  # fmt: skip
    columns = [c for c in wanted if c in pf.schema_arrow.names]
    for batch in pf.iter_batches(batch_size=1024, columns=columns):
        yield from batch.to_pylist()


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
    if endpoint == EMBEDDINGS:
        line["response"] = {"status_code": 200, "request_id": request_id,
                            "body": _embeddings(samples, model)}  # fmt: skip
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
                  "total_tokens": first["prompt_tokens"] + completion,
                  "prompt_tokens_details": {"cached_tokens": first.get("cached_tokens") or 0}},
    }  # fmt: skip
    line["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    return line


def _embeddings(samples: list[dict], model: str) -> dict:
    """An embeddings line's body: one embedding object per input (its sample), as floats or
    base64 of their little-endian float32 bytes (the line's encoding_format)."""
    tokens = sum(s["prompt_tokens"] for s in samples)

    def vector(s: dict):
        if s.get("encoding_format") == "base64":
            return base64.b64encode(np.asarray(s["embedding"], dtype="<f4").tobytes()).decode()
        return s["embedding"]

    data = [{"object": "embedding", "index": s["sample_index"], "embedding": vector(s)}
            for s in samples]  # fmt: skip
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


def _choice(s: dict, chat: bool) -> dict:
    lps = s.get("logprobs")
    choice: dict = {"index": s["sample_index"], "finish_reason": s["finish_reason"],
                    "stop_reason": _stop_reason(s)}  # fmt: skip
    if chat:
        choice["message"] = {"role": "assistant", "content": s["output_text"]}
        if s.get("reasoning_text") is not None:  # output.reasoning (vLLM's field)
            choice["message"]["reasoning_content"] = s["reasoning_text"]
        choice["logprobs"] = None if lps is None else {"content": [_chat_lp(e) for e in lps]}
    else:
        choice["text"] = s["output_text"]
        choice["logprobs"] = None if lps is None else _completion_lp(lps)
    return choice


def _stop_reason(s: dict) -> str | int | None:
    """vLLM's `stop_reason`: the stop string or stop token id that ended the sample; None for
    an EOS token, a length or parts written before the columns existed."""
    if s.get("stop_reason") is not None:
        return s["stop_reason"]
    return s.get("stop_token_id")


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

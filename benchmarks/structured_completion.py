"""How many JSON-schema rows complete, and validate, with the default JSON whitespace (bounded:
at most one line break per gap) vs flexible whitespace (any run of it, the old default), on
the default model (SmolLM2-135M-Instruct, greedy).

The 60 schemas of the structured-output tests (tests/support/schemas.py: flat and nested
objects, arrays, enums, bounded numbers, patterns, $ref, anyOf, optional keys), each over
`--prompts-per-schema` ShareGPT first turns with the schema in the system message. A row is
complete when it ends `stop` (not `length`); a complete row is valid when its text parses as
JSON and validates against its schema (the `jsonschema` package).

    python benchmarks/structured_completion.py [--prompts-per-schema 2] [--max-new-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq

from eaglebatch.job import builtin
from eaglebatch.job.config import load_job
from eaglebatch.prepare import prepare
from eaglebatch.runner import run_prepared

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.schemas import schemas  # noqa: E402

# the schema's x-guidance per setting: none = eaglebatch's default
SETTINGS = {"bounded (default)": {}, "flexible (old)": {"whitespace_flexible": True}}


def prompts(n: int) -> list[str]:
    table = pq.ParquetFile(builtin.sharegpt_parquet()).read_row_group(0)
    return [r["prompt"][:300] for r in table.slice(0, n).to_pylist()]


def write_input(path: Path, texts: list[str], all_schemas: list[dict], options: dict) -> None:
    rows = [all_schemas[i % len(all_schemas)] for i in range(len(texts))]
    msgs = [[{"role": "system", "content": "Reply with one JSON object matching this schema: "
              + json.dumps(s)}, {"role": "user", "content": t}]
            for t, s in zip(texts, rows, strict=True)]  # fmt: skip
    rf = [json.dumps({"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": (
        {**s, "x-guidance": options} if options else s)}}) for i, s in enumerate(rows)]  # fmt: skip
    pq.write_table(pa.table({"messages": msgs, "rf": rf}), path)


def run(tmp: Path, name: str, max_new: int) -> list[dict]:
    job = tmp / f"{name}.yaml"
    job.write_text(
        f"model: smollm2-135m-instruct\ninput:\n  path: {tmp / name}.parquet\n"
        "  messages_column: messages\n  sampling_columns:\n    response_format: rf\n"
        f"output:\n  path: {tmp / name}\nsampling:\n  max_new_tokens: {max_new}\n"
        "engine:\n  max_batch_size: 64\n"
    )
    run_prepared(prepare(load_job(job, [])))
    return pq.read_table(tmp / name).sort_by("row_index").to_pylist()


def score(rows: list[dict], all_schemas: list[dict]) -> dict:
    complete = [r for r in rows if r["finish_reason"] == "stop"]
    valid = 0
    for r in complete:
        try:
            jsonschema.validate(json.loads(r["output_text"]),
                                all_schemas[r["row_index"] % len(all_schemas)])  # fmt: skip
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    lengths = [len(r["output_text"]) for r in rows]
    newlines = sum(r["output_text"].count("\n") for r in rows)
    return {"rows": len(rows), "complete": len(complete), "valid": valid,
            "errors": sum(r["finish_reason"] == "error" for r in rows),
            "mean_chars": sum(lengths) / len(rows), "newlines": newlines}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts-per-schema", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    args = ap.parse_args()
    all_schemas = schemas()
    texts = prompts(len(all_schemas) * args.prompts_per_schema)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for i, (label, options) in enumerate(SETTINGS.items()):
            write_input(tmp / f"s{i}.parquet", texts, all_schemas, options)
            t0 = time.perf_counter()
            rows = run(tmp, f"s{i}", args.max_new_tokens)
            results[label] = {**score(rows, all_schemas), "seconds": time.perf_counter() - t0}
    print(f"{len(all_schemas)} JSON schemas x {args.prompts_per_schema} ShareGPT prompts, "
          f"smollm2-135m-instruct, greedy, max_new_tokens {args.max_new_tokens}")
    print(f"{'whitespace':<20}{'rows':>6}{'complete':>16}{'valid of complete':>20}"
          f"{'errors':>8}{'mean chars':>12}{'newlines':>10}{'seconds':>9}")
    for label, r in results.items():
        done = f"{r['complete']} ({100 * r['complete'] / r['rows']:.1f}%)"
        ok = f"{r['valid']} ({100 * r['valid'] / max(r['complete'], 1):.1f}%)"
        print(f"{label:<20}{r['rows']:>6}{done:>16}{ok:>20}{r['errors']:>8}"
              f"{r['mean_chars']:>12.0f}{r['newlines']:>10}{r['seconds']:>9.0f}")


if __name__ == "__main__":
    main()

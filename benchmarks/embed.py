"""Embeddings (`task: embed`) on eaglebatch vs sentence-transformers' `encode`, in one run on
one machine, on the default model (SmolLM2-135M-Instruct) as a last-token embedder: its float32
checkpoint (the builtin model converted by transformers' GGUF loader) copied to a temporary
folder with sentence-transformers' files written beside it (last-token pooling, Normalize), so
both engines load the same weights from the same folder.

- throughput, for each `--dtype` (both engines load the weights in it): `--rows` ShareGPT
  first-turn prompts, rows per second of eaglebatch's `Engine.embed` and of
  `SentenceTransformer.encode(batch_size=32)` (each after loading, the best of `--repeats`),
  and the least cosine between the two engines' embeddings. Both run in this process, so
  sentence-transformers runs under the glibc malloc thresholds eaglebatch's CPU worker set
  (cpu/allocator.py): the same allocator for both;
- memory: a job over each of `--memory-rows` synthetic short rows in a subprocess of its own
  (a fixed 16,384-token KV cache, the first `--dtype`), its peak resident memory (VmHWM); flat
  means streaming (rows are written as they finish, never accumulated).

    python benchmarks/embed.py [--rows 2000] [--memory-rows 2000 --memory-rows 200000 | 0]
                               [--dtype float32 --dtype bfloat16] [--device cpu|cuda]
                               [--repeats 2] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def embedder_copy(root: Path) -> Path:
    """The default model's float32 checkpoint with last-token sentence-transformers files."""
    from eaglebatch.job import builtin

    model = root / "smollm2-embed"
    shutil.copytree(builtin.builtin_reference_dir(), model)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (model / "modules.json").write_text(json.dumps(modules))
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, "pooling_mode_lasttoken": True}))  # fmt: skip
    (model / "2_Normalize").mkdir()
    (model / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 2048}))
    return model


def sharegpt_prompts(n: int) -> list[str]:
    from eaglebatch.job import builtin

    table = pq.ParquetFile(builtin.sharegpt_parquet()).read_row_group(0, columns=["prompt"])
    prompts = [p for p in table.column("prompt").to_pylist() if p]
    return (prompts * (n // max(len(prompts), 1) + 1))[:n]


def best_of(repeats: int, fn) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def throughput(model: Path, texts: list[str], device: str, dtype: str, repeats: int) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    import eaglebatch

    engine_keys = {"device": device, "dtype": dtype, "max_model_len": 2048,
                   "max_batch_size": 256}  # fmt: skip
    with eaglebatch.Engine(str(model), engine=engine_keys) as engine:
        eb_s, table = best_of(repeats, lambda: engine.embed(texts))
        print(f"eaglebatch {dtype}: {eb_s:.1f} s", file=sys.stderr, flush=True)
    ours = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    st = SentenceTransformer(str(model), device=device,
                             model_kwargs={"torch_dtype": getattr(torch, dtype)})  # fmt: skip
    st_s, theirs = best_of(repeats, lambda: st.encode(texts, batch_size=32,
                                                      normalize_embeddings=True))  # fmt: skip
    theirs = np.asarray(theirs, dtype=np.float32)
    cos = (ours * theirs).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
    out = {"rows": len(texts), "dtype": dtype, "eaglebatch_rows_s": len(texts) / eb_s,
           "sentence_transformers_rows_s": len(texts) / st_s, "speedup": st_s / eb_s,
           "min_cosine": float(cos.min())}  # fmt: skip
    print(json.dumps(out), file=sys.stderr, flush=True)  # kept if a later part is stopped
    return out


# VmHWM, the process's own peak (ru_maxrss would carry the forking parent's over exec)
_CHILD = """
import sys, eaglebatch
eaglebatch.run(sys.argv[1])
status = open("/proc/self/status").read().split("VmHWM:")[1]
print(int(status.split()[0]))
"""


def peak_memory(model: Path, rows: int, device: str, dtype: str, root: Path) -> float:
    """Peak resident MiB of a job over `rows` synthetic short rows, in a process of its own."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    texts = pa.array([f"{i} " + " ".join(words[: 1 + i % 6]) for i in range(rows)])
    d = root / f"mem-{rows}"
    d.mkdir()
    pq.write_table(pa.table({"prompt": texts}), d / "in.parquet", row_group_size=8192)
    job = d / "job.yaml"
    job.write_text(f"model: {model}\ntask: embed\ninput:\n  path: {d / 'in.parquet'}\n"
                   f"output:\n  path: {d / 'out'}\nengine:\n  device: {device}\n"
                   f"  dtype: {dtype}\n"
                   "  max_model_len: 2048\n  max_batch_size: 256\n"
                   "  kv_cache_tokens: 16384\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", _CHILD, str(job)], capture_output=True,
                         text=True, check=True)  # fmt: skip
    return int(out.stdout.split()[-1]) / 1024  # KiB


def cpu_name() -> str:
    """The CPU's model name and the flags that decide its GEMMs (AVX-512, AMX)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                 if ln.startswith("model name")), platform.machine())  # fmt: skip
    flags = sorted({f for f in info.split() if f.startswith(("avx512", "amx"))})
    return f"{name} ({os.cpu_count()} cores; {' '.join(flags) or 'no AVX-512'})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2000, help="0: memory only")
    p.add_argument("--memory-rows", type=int, action="append")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", action="append", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = embedder_copy(root)
        dtypes = args.dtype or ["float32"]
        texts = sharegpt_prompts(args.rows)
        result = {"machine": cpu_name(), "device": args.device,
                  "throughput": [throughput(model, texts, args.device, d, args.repeats)
                                 for d in dtypes if args.rows]}  # fmt: skip
        sizes = [n for n in args.memory_rows or [2000, 200_000] if n > 0]  # 0: none
        result["peak_rss_mib"] = {n: peak_memory(model, n, args.device, dtypes[0], root)
                                  for n in sizes}  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""A real-size GGUF on the CPU: peak resident memory against file + KV cache, the cache folder,
start-up time (beside llama.cpp's where a `llama-server` is found) and decode speed.

    python benchmarks/cpu_at_scale.py --model-shape 7b [--gguf PATH] [--kv-tokens 1024]
        [--max-tokens 16] [--json PATH] [--build-llama]

Writes a synthetic Llama GGUF of the shape (benchmarks/synthetic_gguf.py: Q4_0 / Q8_0 mixed,
random weights) unless --gguf names one, then runs `eaglebatch run` in a fresh process twice
with an empty cache: one prompt, one new token (start-up: process start to exit, the cache
folder written then) and again with it, and 2 prompts x --max-tokens (decode speed, EOS
ignored). Peak resident memory is the largest child's ru_maxrss, reported against the goal
file + KV cache + 15% (the runtime's ~0.7 GiB exceeds 15% of a small model's file).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_gguf import write_llama_gguf  # noqa: E402

MIB = 1 << 20


def _job(tmp: Path, gguf: Path, name: str, prompts: int, max_tokens: int, kv: int) -> Path:
    inp = tmp / f"{name}.parquet"
    words = ["Write a short story about the sea.", "List three prime numbers."]
    pq.write_table(pa.table({"prompt": [words[i % 2] for i in range(prompts)]}), inp)
    job = tmp / f"{name}.yaml"
    job.write_text(
        f"model: {gguf}\ninput:\n  path: {inp}\noutput:\n  path: {tmp / name}\n"
        f"sampling:\n  max_new_tokens: {max_tokens}\n  ignore_eos: true\n"
        f"engine:\n  device: cpu\n  kv_cache_tokens: {kv}\n  max_batch_size: {prompts}\n"
    )
    return job


def _run(job: Path, cache: Path) -> dict:
    """`eaglebatch run JOB` in a child process: wall seconds, its peak RSS, its output."""
    env = {**os.environ, "EAGLEBATCH_CACHE": str(cache)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "eaglebatch.cli", "run", str(job)], env=env,
                         capture_output=True, text=True)  # fmt: skip
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB, the largest child
    if out.returncode != 0:
        raise SystemExit(f"eaglebatch failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    text = out.stdout + out.stderr
    return {"wall_s": wall, "peak_rss_mib": max(peak, before) / 1024, "log": text}


def _gen_tok_s(log: str) -> float | None:
    for line in log.splitlines():
        if "output tok/s" in line and "│" in line:
            try:
                return float(line.split("│")[2].split()[0])
            except (IndexError, ValueError):
                return None
    return None


def _llama_startup(gguf: Path, kv: int, build: bool) -> float | None:
    """Seconds from starting llama-server on `gguf` to its /health answering; None when there
    is no built server and `build` is off."""
    import shutil

    import llamacpp as lc

    known = (os.environ.get(lc.ENV_VAR) or shutil.which(lc.BINARY)
             or (lc.cache_dir() / lc.BINARY).is_file())  # fmt: skip
    if not (known or build):
        return None
    path, _ = lc.find_llama_server()
    port = lc._free_port()
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(lc._server_command(path, gguf, port, 1, 2, kv), stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
        try:
            lc._wait_healthy(proc, port, Path(log.name), 600)
            return time.perf_counter() - start
        finally:
            lc._stop(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-shape", default="7b", choices=["tiny", "1b", "3b", "7b"])
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--kv-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--build-llama", action="store_true",
                    help="build llama-server (benchmarks/llamacpp.py) when none is found")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="eaglebatch-at-scale-") as d:
        tmp = Path(d)
        gguf = args.gguf
        if gguf is None:
            t = time.perf_counter()
            gguf = write_llama_gguf(tmp / f"{args.model_shape}.gguf", args.model_shape)
            print(f"wrote {gguf.name} in {time.perf_counter() - t:.0f} s", flush=True)
        size = gguf.stat().st_size
        start = _run(_job(tmp, gguf, "start", 1, 1, args.kv_tokens), tmp / "cache")
        cache = sum(p.stat().st_size for p in (tmp / "cache").rglob("*") if p.is_file())
        warm = _run(_job(tmp, gguf, "warm", 1, 1, args.kv_tokens), tmp / "cache")
        decode = _run(_job(tmp, gguf, "decode", 2, args.max_tokens, args.kv_tokens),
                      tmp / "cache")  # fmt: skip
        kv_line = next((ln for ln in start["log"].splitlines() if ln.startswith("memory:")), "")
        llama = _llama_startup(gguf, args.kv_tokens, args.build_llama)
    kv_bytes = _kv_bytes(kv_line)
    peak = max(start["peak_rss_mib"], warm["peak_rss_mib"], decode["peak_rss_mib"]) * MIB
    result = {
        "model_shape": args.model_shape, "file_bytes": size, "kv_bytes": kv_bytes,
        "peak_rss_bytes": int(peak), "promise_bytes": int((size + kv_bytes) * 1.15),
        "cache_bytes": cache, "startup_s": start["wall_s"], "warm_startup_s": warm["wall_s"],
        "llama_cpp_startup_s": llama,
        "decode_wall_s": decode["wall_s"], "output_tok_s": _gen_tok_s(decode["log"]),
        "memory_line": kv_line,
    }  # fmt: skip
    _report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _kv_bytes(line: str) -> int:
    """The KV cache's bytes from the run's `memory:` line ("KV cache 1.00 GiB (...)")."""
    try:
        return int(float(line.split("KV cache ")[1].split(" GiB")[0]) * (1 << 30))
    except (IndexError, ValueError):
        return 0


def _report(r: dict) -> None:
    gib = 1 << 30
    held = r["file_bytes"] + r["kv_bytes"]
    print(f"{r['model_shape']}: file {r['file_bytes'] / gib:.2f} GiB, KV cache "
          f"{r['kv_bytes'] / gib:.2f} GiB, peak resident {r['peak_rss_bytes'] / gib:.2f} GiB "
          f"= file + KV + {(r['peak_rss_bytes'] - held) / gib:.2f} GiB "
          f"({r['peak_rss_bytes'] / held - 1:+.0%}; the goal, within +15%: "
          f"{'met' if r['peak_rss_bytes'] <= r['promise_bytes'] else 'not met'})")
    llama = r["llama_cpp_startup_s"]
    print(f"cache folder {r['cache_bytes'] / MIB:.1f} MiB; start-up to exit (1 prompt, 1 token): "
          f"{r['startup_s']:.1f} s with an empty cache, {r['warm_startup_s']:.1f} s after"
          + (f"; llama-server to healthy {llama:.1f} s" if llama else " (no llama-server)"))
    print(f"decode: {r['output_tok_s']} output tok/s (2 prompts), {r['decode_wall_s']:.1f} s "
          f"wall")


if __name__ == "__main__":
    sys.exit(main())

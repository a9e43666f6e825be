"""A real-size model on the CPU: peak resident memory against file + KV cache, the cache folder,
start-up time (beside llama.cpp's where a `llama-server` is found) and decode speed.

    python benchmarks/cpu_at_scale.py --model-shape 7b [--format gguf|bf16|f16] [--gguf PATH]
        [--kv-tokens 1024] [--max-tokens 16] [--json PATH] [--build-llama]

--format bf16 / f16: a synthetic Hugging Face folder of that dtype instead
(benchmarks/synthetic_safetensors.py), run from its 16-bit weights (`engine.weights: auto`)
and, for comparison, loaded into float32 (`dequantized`: its peak and speed, or the memory
check's refusal); llama.cpp does not read safetensors, so there is no llama-server column.

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
from synthetic_safetensors import write_llama_safetensors  # noqa: E402

MIB = 1 << 20


def _job(tmp: Path, model: Path, name: str, prompts: int, max_tokens: int, kv: int,
         weights: str = "auto") -> Path:  # fmt: skip
    inp = tmp / f"{name}.parquet"
    words = ["Write a short story about the sea.", "List three prime numbers."]
    pq.write_table(pa.table({"prompt": [words[i % 2] for i in range(prompts)]}), inp)
    job = tmp / f"{name}.yaml"
    job.write_text(
        f"model: {model}\ninput:\n  path: {inp}\noutput:\n  path: {tmp / name}\n"
        f"sampling:\n  max_new_tokens: {max_tokens}\n  ignore_eos: true\n"
        f"engine:\n  device: cpu\n  kv_cache_tokens: {kv}\n  max_batch_size: {prompts}\n"
        f"  weights: {weights}\n"
    )
    return job


def _run(job: Path, cache: Path, may_refuse: bool = False) -> dict:
    """`eaglebatch run JOB` in a child process: wall seconds, its peak RSS, its output (with
    `may_refuse`, a refusal by the memory check, exit 2, is a result: "refused")."""
    env = {**os.environ, "EAGLEBATCH_CACHE": str(cache)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "eaglebatch.cli", "run", str(job)], env=env,
                         capture_output=True, text=True)  # fmt: skip
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB, the largest child
    if out.returncode == 2 and may_refuse:
        return {"refused": (out.stdout + out.stderr).strip().splitlines()[-1]}
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
    ap.add_argument("--format", default="gguf", choices=["gguf", "bf16", "f16"])
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--kv-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--build-llama", action="store_true",
                    help="build llama-server (benchmarks/llamacpp.py) when none is found")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="eaglebatch-at-scale-") as d:
        tmp = Path(d)
        model = _model(args, tmp)
        result = _measure(args, tmp, model)
    _report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _model(args, tmp: Path) -> Path:
    """--gguf, or a synthetic model of --model-shape in --format written into `tmp`."""
    if args.gguf is not None:
        return args.gguf
    t = time.perf_counter()
    if args.format == "gguf":
        model = write_llama_gguf(tmp / f"{args.model_shape}.gguf", args.model_shape)
    else:
        model = write_llama_safetensors(tmp / args.model_shape, args.model_shape, args.format)
    print(f"wrote {model.name} in {time.perf_counter() - t:.0f} s", flush=True)
    return model


def _measure(args, tmp: Path, model: Path) -> dict:
    kv, cache = args.kv_tokens, tmp / "cache"
    files = [model] if model.is_file() else list(model.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    start = _run(_job(tmp, model, "start", 1, 1, kv), cache)
    cache_bytes = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    warm = _run(_job(tmp, model, "warm", 1, 1, kv), cache)
    decode = _run(_job(tmp, model, "decode", 2, args.max_tokens, kv), cache)
    peak = max(start["peak_rss_mib"], warm["peak_rss_mib"], decode["peak_rss_mib"]) * MIB
    kv_line = next((ln for ln in start["log"].splitlines() if ln.startswith("memory:")), "")
    kv_bytes = _kv_bytes(kv_line)
    result = {
        "model_shape": args.model_shape, "format": args.format, "file_bytes": size,
        "kv_bytes": kv_bytes, "peak_rss_bytes": int(peak),
        "promise_bytes": int((size + kv_bytes) * 1.15), "cache_bytes": cache_bytes,
        "startup_s": start["wall_s"], "warm_startup_s": warm["wall_s"],
        "decode_wall_s": decode["wall_s"], "output_tok_s": _gen_tok_s(decode["log"]),
        "memory_line": kv_line, "llama_cpp_startup_s": None,
    }  # fmt: skip
    if args.format == "gguf":
        result["llama_cpp_startup_s"] = _llama_startup(model, kv, args.build_llama)
    else:  # last: the children's peak is the largest so far
        f32 = _run(_job(tmp, model, "float32", 2, args.max_tokens, kv, "dequantized"), cache,
                   may_refuse=True)  # fmt: skip
        result["float32"] = f32.get("refused") or {
            "peak_rss_bytes": int(f32["peak_rss_mib"] * MIB), "wall_s": f32["wall_s"],
            "output_tok_s": _gen_tok_s(f32["log"])}  # fmt: skip
    return result


def _kv_bytes(line: str) -> int:
    """The KV cache's bytes from the run's `memory:` line ("KV cache 1.00 GiB (...)")."""
    try:
        return int(float(line.split("KV cache ")[1].split(" GiB")[0]) * (1 << 30))
    except (IndexError, ValueError):
        return 0


def _report(r: dict) -> None:
    gib = 1 << 30
    held = r["file_bytes"] + r["kv_bytes"]
    print(f"{r['model_shape']} {r['format']}: file {r['file_bytes'] / gib:.2f} GiB, KV cache "
          f"{r['kv_bytes'] / gib:.2f} GiB, peak resident {r['peak_rss_bytes'] / gib:.2f} GiB "
          f"= file + KV + {(r['peak_rss_bytes'] - held) / gib:.2f} GiB "
          f"({r['peak_rss_bytes'] / held - 1:+.0%}; the goal, within +15%: "
          f"{'met' if r['peak_rss_bytes'] <= r['promise_bytes'] else 'not met'})")
    llama = r["llama_cpp_startup_s"]
    print(f"cache folder {r['cache_bytes'] / MIB:.1f} MiB; start-up to exit (1 prompt, 1 token): "
          f"{r['startup_s']:.1f} s with an empty cache, {r['warm_startup_s']:.1f} s after"
          + (f"; llama-server to healthy {llama:.1f} s" if llama else ""))
    print(f"decode: {r['output_tok_s']} output tok/s (2 prompts), {r['decode_wall_s']:.1f} s "
          f"wall")
    f32 = r.get("float32")
    if isinstance(f32, dict):
        print(f"the same loaded into float32 (engine.weights: dequantized): peak resident "
              f"{f32['peak_rss_bytes'] / gib:.2f} GiB, {f32['output_tok_s']} output tok/s")
    elif f32:
        print(f"the same loaded into float32 (engine.weights: dequantized): {f32}")


if __name__ == "__main__":
    sys.exit(main())

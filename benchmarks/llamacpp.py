"""Measure llama.cpp's generation throughput with ``llama-server`` on a GGUF file.

What it measures: for one GGUF model and a list of prompts, the output tokens
per second that llama.cpp's HTTP server (CPU build) reaches at a given number
of parallel slots, so the figures can be put beside eaglebatch's.

How:

* ``find_llama_server`` locates a ``llama-server`` binary (env var
  ``EAGLEBATCH_LLAMA_SERVER``, then ``PATH``, then a cached build) or builds
  one from the llama.cpp sources vendored in the pinned llama-cpp-python sdist
  (CMake, Release, ``GGML_NATIVE=ON``, CPU only, static libraries).
* ``run_llama_server`` starts the server with ``-np parallel`` slots and a
  context of ``parallel * ctx_per_slot`` tokens, waits for ``GET /health``,
  then sends every prompt to ``POST /completion`` (greedy: temperature 0,
  top_k 1, seed 0, prompt cache off) from a thread pool with at most
  ``parallel`` requests in flight, and summarises the server's per-request
  ``timings`` and the client-side wall time.

Prompts are sent verbatim, as text or as token ids: ``/completion`` applies no
chat template, so the caller passes chat-formatted text or, to give both engines
exactly the same input, the token ids eaglebatch's tokenizer made. Text is
tokenized by the server with special tokens parsed, and a BOS token is added
only when the GGUF's ``tokenizer.ggml.add_bos_token`` is true (SmolLM2's is
false).

Only the standard library is used for running and talking to the server.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
ENV_VAR = "EAGLEBATCH_LLAMA_SERVER"
BINARY = "llama-server"
DESCRIPTION_FILE = "description.txt"
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_HIP=OFF",
    "-DGGML_SYCL=OFF",
    "-DGGML_OPENCL=OFF",
]
# ggml's x86 ISA options by the /proc/cpuinfo flag that enables each (used where AMX is present:
# module doc of `isa_options`)
_ISA_FLAGS = {"GGML_SSE42": "sse4_2", "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_BMI2": "bmi2",
              "GGML_FMA": "fma", "GGML_F16C": "f16c", "GGML_AVX_VNNI": "avx_vnni",
              "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi",
              "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16"}


def isa_options(cpuinfo: str | None = None) -> tuple[list[str], str]:
    """(CMake options, description) of the instruction sets to build for. GGML_NATIVE=ON
    (-march=native) unless the CPU reports AMX: ggml's AMX matmul then crashes (SIGSEGV in
    ggml_backend_amx_mul_mat at the warm-up, seen on a VM with amx_tile/int8/bf16 and the tile
    permission granted), so such hosts build every other x86 extension the CPU reports and no
    AMX (eaglebatch uses no AMX either)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    flags = set(re.findall(r"^flags\s*:\s*(.*)$", cpuinfo, re.M)[0].split()) if re.search(
        r"^flags", cpuinfo, re.M) else set()  # fmt: skip
    if "amx_int8" not in flags:
        return ["-DGGML_NATIVE=ON"], "GGML_NATIVE=ON"
    opts = [f"-D{k}={'ON' if v in flags else 'OFF'}" for k, v in _ISA_FLAGS.items()]
    amx = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    on = [k.removeprefix("GGML_") for k, v in _ISA_FLAGS.items() if v in flags]
    return ["-DGGML_NATIVE=OFF", *opts, *amx], f"GGML_NATIVE=OFF, {'+'.join(on)}, no AMX"


# --------------------------------------------------------------------------
# Finding or building the binary
# --------------------------------------------------------------------------


def cache_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Directory holding the cached build for one llama-cpp-python version."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "eaglebatch" / "llama.cpp" / version


def find_llama_server() -> tuple[Path, str]:
    """Return the ``llama-server`` binary and a one-line note on its origin.

    Order: ``$EAGLEBATCH_LLAMA_SERVER``, ``llama-server`` on ``PATH``, the
    cached build in :func:`cache_dir`, else a fresh build (minutes).
    """
    env = os.environ.get(ENV_VAR)
    if env:
        path = Path(env)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise FileNotFoundError(f"${ENV_VAR}={env} is not an executable file")
        return path, f"from ${ENV_VAR}: {path}"
    on_path = shutil.which(BINARY)
    if on_path:
        return Path(on_path), f"found on PATH: {on_path}"
    cached = cache_dir() / BINARY
    if cached.is_file():
        note = (cache_dir() / DESCRIPTION_FILE).read_text().strip()
        return cached, f"cached build {cached}: {note}"
    return build_llama_server()


def build_llama_server(version: str = LLAMA_CPP_PYTHON_VERSION) -> tuple[Path, str]:
    """Build ``llama-server`` from the sdist and install it into the cache.

    Everything happens in a temporary directory beside the cache directory,
    which is renamed into place only once the binary is complete.
    """
    dest = cache_dir(version)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{version}-") as tmp:
        work = Path(tmp)
        source = _extract_sdist(_download_sdist(version, work / "dl"), work / "src")
        cmake = _ensure_cmake()
        commit = _vendored_commit(source, version)
        binary = _cmake_build(cmake, source / "vendor" / "llama.cpp", work / "build", commit)
        stage = work / "install"
        stage.mkdir()
        shutil.copy2(binary, stage / BINARY)
        note = _build_description(cmake, version, commit)
        (stage / DESCRIPTION_FILE).write_text(note + "\n")
        _install_atomically(stage, dest)
    return dest / BINARY, note


def _run_build_step(cmd: list[str]) -> None:
    """Run one build command, sending its output to stderr (stdout stays clean)."""
    subprocess.run(cmd, check=True, stdout=sys.stderr)


def _download_sdist(version: str, into: Path) -> Path:
    """Fetch the llama-cpp-python sdist with pip (no wheel, no dependencies)."""
    into.mkdir(parents=True)
    # ``--no-binary llama-cpp-python`` rather than ``:all:``: pip still
    # prepares the sdist's metadata, and ``:all:`` would make it compile the
    # build backend's own dependencies (CMake itself) from source first.
    cmd = [
        sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}",
        "--no-binary", "llama-cpp-python", "--no-deps", "-d", str(into),
    ]
    _run_build_step(cmd)
    found = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download left no llama-cpp-python sdist in {into}")
    return found[0]


def _extract_sdist(sdist: Path, into: Path) -> Path:
    """Unpack the sdist and return its top-level source directory."""
    into.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="data")
    roots = [p for p in into.iterdir() if p.is_dir()]
    if len(roots) != 1 or not (roots[0] / "vendor" / "llama.cpp").is_dir():
        raise RuntimeError(f"unexpected sdist layout in {sdist}")
    return roots[0]


def _vendored_commit(source: Path, version: str) -> str:
    """The llama.cpp commit named in the sdist's CHANGELOG for ``version``."""
    changelog = source / "CHANGELOG.md"
    if not changelog.is_file():
        return "unknown"
    text = changelog.read_text(errors="replace")
    section = text.split(f"## [{version}]", 1)[-1].split("\n## [", 1)[0]
    match = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section)
    return match.group(1) if match else "unknown"


def _ensure_cmake() -> str:
    """Path of a ``cmake`` executable, installing the PyPI wheel if absent."""
    found = shutil.which("cmake")
    if found:
        return found
    _run_build_step([sys.executable, "-m", "pip", "install", "cmake"])
    scripts = Path(sys.executable).parent
    found = shutil.which("cmake") or shutil.which("cmake", path=str(scripts))
    if not found:
        raise RuntimeError("cmake was installed with pip but is not on PATH")
    return found


def _cmake_build(cmake: str, llama_dir: Path, build_dir: Path, commit: str) -> Path:
    """Configure llama.cpp and build only the ``llama-server`` target."""
    configure = [cmake, "-S", str(llama_dir), "-B", str(build_dir), *CMAKE_OPTIONS,
                 *isa_options()[0]]
    if commit != "unknown":
        # The sdist has no git history, so tell the build which commit it is.
        configure.append(f"-DLLAMA_BUILD_COMMIT={commit}")
    _run_build_step(configure)
    jobs = str(os.cpu_count() or 1)
    _run_build_step([cmake, "--build", str(build_dir), "--target", BINARY, "-j", jobs])
    binary = build_dir / "bin" / BINARY
    if not binary.is_file():
        raise RuntimeError(f"build finished but {binary} does not exist")
    return binary


def _build_description(cmake: str, version: str, commit: str) -> str:
    """One line saying what was built and how."""
    out = subprocess.run([cmake, "--version"], capture_output=True, text=True)
    cmake_version = out.stdout.split("\n", 1)[0].replace("cmake version ", "")
    return (
        f"built from llama-cpp-python {version} sdist's vendored llama.cpp "
        f"(ggml-org/llama.cpp@{commit}) with CMake {cmake_version}, Release, "
        f"{isa_options()[1]}, CPU only, static"
    )


def _install_atomically(stage: Path, dest: Path) -> None:
    """Rename ``stage`` to ``dest``; a concurrent finished build wins."""
    try:
        stage.rename(dest)
    except OSError:
        if not (dest / BINARY).is_file():
            raise


# --------------------------------------------------------------------------
# Running the server
# --------------------------------------------------------------------------


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _supports_flag(binary: Path, flag: str) -> bool:
    """Whether ``binary --help`` mentions ``flag``."""
    out = subprocess.run(
        [str(binary), "--help"], capture_output=True, text=True, timeout=60
    )
    return re.search(rf"(^|[\s,]){re.escape(flag)}([\s,]|$)", out.stdout + out.stderr) is not None


def _server_command(
    binary: Path, gguf: Path, port: int, parallel: int, threads: int, ctx_per_slot: int
) -> list[str]:
    """Command line for one server run."""
    cmd = [
        str(binary), "-m", str(gguf),
        "-t", str(threads), "-tb", str(threads),
        "-np", str(parallel), "-c", str(parallel * ctx_per_slot),
        "--host", "127.0.0.1", "--port", str(port),
    ]
    if _supports_flag(binary, "-cb"):
        cmd.append("-cb")
    return cmd


def _log_tail(log: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of the server's log."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no server log)"


def _request(port: int, method: str, path: str, body: dict | None = None,
             timeout: float = 600.0) -> tuple[int, bytes]:
    """One HTTP request to the server; returns status and body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    """Poll ``GET /health`` until it answers 200, the server dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"llama-server exited with code {proc.returncode} before it was "
                f"ready; log tail:\n{_log_tail(log)}"
            )
        try:
            status, _ = _request(port, "GET", "/health", timeout=5)
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(
        f"llama-server not healthy after {timeout:.0f}s; log tail:\n{_log_tail(log)}"
    )


def _peak_resident_mib(pid: int) -> float | None:
    """The process's peak resident memory (VmHWM: mapped file pages it touched included), in
    MiB; None where /proc does not say."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmHWM:\s*(\d+) kB", text, re.M)
    return int(m.group(1)) / 1024 if m else None


def _stop(proc: subprocess.Popen) -> None:
    """Terminate the server, killing it if it does not exit promptly."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _complete(port: int, prompt: str | list[int], max_tokens: int,
              ignore_eos: bool = False) -> dict:  # fmt: skip
    """Send one greedy ``/completion`` request (text, or token ids sent as they are); return
    its timings."""
    body = {
        "prompt": prompt, "n_predict": max_tokens, "temperature": 0,
        "top_k": 1, "cache_prompt": False, "seed": 0, "ignore_eos": ignore_eos,
    }
    start = time.perf_counter()
    status, raw = _request(port, "POST", "/completion", body)
    end = time.perf_counter()
    if status != 200:
        raise RuntimeError(f"/completion answered {status}: {raw[:500]!r}")
    timings = json.loads(raw)["timings"]
    record = {key: timings[key] for key in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms")}
    record.update(start=start, end=end, wall_ms=(end - start) * 1000.0)
    return record


def _summarise(records: list[dict], parallel: int, description: str) -> dict:
    """Aggregate per-request records into the result dict."""
    wall_s = max(r["end"] for r in records) - min(r["start"] for r in records)
    output_tokens = sum(r["predicted_n"] for r in records)
    prompt_ms = sum(r["prompt_ms"] for r in records)
    if parallel == 1:
        gen_s = sum(r["predicted_ms"] for r in records) / 1000.0
    else:
        gen_s = wall_s - prompt_ms / parallel / 1000.0
    return {
        "engine": "llama.cpp",
        "parallel": parallel,
        "requests": len(records),
        "prompt_tokens": sum(r["prompt_n"] for r in records),
        "output_tokens": output_tokens,
        "wall_s": wall_s,
        "output_tok_s_wall": output_tokens / wall_s if wall_s > 0 else float("nan"),
        "output_tok_s_gen": output_tokens / gen_s if gen_s > 0 else float("nan"),
        "mean_ttft_ms": prompt_ms / len(records),
        "binary": description,
        "per_request": [{k: v for k, v in r.items() if k not in ("start", "end")} for r in records],
    }


def run_llama_server(
    gguf: Path,
    prompts: list[str] | list[list[int]],
    max_tokens: int,
    parallel: int,
    threads: int = 2,
    ctx_per_slot: int = 1024,
    *,
    binary: tuple[Path, str] | None = None,
    startup_timeout: float = 300.0,
    ignore_eos: bool = False,
) -> dict:
    """Serve ``gguf`` with ``parallel`` slots and time generating for ``prompts``.

    Each prompt is sent verbatim (no chat template) as a greedy ``/completion``
    request for ``max_tokens`` tokens; at most ``parallel`` are in flight.

    Returned keys: ``engine``, ``parallel``, ``requests``, ``prompt_tokens``,
    ``output_tokens`` (sum of the server's ``predicted_n``), ``wall_s`` (first
    request sent to last response received, client side),
    ``output_tok_s_wall`` (output_tokens / wall_s), ``output_tok_s_gen``,
    ``mean_ttft_ms`` (mean of the server's ``prompt_ms``: prompt processing
    time, excluding queueing), ``binary`` (description), ``per_request``,
    ``startup_s`` (start to a healthy server: the model loaded) and
    ``peak_resident_mib`` (the server's VmHWM before it stops).

    ``output_tok_s_gen`` is output_tokens divided by a generation time: for
    ``parallel == 1`` the sum of the server's ``predicted_ms``; for
    ``parallel > 1`` it is ``wall_s - sum(prompt_ms) / parallel / 1000``, i.e.
    wall time minus prompt-processing time as if prompts were processed
    ``parallel`` at a time. It is an estimate: prompt and generation batches
    overlap under continuous batching, and queueing is not subtracted.
    """
    if not prompts:
        raise ValueError("no prompts")
    path, description = binary or find_llama_server()
    port = _free_port()
    cmd = _server_command(path, Path(gguf), port, parallel, threads, ctx_per_slot)
    with tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log") as log_file:
        log = Path(log_file.name)
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, port, log, startup_timeout)
            startup_s = time.monotonic() - started
            with ThreadPoolExecutor(max_workers=parallel) as pool:
                futures = [pool.submit(_complete, port, p, max_tokens, ignore_eos)
                           for p in prompts]
                records = [f.result() for f in futures]
            peak = _peak_resident_mib(proc.pid)
        finally:
            _stop(proc)
    return _summarise(records, parallel, description) | {"startup_s": startup_s,
                                                         "peak_resident_mib": peak}


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def _read_prompts(path: Path) -> list[str]:
    """Prompts from a JSONL file holding one JSON string per line."""
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        value = json.loads(line)
        if not isinstance(value, str):
            raise ValueError(f"{path}:{n}: expected a JSON string")
        prompts.append(value)
    return prompts


def _format_line(result: dict) -> str:
    """One human-readable line per parallel setting."""
    return (
        f"{result['engine']} parallel={result['parallel']} "
        f"requests={result['requests']} output_tokens={result['output_tokens']} "
        f"wall_s={result['wall_s']:.2f} tok/s(wall)={result['output_tok_s_wall']:.1f} "
        f"tok/s(gen)={result['output_tok_s_gen']:.1f} "
        f"mean_ttft_ms={result['mean_ttft_ms']:.1f}"
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--prompts-file", type=Path, help="JSONL, one JSON string per line")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--parallel", type=int, nargs="+", default=[1])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx-per-slot", type=int, default=1024)
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")
    parser.add_argument("--build-only", action="store_true",
                        help="only find or build llama-server; print its path and origin")
    args = parser.parse_args(argv)
    if not args.build_only and (args.gguf is None or args.prompts_file is None):
        parser.error("--gguf and --prompts-file are required unless --build-only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    binary = find_llama_server()
    if args.build_only:
        print(binary[0])
        print(binary[1])
        return 0
    prompts = _read_prompts(args.prompts_file)
    for parallel in args.parallel:
        result = run_llama_server(
            args.gguf, prompts, args.max_tokens, parallel,
            threads=args.threads, ctx_per_slot=args.ctx_per_slot, binary=binary,
        )
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print(_format_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

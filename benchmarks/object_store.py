"""Object storage against a local S3 server (moto, started here on 127.0.0.1): read and write
throughput of a large Parquet input through eaglebatch's object-store layer, beside the same
file on local disk, and a job's wall time from and to S3 beside the same job on local files.

    python benchmarks/object_store.py [--mb 1024] [--rows 64] [--json results.json]

Needs `pip install "moto[server]" boto3`. The local server keeps objects in memory and runs in
Python: its figures bound the layer's overhead from above, not what a cloud store delivers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret",
       "AWS_REGION": "us-east-1"}  # fmt: skip


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(endpoint + "/", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
                 aws_secret_access_key="bench-secret").create_bucket(Bucket="bench")  # fmt: skip
    return proc, endpoint


def big_input(path: Path, mb: int) -> int:
    """A Parquet file of about `mb` MB of incompressible prompt strings; returns its size."""
    rng = np.random.default_rng(0)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789 ", np.uint8)
    rows_per_group, text = 16_384, 4_000
    with pq.ParquetWriter(path, pa.schema([("prompt", pa.string())]), compression="none") as w:
        while not path.exists() or path.stat().st_size < mb * 1e6:
            chars = alphabet[rng.integers(0, len(alphabet), rows_per_group * text)]
            offsets = np.arange(0, (rows_per_group + 1) * text, text, dtype=np.int32)
            arr = pa.StringArray.from_buffers(rows_per_group, pa.py_buffer(offsets),
                                              pa.py_buffer(chars))  # fmt: skip
            w.write_table(pa.table({"prompt": arr}))
    return path.stat().st_size


def throughput(store, local: Path, url: str) -> dict:
    """MB/s: one PUT of the file (as a part is written) vs a local copy with fsync; sequential
    ranged reads through the reader's block cache vs local reads."""
    data = local.read_bytes()
    size = len(data) / 1e6
    t = time.perf_counter()
    store.put(url, data, "create")
    put_s = time.perf_counter() - t
    t = time.perf_counter()
    copy = local.with_suffix(".copy")
    with copy.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    local_write_s = time.perf_counter() - t
    del data
    remote = store.open_file(url)
    t = time.perf_counter()
    pos = 0
    while chunk := remote.read_at(pos, 1 << 20):
        pos += len(chunk)
    get_s = time.perf_counter() - t
    t = time.perf_counter()
    with copy.open("rb") as f:
        while f.read(1 << 20):
            pass
    local_read_s = time.perf_counter() - t
    copy.unlink()
    return {"mb": round(size, 1), "s3_write_mb_s": round(size / put_s, 1),
            "local_write_mb_s": round(size / local_write_s, 1),
            "s3_read_mb_s": round(size / get_s, 1),
            "local_read_mb_s": round(size / local_read_s, 1)}  # fmt: skip


def job_times(store, endpoint: str, tmp: Path, rows: int) -> dict:
    """Wall seconds of one job (builtin model and prompts, `rows` rows, 32 new tokens) from
    and to local files vs from and to S3 (the same input file uploaded); each runs twice,
    alternated, and the second run counts (caches warm for both)."""
    src = tmp / "prompts.parquet"
    pq.write_table(pq.read_table(_sharegpt()).slice(0, rows), src)
    store.put("s3://bench/job/in/prompts.parquet", src.read_bytes(), "create")
    out = {}
    runs = [("local", str(src), str(tmp / "out")), ("s3", "s3://bench/job/in", "s3://bench/job/out")]
    for name, inp, outp in runs * 2:  # alternated; the second of each counts
        job = tmp / f"{name}.yaml"
        job.write_text(
            f"model: smollm2-135m-instruct\ninput:\n  path: {inp}\n  messages_column: messages\n"
            f"  id_column: id\noutput:\n  path: {outp}\n  part_rows: 16\nsampling:\n"
            f"  max_new_tokens: 32\nstorage:\n  endpoint: {endpoint}\n"
        )
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "eaglebatch.cli", "run", str(job), "--restart"],
                       check=True, env={**os.environ, **ENV}, capture_output=True)  # fmt: skip
        out[f"{name}_job_s"] = round(time.perf_counter() - t, 2)
    out["s3_overhead"] = round(out["s3_job_s"] / out["local_job_s"], 3)
    return out


def _sharegpt() -> Path:
    from eaglebatch.job.builtin import sharegpt_parquet

    return sharegpt_parquet()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=1024, help="input size in MB")
    ap.add_argument("--rows", type=int, default=64, help="rows of the job comparison")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    os.environ.update(ENV)
    proc, endpoint = start_moto()
    tmp = Path(tempfile.mkdtemp(prefix="eb-os-bench-"))
    try:
        from eaglebatch import _native

        store = _native.ObjectStore(endpoint, {}, False)
        size = big_input(tmp / "big.parquet", args.mb)
        print(f"input: {size / 1e6:.0f} MB; server: moto on {endpoint}")
        figures = throughput(store, tmp / "big.parquet", "s3://bench/big.parquet")
        (tmp / "big.parquet").unlink()
        figures |= job_times(store, endpoint, tmp, args.rows)
        for k, v in figures.items():
            print(f"{k:>18}: {v}")
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2) + "\n")
    finally:
        proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

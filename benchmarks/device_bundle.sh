#!/usr/bin/env bash
# Builds what the GPU device check carries to a machine with no package index (<= 64 MiB in all,
# the working tree included):
#   py/eaglebatch/_native.abi3.so  the Rust extension (abi3), out of a release wheel; the Python
#          package itself runs from the carried tree (PYTHONPATH=py), so the ~17 MB builtin head
#          travels once, not twice;
#   .whl/  the wheels the device image lacks: pydantic and its parts, and flashinfer-python 0.6.13
#          with apache-tvm-ffi (pure-source kernels JIT-compiled by the device's nvcc; 17 MiB);
#          FLASHINFER="" leaves them out (the check then times the torch backend).
# Then run with carry [".whl", "py/eaglebatch/_native.abi3.so"], from the repository root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && PYTHONPATH=/tmp/site:py PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py \
#     --out $OUT/gpu.json
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl/own
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/eaglebatch-target}" \
    maturin build --release --strip --quiet -o .whl/own
unzip -o -q -j .whl/own/eaglebatch-*.whl 'eaglebatch/_native.abi3.so' -d py/eaglebatch
rm -rf .whl/own
dl() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d .whl "$@"
}
dl pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
FLASHINFER="${FLASHINFER-flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2}"
if [ -n "$FLASHINFER" ]; then
    # shellcheck disable=SC2086
    dl $FLASHINFER
fi
du -ch .whl/* py/eaglebatch/_native.abi3.so | tail -n 1
size=$(du -cb .whl/* py/eaglebatch/_native.abi3.so | tail -n 1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
echo "carried: $(((size + tree) / 1048576)) MiB (tracked tree $((tree / 1048576)) MiB)"
if [ $((size + tree)) -gt $((62 * 1024 * 1024)) ]; then
    echo "device_bundle: over the device's 64 MiB per call" >&2
    exit 1
fi

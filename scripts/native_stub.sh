#!/usr/bin/env bash
# The stub check (.ci/run, after scripts/test.sh installed the extension): this checkout's
# py/eaglebatch/_native.pyi against the built extension, recursively through its classes, by
# mypy's stubtest. It fails naming each name the stub lacks ("X is not present in stub"), each
# name only the stub has ("X is not present at runtime") and each signature that differs.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "mypy==2.4.1"
# MYPYPATH: the stub read is the checkout's; the extension imported is the one Python finds
MYPYPATH=py python -m mypy.stubtest eaglebatch._native \
    --allowlist scripts/native_stub_allowlist.txt

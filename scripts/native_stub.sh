#!/usr/bin/env bash
# The stub check (.ci/run, after scripts/test.sh installed this checkout): _native.pyi against
# the built extension, recursively through its classes, by mypy's stubtest. It fails naming
# each name the stub lacks ("X is not present in stub"), each name only the stub has ("X is not
# present at runtime") and each signature that differs.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "mypy==2.4.1"
# The package as Python finds it (installed, or PYTHONPATH=py): its stub and its extension; mypy
# checks the rest of the package only as far as the stub's imports need, silently (an installed
# package's errors are not this check's)
python -m mypy.stubtest eaglebatch._native --allowlist scripts/native_stub_allowlist.txt

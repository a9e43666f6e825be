"""Lists library functions longer than a limit (default 60 lines), Python and Rust, tests
excluded; exits 1 when any is found outside the named SIMD kernels (docs/architecture.md).

    python scripts/long_functions.py [--limit 60]
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# SIMD kernel bodies whose splitting would cost speed (see docs/architecture.md): the AVX-512
# and AVX2 copies of the multi-row paged-attention kernel, and of the small GEMM's register
# tile (its accumulators must stay in registers across the whole k loop).
KERNELS: set[tuple[str, str]] = {("rust/src/cpu/paged_attention.rs", "heads"),
                                 ("rust/src/cpu/small_gemm.rs", "tile")}  # fmt: skip


def python_functions(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            yield node.name, start, node.end_lineno - start + 1


_RUST_FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(unsafe\s+)?(extern\s+\"C\"\s+)?fn\s+(\w+)")


def rust_functions(path: Path):
    """`fn` items by brace matching (strings and comments with braces are rare enough in this
    code base; a test module is skipped from `#[cfg(test)]` on)."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip().startswith("#[cfg(test)]"):
            return
        m = _RUST_FN.match(lines[i])
        if not m:
            i += 1
            continue
        depth, j, opened = 0, i, False
        while j < len(lines):
            code = lines[j].split("//")[0]
            depth += code.count("{") - code.count("}")
            opened = opened or "{" in code
            if opened and depth <= 0 or (not opened and code.rstrip().endswith(";")):
                break
            j += 1
        yield m.group(5), i + 1, j - i + 1
        i = j + 1


def long_functions(limit: int):
    for path in sorted((ROOT / "py").rglob("*.py")):
        for name, line, n in python_functions(path):
            if n > limit:
                yield path.relative_to(ROOT), name, line, n
    for path in sorted((ROOT / "rust" / "src").rglob("*.rs")):
        if path.name == "tests.rs" or path.name == "testutil.rs":
            continue
        for name, line, n in rust_functions(path):
            if n > limit:
                yield path.relative_to(ROOT), name, line, n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=60)
    args = ap.parse_args()
    found = sorted(long_functions(args.limit), key=lambda f: -f[3])
    bad = [f for f in found if (str(f[0]), f[1]) not in KERNELS]
    for path, name, line, n in found:
        tag = " (SIMD kernel)" if (str(path), name) in KERNELS else ""
        print(f"{n:4d}  {path}:{line}  {name}{tag}")
    print(f"{len(found)} function(s) over {args.limit} lines, {len(bad)} outside the kernels")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

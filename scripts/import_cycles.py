"""Fails (exit 1) when py/eaglebatch's import graph has a loop or an unexplained lazy import:

- modules importing each other in a loop, counting imports inside functions too (a loop hidden
  in a function is still a loop a reader must follow);
- wings importing each other in a loop (a wing is a subpackage such as `job/` or `output/`, or a
  root module), so every import between wings points one way, from a higher layer down;
- an import of the package's own modules inside a function whose module, with what it imports at
  its top, pulls in nothing heavy (torch, numpy, pyarrow, the extension, an optional extra): such
  an import belongs at the top of the file. A lazy import that is heavy must carry a reason, as
  a comment on its line or on the line above (one comment serves a run of lazy imports).

    python scripts/import_cycles.py

The edges are `import eaglebatch.x`, `from eaglebatch.x import y` and relative imports.
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "py"


def modules() -> dict[str, Path]:
    out = {}
    for f in sorted((ROOT / "eaglebatch").rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imported(name: str, f: Path, node: ast.ImportFrom | ast.Import, known) -> set[str]:
    """The package's modules one import statement of module `name` (file `f`) names."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if node.level:
        base = name.split(".")
        if f.name != "__init__.py":
            base = base[:-1]
        base = base[: len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = {f"{target}.{a.name}" for a in node.names} & known
    return found or ({target} & known)


def edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph = {}
    for name, f in mods.items():
        nodes = ast.walk(ast.parse(f.read_text()))
        graph[name] = set().union(*(imported(name, f, n, mods.keys()) for n in nodes
                                    if isinstance(n, (ast.Import, ast.ImportFrom))))
        graph[name].discard(name)
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while (w := stack.pop()) != node:
                        on.discard(w)
                        comp.append(w)
                    on.discard(node)
                    if comp:
                        out.append(sorted([node, *comp]))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on:
                low[node] = min(low[node], index[child])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


HEAVY = {"torch", "numpy", "pyarrow", "eaglebatch._native", "ray", "transformers", "flashinfer",
         "safetensors", "gguf", "datasets", "lm_eval", "rich"}


def wing(module: str) -> str:
    """`eaglebatch.job.config` -> `eaglebatch.job`; root modules are wings of their own."""
    return ".".join(module.split(".")[:2])


def wing_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {wing(m): set() for m in graph}
    for a, targets in graph.items():
        out[wing(a)] |= {wing(b) for b in targets if wing(b) != wing(a)}
    return out


def top_imports(f: Path, name: str, known) -> tuple[set[str], set[str]]:
    """(package modules, other top-level names) imported at the top of module `name`."""
    body = [n for n in ast.parse(f.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
    own = set().union(*(imported(name, f, n, known) for n in body))
    other = {a.name.split(".")[0] for n in body if isinstance(n, ast.Import) for a in n.names}
    other |= {(n.module or "").split(".")[0] for n in body if isinstance(n, ast.ImportFrom)
              and not n.level}
    other |= {"eaglebatch._native" for n in body if names_native(n)}
    return own, other


def lazy_import_faults(mods: dict[str, Path]) -> list[str]:
    @cache
    def heavy(name: str) -> bool:
        own, other = top_imports(mods[name], name, mods.keys())
        return bool(other & HEAVY) or any(heavy(m) for m in own if m != name)

    faults = []
    for name, f in mods.items():
        lines = f.read_text().splitlines()
        for node in lazy_imports(ast.parse("\n".join(lines))):
            targets = imported(name, f, node, mods.keys())
            names = {a.name for a in node.names} if isinstance(node, ast.Import) else set()
            if names_native(node):
                targets = set()
            elif not targets and not names & HEAVY:
                continue
            where = f"{f.relative_to(ROOT)}:{node.lineno}"
            if targets and not any(heavy(m) for m in targets):
                faults.append(f"{where}: lazy import of {sorted(targets)} pulls nothing heavy:"
                              " import it at the top")
            elif not _explained(lines, node.lineno - 1):
                faults.append(f"{where}: lazy import without a reason (a comment on its line "
                              "or above)")
    return faults


def lazy_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements inside the module's functions, each once (a nested function's
    are inside its enclosing one too)."""
    found = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found |= {id(n): n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return sorted(found.values(), key=lambda n: n.lineno)


def names_native(node: ast.Import | ast.ImportFrom) -> bool:
    """`from eaglebatch import _native`, `from eaglebatch._native import x` or `import
    eaglebatch._native`: the extension (heavy)."""
    if isinstance(node, ast.ImportFrom):
        return node.module == "eaglebatch._native" or (
            node.module == "eaglebatch" and any(a.name == "_native" for a in node.names))
    return any(a.name == "eaglebatch._native" for a in node.names)


def _explained(lines: list[str], i: int) -> bool:
    """A comment on line i, or on the nearest line above that is not a lazy import."""
    while True:
        if "#" in lines[i]:
            return True
        i -= 1
        if i < 0 or not lines[i].strip().startswith(("from ", "import ")):
            return i >= 0 and lines[i].strip().startswith("#")


def main() -> int:
    mods = modules()
    graph = edges(mods)
    found = loops(graph) + loops(wing_edges(graph))
    for comp in found:
        print("import loop: " + " <-> ".join(comp))
    faults = lazy_import_faults(mods)
    print("\n".join(faults))
    print(f"{len(found)} import loop(s), {len(faults)} lazy import fault(s) in py/eaglebatch")
    return 1 if found or faults else 0


if __name__ == "__main__":
    sys.exit(main())

"""Fails (exit 1) when modules of py/eaglebatch import each other in a loop, counting imports
inside functions too (a loop hidden in a function is still a loop a reader must follow).

    python scripts/import_cycles.py

Prints each loop as its modules; the edges are `import eaglebatch.x`, `from eaglebatch.x import
y` and relative imports, wherever they stand.
"""

from __future__ import annotations

import ast
import sys
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


def main() -> int:
    found = loops(edges(modules()))
    for comp in found:
        print("import loop: " + " <-> ".join(comp))
    print(f"{len(found)} import loop(s) in py/eaglebatch")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

"""Fails (exit 1) when rust/src's module graph has a cycle, printing each one (a strongly
connected component); the same for its wings, each module collapsed to its top-level one
(`cpu::quant` -> `cpu`), so that every edge between wings points one way.

- Nodes: module files (`a.rs` or `a/mod.rs` is `a`, `a/b.rs` is `a::b`, lib.rs is `crate`); an
  inline `mod x { ... }` is part of its file's module.
- Edges: a -> b for each path in a's code naming b: `crate::b::...`, `super::` and `self::`
  paths resolved from a, `b::...` for a child b of a; `use` groups are expanded. A path stands
  for the longest module it starts with. A module naming its own ancestor is no edge: that is
  the parent's code split across files (rust/src/scheduler/*.rs name `super::Scheduler`).
- Test code is left out: `#[cfg(test)]` items, the modules declared under it, testutil.rs.

    python scripts/rust_module_cycles.py
"""

import re
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "rust" / "src"
NOISE = re.compile(  # comments, strings and chars: braces and paths in them are not code
    r"//[^\n]*|/\*.*?\*/|b?r(#*)\".*?\"\1|b?\"(?:\\.|[^\"\\])*\"|b?'(?:\\.|[^\\'\n])'", re.S)
PATH = re.compile(r"(?<![\w:])\w+(?:::\w+)+")
USE = re.compile(r"\buse\s+([^;]+);")
INLINE_MOD = re.compile(r"\bmod\s+\w+\s*\{")
DEPTH = {"{": 1, "(": 1, "[": 1, "}": -1, ")": -1, "]": -1}


def item_end(code: str, i: int) -> int:
    """The index after the item starting at i: its `;`, or its braces when they open first."""
    depth = 0
    for j in range(i, len(code)):
        depth += DEPTH.get(code[j], 0)
        if code[j] in ";}" and depth == 0:
            return j + 1
    return len(code)


def modules() -> dict[str, str]:
    """Module name -> code (without comments, literals and test items), for non-test modules."""
    found = {}
    for f in sorted(SRC.rglob("*.rs")):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        code = NOISE.sub('""', f.read_text())
        while (i := code.find("#[cfg(test)]")) >= 0:
            code = code[:i] + code[item_end(code, i):]
        found["::".join(parts[:-1] if parts[-1] == "mod" or parts == ["lib"] else parts)] = code
    declared = {""} | {f"{m}::{c}".lstrip(":") for m, code in found.items()
                       for c in re.findall(r"\bmod\s+(\w+)\s*;", code)}
    return {m: code for m, code in found.items() if m in declared and m != "testutil"}


def use_paths(tree: str) -> list[str]:
    """`a::{b, c::{self, d as e}}` -> ['a::b', 'a::c', 'a::c::d']."""
    tree = re.sub(r"\s+as\s+\w+$", "", re.sub(r"\s+", " ", tree.strip()))
    if not tree.endswith("}"):
        return [tree.removesuffix("::self")]
    head, _, body = tree[:-1].partition("{")
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(body + ","):
        depth += DEPTH.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(body[start:i].strip())
            start = i + 1
    return [p for part in parts if part for p in use_paths(head + part)]


def resolve(path: list[str], here: str, inline: int, mods) -> str | None:
    """The module `path` stands for in module `here`, at a place `inline` inline modules deep."""
    base = here.split("::") if here else []
    if path[0] == "crate":
        base, path = [], path[1:]
    elif path[0] in ("self", "super"):
        path = path[1:] if path[0] == "self" else path
        ups = next((i for i, p in enumerate(path) if p != "super"), len(path))
        base, path = base[: len(base) - max(ups - inline, 0)], path[ups:]
    elif "::".join(base + path[:1]) not in mods:
        return None  # another crate's path, or a type's (`Kind::Int`)
    return next(n for k in range(len(path), -1, -1)
                if (n := "::".join(base + path[:k])) in mods or not n)


def edges(mods: dict[str, str]) -> dict[str, set[str]]:
    graph = {m: set() for m in mods}
    for here, code in mods.items():
        spans = [(m.start(), item_end(code, m.start())) for m in INLINE_MOD.finditer(code)]
        found = [(u.start(), p) for u in USE.finditer(code) for p in use_paths(u.group(1))]
        rest = USE.sub(lambda u: " " * len(u.group()), code)
        found += [(p.start(), p.group()) for p in PATH.finditer(rest)]
        for at, path in found:
            inline = sum(a <= at < b for a, b in spans)
            target = resolve(path.split("::"), here, inline, mods)
            if target is not None and not f"{here}::".startswith(f"{target}::".lstrip(":")):
                graph[here].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node: nodes that reach each other."""
    reach = {}
    for v in graph:
        seen, todo = set(), list(graph[v])
        while todo:
            if (w := todo.pop()) not in seen:
                seen.add(w)
                todo.extend(graph[w])
        reach[v] = seen
    comps = {tuple(sorted(w for w in reach[v] if v in reach[w])) for v in graph if v in reach[v]}
    return sorted(list(c) for c in comps if len(c) > 1)


def main() -> int:
    graph = edges(modules())
    wings: dict[str, set[str]] = {}
    for a, targets in graph.items():
        wing = a.split("::")[0]
        wings.setdefault(wing, set()).update({b.split("::")[0] for b in targets} - {wing})
    found = [("module", c) for c in cycles(graph)] + [("wing", c) for c in cycles(wings)]
    for kind, comp in found:
        print(f"{kind} cycle: " + " <-> ".join(m or "crate" for m in comp))
    print(f"{len(found)} cycle(s) among the {len(graph)} modules of rust/src (tests left out)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

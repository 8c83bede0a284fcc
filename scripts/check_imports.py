"""Check kdnctl's import graph: no import cycles, imports point down the layers of
docs/architecture.md (both counting imports inside functions; imports for type checkers only
are left out), no private names imported across modules, modules under 500 lines. Prints the
problems; exit status 1 when there are any.

    python scripts/check_imports.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kdnctl"

# Lower number = lower layer; a module may import its own layer or lower ones.
LAYERS = [
    ("errors",),
    ("registry", "versions", "format", "store", "models"),
    ("engine.attention", "engine.prefill", "scorers", "presses", "allocate", "quant", "kernels"),
    ("ingest", "compress", "steer", "engine", "server", "export"),
    ("evaluation", "recipes", "distributed"),
    ("cli",),
]
# Known exceptions (source layer, target layer) -> reason. Empty: every import points down.
ALLOWED: dict[tuple[str, str], str] = {}


def layer_of(mod: str) -> int:
    """Layer of a module path below kdnctl (``engine.prefill``): its longest listed prefix's."""
    parts = mod.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        for i, names in enumerate(LAYERS):
            if name in names:
                return i
    return -1


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path) -> list[tuple[str, list[str], bool]]:
    """(imported module, names, at module level) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    top_level = {id(n) for n in tree.body}
    typing_only = set()  # imports under ``if TYPE_CHECKING:`` run for type checkers only
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            out.append((target, names, id(node) in top_level))
        elif isinstance(node, ast.Import):
            for a in node.names:
                out.append((a.name, [], id(node) in top_level))
    return out


def find_problems() -> list[str]:
    problems = []
    graph: dict[str, set[str]] = {}
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    for mod, path in sorted(modules.items()):
        src_top = mod.split(".")[1] if "." in mod else "__init__"
        for target, names, top_level in imports(path):
            if not target.startswith("kdnctl"):
                continue
            # "from kdnctl.x import y" may import a submodule y; private names may be shared
            # inside one package (kdnctl/store/*), not across packages
            for n in names or [""]:
                sub = f"{target}.{n}" if n and f"{target}.{n}" in modules else target
                if sub in modules and sub != mod:
                    graph.setdefault(mod, set()).add(sub)
                parts = sub.split(".")  # "from . import sizing" imports kdnctl.compress.sizing
                dst_top = parts[1] if len(parts) > 1 else "__init__"
                if n.startswith("_") and not n.startswith("__") and src_top != dst_top:
                    problems.append(f"{mod}: imports private name {n} from {target}")
                if dst_top in ("__init__",) or src_top == dst_top:
                    continue
                ls, ld = layer_of(mod.split(".", 1)[1]), layer_of(".".join(parts[1:]))
                if 0 <= ls < ld and (src_top, dst_top) not in ALLOWED:
                    problems.append(f"{mod}: imports upward from {sub} (layer {ld} > {ls})")
    # import cycles, function-level imports included (Tarjan's SCC)
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    problems += [f"import cycle: {' -> '.join(c)}" for c in sccs]
    tops = {m.split(".")[1] for m in modules if "." in m}
    problems += [f"kdnctl.{t}: not in a layer of LAYERS (place it in docs/architecture.md and here)"
                 for t in sorted(tops) if layer_of(t) < 0]
    long = [(m, len(p.read_text().splitlines())) for m, p in modules.items()]
    problems += [f"{m}: {n} lines (> 500)" for m, n in long if n > 500]
    return list(dict.fromkeys(problems))


def main() -> int:
    problems = find_problems()
    for p in problems:
        print(p)
    print(f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

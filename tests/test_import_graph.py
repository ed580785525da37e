"""No import circles in pagedserve: the graph of `import` / `from ... import` statements between
its modules (read with ast, so every import counts: top-level, inside functions and under
TYPE_CHECKING alike) has no cycle. A module that needs a name only for typing takes it from a
small types module (engine/inflight.py, runner/step_input.py, runner/runner_view.py), not from
the module that imports it.

`from pkg import name` counts as importing pkg.name when that is a module, else pkg; a package's
own __init__ importing its submodules is not a circle with them (Python runs it first anyway).
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "pagedserve"
# Nothing is excluded: the serving circle (api_server -> serving/launch -> ... -> api_server) is gone
# since #38 (tests/serving/test_serving_imports.py also checks imports inside functions there).
EXCLUDED_PREFIXES: tuple[str, ...] = ()


def module_files() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def imported(mod: str, path: Path, node: ast.AST, mods: dict) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in mods}
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    out = set()
    for a in node.names:
        full = f"{prefix}.{a.name}"
        out.add(full if full in mods else prefix)
    return {m for m in out if m in mods}


def import_graph() -> dict[str, set[str]]:
    mods = module_files()
    graph = {}
    for mod, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= imported(mod, path, node, mods)
        # A package's __init__ importing its own submodules runs before them: not a circle.
        graph[mod] = {d for d in deps if d != mod and not (path.name == "__init__.py" and d.startswith(mod + "."))}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter; counter += 1
        stack.append(root); on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter; counter += 1
                    stack.append(w); on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on_stack.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_reads_the_edges_that_replaced_the_circles():
    graph = import_graph()
    # The two circles #37 named, broken through small types modules.
    assert "pagedserve.runner.step_input" in graph["pagedserve.runner.warmup"]
    assert "pagedserve.engine.inflight" in graph["pagedserve.engine.token_application"]


def test_no_import_circles():
    graph = {m: {d for d in ds if not d.startswith(EXCLUDED_PREFIXES)}
             for m, ds in import_graph().items() if not m.startswith(EXCLUDED_PREFIXES)}
    assert cycles(graph) == []

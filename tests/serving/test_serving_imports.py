"""The serving side imports in one direction: no module of pagedserve/serving or
pagedserve/entrypoints/openai reaches itself again through imports, whether at the top of a file
or inside a function (a lazy import is still a dependency). Imports under `if TYPE_CHECKING:`
are typing only and not counted. (Issue #37: api_server -> serving/launch -> frontend / ray_app /
relay_worker -> api_server was such a circle; the package's other circles are another branch's.)
"""
from __future__ import annotations

import ast
from pathlib import Path

import pagedserve

ROOT = Path(pagedserve.__file__).resolve().parent
SCOPE = ("serving", "entrypoints/openai")


def _modules() -> dict[str, Path]:
    out = {}
    for folder in SCOPE:
        for path in sorted((ROOT / folder).glob("*.py")):
            parts = ["pagedserve", *folder.split("/")]
            if path.stem != "__init__":
                parts.append(path.stem)
            out[".".join(parts)] = path
    return out


def _typing_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, package: str) -> set[str]:
    """Every module name path imports (absolute; relative ones resolved against package)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _typing_only(node):
            return
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(ast.parse(path.read_text()))
    return names


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
        graph[name] = {m for m in _imports(path, package) if m in mods and m != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = dfs(node)
            if found:
                return found
    return None


def test_the_checker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_serving_modules_have_no_import_cycle():
    graph = _graph()
    assert "pagedserve.serving.launch" in graph and "pagedserve.entrypoints.openai.api_server" in graph
    assert "pagedserve.entrypoints.openai.api_server" in graph["pagedserve.serving.launch"]
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_api_server_does_not_import_its_launcher():
    graph = _graph()
    assert not any(m.startswith("pagedserve.serving") for m in graph["pagedserve.entrypoints.openai.api_server"])

"""Imports point one way (DESIGN.md, "Layout"), read statically from the source.

    deploy -> replicas -> replicas.speculation -> native module
    autoscaling -> replicas.stats, replicas.speculation.{gate,ranking}
    nothing imports deploy but Serve; training and benchmarks may import anything,
    nothing imports them

Every import statement of every file under the scanned packages counts, wherever it stands
(module level, inside a function, under `TYPE_CHECKING`), relative imports resolved. What
importing a module loads at run time (torch, Ray, the native module) is checked separately:
tests/autoscaling/test_import_purity.py, and the router's and ranking's import tests.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("deploy", "replicas", "autoscaling", "training", "benchmarks")
TOOLS = ("training", "benchmarks")  # not shipped: may import anything

# (importers, imported, why): no module within the first may import a module within the second
FORBIDDEN = [
    *((runtime, tool, "nothing imports training or benchmarks")
      for runtime in ("deploy", "replicas", "autoscaling") for tool in TOOLS),
    ("replicas", "deploy", "nothing imports deploy but Serve"),
    ("autoscaling", "deploy", "nothing imports deploy but Serve"),
    ("replicas", "autoscaling", "replicas never imports autoscaling"),
    *(("replicas.speculation", engine, "replicas.speculation is engine-agnostic")
      for engine in ("replicas.torch_engine", "replicas.trtllm", "replicas.trtllm_engine", "replicas.replica")),
]
# importers -> the only project modules they may import (each with its submodules)
ONLY = {
    "autoscaling": ("autoscaling", "replicas.stats", "replicas.speculation.gate", "replicas.speculation.ranking"),
}


@dataclass(frozen=True)
class Edge:
    importer: str  # dotted module names
    imported: str
    where: str  # path:line of the import statement

    def __str__(self) -> str:
        return f"{self.where}: {self.importer} -> {self.imported}"


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).parts)
    parts[-1] = parts[-1].split(".")[0]  # suffixes, including an extension's `.cpython-311-...so`
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=1)
def _modules() -> dict[str, Path]:
    """Every Python module of the scanned packages, plus native extensions (import targets only)."""
    found = {}
    for top in SCANNED:
        for pattern in ("*.py", "*.so"):
            for path in sorted((ROOT / top).rglob(pattern)):
                if "__pycache__" not in path.parts:
                    found[_module_name(path)] = path
    return found


def _resolve(module: Optional[str], level: int, importer: str, is_package: bool) -> str:
    """The absolute module name of `from <level dots><module> import ...` in `importer`."""
    if level == 0:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _edges_of(name: str, path: Path) -> list[Edge]:
    known = _modules()
    tree = ast.parse(path.read_text(), filename=str(path))
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node.module, node.level, name, path.name == "__init__.py")
            # `from pkg import sub` imports the submodule when there is one, else a name of pkg
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        where = f"{path.relative_to(ROOT)}:{node.lineno}"
        edges += [Edge(name, t, where) for t in dict.fromkeys(targets) if t.split(".")[0] in SCANNED and t != name]
    return edges


@lru_cache(maxsize=1)
def _all_edges() -> tuple[Edge, ...]:
    return tuple(e for name, path in _modules().items() if path.suffix == ".py" for e in _edges_of(name, path))


def _violation(importer: str, imported: str) -> Optional[str]:
    """Why this import breaks the direction, or None."""
    for importers, forbidden, why in FORBIDDEN:
        if _within(importer, importers) and _within(imported, forbidden):
            return why
    for importers, allowed in ONLY.items():
        if _within(importer, importers) and not any(_within(imported, a) for a in allowed):
            return f"{importers} imports from the project only {', '.join(allowed)}"
    return None


def _cycles(edges: tuple[Edge, ...]) -> list[list[Edge]]:
    """One cycle (as its edges) per strongly connected component of more than one module."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        graph.setdefault(e.importer, {}).setdefault(e.imported, e)
    return [_shortest_cycle(graph, component) for component in _components(graph)]


def _components(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _shortest_cycle(graph: dict[str, dict[str, Edge]], component: list[str]) -> list[Edge]:
    """Breadth-first from the component's first module back to itself, inside the component."""
    start, members = component[0], set(component)
    came_by: dict[str, Edge] = {}  # module -> the edge it was first reached by
    frontier = [start]
    while start not in came_by:
        reached = []
        for v in frontier:
            for w, e in graph.get(v, {}).items():
                if w in members and w not in came_by:
                    came_by[w] = e
                    reached.append(w)
        frontier = reached
    path = [came_by[start]]
    while path[-1].importer != start:
        path.append(came_by[path[-1].importer])
    return path[::-1]


# --- the checker itself, on known cases -----------------------------------------------------

RULES = [
    # (importer, imported, breaks the direction)
    ("deploy.router", "replicas.speculation.ranking", False),
    ("deploy.config_check", "autoscaling.decision", False),
    ("benchmarks.serve", "deploy.config", False),
    ("benchmarks.datasets", "training.corpora", False),
    ("training.mtp_train", "replicas.torch_engine.mtp", False),
    ("replicas.torch_engine.engine", "replicas.speculation.hybrid", False),
    ("replicas.speculation.suffix", "replicas.speculation._sa_native", False),
    ("autoscaling.fleet", "replicas.speculation.gate", False),
    ("autoscaling.simulate", "deploy.ranking", True),
    ("autoscaling.policy", "replicas.engine", True),
    ("autoscaling.policy", "replicas.speculation.suffix", True),
    ("replicas.replica", "deploy.config", True),
    ("replicas.torch_engine.engine", "training.corpora", True),
    ("deploy.app", "benchmarks.datasets", True),
    ("replicas.speculation.hybrid", "replicas.torch_engine.mtp", True),
    ("replicas.speculation.gate", "replicas.trtllm_engine", True),
    ("replicas.stats", "autoscaling.decision", True),
]


@pytest.mark.parametrize("importer,imported,breaks", RULES, ids=[f"{a}->{b}" for a, b, _ in RULES])
def test_the_rules(importer, imported, breaks):
    assert (_violation(importer, imported) is not None) is breaks


def test_cycles_are_found_with_their_path():
    e = [Edge("a", "b", "a.py:1"), Edge("b", "c", "b.py:2"), Edge("c", "a", "c.py:3"), Edge("c", "d", "c.py:4")]
    (cycle,) = _cycles(tuple(e))
    assert [x.importer for x in cycle] == ["a", "b", "c"]
    assert _cycles(tuple(e[:2] + e[3:])) == []


def test_relative_imports_resolve():
    assert _resolve("gate", 1, "replicas.speculation.ranking", False) == "replicas.speculation.gate"
    assert _resolve(None, 1, "replicas.speculation", True) == "replicas.speculation"
    assert _resolve("stats", 2, "replicas.speculation.ranking", False) == "replicas.stats"


def test_the_scan_sees_every_kind_of_import():
    edges = {(e.importer, e.imported) for e in _all_edges()}
    assert ("deploy.router", "replicas.speculation.ranking") in edges  # module level
    assert ("deploy.config_check", "autoscaling.decision") in edges  # inside a function
    assert ("replicas.speculation.suffix", "replicas.speculation._sa_native") in edges  # `from pkg import sub`
    assert ("benchmarks.drafters", "benchmarks.datasets") in edges  # a namespace package


# --- the project -----------------------------------------------------------------------------

def test_imports_point_one_way():
    bad = [f"{e}  ({why})" for e in _all_edges() if (why := _violation(e.importer, e.imported))]
    assert not bad, "imports against the direction in DESIGN.md:\n" + "\n".join(bad)


def test_no_import_cycles_between_modules():
    cycles = _cycles(_all_edges())
    text = ["  " + " -> ".join([c[0].importer] + [e.imported for e in c]) + "\n"
            + "".join(f"      {e}\n" for e in c) for c in cycles]
    assert not cycles, "modules that import each other (through these edges):\n" + "".join(text)

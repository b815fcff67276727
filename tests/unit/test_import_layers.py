"""Tier 1: epcomm's modules import each other without a cycle.

Every ``.py`` under ``src/epcomm`` is parsed with ``ast`` (nothing is imported); each ``import`` or
``from ... import`` naming an epcomm module is an edge, wherever it stands: at module level, inside a
function (a lazy import is still a dependency), or under ``TYPE_CHECKING``. ``from .x import name``
points at ``x.name`` when that is a module, else at ``x``; a package's ``__init__`` is its own node.

Example: ``backends/nvlink_ll.py`` doing ``from .nvlink import TIMER`` while ``backends/nvlink.py``
imports ``nvlink_ll`` is the cycle ``epcomm.backends.nvlink -> epcomm.backends.nvlink_ll ->
epcomm.backends.nvlink``.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "epcomm"


def module_names(src: Path = SRC) -> dict[str, Path]:
    """``{"epcomm.backends.nvlink": path, "epcomm.backends": .../__init__.py, ...}``."""
    out = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted ``name`` that is one of ``modules``."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in modules:
            return cand
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The epcomm modules that ``module`` (at ``path``) imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    # the package a relative import of level 1 starts from
    base = module.split(".") if is_package else module.split(".")[:-1]
    deps = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                stem = ".".join(anchor + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import sub` imports the module pkg.sub when there is one, else pkg's name
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
        for t in targets:
            if t.split(".")[0] != PACKAGE:
                continue
            dep = _resolve(t, modules)
            if dep is not None and dep != module:
                deps.add(dep)
    return deps


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    modules = module_names(src)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), each written as
    a path ``a -> b -> ... -> a`` through that component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(comp, graph) for comp in comps]


def _cycle_in(comp: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A closed path inside one strongly connected component, from its first module by name."""
    start = min(comp)
    path, seen, v = [start], {start}, start
    while True:
        v = min(w for w in graph[v] if w in comp)  # every node of an SCC has a successor inside it
        if v in seen:
            return path[path.index(v):] + [v]
        path.append(v)
        seen.add(v)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import A\n",
        "a.py": "import epcomm.b\nA = 1\n",
        "b.py": "def f():\n    from .sub import c\n    return c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from ..a import A\nfrom . import d\nimport torch\n",
        "sub/d.py": "from epcomm.sub.c import x\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph == {
        "epcomm": {"epcomm.a"},
        "epcomm.a": {"epcomm.b"},
        "epcomm.b": {"epcomm.sub.c"},  # a function-level import counts
        "epcomm.sub": set(),
        "epcomm.sub.c": {"epcomm.a", "epcomm.sub.d"},
        "epcomm.sub.d": {"epcomm.sub.c"},
    }
    cycles = find_cycles(graph)
    assert sorted(cycles) == [
        ["epcomm.a", "epcomm.b", "epcomm.sub.c", "epcomm.a"],
    ]


def test_find_cycles_names_each_tangle_once():
    graph = {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.d"}, "p.d": {"p.e"}, "p.e": {"p.c"}, "p.f": {"p.a"}}
    assert sorted(find_cycles(graph)) == [["p.a", "p.b", "p.a"], ["p.c", "p.d", "p.e", "p.c"]]
    assert find_cycles({"p.a": {"p.b"}, "p.b": set()}) == []


def test_epcomm_has_no_import_cycle():
    graph = import_graph()
    assert "epcomm.buffer" in graph and "epcomm.backends.nvlink" in graph  # the parse found the package
    cycles = find_cycles(graph)
    assert not cycles, "import cycles inside epcomm:\n" + "\n".join(" -> ".join(c) for c in cycles)

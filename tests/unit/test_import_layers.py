"""Tier 1: epcomm's modules import each other without a cycle, and only downwards (docs/architecture.md).

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

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "epcomm"

# The layers of docs/architecture.md, lowest first; a module may import its own layer and the ones
# below. A module is in the layer of the longest name here that is it or a package holding it.
LAYERS = {
    # 0, bottom: pure torch math, configuration, argument checks, the environment
    "epcomm._env": 0, "epcomm.config": 0, "epcomm.event": 0, "epcomm.layout": 0, "epcomm.quant": 0,
    "epcomm._validate": 0, "epcomm.streams": 0, "epcomm.elastic_layout": 0, "epcomm.native": 0,
    "epcomm.kernels": 1,
    "epcomm.backends": 2,
    # 3: the Buffer and the API over it
    "epcomm.buffer": 3, "epcomm.buffer_ll": 3, "epcomm.ops": 3, "epcomm": 3, "epcomm._deep_ep": 3,
    "epcomm.elastic": 3, "epcomm.elastic_engine": 3, "epcomm.elastic_handle": 3, "epcomm.elastic_args": 3,
    "epcomm.elastic_chains": 3, "epcomm.elastic_extras": 3,
    # 4: tools beside the stack
    "epcomm.testing": 4, "epcomm.bench": 4, "epcomm.cli": 4, "epcomm.doctor": 4, "epcomm.__main__": 4,
    "epcomm.model": 4,
}


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


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS and (n == len(parts) or ".".join(parts[:n]) != PACKAGE):
            return LAYERS[".".join(parts[:n])]
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``"a (layer i) imports b (layer j > i)"`` for every import that points up."""
    return [f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
            for m in sorted(graph) for d in sorted(graph[m]) if layer_of(d) > layer_of(m)]


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


def test_layers():
    assert layer_of("epcomm") == 3 and layer_of("epcomm.kernels.ll") == 1
    assert layer_of("epcomm.bench.report") == 4 and layer_of("epcomm.layout") == 0
    assert layer_of("epcomm.somewhere_new") is None  # the package's own entry does not cover its modules
    graph = {"epcomm.layout": {"epcomm.buffer"}, "epcomm.buffer": {"epcomm.layout", "epcomm.backends.base"},
             "epcomm.backends.base": {"epcomm.layout"}}
    assert upward_imports(graph) == ["epcomm.layout (layer 0) imports epcomm.buffer (layer 3)"]


def test_every_module_has_a_layer():
    missing = [m for m in import_graph() if layer_of(m) is None]
    assert not missing, f"modules with no layer (add them to LAYERS and to docs/architecture.md): {missing}"


def test_epcomm_imports_point_downwards():
    graph = import_graph()
    if any(layer_of(m) is None for m in graph):
        pytest.skip("a module has no layer (test_every_module_has_a_layer names it)")
    bad = upward_imports(graph)
    assert not bad, "imports that point up a layer:\n" + "\n".join(bad)


def test_epcomm_has_no_import_cycle():
    graph = import_graph()
    assert "epcomm.buffer" in graph and "epcomm.backends.nvlink" in graph  # the parse found the package
    cycles = find_cycles(graph)
    assert not cycles, "import cycles inside epcomm:\n" + "\n".join(" -> ".join(c) for c in cycles)

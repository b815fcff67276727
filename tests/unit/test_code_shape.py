"""Tier 1: every module under ``src/epcomm`` is at most 500 lines and every function (a method, a nested
function, a lambda's enclosing function alike) at most 120, its decorators and docstring included. Parsed
with ``ast``; nothing is imported.

Why: a module holds one concept and a function one step; past these sizes that has stopped being so (the
high-throughput dispatch plan was one closure of 264 lines before ``backends/ht_dispatch_plan.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "epcomm"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 120


def too_long(src: Path = SRC) -> list[str]:
    """``"path: N lines"`` for each module over the bound and ``"path:line name: N lines"`` for each function."""
    found = []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(src.parent)
        n = len(text.splitlines())
        if n > MAX_MODULE_LINES:
            found.append(f"{rel}: {n} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = node.end_lineno - first + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{rel}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


def test_modules_and_functions_are_within_bounds():
    assert SRC.is_dir(), SRC
    assert not too_long(), "\n".join(too_long())


def test_the_check_finds_a_long_module_and_a_long_function(tmp_path):
    """The bounds bite: a module of 501 lines and a method of 121 (holding a function of 119) are named."""
    pkg = tmp_path / "epcomm"
    pkg.mkdir()
    (pkg / "ok.py").write_text("def f():\n    return 1\n")
    (pkg / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    # m: its def, inner's def, inner's body, inner's return, m's return: 121 lines (inner's 119 are within)
    body = "            y = 1\n" * (MAX_FUNCTION_LINES - 3)
    (pkg / "fn.py").write_text("class A:\n    def m(self):\n        def inner():\n" + body
                               + "            return y\n        return inner\n")
    found = too_long(pkg)
    assert len(found) == 2, found
    assert found[0].startswith("epcomm/big.py: 501 lines"), found
    assert found[1].startswith("epcomm/fn.py:2 m: "), found

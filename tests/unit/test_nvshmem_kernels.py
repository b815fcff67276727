"""Tier 1: which kernels are launched through ``requires_nvshmem`` (``kernels/nvshmem.nvshmem_kernel``).

torch initialises every module compiled under ``requires_nvshmem`` for NVSHMEM, and that fails on a module with no
NVSHMEM symbols (``nvshmemx_cumodule_init failed. Error code: 7`` at its first launch, on a GPU only: the
simulation never calls it). So ``nvshmem_kernel`` takes only kernels that make an NVSHMEM device call, and every
kernel the package hands it does. Example: the AGRS session's wait, which polls this rank's own signal words, is a
plain kernel (wrapped, it failed its first launch on an H100 with two ranks under MPS).
"""
from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

import epcomm
from epcomm.kernels import agrs, nvshmem


def _wrapped_kernels():
    """``(module.kernel name, kernel)`` of every ``nvshmem_kernel(K.name, ...)`` call in the package's source."""
    root = pathlib.Path(epcomm.__file__).parent
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        imports = {a.asname or a.name.rsplit(".", 1)[-1]: (node.module or "", a.name)
                   for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
                    == "nvshmem_kernel" and node.args and isinstance(node.args[0], ast.Attribute)):
                continue
            alias, name = node.args[0].value.id, node.args[0].attr
            if alias not in imports:
                continue  # (a test kernel of the module itself)
            mod, sub = imports[alias]
            base = "epcomm.kernels" if mod.endswith("kernels") else mod.replace("..", "epcomm.")
            m = importlib.import_module(f"{base}.{sub}" if mod.endswith("kernels") else base)
            out.append((f"{path.relative_to(root)}: {sub}.{name}", getattr(m, name)))
    return out


def test_every_kernel_the_package_wraps_makes_an_nvshmem_call():
    found = _wrapped_kernels()
    assert len(found) >= 11, found  # internode HT (3), LL (4), PP (2), Engram (1), AGRS (1)
    bad = [where for where, k in found if not nvshmem.makes_device_calls(k)]
    assert not bad, f"wrapped through nvshmem_kernel without an NVSHMEM device call: {bad}"


def test_a_kernel_without_nvshmem_calls_is_refused_and_one_with_them_taken():
    with pytest.raises(ValueError, match="_agrs_wait_signals_kernel makes no NVSHMEM device call"):
        nvshmem.nvshmem_kernel(agrs._agrs_wait_signals_kernel, True)
    assert nvshmem.nvshmem_kernel(agrs._agrs_put_nvshmem_kernel, True) is agrs._agrs_put_nvshmem_kernel
    assert nvshmem.makes_device_calls(agrs._agrs_put_nvshmem_kernel)  # through nvshmem.put, fence, signal_add

"""The files that are not Python but that an installed epcomm needs ship in the package: the native
extension's C++ source (``epcomm/native.cpp``, compiled on the user's machine by ``native.module``) sits
beside ``native.py``, and a wheel built from this tree (``pip install .``: the in-tree build backend around
setuptools, pyproject.toml's package data) carries it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

from epcomm import native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_native_source_is_in_the_package():
    assert native.SOURCE == os.path.join(os.path.dirname(native.__file__), "native.cpp")
    with open(native.SOURCE) as f:
        text = f.read()
    assert "PYBIND11_MODULE(TORCH_EXTENSION_NAME" in text  # (the module native.module loads)


def test_a_wheel_built_from_the_tree_carries_the_native_source(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "MANIFEST.in", "README.md"):
        shutil.copy(os.path.join(ROOT, name), tree / name)
    for name in ("src", "build_backend"):
        shutil.copytree(os.path.join(ROOT, name), tree / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    out = tmp_path / "wheels"
    code = ("import sys; sys.path.insert(0, 'build_backend'); import epcomm_build; "
            f"print(epcomm_build.build_wheel({str(out)!r}))")
    run = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    wheel = out / run.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = z.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
    assert "epcomm/native.cpp" in names, [n for n in names if not n.endswith(".py")]
    assert "epcomm/native.cpp," in record

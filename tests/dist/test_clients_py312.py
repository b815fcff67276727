"""Tier 2 on Python 3.12 (``py312_env.py``: README's test command in a cached 3.12 virtualenv, which gets the
CUDA build of torch 2.13.0 from PyPI and the newest Megatron-Core from the test extra), and the test extra
against both builds of torch 2.13.

- ``test_megatron_newest``: ``test_clients_megatron.py`` run by pytest in that virtualenv with
  ``EPCOMM_TEST_MEGATRON_VERSION=0.19.2`` (the file fails if another version is installed), at 2 ranks:
  Megatron-Core 0.19.2's own ``fused_a2a`` and flex/DeepEP ``MoELayer`` on epcomm, with its current option
  names. Python 3.11 runs the same file on 0.16.1 (``tests/dist`` as usual).
- ``test_extra_keeps_torch_cpu`` / ``_cuda``: ``pip install --dry-run --report - -e "<repo>[test]"`` (no
  ``torch==``, as a user with torch installed types it) in this interpreter's environment (CI: torch 2.13.0's
  CPU build) and in the 3.12 one (its CUDA build, which pins ``triton==3.7.1``): pip must plan to install no
  torch. Where the extra pinned a Triton other than the CUDA build's (the ``triton==3.6.0`` it had), pip
  planned torch 2.11.0.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import harness
import py312_env
import pytest

_BUILD: dict = {}  # the build started by start_early: (Popen, log path)


def _start_build():
    if "p" not in _BUILD:
        log = py312_env.releases.cache_dir() / "venv-py312-build.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        f = open(log, "w")  # noqa: SIM115 - the child writes it until it exits
        p = subprocess.Popen(["nice", "-n", "5", sys.executable, str(pathlib.Path(py312_env.__file__))],
                             stdout=f, stderr=subprocess.STDOUT)
        _BUILD.update(p=p, log=log, f=f)
    return _BUILD["p"]


def start_early(items) -> None:
    """Start the 3.12 virtualenv's build as soon as the session's tests are collected (tests/conftest.py),
    where a selected test needs it: a cold one downloads for minutes, mostly waiting on the network, while
    tier 1 runs."""
    if harness.TRANSPORT == "gloo" and any("py312" in getattr(item, "fixturenames", ()) for item in items):
        _start_build()


def stop_early() -> None:
    p = _BUILD.get("p")
    if p is not None and p.poll() is None:
        p.kill()
        p.wait()
    if "f" in _BUILD:
        _BUILD["f"].close()


@pytest.fixture(scope="module")
def py312() -> pathlib.Path:
    if harness.TRANSPORT != "gloo":
        pytest.skip("CPU-only: the 3.12 virtualenv's runs are gloo runs")
    p = _start_build()
    try:
        rc = p.wait(timeout=1200)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = "killed after 1200 s"
    log = _BUILD["log"].read_text()
    assert rc == 0, f"the Python 3.12 virtualenv (tests/dist/py312_env.py) failed ({rc}):\n{log[-6000:]}"
    return py312_env.python()


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=False, **kw)


def test_py312_has_the_cuda_build(py312):
    """The 3.12 virtualenv holds what README's command gave it: Python 3.12, torch 2.13.0's CUDA build and the
    Triton it pins, Megatron-Core 0.19.2."""
    code = ("import sys, importlib.metadata as m, torch; print(sys.version_info[:2], torch.__version__, "
            "torch.version.cuda is not None, m.version('triton'), m.version('megatron-core'))")
    out = _run([py312, "-c", code])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["(3,", "12)", "2.13.0+cu130", "True", "3.7.1", "0.19.2"], out.stdout


def _planned(python) -> list[str]:
    """What ``pip install -e "<repo>[test]"`` would install in ``python``'s environment: ``name==version``."""
    out = _run([python, "-m", "pip", "install", "--dry-run", "--quiet", "--disable-pip-version-check",
                "--no-build-isolation", "--report", "-", "-e", f"{py312_env.REPO}[test]"], timeout=900)
    assert out.returncode == 0, f"pip's dry run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    report = json.loads(out.stdout[out.stdout.index("{"):])
    return [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in report["install"]]


def _keeps_torch(python, build: str, version: str) -> None:
    assert version.startswith("2.13.0"), f"{build}: torch {version}, expected 2.13.0"
    planned = _planned(python)
    assert not [p for p in planned if p.lower().startswith("torch==")], \
        f"{build}: pip install -e '.[test]' would replace torch {version}: {planned}"


def test_extra_keeps_torch_cpu():
    """This interpreter's torch (CI: 2.13.0's CPU build) stays."""
    import importlib.metadata as md

    _keeps_torch(sys.executable, "this interpreter", md.version("torch"))


def test_extra_keeps_torch_cuda(py312):
    """The 3.12 virtualenv's torch 2.13.0 CUDA build, which pins triton 3.7.1, stays."""
    version = _run([py312, "-c", "import torch; print(torch.__version__)"]).stdout.strip()
    _keeps_torch(py312, "the 3.12 virtualenv (CUDA build)", version)


def test_megatron_newest(py312):
    env = dict(os.environ, EPCOMM_TEST_MEGATRON_VERSION="0.19.2")
    for var in ("PYTHONPATH", "VIRTUAL_ENV", "EPCOMM_AS_DEEP_EP"):
        env.pop(var, None)
    ids = [f"tests/dist/test_clients_megatron.py::test_megatron[{name}-2]"
           for name in ("switch", "fused_a2a", "flex_layer")]
    out = _run([py312, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids], cwd=py312_env.REPO, env=env,
               timeout=900)
    tail = out.stdout[-6000:] + out.stderr[-3000:]
    assert out.returncode == 0, f"Megatron-Core 0.19.2 on Python 3.12:\n{tail}"
    assert "3 passed" in out.stdout and "skipped" not in out.stdout, tail

"""A Python 3.12 virtualenv for the tests that need one, made the way README.md's test command makes CI's.

Megatron-Core 0.17.0 and later require Python >= 3.12 (their wheels are cp312 and say ``Requires-Python:
>=3.12``), and CI's interpreter is 3.11. Its machine image also has a CPython 3.12 (pyenv's), so the newest
Megatron-Core runs there for real, with nothing about its version check worked around: this module finds
that interpreter and makes a virtualenv with README.md's command (b), ``pip install torch==2.13.0
-e "<repo>[test]"``, whose test extra takes the newest Megatron-Core on 3.12. pip then takes torch 2.13.0
from PyPI: for Python 3.12 that is the CUDA build (cu130, with its NVIDIA libraries and Triton 3.7.1;
it runs on a CPU), so the same virtualenv shows that the test extra keeps a CUDA build's torch.

Cost (measured on CI's machine kind): cold, 4.7 GB (torch's CUDA wheels, most of them from PyPI, some from
the machine's local index) in 2 min 36 s on a quiet machine, 4 to 12 min beside other loads (load average
15 to 20; about 1.5 min of CPU: it waits on the network and the disk); warm, the same command finds
everything installed and only reinstalls the editable epcomm (seconds). The virtualenv lives in the test cache
(``$EPCOMM_TEST_CACHE``, default ``~/.cache/epcomm-tests``) and is marked
when complete, so a build that stopped half way is made again. ``tests/dist/test_clients_py312.py`` starts
the build when the session's tests are collected (``start_early``), so a cold build runs while tier 1 runs.

The interpreter: ``$EPCOMM_TEST_PY312`` if set, else ``python3.12`` on the PATH, else the newest
``$(pyenv root)/versions/3.12.*``.

    python tests/dist/py312_env.py      # make or refresh the virtualenv, print its python
"""

from __future__ import annotations

import glob
import os
import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import releases

TORCH = "torch==2.13.0"
NAME = "venv-py312"


def interpreter() -> str:
    """A CPython 3.12 (see the module docstring), or RuntimeError naming where it looked."""
    tried = []
    candidates = [os.environ.get("EPCOMM_TEST_PY312"), shutil.which("python3.12")]
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates += sorted(glob.glob(os.path.join(root, "versions", "3.12.*", "bin", "python3.12")), reverse=True)
    for c in candidates:
        if not c:
            continue
        tried.append(c)
        try:
            out = subprocess.run([c, "-c", "import sys, venv; print(sys.version_info[:2])"], capture_output=True,
                                 text=True, timeout=60, check=False)
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.strip() == "(3, 12)":
            return c
    raise RuntimeError(f"no CPython 3.12 with venv found (tried {tried}); set EPCOMM_TEST_PY312 to one")


def venv_dir() -> pathlib.Path:
    return releases.cache_dir() / NAME


def python() -> pathlib.Path:
    return venv_dir() / "bin" / "python"


def _run(cmd, log) -> None:
    log.write(f"$ {' '.join(map(str, cmd))}\n")
    log.flush()
    subprocess.run([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, check=True, timeout=1800)


def build(log=sys.stdout) -> pathlib.Path:
    """Make the virtualenv where it is absent or was left half made, then run README's command (b) in it for
    this checkout (pip reinstalls the editable epcomm every time, and anything the test extra now asks for);
    return its python. One build at a time (a lock file beside it)."""
    import fcntl

    final = venv_dir()
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.with_name(f".{NAME}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = final / ".complete"
        if not done.exists():
            shutil.rmtree(final, ignore_errors=True)
            _run([interpreter(), "-m", "venv", final], log)
        _run([python(), "-m", "pip", "install", "--disable-pip-version-check", TORCH, "-e", f"{REPO}[test]"], log)
        done.write_text("made by tests/dist/py312_env.py\n")
    return python()


if __name__ == "__main__":
    print(build())

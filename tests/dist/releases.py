"""Client frameworks' released files, for the tier-2 tests that run a client's own code on epcomm.

A client whose package cannot be installed here with its dependencies (they pull in CUDA builds, serving
stacks, model hubs) but whose DeepEP module imports with torch alone is loaded from its release on PyPI:
``pip download --no-deps`` of one wheel, named here with its version and sha256, then the files the test
loads unpacked into a cache (``$EPCOMM_TEST_CACHE``, default ``~/.cache/epcomm-tests``). Nothing of theirs
is kept in this repository and nothing in their files is changed; a test says which modules it loads and
how (tests/dist/test_clients_*.py).

The first run downloads (about 110 MB in all, most of it lmdeploy's binary wheel, of which only the Python
files are unpacked); later runs find the files in the cache. Without PyPI the tests that need a release fail
and say so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile


@dataclasses.dataclass(frozen=True)
class Release:
    name: str  # the PyPI name
    version: str
    wheel: str  # the file pip downloads with the options below
    sha256: str
    prefixes: tuple[str, ...]  # the members unpacked: paths under these, Python files only
    pip_args: tuple[str, ...] = ()  # pinning the wheel where it is built per Python version


RELEASES = {
    r.name: r
    for r in (
        Release(
            "torchtitan", "0.3.0", "torchtitan-0.3.0-py3-none-any.whl",
            "5563ccf9a295b24e00a36087149e9c2d0686cecbd3972c31e67227029293af42",
            ("torchtitan/distributed/deepep/",),
        ),
        Release(
            "nemo-automodel", "0.7.0", "nemo_automodel-0.7.0-py3-none-any.whl",
            "37b8397a73c17e4a8bffd0cd3becc0507abecc1ebfea3b3eb6468eed57ba6674",
            ("nemo_automodel/",),
        ),
        Release(
            "lmdeploy", "0.18.0", "lmdeploy-0.18.0-cp311-cp311-manylinux_2_28_x86_64.whl",
            "e6790a25dcdb0345c160567fdf2ac604fec319389523a8b806834c9d92c8ffe1",
            ("lmdeploy/pytorch/envs.py", "lmdeploy/pytorch/backends/"),
            # the same wheel whatever Python runs the tests: only its Python files are used
            ("--python-version", "3.11", "--platform", "manylinux_2_28_x86_64", "--only-binary=:all:"),
        ),
    )
}


def cache_dir() -> pathlib.Path:
    root = os.environ.get("EPCOMM_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "epcomm-tests")
    return pathlib.Path(root)


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download(rel: Release, into: pathlib.Path) -> pathlib.Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d",
           str(into), *rel.pip_args, f"{rel.name}=={rel.version}"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    wheel = into / rel.wheel
    if proc.returncode != 0 or not wheel.exists():
        raise RuntimeError(f"could not download {rel.name}=={rel.version} from PyPI ({' '.join(cmd)}): exit "
                           f"{proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    got = _sha256(wheel)
    if got != rel.sha256:
        raise RuntimeError(f"{rel.wheel}: sha256 {got}, expected {rel.sha256}")
    return wheel


def release_root(name: str) -> pathlib.Path:
    """The directory holding the unpacked files of release ``name`` (downloaded and unpacked on first use;
    several processes may ask at once: each unpacks into its own directory and the first rename wins)."""
    rel = RELEASES[name]
    root = cache_dir() / f"{rel.name}-{rel.version}-{rel.sha256[:12]}"
    if (root / ".complete").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{rel.name}-", dir=root.parent))
    try:
        wheel = _download(rel, tmp / "wheel")
        out = tmp / "files"
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                if member.endswith(".py") and member.startswith(rel.prefixes):
                    z.extract(member, out)
        (out / ".complete").write_text(f"{rel.name}=={rel.version} {rel.wheel} sha256={rel.sha256}\n")
        try:
            out.rename(root)
        except OSError:  # another process finished first
            if not (root / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root

"""Tier 1: the environment a bench row carries names epcomm's own version and commit, never the cwd's.

A git repository of the test's own (``_repo``) plays "some other checkout": the cwd a bench runs in, or
a repository that holds a copy of the package without tracking it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import epcomm
from epcomm.bench import report, table

GIT = shutil.which("git")
needs_git = pytest.mark.skipif(GIT is None, reason="git is not installed")


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def _repo(path: Path, files: dict[str, str]) -> str:
    """A git repository at ``path`` with ``files`` committed; returns its HEAD."""
    path.mkdir(parents=True, exist_ok=True)
    _git(path, "init", "-q")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    _git(path, "add", *files)
    _git(path, "commit", "-q", "-m", "other")
    return _git(path, "rev-parse", "HEAD")


@needs_git
def test_commit_is_epcomms_own_from_another_repositorys_cwd(tmp_path, monkeypatch):
    pkg = Path(epcomm.__file__).resolve().parent
    own = subprocess.run(["git", "-C", str(pkg), "rev-parse", "HEAD"], capture_output=True, text=True,
                         check=False)
    if own.returncode != 0:
        pytest.skip("epcomm is not imported from a git checkout here")
    other = _repo(tmp_path / "elsewhere", {"README": "another project\n"})
    monkeypatch.chdir(tmp_path / "elsewhere")
    env = report.environment({"device": "cpu", "gpu_count": 0}, 1, "gloo", ["reference"])
    assert env["git_sha"] == own.stdout.strip() != other
    assert isinstance(env["git_dirty"], bool)


@needs_git
def test_dirty_means_the_package_differs_from_its_commit(tmp_path, monkeypatch):
    root = tmp_path / "checkout"
    head = _repo(root, {"src/epcomm/__init__.py": "", "src/epcomm/a.py": "x = 1\n", "NOTES": "n\n"})
    monkeypatch.setattr(report, "_package_dir", lambda: root / "src" / "epcomm")
    assert report.source_commit() == (head, False)
    (root / "NOTES").write_text("edited outside the package\n")
    assert report.source_commit() == (head, False)
    (root / "src" / "epcomm" / "b.py").write_text("y = 2\n")  # an untracked module can be imported
    assert report.source_commit() == (head, True)
    (root / "src" / "epcomm" / "b.py").unlink()
    (root / "src" / "epcomm" / "a.py").write_text("x = 3\n")
    assert report.source_commit() == (head, True)


@needs_git
def test_a_repository_that_does_not_track_the_package_is_not_its_checkout(tmp_path, monkeypatch):
    root = tmp_path / "venv-in-a-repo"
    _repo(root, {"setup.cfg": "[x]\n"})
    pkg = root / "lib" / "site-packages" / "epcomm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    monkeypatch.setattr(report, "_package_dir", lambda: pkg)
    assert report.source_commit() == (None, None)
    assert report.git_info() == ("unknown", None)


@needs_git
def test_a_copy_outside_any_checkout_records_no_commit(tmp_path):
    """A real process importing a copy of the package that sits, untracked, inside another repository."""
    _repo(tmp_path, {"README": "another project\n"})
    shutil.copytree(Path(epcomm.__file__).resolve().parent, tmp_path / "copy" / "epcomm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import epcomm, json; from epcomm.bench import report; "
            "env = report.environment({'device': 'cpu', 'gpu_count': 0}, 1, 'gloo', []); "
            "print(json.dumps([epcomm.__file__, report.commit_record(), env['git_sha'], env['git_dirty']]))")
    base = {k: v for k, v in os.environ.items() if not k.startswith("EPCOMM_COMMIT")}

    def run(**extra):
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                             env={**base, "PYTHONPATH": str(tmp_path / "copy"), **extra}).stdout
        return json.loads(out.splitlines()[-1])

    path, commit, sha, dirty = run()
    assert Path(path).resolve().is_relative_to((tmp_path / "copy").resolve())
    assert commit == [None, None, None] and sha == "unknown" and dirty is None  # never a guess
    # a GPU machine's copy (no .git): the run script passes the commit of the tree it shipped
    assert run(EPCOMM_COMMIT="0123abcd" * 5, EPCOMM_COMMIT_DIRTY="1")[1:] == [
        ["0123abcd" * 5, True, "EPCOMM_COMMIT"], "0123abcd" * 5, True]
    assert run(EPCOMM_COMMIT="7796DA0")[1] == ["7796da0", None, "EPCOMM_COMMIT"]  # dirty unknown: unset


def test_commit_variables_are_checked(monkeypatch):
    from epcomm import _env

    monkeypatch.setenv("EPCOMM_COMMIT", "HEAD")
    with pytest.raises(ValueError, match="EPCOMM_COMMIT must be a git commit sha.*'head'"):
        _env.commit()
    monkeypatch.setenv("EPCOMM_COMMIT", "7796da0")
    monkeypatch.setenv("EPCOMM_COMMIT_DIRTY", "yes")
    with pytest.raises(ValueError, match="EPCOMM_COMMIT_DIRTY must be 0 or 1, got 'yes'"):
        _env.commit()
    monkeypatch.setenv("EPCOMM_COMMIT_DIRTY", "0")
    assert _env.commit() == ("7796da0", False)
    assert "EPCOMM_COMMIT" in _env.VARIABLES and "EPCOMM_COMMIT_DIRTY" in _env.VARIABLES


@needs_git
def test_a_commit_variable_wins_over_a_checkout(tmp_path, monkeypatch):
    """The device machines ship the session's first .git beside the current tree: there the checkout's HEAD
    (clean or not) is a commit that did not run, and the run script's variable is the one that did."""
    root = tmp_path / "checkout"
    head = _repo(root, {"src/epcomm/__init__.py": ""})
    monkeypatch.setattr(report, "_package_dir", lambda: root / "src" / "epcomm")
    monkeypatch.delenv("EPCOMM_COMMIT", raising=False)
    monkeypatch.delenv("EPCOMM_COMMIT_DIRTY", raising=False)
    assert report.commit_record() == (head, False, "git")  # no variable: the checkout
    monkeypatch.setenv("EPCOMM_COMMIT", "7796da0")  # the tree that was shipped, newer than the checkout
    monkeypatch.setenv("EPCOMM_COMMIT_DIRTY", "1")
    assert report.commit_record() == ("7796da0", True, "EPCOMM_COMMIT")


def test_every_epcomm_variable_that_is_set_is_recorded(monkeypatch):
    for k in [k for k in os.environ if k.startswith("EPCOMM_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("EPCOMM_TUNE", "push_rb=4")
    monkeypatch.setenv("EPCOMM_NOT_YET_KNOWN", "1")  # recorded even if epcomm env does not list it
    monkeypatch.setenv("EPCOMM_BACKEND", "")          # set but empty: nothing ran differently
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    env = report.environment({"device": "cpu", "gpu_count": 0}, 1, "gloo", ["reference"])
    assert env["epcomm_env"] == {"EPCOMM_NOT_YET_KNOWN": "1", "EPCOMM_TUNE": "push_rb=4"}


def test_version_is_the_installed_distributions(monkeypatch):
    monkeypatch.setattr(report, "package_version", lambda name: "9.9.9" if name == "epcomm" else None)
    assert report.environment({"device": "cpu", "gpu_count": 0}, 1, "gloo", [])["epcomm"] == "9.9.9"
    monkeypatch.setattr(report, "package_version", lambda name: None)
    assert report.epcomm_version() == epcomm.__version__


def test_header_without_a_commit():
    env = report.environment({"device": "cpu", "gpu_count": 0}, 1, "gloo", ["reference"])
    text = table.render_header({**env, "git_sha": None, "git_dirty": None}, None)
    assert "(git unknown)" in text

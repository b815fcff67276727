"""Tier 1: the suite's progress lines (tests/progress_lines.py), in a pytest of its own on two small test files
run with ``-q`` as CI runs the suite: each file ends on a row with its name, count and time, and a test that
runs past the heartbeat's period gets a line that names it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # where progress_lines.py is


def _run(tmp_path: Path, *args: str, files=("test_quick.py", "test_slow.py")) -> list[str]:
    (tmp_path / "conftest.py").write_text(
        "from progress_lines import ProgressLines\n\n"
        "def pytest_configure(config):\n"
        "    config.pluginmanager.register(ProgressLines(every_s=1.0), 'progress-lines')\n")
    (tmp_path / "test_quick.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(2.2)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", *files], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout.splitlines()


def test_quiet_run_names_each_file_and_a_test_that_runs_long(tmp_path):
    lines = _run(tmp_path, "-q")
    assert re.fullmatch(r"test_quick\.py \.\. 2 tests, \d+\.\d s \[2/3 at 0:0\d\]", lines[0]), lines
    assert lines[1] == "test_slow.py ", lines
    beats = [ln for ln in lines if ln.startswith("... still in ")]
    assert beats and re.fullmatch(r"\.\.\. still in test_slow\.py::test_sleeps, [12] s \[at 0:0\d\]", beats[0]), lines
    assert len(beats) <= 3, lines  # one a second after the last line, while it sleeps 2.2 s
    assert re.fullmatch(r"\. 1 test, \d\.\d s \[3/3 at 0:0\d\] +\[100%\]", lines[2 + len(beats)]), lines


def test_verbose_run_gives_each_file_a_line_of_its_own(tmp_path):
    lines = _run(tmp_path, "-v", files=("test_quick.py",))
    last = next(i for i, ln in enumerate(lines) if ln.startswith("test_quick.py::test_b PASSED"))
    assert re.fullmatch(r"test_quick\.py: 2 tests, \d+\.\d s \[2/2 at 0:0\d\]", lines[last + 1]), lines

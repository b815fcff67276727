"""Tier 1: the internode high-throughput launches, compiled for sm_90 (no GPU), move their rows as 16-byte
vectors (``sims/vectors_internode_ht.py``: the counts, and why rows built from ``ptr_table`` need the
kernels' alignment hints). In its own process: the test session may run Triton's interpreter, which must not
be on for a compile."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIMS = os.path.join(ROOT, "tests", "unit", "sims")


def test_internode_ht_rows_move_as_16_byte_vectors_on_sm90():
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), SIMS,
                                                       os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, os.path.join(SIMS, "vectors_internode_ht.py")], env=env, cwd=ROOT,
                         check=False, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    lines = res.stdout.splitlines()
    plan = sum(int(line.split()[1]) for line in lines if line.startswith("plan "))
    assert plan > 0 and sum(line.startswith("ok") for line in lines) == plan, res.stdout

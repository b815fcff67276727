"""Tier 1: the Triton kernels' logic on CPU. sims/sim_ht.py and sims/sim_ll.py (beside this file) run every
high-throughput and low-latency kernel under the Triton interpreter with 1-3 simulated ranks (peer
buffers are CPU tensors) and compare with oracles: dispatch bitwise, combine within the budget,
shrink; sims/sim_internode_prep.py the internode layout kernel against torch formulas;
sims/compile_internode_ht.py compiles the internode high-throughput kernels for sm_90 (no GPU needed). Each runs in its own process (TRITON_INTERPRET must be set before Triton loads), all four started at once, and must report
every check it plans as passed. Skipped
where Triton is not installed (it comes with the ``test`` extra)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytest.importorskip("numpy")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sims")


SCRIPTS = ["sim_ht.py", "sim_ll.py", "sim_internode_prep.py", "compile_internode_ht.py"]


def start(script: str) -> subprocess.Popen:
    """``sims/<script>`` started in its own process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    if script.startswith("compile"):
        env.pop("TRITON_INTERPRET", None)  # Triton's compiler itself, for sm_90
    return subprocess.Popen([sys.executable, os.path.join(SIMS, script)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def started_scripts(scripts):
    """Every script started at once (the body of a module fixture): each is one single-threaded Python
    process, so on a machine of two cores two of them run in the time of one; the tests collect their own."""
    procs = {script: start(script) for script in scripts}
    try:
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()


def collect(script: str, p: subprocess.Popen) -> None:
    """Wait for ``p`` (300 s at most); it must exit 0 and report every check it plans as passed."""
    try:
        out, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"{script} did not finish within 300 s:\n{out[-2000:]}{err[-4000:]}")
    proc = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # each script prints "plan N" (its N checks, from one list) before it starts, then "ok ..." per check
    # passed: a check that returned early, or a plan line lost, fails here even when the script exits 0
    lines = proc.stdout.splitlines()
    plans = [int(line.split()[1]) for line in lines if line.startswith("plan ")]
    oks = [line for line in lines if line.startswith("ok")]
    assert len(plans) == 1 and plans[0] > 0, proc.stdout
    assert len(oks) == plans[0], f"{len(oks)} of {plans[0]} checks reported ok:\n{proc.stdout}"


@pytest.fixture(scope="module")
def started():
    yield from started_scripts(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_kernels_under_the_interpreter(started, script):
    collect(script, started[script])

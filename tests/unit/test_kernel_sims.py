"""Tier 1: the Triton kernels' logic on CPU. sims/sim_ht.py and sims/sim_ll.py (beside this file) run every
high-throughput and low-latency kernel under the Triton interpreter with 1-3 simulated ranks (peer
buffers are CPU tensors) and compare with oracles: dispatch bitwise, combine within the budget,
shrink; sims/sim_internode_prep.py the internode layout kernel against torch formulas;
sims/compile_internode_ht.py compiles the internode high-throughput kernels for sm_90 (no GPU needed). Each runs in its own process (TRITON_INTERPRET must be set before Triton loads), all four started at once (as soon as the
session's tests are collected, at the lowest priority: tests/conftest.py), and must report every check it plans
as passed. Skipped where Triton is not installed (it comes with the ``test`` extra)."""
import os
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("triton")
pytest.importorskip("numpy")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sims")


SCRIPTS = ["sim_ht.py", "sim_ll.py", "sim_internode_prep.py", "compile_internode_ht.py"]


def start(script: str, nice: int = 0) -> subprocess.Popen:
    """``sims/<script>`` started in its own process (``nice``: its niceness), its output into files that
    ``collect`` reads (a pipe nobody reads yet could fill up and stall it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    if script.startswith("compile"):
        env.pop("TRITON_INTERPRET", None)  # Triton's compiler itself, for sm_90
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by _output
    p = subprocess.Popen([sys.executable, os.path.join(SIMS, script)], env=env, cwd=ROOT, stdout=out, stderr=err,
                         text=True)
    if nice:
        os.setpriority(os.PRIO_PROCESS, p.pid, nice)
    p.out_files = (out, err)
    return p


# Scripts started when the session's tests were collected (``start_early``, from tests/conftest.py), by name;
# every one of them, collected or not (``early_done``).
_EARLY: dict[str, subprocess.Popen] = {}
_STARTED: list[subprocess.Popen] = []


def start_early(items) -> None:
    """The scripts of ``items`` (this session's tests of this module, or of one that imports this) started now,
    at the lowest priority: they run on the cores the tests before theirs leave idle (tier 1 runs in this one
    process) and are done, or nearly, when their tests come."""
    for item in items:
        script = item.callspec.params["script"]
        if script not in _EARLY:
            _EARLY[script] = start(script, nice=19)
            _STARTED.append(_EARLY[script])


def early_done() -> bool:
    """Whether every script ``start_early`` started has ended (tests/conftest.py then lets tier 2's background queue run:
    tests/dist/background.py)."""
    return all(p.poll() is not None for p in _STARTED)


def stop_early() -> None:
    """End the early scripts no test collected (the session stopped before their tests)."""
    while _EARLY:
        _, p = _EARLY.popitem()
        if p.poll() is None:
            p.kill()
            p.wait()


def started_scripts(scripts):
    """Every script started at once, or earlier by ``start_early`` (the body of a module fixture): each is one
    single-threaded Python process, so on a machine of two cores two of them run in the time of one; the
    tests collect their own."""
    procs = {script: _EARLY.pop(script, None) or start(script) for script in scripts}
    try:
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def collect(script: str, p: subprocess.Popen) -> None:
    """Wait for ``p`` (300 s at most); it must exit 0 and report every check it plans as passed."""
    try:
        p.wait(timeout=300)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        out, err = _output(p)
        pytest.fail(f"{script} did not finish within 300 s:\n{out[-2000:]}{err[-4000:]}")
    out, err = _output(p)
    proc = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # each script prints "plan N" (its N checks, from one list) before it starts, then "ok ..." per check
    # passed: a check that returned early, or a plan line lost, fails here even when the script exits 0
    lines = proc.stdout.splitlines()
    plans = [int(line.split()[1]) for line in lines if line.startswith("plan ")]
    oks = [line for line in lines if line.startswith("ok")]
    assert len(plans) == 1 and plans[0] > 0, proc.stdout
    assert len(oks) == plans[0], f"{len(oks)} of {plans[0]} checks reported ok:\n{proc.stdout}"


def _output(p: subprocess.Popen) -> tuple[str, str]:
    texts = []
    for f in p.out_files:
        f.seek(0)
        texts.append(f.read())
        f.close()
    return texts[0], texts[1]


@pytest.fixture(scope="module")
def started():
    yield from started_scripts(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_kernels_under_the_interpreter(started, script):
    collect(script, started[script])

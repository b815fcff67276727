"""Tier 2: the process launcher reports hangs with the stuck ranks' Python stacks."""
import concurrent.futures
import time

import pytest

from epcomm.testing.launcher import RankError, parallel_launch


def _stuck_here(seconds):
    time.sleep(seconds)


def _one_fails_one_hangs(ctx):
    if ctx.rank == 0:
        raise ValueError("rank 0 gives up")
    _stuck_here(120)
    return "unreachable"


def _one_hangs(ctx):
    if ctx.rank == 1:
        _stuck_here(120)
    return ctx.rank


def _hangs_deaf(ctx):
    if ctx.rank == 1:
        import signal

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # as a thread stuck in a driver call
        _stuck_here(120)
    return ctx.rank


# The launches that wait out a grace period or a deadline (3, 12 and 14 s): started together, each in a
# thread of this process, once the session's tests are collected (``start_early``, from tests/conftest.py), or
# else by the first test that asks for one. Their ranks sleep: one after the other they took ~33 s of a CI
# run, together ~15 s, and from the start of the session none of its time.
HANGS = {"failure": (_one_fails_one_hangs, {"timeout_s": 60, "grace_s": 3.0}),
         "timeout": (_one_hangs, {"timeout_s": 12}),
         "deaf": (_hangs_deaf, {"timeout_s": 14})}  # its watchdog writes at 9 s


def _timed_launch(fn, kw):
    """``(the RankError raised or None, seconds the launch took)``."""
    t0 = time.monotonic()
    try:
        parallel_launch(2, fn, backend="gloo", **kw)
    except RankError as e:
        return e, time.monotonic() - t0
    return None, time.monotonic() - t0


_STARTED: dict = {}  # name -> the future of its launch
_POOL: list = []


def _start_hangs() -> dict:
    if not _STARTED:
        _POOL.append(concurrent.futures.ThreadPoolExecutor(len(HANGS)))
        _STARTED.update({name: _POOL[0].submit(_timed_launch, fn, kw) for name, (fn, kw) in HANGS.items()})
    return _STARTED


def start_early(items) -> None:
    if any("hangs" in item.fixturenames for item in items):
        _start_hangs()


def stop_early() -> None:
    while _POOL:
        _POOL.pop().shutdown(wait=True)  # (each launch ends within its deadline)


@pytest.fixture(scope="module")
def hangs():
    yield _start_hangs()
    stop_early()


def test_a_failure_reports_the_other_ranks_stacks(hangs):
    err, took = hangs["failure"].result()
    assert isinstance(err, RankError), err
    msg = str(err)
    assert "rank 0 gives up" in msg
    assert "rank 1 was still running" in msg and "_stuck_here" in msg, msg
    assert took < 45  # the survivors get a short grace period, not the whole timeout
    with pytest.raises(ValueError, match="grace_s must be > 0, got 0"):
        parallel_launch(2, _one_fails_one_hangs, grace_s=0)


def test_a_timeout_names_the_rank_and_where_it_hangs(hangs):
    err, took = hangs["timeout"].result()
    assert isinstance(err, RankError), err
    # the deadline, the stack dump (1 s), a margin for a loaded machine (16.5 s seen on 2 busy cores): a hung rank is
    # killed once its stacks are taken, long before its 120 s sleep would end
    assert took < 12 + 1 + 10, took
    msg = str(err)
    assert "ranks [1] did not finish within 12 s" in msg
    assert "rank 1 was still running" in msg and "_stuck_here" in msg, msg


def test_a_rank_that_cannot_take_the_signal_still_leaves_its_stacks(hangs):
    err, _ = hangs["deaf"].result()
    assert isinstance(err, RankError), err
    msg = str(err)
    assert "rank 1 was still running" in msg and "_stuck_here" in msg, msg


@pytest.mark.parametrize("env, gpus, world, expected", [
    ("1", 1, 2, True), ("1", 2, 2, False), ("0", 1, 2, False), ("", 1, 4, False), ("1", 0, 2, False),
])
def test_shared_gpu_mode_only_when_asked_and_short_of_gpus(monkeypatch, env, gpus, world, expected):
    import torch

    from epcomm.testing import launcher

    monkeypatch.setenv("EPCOMM_TEST_SHARE_GPU", env)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert launcher.share_gpu(world) is expected


def _skips_in_rank_1(ctx):
    if ctx.rank == 1:
        pytest.skip("rank 1 has no use for this case")
    return ctx.rank


def test_pytest_skip_in_a_rank_skips_the_test():
    with pytest.raises(pytest.skip.Exception) as e:
        parallel_launch(2, _skips_in_rank_1, backend="gloo", timeout_s=60)
    assert "rank 1: rank 1 has no use for this case" in str(e.value.msg)


def _skips_in_rank_1_fails_in_rank_0(ctx):
    if ctx.rank == 0:
        raise ValueError("rank 0 breaks")
    pytest.skip("rank 1 skips")


def test_a_failure_beside_a_skip_still_fails():
    with pytest.raises(RankError) as e:
        parallel_launch(2, _skips_in_rank_1_fails_in_rank_0, backend="gloo", timeout_s=60)
    assert "rank 0 breaks" in str(e.value)



def _fails_and_leaves_its_peer_waiting(ctx, lost):
    if ctx.rank == 1:
        raise ValueError("rank 1 breaks first")
    time.sleep(0.5)  # rank 0's next wait then finds rank 1 gone (gloo), or passes its deadline (NCCL)
    from epcomm.backends.errors import PeerLostError, PeerTimeoutError

    if lost:
        raise PeerLostError(0, "the next wait", 1, "Connection closed by peer")
    raise PeerTimeoutError(0, "the next wait", 1, 10.0)


@pytest.mark.parametrize("lost", [True, False], ids=["lost", "timed-out"])
def test_a_failure_reports_the_rank_that_failed_not_the_peer_that_waited_on_it(lost):
    with pytest.raises(RankError) as e:
        parallel_launch(2, _fails_and_leaves_its_peer_waiting, lost, backend="gloo", timeout_s=60)
    assert e.value.rank == 1, str(e.value)
    msg = str(e.value)
    assert msg.startswith("rank 1 failed") and "rank 1 breaks first" in msg, msg
    seen = "PeerLostError: epcomm rank 0: the next wait lost rank 1" if lost else \
        "PeerTimeoutError: epcomm rank 0: the next wait waited 10 s for rank 1"
    assert f"rank 0 also failed: epcomm.backends.errors.{seen}" in msg, msg


def _start_up(ctx):
    """How this rank started: its parent process, the variables it sees, whether the interpreter's start-up
    hook for ``EPCOMM_AS_DEEP_EP`` answered ``import deep_ep``, and whether it started with a module that this
    file does not import (``tests/conftest.py`` has the server import it)."""
    import importlib.util
    import os
    import sys

    spec = importlib.util.find_spec("deep_ep")
    return (os.getppid(), *(os.environ.get(k) for k in ("PYTEST_CURRENT_TEST", "EPCOMM_TIMEOUT_S", "EPCOMM_AS_DEEP_EP")),
            spec is not None and "epcomm" in (spec.origin or ""), "epcomm.testing.compare" in sys.modules)


def test_ranks_fork_from_the_server_with_the_launchs_variables_and_spawn_for_start_up_ones(monkeypatch):
    """The session's launches fork their ranks from the server that imported torch, epcomm and the test helpers
    (their parent is not this process; their modules are there before their target's), each with the launch's
    variables: the test's own PYTEST_CURRENT_TEST and an epcomm variable set since (read in the rank). A launch
    with a variable that the interpreter's start-up reads set since (EPCOMM_AS_DEEP_EP, epcomm_as_deep_ep.pth)
    spawns: a fresh interpreter, whose start-up hook sees it."""
    import os

    from epcomm.testing import fork_servers

    if not fork_servers.running():
        pytest.skip("this session spawns every rank (with CUDA, tests/conftest.py starts no fork server)")
    here = os.environ["PYTEST_CURRENT_TEST"]
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "17")
    for got in parallel_launch(2, _start_up, backend="gloo", timeout_s=60):
        assert got[0] != os.getpid() and got[1:] == (here, "17", None, False, True), got
    monkeypatch.setenv("EPCOMM_AS_DEEP_EP", "1")
    for got in parallel_launch(2, _start_up, backend="gloo", timeout_s=60):
        assert got[0] == os.getpid() and got[1:] == (here, "17", "1", True, False), got


def _set_up(ctx):
    """This rank's parent process and whether it started with the interpreter and a kernel module loaded and a
    kernel rewritten (the interpreter's server, ``epcomm.testing.interp_server``, does those)."""
    import os
    import sys

    kernels = sys.modules.get("epcomm.kernels.ht_layout")
    rewritten = kernels is not None and kernels._layout_kernel.fn in type(kernels._layout_kernel).rewritten_fn
    return os.getppid(), "epcomm.testing.interp" in sys.modules, rewritten


def test_interpreter_ranks_fork_from_a_server_of_their_own(monkeypatch):
    """A launch for the interpreter's server forks its ranks from it, set up (another parent than the session's
    server's ranks have, the interpreter and the kernels there before the target runs); TorchInductor's variables
    are read at that server's imports: one set since makes its launches spawn, not the others; but its cache
    directory, which it reads when used and sets itself at its first use (a test that compiles does)."""
    import os

    import harness

    from epcomm.testing import fork_servers

    if not fork_servers.running(harness.INTERPRETER):
        pytest.skip("no fork server for the interpreter's ranks (tests/conftest.py: none with CUDA or without Triton)")
    plain = parallel_launch(2, _set_up, backend="gloo", timeout_s=120)
    interpreted = parallel_launch(2, _set_up, backend="gloo", timeout_s=120, server=harness.INTERPRETER)
    assert all(got[1:] == (False, False) for got in plain), plain
    assert all(got[1:] == (True, True) for got in interpreted), interpreted
    parents = {got[0] for got in plain}, {got[0] for got in interpreted}
    assert len(parents[0]) == len(parents[1]) == 1 and parents[0] != parents[1], parents
    assert os.getpid() not in parents[0] | parents[1], parents
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/nonexistent/epcomm-test")
    got = parallel_launch(2, _set_up, backend="gloo", timeout_s=120, server=harness.INTERPRETER)
    assert {g[0] for g in got} == parents[1] and all(g[1:] == (True, True) for g in got), got
    monkeypatch.setenv("TORCHINDUCTOR_EPCOMM_TEST", "1")
    assert parallel_launch(2, _set_up, backend="gloo", timeout_s=120)[0][0] == parents[0].pop()
    for got in parallel_launch(2, _set_up, backend="gloo", timeout_s=120, server=harness.INTERPRETER):
        assert got == (os.getpid(), False, False), got


def _switch_and_megatron(ctx):
    import os
    import sys

    import _epcomm_as_deep_ep as hook

    return os.getppid(), hook.installed(), "megatron.core.transformer.moe.fused_a2a" in sys.modules


def test_megatron_ranks_fork_from_a_server_started_with_the_switch(monkeypatch):
    """Megatron-Core's server starts with EPCOMM_AS_DEEP_EP=1 whatever this process's environment (its first launch
    here has none): a launch without the switch spawns (the server's start-up does not hold for it), one with it
    forks from the server (epcomm's start-up hook installed there, as at a fresh interpreter's start-up,
    Megatron-Core imported)."""
    import importlib.util
    import os

    import harness

    from epcomm.testing import fork_servers

    if not fork_servers.running(harness.MEGATRON) or importlib.util.find_spec("megatron") is None:
        pytest.skip("no fork server for Megatron-Core's ranks, or no Megatron-Core")
    monkeypatch.delenv("EPCOMM_AS_DEEP_EP", raising=False)
    got = parallel_launch(2, _switch_and_megatron, backend="gloo", timeout_s=120, server=harness.MEGATRON)
    assert all(g == (os.getpid(), False, False) for g in got), got
    monkeypatch.setenv("EPCOMM_AS_DEEP_EP", "1")
    got = parallel_launch(2, _switch_and_megatron, backend="gloo", timeout_s=120, server=harness.MEGATRON)
    assert all(g[0] != os.getpid() and g[1:] == (True, True) for g in got), got

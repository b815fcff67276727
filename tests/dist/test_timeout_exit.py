"""Tier 2 (gloo on CPU, real processes): after a named timeout the process exits promptly, whether or
not the error is caught and whether or not its peer is alive.

Each case starts two plain ``python`` processes (``timeout_rank.py``, not the in-process launcher, so
the interpreter's own exit is what is measured), joined through a ``file://`` rendezvous, with
``EPCOMM_TIMEOUT_S=3``. Rank 0 waits on rank 1, which either never makes the call (it sleeps for
minutes), or exits at once, or never builds its Buffer. Every case runs at the same time; each must see
rank 0 end within ``BOUND_S`` of the moment it started waiting, with the exit code its role implies,
and its stderr must name rank 0 and the phase. Before the fix, an idle peer kept rank 0's process
alive until the peer ended: gloo's worker thread stayed blocked in the timed-out operation, and the
process group's teardown at exit joined it.
"""

from __future__ import annotations

import re

import pytest
import timeout_rank

TIMEOUT_S = 3
BOUND_S = TIMEOUT_S + 20

# case -> (rank 0's role, rank 1's role, rank 0's exit code, what rank 0's stderr must match)
CASES = {
    "caught, peer alive": ("caught", "idle", 0,
                           r"caught PeerTimeoutError on reference: epcomm rank 0: dispatch/notify waited 3 s"),
    "uncaught, peer alive": ("uncaught", "idle", 1,
                             r"PeerTimeoutError: epcomm rank 0: dispatch/notify waited 3 s"),
    "uncaught, peer dead": ("uncaught", "dies", 1, r"Peer\w+Error: epcomm rank 0: dispatch/notify"),
    "construction, peer absent": ("build", "absent", 1,
                                  r"PeerTimeoutError: epcomm rank 0: Buffer/rank exchange waited 3 s"),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """``{case: (exit code or None if still running, seconds from 'waiting' to exit, stderr)}``."""
    return timeout_rank.run(CASES, tmp_path_factory, {"EPCOMM_TIMEOUT_S": str(TIMEOUT_S)}, "gloo")


@pytest.mark.parametrize("case", list(CASES))
def test_process_exits_promptly_after_a_named_timeout(outcomes, case):
    code, took, text = outcomes[case]
    _, _, expected_code, pattern = CASES[case]
    assert code is not None, f"{case}: rank 0 still running long after its deadline; stderr:\n{text[-3000:]}"
    assert took is not None, f"{case}: rank 0 never reached its wait; stderr:\n{text[-3000:]}"
    assert took < BOUND_S, f"{case}: rank 0 exited {took:.1f} s after it began waiting; stderr:\n{text[-3000:]}"
    assert code == expected_code, f"{case}: exit code {code}, expected {expected_code}; stderr:\n{text[-3000:]}"
    assert re.search(pattern, text), f"{case}: stderr does not match {pattern!r}:\n{text[-3000:]}"


def test_the_caught_case_tears_down_without_waiting(outcomes):
    """``destroy()`` and ``dist.destroy_process_group()`` after a timeout return at once (the peer is idle)."""
    code, _, text = outcomes["caught, peer alive"]
    caught = re.search(r"waiting at ([0-9.]+)", text)
    torn = re.search(r"torn down at ([0-9.]+)", text)
    assert code == 0 and caught and torn, text[-3000:]
    assert float(torn.group(1)) - float(caught.group(1)) < TIMEOUT_S + 5, text[-3000:]

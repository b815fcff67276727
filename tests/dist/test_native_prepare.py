"""Tier 2 (gloo, 2 spawned CPU ranks): a buffer loads or builds the native output helper (``epcomm.native``) before
its first collective and then meets its peers under a deadline that covers a build (``deadline.prepare_native``):
a rank that builds while its peer loads from the cache keeps the peer waiting there, not in a dispatch or in a
barrier of the ordinary deadline.

Here rank 0's build takes 3 s (``native.module`` slowed down), ``EPCOMM_TIMEOUT_S=1``: both ranks then pass a
barrier of that 1 s deadline (without ``prepare_native``'s long barrier, rank 1 would wait there 3 s and give up),
and with ``EPCOMM_NATIVE=0`` nothing is built and no barrier is added.
"""

from __future__ import annotations

import os
import time

from epcomm.testing.launcher import parallel_launch


def _rank(ctx):
    import torch

    from epcomm import native
    from epcomm.backends import deadline

    slow = native.module

    def module():
        if ctx.rank == 0:
            time.sleep(3.0)
        return slow()

    native.module = module
    os.environ["EPCOMM_NATIVE"] = "all"
    t0 = time.monotonic()
    deadline.prepare_native(ctx.group, ctx.rank, torch.device("cpu"), True, 1.0)
    waited = time.monotonic() - t0
    deadline.barrier(ctx.group, ctx.rank, "after", 1.0)  # rank 1 waited for rank 0's build above, not here
    os.environ["EPCOMM_NATIVE"] = "0"
    t1 = time.monotonic()
    deadline.prepare_native(ctx.group, ctx.rank, torch.device("cpu"), True, 1.0)  # off: no build, no barrier
    return waited, time.monotonic() - t1


def test_a_slow_build_is_waited_for_before_the_first_collective():
    (w0, off0), (w1, off1) = parallel_launch(2, _rank, timeout_s=300, backend="gloo")
    assert w0 >= 3.0 and w1 >= 2.5, (w0, w1)  # rank 1 waited for rank 0's build inside prepare_native
    assert off0 < 0.5 and off1 < 0.5, (off0, off1)

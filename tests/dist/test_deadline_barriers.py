"""Tier 2 (gloo, 2 spawned CPU ranks): the host waits epcomm issues itself have deadlines, and teardown
after a deadline does not wait on the peer.

The nvlink backend runs on CPU processes (``epcomm.testing.cpu_nvlink``: its host code, symmetric memory
emulated), with ``EPCOMM_TIMEOUT_S=2``. Rank 1 skips one step; rank 0 must raise ``PeerTimeoutError``
naming itself and the phase within a few seconds of the deadline:

- building the backend: the barrier before torch's symmetric-memory rendezvous (which has no deadline of
  its own) — rank 1 builds its Buffer but not the nvlink backend;
- ``clean_low_latency_buffer``: the barrier before it zeroes the low-latency region — rank 1 never calls it;
  then rank 0's ``destroy()`` returns at once (no barrier with a peer that is out of step).

Each step runs on a fresh process group; rank 1 waits for rank 0's marker file before the next one. The
backend step comes last: rank 0's extra allocation puts the emulated allocator out of step with rank 1's.
"""

from __future__ import annotations

import importlib.util
import os
import time
import uuid

import pytest

from epcomm.testing.launcher import parallel_launch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter)")

TIMEOUT_S = 2.0


def _wait_for(path: str) -> None:
    end = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)


def _steps(ctx, tag, markers):
    import torch.distributed as dist

    from epcomm.testing import cpu_nvlink

    os.environ["EPCOMM_TIMEOUT_S"] = str(TIMEOUT_S)
    cpu_nvlink.install(tag, ctx.rank, ctx.world_size, ctx.group)
    from epcomm import Buffer
    from epcomm.backends.base import PeerTimeoutError
    from epcomm.backends.nvlink import NVLinkBackend

    out = {}

    def timed(step, fn):
        t0 = time.monotonic()
        try:
            fn()
            out[step] = ("returned", None, time.monotonic() - t0)
        except PeerTimeoutError as e:
            out[step] = (str(e), e.phase, time.monotonic() - t0)
        open(os.path.join(markers, f"{step}.{ctx.rank}"), "w").close()

    # 1. clean_low_latency_buffer, which rank 1 never calls; then destroy()
    group = dist.new_group([0, 1], backend="gloo")
    m, h, e = 4, 128, 4
    hint = Buffer.get_low_latency_rdma_size_hint(m, h, 2, e)
    fast = cpu_nvlink.nvlink_buffer(group, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True)
    if ctx.rank == 0:
        timed("clean", lambda: fast.clean_low_latency_buffer(m, h, e))
        timed("destroy", fast.destroy)
    else:
        _wait_for(os.path.join(markers, "destroy.0"))

    # 2. building the nvlink backend: rank 1 builds only its Buffer
    group = dist.new_group([0, 1], backend="gloo")
    buf = Buffer(group, num_nvl_bytes=1 << 20)
    if ctx.rank == 0:
        timed("rendezvous", lambda: NVLinkBackend(buf))
    else:
        _wait_for(os.path.join(markers, "rendezvous.0"))
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    markers = str(tmp_path_factory.mktemp("markers"))
    return parallel_launch(2, _steps, uuid.uuid4().hex[:12], markers, backend="gloo", timeout_s=240)[0]


@pytest.mark.parametrize("step, phase", [
    ("rendezvous", "Buffer/before the symmetric-memory rendezvous"),
    ("clean", "clean_low_latency_buffer/before"),
])
def test_a_skipped_step_gives_the_deadline_error(outcomes, step, phase):
    message, got_phase, took = outcomes[step]
    assert got_phase == phase, f"{step}: expected PeerTimeoutError for {phase!r}, got: {message}"
    assert message.startswith(f"epcomm rank 0: {phase} waited {TIMEOUT_S:g} s"), message
    assert 0.8 * TIMEOUT_S <= took < TIMEOUT_S + 4, f"{step}: gave up after {took:.1f} s"


def test_destroy_after_a_deadline_does_not_wait_on_the_peer(outcomes):
    message, _, took = outcomes["destroy"]
    assert message == "returned", f"destroy() after the timed-out clean: {message}"
    assert took < TIMEOUT_S / 2, f"destroy() took {took:.1f} s"

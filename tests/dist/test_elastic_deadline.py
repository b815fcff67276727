"""Tier 2 (gloo, 2 spawned CPU ranks): ``ElasticBuffer``'s own host waits have deadlines.

Both ranks build an ``ElasticBuffer`` (reference backend) with ``EPCOMM_TIMEOUT_S=2``; then rank 0 calls
``barrier()`` and rank 1 does not. Rank 0 must raise ``PeerTimeoutError`` naming itself, rank 1, the phase
and ``EPCOMM_TIMEOUT_S`` within a few seconds of the deadline, and its ``destroy()`` must return at once (no
barrier with a peer that is out of step). Then, without the variable, on a buffer made with
``num_cpu_timeout_secs=2``, rank 0 calls ``barrier()`` and ``dispatch()`` alone: each error names
``num_cpu_timeout_secs`` as what set the deadline. Rank 1 waits for rank 0's marker file, then leaves.
"""

from __future__ import annotations

import os
import time

from epcomm.testing.launcher import parallel_launch

TIMEOUT_S = 2.0


def _steps(ctx, markers):
    import torch
    import torch.distributed as dist

    os.environ["EPCOMM_TIMEOUT_S"] = str(TIMEOUT_S)
    from epcomm import ElasticBuffer
    from epcomm.backends.base import PeerTimeoutError

    group = dist.new_group([0, 1], backend="gloo")
    buf = ElasticBuffer(group, num_max_tokens_per_rank=4, hidden=128, num_topk=2, explicitly_destroy=True)
    del os.environ["EPCOMM_TIMEOUT_S"]  # (the buffer's deadlines are its arguments' where it is unset)
    own = ElasticBuffer(dist.new_group([0, 1], backend="gloo"), num_max_tokens_per_rank=4, hidden=128, num_topk=2,
                        num_cpu_timeout_secs=int(TIMEOUT_S))
    x, idx = torch.zeros(4, 128, dtype=torch.bfloat16), torch.tensor([[0, 1]] * 4)
    out = {}
    if ctx.rank == 0:
        for step, fn in (("barrier", buf.barrier), ("destroy", buf.destroy), ("own barrier", own.barrier),
                         ("own dispatch", lambda: own.dispatch(x, topk_idx=idx, num_experts=4))):
            if step.startswith("own"):  # (a host wait reads the variable when it begins)
                os.environ.pop("EPCOMM_TIMEOUT_S", None)
            else:
                os.environ["EPCOMM_TIMEOUT_S"] = str(TIMEOUT_S)
            t0 = time.monotonic()
            try:
                fn()
                out[step] = ("returned", None, time.monotonic() - t0)
            except PeerTimeoutError as e:
                out[step] = (str(e), e.phase, time.monotonic() - t0)
        open(os.path.join(markers, "done"), "w").close()
    else:
        end = time.monotonic() + 60
        while not os.path.exists(os.path.join(markers, "done")) and time.monotonic() < end:
            time.sleep(0.05)
    return out


def test_an_elastic_barrier_without_the_peer_gives_the_deadline_error(tmp_path):
    out = parallel_launch(2, _steps, str(tmp_path), backend="gloo", timeout_s=120)[0]
    message, phase, took = out["barrier"]
    assert phase == "ElasticBuffer.barrier", message
    assert message.startswith(f"epcomm rank 0: ElasticBuffer.barrier waited {TIMEOUT_S:g} s for rank 1"), message
    assert message.endswith(f"(EPCOMM_TIMEOUT_S={TIMEOUT_S:g} sets the deadline)"), message
    assert 0.8 * TIMEOUT_S <= took < TIMEOUT_S + 4, f"gave up after {took:.1f} s"
    message, _, took = out["destroy"]
    assert message == "returned" and took < TIMEOUT_S / 2, (message, took)
    for step in ("own barrier", "own dispatch"):  # the deadline set by the argument says so
        message, _, took = out[step]
        assert f"waited {TIMEOUT_S:g} s for rank 1" in message, (step, message)
        assert message.endswith(f"(num_cpu_timeout_secs={TIMEOUT_S:g} sets the deadline)"), (step, message)
        assert took < TIMEOUT_S + 4, (step, took)

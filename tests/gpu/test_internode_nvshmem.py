"""Tier 3: NVSHMEM through torch for the internode backend (issue 16), on GPUs.

- ``test_nvshmem_loopback``: two ranks, two virtual nodes of one GPU each: the NVSHMEM settings go in
  before NVSHMEM starts, the device-call layer (``kernels/nvshmem.py``) compiles under
  ``requires_nvshmem``, and a put-with-signal from each rank to itself arrives intact. It needs two
  GPUs: torch's NVSHMEM rendezvous refuses a one-rank group ("Expected global_ranks.size() > 1", one
  H100, 2026-11-24), and NVSHMEM does not put two ranks on one GPU.
- ``test_nvshmem_signal_never_overtakes_its_data``: two ranks as two virtual nodes of one GPU
  (``EPCOMM_GPUS_PER_NODE=1``; nvidia-h200-x2): 200 rounds of ping-pong of 4 MiB; the receiver counts
  bytes that were stale when the signal arrived (``testing/nvshmem_order.py``); all must be 0.
"""
import os

import pytest
import torch

from epcomm.testing.launcher import parallel_launch

WORLD = int(os.environ.get("EPCOMM_TEST_WORLD", "2"))


def _setup(ctx, nbytes):
    from epcomm.backends import internode
    from epcomm.kernels import nvshmem

    if not nvshmem.available():
        pytest.skip("torch's NVSHMEM Triton bindings are unavailable")
    os.environ["EPCOMM_GPUS_PER_NODE"] = "1"
    settings = internode.prepare_nvshmem(num_qps_per_rank=24, symmetric_bytes=64 + 2 * nbytes)
    nodes, _ = internode.group_nodes(ctx.group)
    t, _ = internode.nvshmem_symmetric(64 + 2 * nbytes, ctx.device, ctx.group)
    t.zero_()
    table = torch.zeros(ctx.world_size, dtype=torch.int64, device=ctx.device)
    table[ctx.rank] = t.data_ptr()  # NVSHMEM translates this rank's symmetric address for the peer
    torch.cuda.synchronize()
    torch.distributed.barrier(group=ctx.group)
    return settings, nodes, t, table


def _loopback(ctx):
    from epcomm.testing import nvshmem_order as po

    nbytes = 1 << 20
    settings, nodes, _, table = _setup(ctx, nbytes)
    out = torch.full((1,), -1, dtype=torch.int32, device=ctx.device)
    err = torch.zeros(6, dtype=torch.int32, device=ctx.device)
    po.loopback(table, ctx.rank, nbytes, out, err, int(5e9), sim=False)
    torch.cuda.synchronize()
    assert err[0].item() == 0, po.describe_error(err.tolist())
    return int(out.item()), nodes, os.environ.get("NVSHMEM_IBGDA_NUM_RC_PER_PE"), sorted(settings)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NVSHMEM through torch needs 2+ ranks on 2+ GPUs")
def test_nvshmem_loopback():
    for bad, nodes, qps, settings in parallel_launch(2, _loopback, backend="nccl", timeout_s=300):
        assert bad == 0 and nodes == [0, 1] and qps is not None
        assert "NVSHMEM_SYMMETRIC_SIZE" in settings


def _pingpong(ctx, rounds, nbytes):
    from epcomm.testing import nvshmem_order as po

    _, nodes, _, table = _setup(ctx, nbytes)
    out = torch.full((rounds,), -1, dtype=torch.int32, device=ctx.device)
    err = torch.zeros(6, dtype=torch.int32, device=ctx.device)
    po.pingpong(table, ctx.rank, rounds, nbytes, out, err, int(10e9), sim=False)
    torch.cuda.synchronize()
    assert err[0].item() == 0, po.describe_error(err.tolist())
    torch.distributed.barrier(group=ctx.group)
    return nodes, out.tolist()


@pytest.mark.skipif(WORLD != 2 or torch.cuda.device_count() < 2, reason="two GPUs: two virtual nodes of one")
def test_nvshmem_signal_never_overtakes_its_data():
    res = parallel_launch(2, _pingpong, 200, 4 << 20, backend="nccl", timeout_s=300)
    assert res[0][0] == [0, 1]
    assert res[1][1] == [0] * 200, [i for i, b in enumerate(res[1][1]) if b]

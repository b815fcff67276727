"""Tier 2: the internode backend's pieces on CPU processes (``testing/cpu_nvlink.py`` maps every rank's
symmetric buffer into every process; the NVSHMEM device calls are simulated, ``kernels/nvshmem.py``).

- The ordering guarantee of the simulated put-with-signal: a signal never overtakes its data
  (``testing/nvshmem_order.py``: ping-pong of a 64 KiB payload, the receiver counts stale bytes).
- Virtual nodes and the selection rule: ``EPCOMM_GPUS_PER_NODE`` splits the ranks into nodes.
"""
import importlib.util
import uuid

import pytest

from epcomm.testing.launcher import parallel_launch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton (the interpreter)")


def _pingpong(ctx, tag, rounds, nbytes):
    from epcomm.testing import cpu_nvlink

    cpu_nvlink.install(tag, ctx.rank, ctx.world_size, ctx.group)
    import torch
    import torch.distributed._symmetric_memory as symm_mem

    from epcomm.testing import nvshmem_order as po

    buf = symm_mem.empty(64 + 2 * nbytes, dtype=torch.uint8)
    buf.zero_()
    hdl = symm_mem.rendezvous(buf, ctx.group.group_name)
    table = torch.tensor(hdl.buffer_ptrs, dtype=torch.int64)
    out = torch.full((rounds,), -1, dtype=torch.int32)
    err = torch.zeros(6, dtype=torch.int32)
    torch.distributed.barrier(group=ctx.group)
    po.pingpong(table, ctx.rank, rounds, nbytes, out, err, int(2e6), sim=True)
    assert err[0] == 0, po.describe_error(err.tolist())
    torch.distributed.barrier(group=ctx.group)
    return out.tolist()


@needs_triton
def test_simulated_signal_never_overtakes_its_data():
    res = parallel_launch(2, _pingpong, uuid.uuid4().hex[:12], 6, 64 << 10, backend="gloo", timeout_s=300)
    assert res[1] == [0] * 6, f"stale bytes seen after the signal, per round: {res[1]}"


def _selection(ctx, tag):
    """Virtual nodes on a gloo group, the forced backend's error, and the loopback (the single-GPU
    smoke test's kernel) in the simulation."""
    import os

    from epcomm.testing import cpu_nvlink

    os.environ["EPCOMM_GPUS_PER_NODE"] = "1"
    cpu_nvlink.install(tag, ctx.rank, ctx.world_size, ctx.group)
    import torch
    import torch.distributed._symmetric_memory as symm_mem

    from epcomm import Buffer
    from epcomm.backends.internode import group_nodes
    from epcomm.testing import nvshmem_order as po

    nodes, how = group_nodes(ctx.group)
    os.environ["EPCOMM_BACKEND"] = "internode"
    try:
        Buffer(ctx.group)
        forced = "no error"
    except RuntimeError as e:
        forced = str(e)
    del os.environ["EPCOMM_BACKEND"]
    auto = Buffer(ctx.group).backend_name  # gloo with CPU tensors: the reference, whatever the nodes
    nbytes = 5000
    buf = symm_mem.empty(64 + 2 * nbytes, dtype=torch.uint8)
    buf.zero_()
    table = torch.tensor(symm_mem.rendezvous(buf, ctx.group.group_name).buffer_ptrs, dtype=torch.int64)
    out, err = torch.full((1,), -1, dtype=torch.int32), torch.zeros(6, dtype=torch.int32)
    po.loopback(table, ctx.rank, nbytes, out, err, int(1e5), sim=True)
    torch.distributed.barrier(group=ctx.group)
    return nodes, how, forced, auto, int(out[0]), err[0].item()


@needs_triton
def test_virtual_nodes_selection_and_loopback():
    res = parallel_launch(2, _selection, uuid.uuid4().hex[:12], backend="gloo", timeout_s=300)
    for nodes, how, forced, auto, bad, err in res:
        assert nodes == [0, 1] and "2 virtual node(s) of 1 rank(s)" in how
        assert forced == "EPCOMM_BACKEND=internode cannot run here: the group is not on CUDA (gloo/CPU tensors)"
        assert auto == "reference"
        assert (bad, err) == (0, 0)

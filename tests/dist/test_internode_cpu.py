"""Tier 2: the internode backend's pieces on CPU processes (``testing/cpu_nvlink.py`` maps every rank's
symmetric buffer into every process; the NVSHMEM device calls are simulated, ``kernels/nvshmem.py``).

- The ordering of the simulated NVSHMEM (``kernels/nvshmem_sim.py``: as weak as NVSHMEM's rules), by a
  ping-pong of a 64 KiB payload whose receiver counts stale bytes (``testing/nvshmem_order.py``): a
  put-with-signal's own data, and a plain put followed by a fence or a quiet, arrive before the
  signal; a plain put with nothing between it and the signal arrives after it (stale bytes), so the
  simulation does fail a kernel that signals before its data is fenced. (Tier 2's internode tests
  then run our kernels on that simulation; each also checks that no put was left undelivered.)
- Virtual nodes and the selection rule: ``EPCOMM_GPUS_PER_NODE`` splits the ranks into nodes.
"""
import functools
import importlib.util
import uuid

import harness
import pytest

from epcomm.testing.launcher import parallel_launch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton (the interpreter)")


ORDERS = {"put_signal": 6, "fence": 6, "quiet": 6, "none": 4}  # how rank 0 orders data and signal: rounds


def _pingpong(ctx, tag, nbytes):
    """Every ordering of ``ORDERS`` in turn, each on its own buffer (signals from 0); per ordering rank 1's
    stale-byte counts, the puts left undelivered when the kernel ended and the simulation's counts for
    that ordering."""
    from epcomm.testing import cpu_nvlink

    cpu_nvlink.install(tag, ctx.rank, ctx.world_size, ctx.group)
    import torch
    import torch.distributed._symmetric_memory as symm_mem

    from epcomm.kernels import nvshmem_sim
    from epcomm.testing import nvshmem_order as po

    res = {}
    for how, rounds in ORDERS.items():
        buf = symm_mem.empty(64 + 2 * nbytes, dtype=torch.uint8)
        buf.zero_()
        hdl = symm_mem.rendezvous(buf, ctx.group.group_name)
        table = torch.tensor(hdl.buffer_ptrs, dtype=torch.int64)
        out = torch.full((rounds,), -1, dtype=torch.int32)
        err = torch.zeros(6, dtype=torch.int32)
        before = dict(nvshmem_sim.stats)
        torch.distributed.barrier(group=ctx.group)
        po.pingpong(table, ctx.rank, rounds, nbytes, out, err, int(2e6), sim=True, how=how)
        assert err[0] == 0, po.describe_error(err.tolist())
        left = nvshmem_sim.pending()  # (overtaken puts land late)
        nvshmem_sim.flush()
        torch.distributed.barrier(group=ctx.group)
        res[how] = (out.tolist(), left, {k: v - before[k] for k, v in nvshmem_sim.stats.items()})
    return res


@functools.cache
def _orders():
    """One launch for the tests below (each ordering is a few seconds; starting the ranks is more)."""
    return parallel_launch(2, _pingpong, uuid.uuid4().hex[:12], 64 << 10, backend="gloo", timeout_s=300,
                           server=harness.INTERPRETER)


@needs_triton
@pytest.mark.parametrize("how", ["put_signal", "fence", "quiet"])
def test_simulated_signal_never_overtakes_its_data(how):
    res = [r[how] for r in _orders()]
    assert res[1][0] == [0] * 6, f"stale bytes seen after the signal, per round: {res[1][0]}"
    assert res[0][1] == res[1][1] == 0 and res[0][2]["overtaken"] == 0, res[0]
    assert res[0][2]["puts"] == (0 if how == "put_signal" else 6), res[0][2]


@needs_triton
def test_simulated_put_without_fence_lands_after_the_signal():
    """The simulation is as weak as NVSHMEM: a plain put, then a signal with no fence or quiet between
    them: the signal goes first and the receiver counts stale bytes, in every round where the put did
    not land early by chance (``nvshmem_sim.EARLY_P``) before the signal."""
    res = [r["none"] for r in _orders()]
    stale, stats = res[1][0], res[0][2]
    assert stats["overtaken"] + stats["early"] == 4 and stats["overtaken"] > 0, stats
    assert stale.count(0) <= stats["early"], (stale, stats)


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
    res = parallel_launch(2, _selection, uuid.uuid4().hex[:12], backend="gloo", timeout_s=300,
                          server=harness.INTERPRETER)
    for nodes, how, forced, auto, bad, err in res:
        assert nodes == [0, 1] and "2 virtual node(s) of 1 rank(s)" in how
        assert forced == "EPCOMM_BACKEND=internode cannot run here: the group is not on CUDA (gloo/CPU tensors)"
        assert auto == "reference"
        assert (bad, err) == (0, 0)

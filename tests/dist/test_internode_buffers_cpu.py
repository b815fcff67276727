"""Tier 2: the internode backend's symmetric buffer holds each byte the Buffer asks for once, and
``get_local_buffer_tensor`` views that buffer (no second allocation beside it): the NVL buffer is the
high-throughput region's first ``num_nvl_bytes``; the RDMA buffer the low-latency region in
low-latency mode, else the high-throughput region's next ``num_rdma_bytes``. Two CPU processes, virtual
nodes of one rank, NVSHMEM simulated (``epcomm.testing.cpu_internode``); no kernel runs.
"""
import importlib.util
import os
import uuid

import harness
import pytest

from epcomm.testing.launcher import parallel_launch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter)")


def _sizes(ctx, tag):
    os.environ["EPCOMM_GPUS_PER_NODE"] = "1"
    import torch

    from epcomm.backends.internode import DEFAULT_HT_BYTES, _align
    from epcomm.testing import cpu_nvlink

    cpu_nvlink.install(tag, ctx.rank, ctx.world_size, ctx.group)
    from epcomm.testing import cpu_internode

    def inside(view, symm):  # a view of the symmetric buffer, not a tensor of its own
        base, n = symm.data_ptr(), symm.numel()
        return view.untyped_storage().data_ptr() == symm.untyped_storage().data_ptr() and (
            base <= view.data_ptr() and view.data_ptr() + view.numel() <= base + n)

    nvl, rdma = 3 << 10, 5 << 10
    totals = {}
    for ll in (False, True):
        empty = cpu_internode.internode_buffer(ctx.group, low_latency_mode=ll)
        fixed = empty._backend.symm.numel() - DEFAULT_HT_BYTES  # the control words, signals, staging
        empty._backend.destroy()
        buf = cpu_internode.internode_buffer(ctx.group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, low_latency_mode=ll)
        be = buf._backend
        totals[ll] = be.symm.numel() - fixed
        a = buf.get_local_buffer_tensor(torch.uint8)
        b = buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
        assert (a.numel(), b.numel()) == (nvl, rdma), (a.numel(), b.numel())
        assert inside(a, be.symm) and inside(b, be.symm), "a local buffer is not a view of the symmetric buffer"
        lo, hi = sorted([(a.data_ptr(), a.numel()), (b.data_ptr(), b.numel())])
        assert lo[0] + lo[1] <= hi[0], "the NVL and RDMA buffers overlap"
        a.fill_(7)  # what the user writes is in the symmetric buffer, at the HT region's start
        assert be.symm[be.ht_off:be.ht_off + nvl].eq(7).all()
        be.destroy()
    # outside low-latency mode both byte counts live in the HT region, once; in low-latency mode the RDMA
    # bytes are the LL region (and half again for the combine's staging)
    assert totals[False] == _align(nvl + rdma), (totals, _align(nvl + rdma))
    assert totals[True] == _align(rdma) + _align(_align(rdma) // 2) + _align(nvl), totals
    return True


def test_local_buffers_are_views_and_each_byte_is_reserved_once(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (the spawned ranks inherit it)
    assert parallel_launch(2, _sizes, uuid.uuid4().hex[:12], backend="gloo", timeout_s=300,
                           server=harness.INTERPRETER) == [True, True]

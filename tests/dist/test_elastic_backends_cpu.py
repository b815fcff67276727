"""Tier 2: ``ElasticBuffer`` on the nvlink backend and on the internode backend (two virtual nodes of one
rank: every byte crosses the simulated NVSHMEM; and two nodes of two ranks: the hierarchical path,
forwarded in the node) on CPU processes (Triton kernels under the interpreter,
symmetric memory simulated: ``epcomm.testing.cpu_nvlink`` / ``cpu_internode``), against the same oracles as the
reference backend (``epcomm.testing.elastic_cases``): dispatch bitwise for both layouts, BF16 and FP8 with
opaque int32 packs, CPU sync and worst-case shapes (the backend's ``num_worst_tokens`` path), cached
replays; combine bitwise with biases and weights back. GPU memory ordering and graphs are tier 3's.
"""
import importlib.util
import os
import uuid

import pytest

from epcomm.testing.launcher import parallel_launch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter)")


def _run(ctx, tag, backend, gpus_per_node):
    os.environ["EPCOMM_TIMEOUT_S"] = "20"  # the buffer keeps the interpreter's spin count as its deadline
    if backend == "internode":
        os.environ["EPCOMM_GPUS_PER_NODE"] = str(gpus_per_node)
    from epcomm.testing import cpu_nvlink

    cpu_nvlink.install(tag, ctx.rank, ctx.world_size, ctx.group)
    from epcomm import ElasticBuffer
    from epcomm.testing import cpu_internode
    from epcomm.testing import elastic_cases as C

    make = cpu_nvlink.nvlink_buffer if backend == "nvlink" else cpu_internode.internode_buffer

    class OnBackend(ElasticBuffer):
        @staticmethod
        def _engine_cls(group, **kw):
            return make(group, **kw)

    case = C.V2Case(num_ranks=ctx.world_size, tokens=(5, 9, 0, 6)[:ctx.world_size], hidden=128, num_topk=3,
                    num_experts=8, seed=7)
    buf = OnBackend(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden, num_topk=case.num_topk)
    assert buf._backend.name == backend
    checks = (("bf16", False, 1, True), ("bf16", True, 4, False), ("ue8m0", True, 1, True), ("fp32", False, 4, False))
    for sf_kind, expand, alignment, sync in checks[:4 if backend == "nvlink" else 2]:
        C.check_dispatch(buf, case, ctx.rank, sf_kind, expand, alignment, sync)
    C.check_combine(buf, case, ctx.rank, False, 2, 1, False)
    if backend == "nvlink" or gpus_per_node > 1:
        C.check_combine(buf, case, ctx.rank, True, 1, 4, True)
    if backend == "nvlink":  # combines of another num_sms after these (the bench's SM sweep): the arrivals
        for sms in (2, 48):  # count every call's programs, not this call's times the calls
            C.check_combine(buf, case, ctx.rank, False, 0, 1, False, num_sms=sms)
        buf._backend._check_error()  # a wait that gave up has left its error word (rows land on CPU anyway)
    return buf.get_physical_domain_size()


@pytest.mark.parametrize("backend,world,gpus_per_node,domain", [
    ("nvlink", 2, 0, (1, 2)), ("internode", 2, 1, (2, 1)), ("internode", 4, 2, (2, 2))],
    ids=["nvlink", "internode-direct", "internode-hierarchical"])
def test_elastic_buffer_on_device_backends_on_cpu_processes(backend, world, gpus_per_node, domain):
    res = parallel_launch(world, _run, uuid.uuid4().hex[:12], backend, gpus_per_node, backend="gloo", timeout_s=300)
    assert res == [domain] * world

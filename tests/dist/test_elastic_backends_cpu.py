"""Tier 2: ``ElasticBuffer`` on the nvlink backend and on the internode backend (two virtual nodes of one
rank: every byte crosses the simulated NVSHMEM; and two nodes of two ranks: the hierarchical path,
forwarded in the node) on CPU processes (Triton kernels under the interpreter,
symmetric memory simulated: ``epcomm.testing.cpu_nvlink`` / ``cpu_internode``), against the same oracles as the
reference backend (``epcomm.testing.elastic_cases``): dispatch bitwise for both layouts, BF16 and FP8 with
opaque int32 packs, CPU sync and worst-case shapes (the backend's ``num_worst_tokens`` path), cached
replays; combine bitwise with biases and weights back. GPU memory ordering and graphs are tier 3's.

Also the host budget of every ``ElasticBuffer`` call kind on the nvlink backend: the torch calls,
allocations, kernel launches and host reads of device values of its host path above the backend's own
dispatch (which the nvlink backend's tier-1 host budget bounds), counted on the same host code a GPU host runs.

The checks of a world size (2: nvlink, internode direct, the host budget; 4: hierarchical) run in one launch,
one test each.
"""
import contextlib
import importlib.util
import os
import uuid

import harness
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter)")


_INSTALLED: list = []


def _on_backend(ctx, tag, backend, gpus_per_node=0):
    """In this fresh rank process: the interpreter and the simulated memory, and an ``ElasticBuffer`` class
    whose engine runs ``backend``."""
    os.environ["EPCOMM_TIMEOUT_S"] = "20"  # the buffer keeps the interpreter's spin count as its deadline
    if backend == "internode":
        os.environ["EPCOMM_GPUS_PER_NODE"] = str(gpus_per_node)
    else:  # (an earlier check of this process may have set it)
        os.environ.pop("EPCOMM_GPUS_PER_NODE", None)
    from epcomm.testing import cpu_nvlink

    if not _INSTALLED:  # once a process (the checks of a launch share it)
        cpu_nvlink.install(tag, ctx.rank, ctx.world_size, ctx.group)
        _INSTALLED.append(tag)
    from epcomm import ElasticBuffer
    from epcomm.testing import cpu_internode

    make = cpu_nvlink.nvlink_buffer if backend == "nvlink" else cpu_internode.internode_buffer

    class OnBackend(ElasticBuffer):
        @staticmethod
        def _engine_cls(group, **kw):
            return make(group, **kw)

    return OnBackend


def _run(ctx, tag, backend, gpus_per_node):
    OnBackend = _on_backend(ctx, tag, backend, gpus_per_node)
    from epcomm.testing import elastic_cases as C

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


BACKENDS = {"nvlink": ("nvlink", 2, 0, (1, 2)), "internode-direct": ("internode", 2, 1, (2, 1)),
            "internode-hierarchical": ("internode", 4, 2, (2, 2))}


def _host_budget(ctx, tag):
    """Per call kind, ``(torch calls, of which metadata reads, allocations, kernel launches, host reads of
    device values)``
    of ``ElasticBuffer``'s host path (``epcomm.testing.torch_calls.HostCount``), the backend's own dispatch
    and cached dispatch left out; each kind counted on its second call (the first binds its launches)."""
    import torch

    from epcomm.testing import elastic_cases as C
    from epcomm.testing.torch_calls import HostCount

    OnBackend = _on_backend(ctx, tag, "nvlink")
    # (few tokens: the counts do not depend on T, 3 and 5 give every count that 12 and 16 did, and every program
    # of every launch runs in Python here)
    case = C.V2Case(num_ranks=2, tokens=(3, 5), hidden=128, num_topk=8, num_experts=16, seed=7, masked=0.1)
    counting: list = []

    def make(**kw):
        buf = OnBackend(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden, num_topk=case.num_topk, **kw)
        for name in ("dispatch", "cached_dispatch"):  # the V1 host path, bounded in tier 1
            setattr(buf._backend, name, uncounted(getattr(buf._backend, name)))
        return buf

    def uncounted(fn):
        def call(*a, **k):
            with counting[-1].paused() if counting else contextlib.nullcontext():
                return fn(*a, **k)
        return call

    got = {}

    def count(kind, fn, *a, **k):
        fn(*a, **k)
        with HostCount() as c:
            counting.append(c)
            out = fn(*a, **k)
        counting.clear()
        got[kind] = (c.ops, c.meta, c.allocs, c.launches, c.syncs)
        return out

    buf = make()
    x, _, idx, w = C.inputs(case, ctx.rank)
    b = C.bias(case, ctx.rank, 2)
    kw = dict(topk_idx=idx, topk_weights=w, num_experts=case.num_experts, num_max_tokens_per_rank=case.m)
    for expand in (False, True):
        tag = "expanded" if expand else "contiguous"
        count(f"dispatch sync {tag}", buf.dispatch, x, **kw, do_expand=expand, expert_alignment=4)
        rx, _, rw, hd, _ = count(f"dispatch {tag}", buf.dispatch, x, **kw, do_expand=expand, expert_alignment=4,
                                 do_cpu_sync=False)
        count(f"cached {tag}", buf.dispatch, x, handle=hd, do_expand=expand)
        count(f"cached {tag} weights", buf.dispatch, x, handle=hd, do_expand=expand, topk_weights=w)
        y = torch.zeros(rx.shape[0], case.hidden, dtype=torch.bfloat16)
        count(f"combine {tag}", buf.combine, y, hd)
        count(f"combine {tag} weights 2 biases", buf.combine, y, hd, topk_weights=rw, bias=b)
    single = make(allow_multiple_reduction=False)
    rx, _, _, hd, _ = single.dispatch(x, **kw, do_cpu_sync=False, do_expand=True)
    y = torch.zeros(rx.shape[0], case.hidden, dtype=torch.bfloat16)
    count("combine expanded single reduction", single.combine, y, hd, bias=b[0])
    return got


# (torch calls, of which metadata reads, allocations, launches, host reads) per call at 2 ranks, K = 8, nvlink
# backend: the counts of the commit that set them (a change that adds host work must raise a bound here, on
# purpose; since recv_meta takes its int64 outputs from blocks: fewer allocations, more contiguity reads).
# Before the V2 steps became kernels (cc90ea9^, its CUDA path), counted the same way: dispatch 124/30/79/84/0,
# expanded 150/39/88/96/0; combine 85/19/30/39/0, expanded 169/22/88/105/0.
HOST_BOUND = {
    "dispatch sync contiguous": (53, 40, 8, 5, 0),  # int64 outputs from one block, the handle's topk_idx too
    "dispatch contiguous": (53, 40, 8, 5, 0),
    "cached contiguous": (14, 12, 1, 1, 0),
    "cached contiguous weights": (46, 31, 4, 3, 0),
    "combine contiguous": (21, 19, 1, 3, 0),
    "combine contiguous weights 2 biases": (42, 37, 2, 3, 0),  # x and weights read in place: no pack
    "dispatch sync expanded": (67, 49, 10, 6, 0),
    "dispatch expanded": (67, 49, 10, 6, 0),
    "cached expanded": (22, 19, 1, 1, 0),
    "cached expanded weights": (47, 35, 3, 2, 0),
    "combine expanded": (26, 22, 2, 4, 0),
    "combine expanded weights 2 biases": (46, 38, 3, 4, 0),
    "combine expanded single reduction": (154, 133, 4, 32, 0),  # K transports of their own
}


def _check_host_budget(ctx, tag):
    got = _host_budget(ctx, tag)
    assert set(got) == set(HOST_BOUND), sorted(got)
    over = {k: (got[k], b) for k, b in HOST_BOUND.items() if any(g > m for g, m in zip(got[k], b))}
    assert not over, f"rank {ctx.rank}: host work per call above its bound (got, bound): {over}; all: {got}"


# The checks of a world size run in one launch (a launch costs seconds of process start and imports), one test
# each; each builds its own buffers (EPCOMM_GPUS_PER_NODE is read when one is built).
CHECKS = {2: ["nvlink", "internode-direct", "host-budget"], 4: ["internode-hierarchical"]}
TAG = uuid.uuid4().hex[:12]  # this session's shared-memory files


def _rank(ctx, tag):
    def one(name):
        if name == "host-budget":
            return lambda ctx: _check_host_budget(ctx, tag)
        backend, _, gpus_per_node, domain = BACKENDS[name]

        def run(ctx):
            got = _run(ctx, tag, backend, gpus_per_node)
            assert got == domain, (name, got, domain)
        return run

    return harness.run_checks(ctx, [(name, one(name)) for name in CHECKS[ctx.world_size]], env={})


@pytest.mark.parametrize("name", [n for checks in CHECKS.values() for n in checks])
def test_elastic_buffer_on_cpu_processes(name):
    world = next(w for w, checks in CHECKS.items() if name in checks)
    harness.report(harness.launch_gloo_once(_rank, world, TAG, timeout_s=600), name)

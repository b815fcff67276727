"""Tier 2: ``ElasticBuffer`` on the nvlink backend and on the internode backend (two virtual nodes of one
rank: every byte crosses the simulated NVSHMEM; and two nodes of two ranks: the hierarchical path,
forwarded in the node) on CPU processes (Triton kernels under the interpreter,
symmetric memory simulated: ``epcomm.testing.cpu_nvlink`` / ``cpu_internode``), against the same oracles as the
reference backend (``epcomm.testing.elastic_cases``): dispatch bitwise for both layouts, BF16 and FP8 with
opaque int32 packs, CPU sync and worst-case shapes (the backend's ``num_worst_tokens`` path), cached
replays; combine bitwise with biases and weights back. GPU memory ordering and graphs are tier 3's.

Also the host budget of every ``ElasticBuffer`` call kind on the nvlink backend: the torch calls,
allocations, kernel launches and host reads of device values of its whole host path, the backend's dispatch
included, counted on the same host code a GPU host runs.

And the per-kind plans of ``ElasticBuffer`` (``_check_plans``): a later call of a kind seen before gives the
oracle's results and leaves the earlier results unchanged.

The checks of a world size (2: nvlink, internode direct, the host budget, the plans; 4: hierarchical) run in one
launch, one test each.
"""
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

    make = cpu_nvlink.nvlink_backend() if backend == "nvlink" else cpu_internode.internode_backend()

    class OnBackend(ElasticBuffer):
        _make_backend = staticmethod(make)

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
    device values)`` of ``ElasticBuffer``'s whole host path (``epcomm.testing.torch_calls.HostCount``), the
    backend's dispatch and cached dispatch included (an ElasticBuffer plans them with scratch of its own:
    ``HTDispatch.dispatch_run(scratch_rows=)``); each kind counted on its second call (the first binds its
    launches and leaves its plan)."""
    import torch

    from epcomm.testing import elastic_cases as C
    from epcomm.testing.torch_calls import HostCount

    OnBackend = _on_backend(ctx, tag, "nvlink")
    # (few tokens: the counts do not depend on T, 3 and 5 give every count that 12 and 16 did, and every program
    # of every launch runs in Python here)
    case = C.V2Case(num_ranks=2, tokens=(3, 5), hidden=128, num_topk=8, num_experts=16, seed=7, masked=0.1)

    def make(**kw):
        return OnBackend(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden, num_topk=case.num_topk, **kw)

    got = {}

    def count(kind, fn, *a, **k):
        fn(*a, **k)
        with HostCount() as c:
            out = fn(*a, **k)
        got[kind] = (c.ops, c.meta, c.allocs, c.launches, c.syncs)
        return out

    buf = make()
    x, _, idx, w = C.inputs(case, ctx.rank)
    b = C.bias(case, ctx.rank, 2)
    kw = dict(topk_idx=idx, topk_weights=w, num_experts=case.num_experts, num_max_tokens_per_rank=case.m)
    rows = {}
    for expand in (False, True):
        tag = "expanded" if expand else "contiguous"
        count(f"dispatch sync {tag}", buf.dispatch, x, **kw, do_expand=expand, expert_alignment=4)
        rx, ridx, rw, hd, _ = count(f"dispatch {tag}", buf.dispatch, x, **kw, do_expand=expand, expert_alignment=4,
                                    do_cpu_sync=False)
        rows.setdefault(expand, (rx, ridx, int(hd.psum_num_recv_tokens_per_scaleup_rank[-1])))
        count(f"cached {tag}", buf.dispatch, x, handle=hd, do_expand=expand)
        count(f"cached {tag} weights", buf.dispatch, x, handle=hd, do_expand=expand, topk_weights=w)
        y = torch.zeros(rx.shape[0], case.hidden, dtype=torch.bfloat16)
        count(f"combine {tag}", buf.combine, y, hd)
        count(f"combine {tag} weights 2 biases", buf.combine, y, hd, topk_weights=rw, bias=b)
    kw.pop("topk_weights")  # (the backend moves zeros: the plan's own tensor, no allocation or fill a call)
    for _ in range(2):  # (its first call and a repeat: the kept zeros, read again)
        nx, nidx, nw, _, _ = count("dispatch contiguous no weights", buf.dispatch, x, **kw, do_cpu_sync=False,
                                   expert_alignment=4)
        rx, ridx, n = rows[False]  # (the rows past n are padding, unwritten)
        assert nw is None and torch.equal(nx[:n], rx[:n]) and torch.equal(nidx[:n], ridx[:n])
    single = make(allow_multiple_reduction=False)
    rx, _, _, hd, _ = single.dispatch(x, **kw, do_cpu_sync=False, do_expand=True)
    y = torch.zeros(rx.shape[0], case.hidden, dtype=torch.bfloat16)
    count("combine expanded single reduction", single.combine, y, hd, bias=b[0])
    return got


# (torch calls, of which metadata reads, allocations, launches, host reads) per call at 2 ranks, K = 8, nvlink
# backend, the whole path: the counts of the commit that set them (a change that adds host work must raise a
# bound here, on purpose). Counted the same way before the per-kind plans of ElasticBuffer (its checks and
# the backend's dispatch per call, every output allocated; at 501f1b8): dispatch 80/56/16/4/0, expanded
# 94/65/18/6/0, cached 31/25/2/2/0, with weights 63/44/5/4/0, expanded 39/32/2/2/0 and 64/48/4/3/0; combines as
# now. Before the V2 steps became kernels (cc90ea9^, its CUDA path, the backend's dispatch left out): dispatch
# 124/30/79/84/0, expanded 150/39/88/96/0; combine 85/19/30/39/0, expanded 169/22/88/105/0.
HOST_BOUND = {
    # the layout's counts, the received ids before recv_meta and the channel matrices are scratch
    "dispatch sync contiguous": (56, 37, 11, 4, 0),
    "dispatch contiguous": (41, 23, 11, 4, 0),  # recv_meta takes its plan from the kind's slot: no key
    "cached contiguous": (15, 10, 2, 2, 0),  # the kind's plan: no checks, no backend key
    "cached contiguous weights": (51, 32, 5, 4, 0),
    "combine contiguous": (22, 20, 1, 3, 0),
    "combine contiguous weights 2 biases": (44, 39, 2, 3, 0),  # x and weights read in place: no pack
    "dispatch sync expanded": (74, 49, 13, 6, 0),
    "dispatch expanded": (59, 35, 13, 6, 0),
    "cached expanded": (26, 20, 2, 2, 0),
    "cached expanded weights": (54, 38, 4, 3, 0),
    "combine expanded": (27, 23, 2, 4, 0),
    "combine expanded weights 2 biases": (47, 39, 3, 4, 0),
    "combine expanded single reduction": (155, 134, 4, 32, 0),  # K transports of their own
    # the zero weights are the plan's (a dispatch given none allocated and filled them each call: 37/18/12/5/0)
    "dispatch contiguous no weights": (36, 18, 11, 4, 0),
}


def _check_host_budget(ctx, tag):
    got = _host_budget(ctx, tag)
    assert set(got) == set(HOST_BOUND), sorted(got)
    over = {k: (got[k], b) for k, b in HOST_BOUND.items() if any(g > m for g, m in zip(got[k], b))}
    assert not over, f"rank {ctx.rank}: host work per call above its bound (got, bound): {over}; all: {got}"


def _check_plans(ctx, tag):
    """A kind's plan (elastic_engine) and its scratch serve every later call of the kind: a second input set
    of the same shapes goes the repeat path (no checks; dispatch, cached replay on its own handle, combine) and
    gives the oracle's results, and the first call's results, handle included, are unchanged by it (fresh
    tensors, never the scratch). A repeat with events still checks them. A plan keeps none of the tensors of
    the call that made it."""
    import gc
    import weakref

    import pytest
    import torch

    from epcomm.event import EventHandle
    from epcomm.testing import elastic_cases as C

    OnBackend = _on_backend(ctx, tag, "nvlink")
    one, two = (C.V2Case(num_ranks=2, tokens=(5, 9), hidden=128, num_topk=3, num_experts=8, seed=s) for s in (3, 4))
    buf = OnBackend(ctx.group, num_max_tokens_per_rank=one.m, hidden=one.hidden, num_topk=one.num_topk)
    for expand, alignment, sync in ((False, 1, False), (False, 4, True), (True, 4, False)):
        hd, ridx, rw = C.check_dispatch(buf, one, ctx.rank, "bf16", expand, alignment, sync)
        C.check_dispatch(buf, two, ctx.rank, "bf16", expand, alignment, sync)  # the same kind: the repeat path
        want = C.expected_dispatch(one, ctx.rank, "bf16", alignment)
        n = len(want["gid"])
        C._eq("first gid, after later calls", hd.recv_src_metadata[:n, 0], torch.tensor(want["gid"], dtype=torch.int32))
        assert hd.num_unaligned_recv_tokens_per_expert.tolist() == want["counts"], "first counts, after later calls"
        C._eq("first handle's topk_idx, after later calls", hd.topk_idx, C.inputs(one, ctx.rank)[2])
        if not expand:
            C._eq("first recv_topk_idx, after later calls", ridx[:n], want["local"])
            C._eq("first recv_topk_weights, after later calls", rw[:n], want["w"])
    for case in (one, two):  # the second combine: the repeat path, on its own handle
        C.check_combine(buf, case, ctx.rank, False, 2, 1, False)
    x, _, idx, w = C.inputs(one, ctx.rank)
    kw = dict(topk_idx=idx, topk_weights=w, num_experts=one.num_experts, do_cpu_sync=False,
              allocate_on_comm_stream=True)
    first = buf.dispatch(x, previous_event=EventHandle(), **kw)
    again = buf.dispatch(x, previous_event=EventHandle(), **kw)  # (a kind with an event: the repeat path)
    n = int(first[3].psum_num_recv_tokens_per_scaleup_rank[-1])  # (rows past it are padding: unspecified)
    C._eq("a repeat with an event", again[0][:n], first[0][:n])
    with pytest.raises(TypeError, match="previous_event"):
        buf.dispatch(x, previous_event=object(), **kw)
    with pytest.raises(TypeError, match="previous_event"):
        buf.combine(first[0], first[3], previous_event=object(), allocate_on_comm_stream=True)
    buf.combine(first[0], first[3], previous_event=EventHandle(), allocate_on_comm_stream=True)
    with pytest.raises(TypeError, match="previous_event"):  # (now a kind seen before)
        buf.combine(first[0], first[3], previous_event=object(), allocate_on_comm_stream=True)
    # a plan keeps none of its first call's tensors (an x of a new kind, dispatched, then dropped)
    x2 = x[:2].clone()
    got = buf.dispatch(x2, **dict(kw, topk_idx=idx[:2].clone(), topk_weights=w[:2].clone()))
    dropped = weakref.ref(x2)
    del x2, got
    gc.collect()
    assert dropped() is None, "a plan keeps its first call's x alive"


def _with_native(how: str, fn):
    """``fn()`` with ``EPCOMM_NATIVE=how`` (read when a plan is made), put back after."""
    before = os.environ.get("EPCOMM_NATIVE")
    os.environ["EPCOMM_NATIVE"] = how
    try:
        return fn()
    finally:
        if before is None:
            os.environ.pop("EPCOMM_NATIVE", None)
        else:
            os.environ["EPCOMM_NATIVE"] = before


def _check_native(ctx, tag):
    """The nvlink checks with every planned output made by the C++ extension (``native.Outputs``; on CPU with
    ``EPCOMM_NATIVE=all``): the backend's dispatch, layout and combine, ``recv_meta``."""
    from epcomm import native

    assert native.module() is not None, f"the native extension was not built: {native._state.get('why')}"
    assert _run(ctx, tag, "nvlink", 0) == (1, 2)


def _arguments_that_differ(ctx, tag):
    """Ranks that disagree on the experts, the hidden size, M: a ValueError on every rank naming them at the first
    call of the kind, before any kernel (``agree_checks``), on the nvlink backend and on two virtual nodes."""
    import agree_checks

    for backend, gpus_per_node in (("nvlink", 0), ("internode", 1)):
        agree_checks.v2(ctx, _on_backend(ctx, tag, backend, gpus_per_node))


# The checks of a world size run in one launch (a launch costs seconds of process start and imports), one test
# each; each builds its own buffers (EPCOMM_GPUS_PER_NODE is read when one is built).
CHECKS = {2: ["nvlink", "nvlink-native", "internode-direct", "host-budget", "plans", "arguments-that-differ"],
          4: ["internode-hierarchical"]}
TAG = uuid.uuid4().hex[:12]  # this session's shared-memory files


def _rank(ctx, tag):
    def one(name):
        if name == "plans":
            return lambda ctx: _check_plans(ctx, tag)
        if name == "arguments-that-differ":
            return lambda ctx: _arguments_that_differ(ctx, tag)
        if name == "nvlink-native":
            return lambda ctx: _with_native("all", lambda: _check_native(ctx, tag))
        if name == "host-budget":
            return lambda ctx: _with_native("1", lambda: _check_host_budget(ctx, tag))
        backend, _, gpus_per_node, domain = BACKENDS[name]

        def run(ctx):
            got = _run(ctx, tag, backend, gpus_per_node)
            assert got == domain, (name, got, domain)
        return run

    return harness.run_checks(ctx, [(name, one(name)) for name in CHECKS[ctx.world_size]], env={})


def _world(name: str) -> int:
    return next(w for w, checks in CHECKS.items() if name in checks)


def start_early(items):  # (tests/conftest.py) this module's launches, in the background (tests/dist/background.py)
    harness.queue_gloo_once(dict.fromkeys((_rank, _world(it.callspec.params["name"]), TAG) for it in items),
                            timeout_s=600)


stop_early = harness.stop_early


@pytest.mark.parametrize("name", [n for checks in CHECKS.values() for n in checks])
def test_elastic_buffer_on_cpu_processes(name):
    world = _world(name)
    harness.report(harness.launch_gloo_once(_rank, world, TAG, timeout_s=600), name)

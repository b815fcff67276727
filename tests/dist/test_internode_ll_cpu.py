"""Tier 2: the internode backend's low-latency path — its host code and its Triton kernels under the
interpreter, the NVSHMEM device calls simulated — on CPU processes in virtual nodes
(``EPCOMM_GPUS_PER_NODE``), against the reference backend (``epcomm.testing.cpu_internode``).

- Two nodes of one rank: every peer through (simulated) NVSHMEM puts. Repeats of a kind of call
  through Buffer's repeat path; BF16 with the statistics and ``out=``; FP8 with round_scale and UE8M0, the receive hook and zero-copy; ``async_finish``; an expert
  id out of range found on the device; the high-throughput dispatch's expert-id check.
- Four ranks in two nodes of two: peers of the node by plain stores (allow_nvlink_for_low_latency_mode),
  the others through NVSHMEM, FP8 with the hook then BF16 zero-copy on one Buffer; one node of two with allow_nvlink_for_low_latency_mode=False: the node's
  peer through NVSHMEM too.
- Errors: arguments that differ across ranks are named at a kind's first call (``agree_checks``, the
  high-throughput calls too), M differing across ranks by the device too; a rank that never arrives gives the deadline error (rank
  and phase), in two nodes of one and in two nodes of two; with shrink (two nodes of one) the absent
  rank is masked at the deadline and the call carries on.

Dispatch bitwise (FP8 within one e4m3 step, as the nvlink checks), combine within the BF16 budget
(``gpu_cases.check_ll_case``). NVSHMEM itself (its transports, ordering on a network) is tier 3's
(``tests/gpu/test_internode_nvshmem.py``). Shapes are tiny: the interpreter runs every program in Python.
All checks of a world size (2, 4) run in one launch, one test each.
"""
import importlib.util
import os
import uuid

import harness
import pytest

# (not importorskip: the ranks must set TRITON_INTERPRET before anything imports Triton)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter)")

M = 8


_INSTALLED: list = []  # the checks of a launch share one process: install once


def _setup(ctx, tag, gpus_per_node):
    os.environ["EPCOMM_GPUS_PER_NODE"] = str(gpus_per_node)  # read when a Buffer is built
    from epcomm.testing import cpu_nvlink

    if not _INSTALLED:
        cpu_nvlink.install(tag, ctx.rank, ctx.world_size, ctx.group)
        _INSTALLED.append(tag)
    from epcomm.testing import cpu_internode

    return cpu_internode


def _case(ctx, hidden=256, seed=3, tokens=6):
    from epcomm.testing.inputs import Case

    r = ctx.world_size
    return Case(num_ranks=r, tokens=tuple(max(1, tokens - i) for i in range(r)), hidden=hidden, num_topk=4,
                num_experts=4 * r, seed=seed)


def _buffers(ctx, cpu_internode, case, **kw):
    from epcomm import Buffer

    hint = Buffer.get_low_latency_rdma_size_hint(M, case.hidden, ctx.world_size, case.num_experts)
    ref = Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)
    fast = cpu_internode.internode_buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True, **kw)
    assert fast.backend_name == "internode" and ref.backend_name == "reference"
    return ref, fast


def _async_check(ref, fast, case, rank):
    """async_finish on dispatch and combine (the events are waited on before the results are read)."""
    import torch

    from epcomm.testing import gpu_cases as G
    from epcomm.testing.compare import assert_bitwise, assert_within_budget

    e = case.num_experts
    x, topk, w = G.ll_inputs(case, rank, "cpu", seed_shift=7)
    rr = ref.low_latency_dispatch(x, topk, M, e, use_fp8=False)
    fr = fast.low_latency_dispatch(x, topk, M, e, use_fp8=False, async_finish=True)
    assert fr[4] is None
    fr[3].current_stream_wait()
    assert_bitwise(fr[1], rr[1], "async recv_count")
    for l_, n in enumerate(rr[1].tolist()):
        assert_bitwise(fr[0][l_, :n], rr[0][l_, :n], f"async recv_x[{l_}]")
        assert_bitwise(fr[2].recv_src_info[l_, :n], rr[2].recv_src_info[l_, :n], f"async recv_src_info[{l_}]")
    y = torch.zeros_like(rr[0])
    for l_, n in enumerate(rr[1].tolist()):
        y[l_, :n] = (rr[0][l_, :n].float() * (1 + l_ / 8)).to(torch.bfloat16)
    ro, _, _ = ref.low_latency_combine(y, topk, w, rr[2])
    ro_abs, _, _ = ref.low_latency_combine(y.abs(), topk, w.abs(), rr[2])
    out = torch.empty_like(ro)
    fo, ev, hook = fast.low_latency_combine(y, topk, w, fr[2], async_finish=True, out=out)
    assert hook is None and fo.data_ptr() == out.data_ptr()
    ev.current_stream_wait()
    assert_within_budget(fo, ro.double(), ro_abs.double(), case.num_topk + case.num_ranks, "async combine",
                         extra_rel=2.0 ** -8)


def _two_nodes(ctx, tag):
    cpu_internode = _setup(ctx, tag, 1)
    import torch

    from epcomm.backends import internode_ll
    from epcomm.testing import gpu_cases as G

    internode_ll.TUNE["send_gc"] = 1  # one send program per 128 channels: rows go in several puts
    case = _case(ctx)
    ref, fast = _buffers(ctx, cpu_internode, case)
    be = fast._backend
    assert (be.ranks_per_node, be.nodes) == (1, [0, 1])  # every peer on another node: NVSHMEM puts
    done = []
    # repeats of one kind of call take Buffer's repeat path (the launches planned by the first call)
    firsts = []
    for name in ("_ll_dispatch_first", "_ll_combine_first"):
        def counted(*a, _f=getattr(fast, name), _n=name):
            firsts.append(_n)
            return _f(*a)
        setattr(fast, name, counted)
    for i in range(3):
        G.check_ll_case(ref, fast, case, ctx.rank, M, use_fp8=True, seed_shift=20 + i)
    assert firsts == ["_ll_dispatch_first", "_ll_combine_first"], firsts
    for i, kw in enumerate([dict(use_fp8=False),
                            dict(use_fp8=True, round_scale=True, ue8m0=True, hook=True),
                            dict(use_fp8=True, zero_copy=True, hook=True)]):
        G.check_ll_case(ref, fast, case, ctx.rank, M, seed_shift=i, **kw)
        done.append(i)
    _async_check(ref, fast, case, ctx.rank)
    done.append("async")
    # high-throughput (tests/dist/test_internode_ht_cpu.py): the range check is the backend's handle kernel
    # (Buffer leaves it to a backend that checks on the device). Both ranks call, rank 0 with a bad id: the
    # exchange completes on both, rank 0 raises after it, and the Buffer stays usable
    xin, _, topk, w = G.device_inputs(case, ctx.rank, "cpu")
    bad = topk.clone()
    if ctx.rank == 0:
        bad[0, 0] = -3
    try:
        G._dispatch(fast, xin, bad, w, case.num_experts)
        done.append("ht bad id: none")
    except ValueError as err:
        done.append(f"ht bad id: {err}")
    rr, fr = G._dispatch(ref, xin, topk, w, case.num_experts), G._dispatch(fast, xin, topk, w, case.num_experts)
    assert torch.equal(fr[0], rr[0]) and torch.equal(fr[1], rr[1]), "HT dispatch after a bad id"
    # an expert id out of range on rank 0: found by the send kernel, raised by that call on rank 0
    x, topk, _ = G.ll_inputs(case, ctx.rank, "cpu", seed_shift=9)
    if ctx.rank == 0:
        topk[1, 2] = case.num_experts + 5
    try:
        fast.low_latency_dispatch(x, topk, M, case.num_experts, use_fp8=False)
        done.append("bad id: none")
    except ValueError as err:
        done.append(f"bad id: {err}")
    cpu_internode.check_delivery()  # no put overtaken by a signal, none left undelivered
    return done


def _mixed_nodes(ctx, tag, gpus_per_node, nvl, kws):
    cpu_internode = _setup(ctx, tag, gpus_per_node)
    from epcomm.testing import gpu_cases as G

    case = _case(ctx, hidden=128, seed=11, tokens=4)
    ref, fast = _buffers(ctx, cpu_internode, case, allow_nvlink_for_low_latency_mode=nvl)
    assert fast._backend.ranks_per_node == gpus_per_node and fast._backend.nvl == nvl
    for i, kw in enumerate(kws):
        G.check_ll_case(ref, fast, case, ctx.rank, M, seed_shift=i, **kw)
    cpu_internode.check_delivery()
    return "ok"


def _faults(ctx, tag):
    """M differing across ranks (both ranks), then rank 1 leaves: rank 0's dispatch gives the deadline
    error naming rank 1 and the phase; with shrink, rank 0 masks rank 1 at the deadline and carries on."""
    cpu_internode = _setup(ctx, tag, 1)
    import torch

    from epcomm.testing import gpu_cases as G
    from epcomm.testing.compare import assert_within_budget

    from epcomm import Buffer

    case = _case(ctx, hidden=128, seed=6)
    e, r = case.num_experts, ctx.world_size
    hint = Buffer.get_low_latency_rdma_size_hint(16, case.hidden, r, e)
    kw = dict(spins=1e3, num_rdma_bytes=hint, low_latency_mode=True)
    differs, plain, shrink = (cpu_internode.internode_buffer(ctx.group, **kw),
                              cpu_internode.internode_buffer(ctx.group, **kw),
                              cpu_internode.internode_buffer(ctx.group, enable_shrink=True, **kw))
    x, topk, w = G.ll_inputs(case, ctx.rank, "cpu")
    seen = _m_differs_then_absent(ctx, differs, plain, x, topk, e, absent=1)
    if ctx.rank == 1:
        return seen
    rx, cnt, handle, _, _ = shrink.low_latency_dispatch(x, topk, 8, e, use_fp8=False)
    out, _, _ = shrink.low_latency_combine(rx, topk, w, handle)
    status = torch.zeros(r, dtype=torch.int32)
    shrink.low_latency_query_mask_buffer(status)
    lx = e // r
    mine = (topk >= 0) & (topk < lx)  # experts on rank 0: only its own tokens arrive
    assert torch.equal(cnt, torch.bincount(topk[mine], minlength=lx).to(torch.int32)), cnt
    assert_within_budget(out, x.double() * (w.double() * mine.double()).sum(1, keepdim=True),
                         x.double().abs() * (w.double().abs() * mine.double()).sum(1, keepdim=True),
                         2 * case.num_topk, "combine without the masked rank", extra_rel=2.0 ** -8)
    seen.append(status.tolist())
    return seen


def _m_differs_then_absent(ctx, differs, plain, x, topk, e: int, absent: int) -> list:
    """What each rank sees of two faults: a dispatch on ``differs`` where rank 0 asks M=8 and the others 16
    (a ValueError naming it), then, after a barrier, a dispatch on ``plain`` that rank ``absent`` never
    makes (the others' deadline error). Rank ``absent`` returns after the first."""
    import torch

    from epcomm.backends.base import PeerTimeoutError

    seen = []
    # the device's own check, which a call captured in a CUDA graph relies on: no exchange of the arguments on the
    # host (the first call of a kind has it: "arguments-that-differ")
    differs._agree.check = lambda *a: None
    try:
        differs.low_latency_dispatch(x, topk, 8 if ctx.rank == 0 else 16, e)
        seen.append("m differs: none")
    except ValueError as err:
        seen.append(str(err))
    torch.distributed.barrier(group=ctx.group)
    if ctx.rank == absent:
        return seen  # never calls again
    plain._agree.check = lambda *a: None  # (the wait on the device, as for a repeat: rank ``absent`` has left)
    try:
        plain.low_latency_dispatch(x, topk, 8, e)
        seen.append("timeout: none")
    except PeerTimeoutError as err:
        seen.append(str(err))
    return seen


def _faults_two_nodes_of_two(ctx, tag):
    """Four ranks in two nodes of two: M differing on rank 0 is named on every rank; then rank 3 leaves and
    the others' dispatch gives the deadline error naming rank 3 (rank 2 waits for it by stores in its
    node, ranks 0 and 1 across nodes)."""
    cpu_internode = _setup(ctx, tag, 2)

    from epcomm import Buffer
    from epcomm.testing import gpu_cases as G

    case = _case(ctx, hidden=128, seed=6)
    e, r = case.num_experts, ctx.world_size
    hint = Buffer.get_low_latency_rdma_size_hint(16, case.hidden, r, e)
    # (four processes share the cores: a present peer may be descheduled for longer than 1e3 polls)
    kw = {"spins": 4e3, "num_rdma_bytes": hint, "low_latency_mode": True}
    differs = cpu_internode.internode_buffer(ctx.group, **kw)
    plain = cpu_internode.internode_buffer(ctx.group, **kw)
    x, topk, _ = G.ll_inputs(case, ctx.rank, "cpu")
    return _m_differs_then_absent(ctx, differs, plain, x, topk, e, absent=3)


def _check_two_nodes(ctx, tag):
    done = _two_nodes(ctx, tag)
    assert done[:4] == [0, 1, 2, "async"], done
    if ctx.rank == 0:
        assert done[4] == "ht bad id: topk_idx holds expert id -3, outside [-1, 8) for num_experts=8", done
        assert done[5] == "bad id: topk_idx holds expert id 13, outside [-1, 8) for num_experts=8 (found on the " \
                          "device; this Buffer is now unusable)", done
    else:
        assert done[4:] == ["ht bad id: none", "bad id: none"], done


def _check_mixed_nodes(ctx, tag, gpus_per_node, nvl, kws):
    assert _mixed_nodes(ctx, tag, gpus_per_node, nvl, kws) == "ok"


def _check_faults(ctx, tag):
    seen = _faults(ctx, tag)
    assert seen[0] == "num_max_dispatch_tokens_per_rank differs across ranks: 8 on rank 0, 16 on rank 1", seen
    if ctx.rank == 0:
        assert "rank 1" in seen[1] and "low_latency_dispatch/receive" in seen[1], seen
        assert seen[2] == [0, 1], seen  # rank 1 masked


def _check_faults_two_nodes_of_two(ctx, tag):
    seen = _faults_two_nodes_of_two(ctx, tag)
    assert seen[0].startswith("num_max_dispatch_tokens_per_rank differs across ranks: 8 on rank 0, 16 on "
                              "rank"), seen
    if ctx.rank < 3:
        assert "rank 3" in seen[1] and "low_latency_dispatch/receive" in seen[1], (ctx.rank, seen)


def _arguments_that_differ(ctx, tag):
    """Ranks that disagree on the hidden size, the experts, the dtype, top-k, M (two virtual nodes): a ValueError on
    every rank naming them, at the first call of the kind, before any kernel (``agree_checks``); the
    high-throughput calls too."""
    import agree_checks

    cpu_internode = _setup(ctx, tag, 1)

    def make(**kw):
        return cpu_internode.internode_buffer(ctx.group, **kw)

    agree_checks.low_latency(ctx, make)
    agree_checks.v1(ctx, make)


# Every check of a world size runs in one launch (a launch costs seconds of process start and imports), in
# this order, and is reported as its own test; the fault checks come last (the ranks leave them at
# different times). A failed check stops its rank: later ones report "not run".
CHECKS = {
    2: [("two-virtual-nodes", _check_two_nodes, ()),
        ("one-node-nvshmem-only", _check_mixed_nodes,  # one node, its peer through NVSHMEM too
         (2, False, [{"use_fp8": False, "zero_copy": True}])),
        ("arguments-that-differ", _arguments_that_differ, ()),
        ("faults", _check_faults, ())],
    # same-node peers by stores, the other node by NVSHMEM: FP8 with the hook, then BF16 zero-copy, on one
    # Buffer (its signal levels and parities across calls)
    4: [("4-ranks-2-nodes-nvlink", _check_mixed_nodes,
         (2, True, [{"use_fp8": True, "hook": True}, {"use_fp8": False, "zero_copy": True}])),
        ("faults-two-nodes-of-two", _check_faults_two_nodes_of_two, ())],
}
TAG = uuid.uuid4().hex[:12]  # this session's shared-memory files


def _rank(ctx, tag):
    def one(fn, args):
        return lambda ctx: fn(ctx, tag, *args)

    return harness.run_checks(ctx, [(name, one(fn, args)) for name, fn, args in CHECKS[ctx.world_size]], env={})


def start_early(items):  # (tests/conftest.py) this module's launches, in the background (tests/dist/background.py)
    harness.queue_gloo_once(dict.fromkeys((_rank, it.callspec.params["world"], TAG) for it in items), timeout_s=600)


stop_early = harness.stop_early


@pytest.mark.parametrize("world,name", [(w, n) for w, checks in CHECKS.items() for n, *_ in checks])
def test_internode_low_latency_on_cpu_processes(world, name):
    harness.report(harness.launch_gloo_once(_rank, world, TAG, timeout_s=600), name)

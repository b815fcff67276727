"""Tier 2: the nvlink backend — its host code and its Triton kernels under the interpreter — on CPU
processes, against the reference backend (``epcomm.testing.cpu_nvlink``).

High-throughput: dispatch bitwise (BF16, FP8, num_worst_tokens, cached), combine within the BF16
budget, with a rank that sends nothing and a hot expert, over the copy-engine path (here plain
copies), the SM push, and the tuning variants. Low-latency: BF16 / FP8 / UE8M0 dispatch, hook,
zero-copy and out= combine. A rank that never arrives gives the deadline error. GPU memory
ordering, the copy engine itself and CUDA graphs are tier 3's.

All checks of a world size (2, and 3 for the rank loops) run in one launch of CPU processes, each with
its own settings, and are reported one test each (``harness.launch_gloo_once``).
"""
import contextlib
import importlib.util
import os
import uuid

import harness
import pytest

# (not importorskip: the ranks must set TRITON_INTERPRET before anything imports Triton)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter)")


def _setup(ctx, tag):
    """Once per rank process: the interpreter, the stand-ins and the shared symmetric memory."""
    from epcomm.testing import cpu_nvlink

    cpu_nvlink.install(tag, ctx.rank, ctx.world_size, ctx.group)
    return cpu_nvlink


@contextlib.contextmanager
def _variant(env=None, tune=None):
    """One check's settings in this rank: ``env`` (read when a Buffer is built) and ``tune`` (entries of
    the launch table), all put back afterwards (with ``EPCOMM_TUNE``'s effect on both tables and
    ``Buffer.num_sms``), so the checks that share a launch see what a fresh process would."""
    from epcomm import Buffer
    from epcomm.backends import nvlink_ll, nvlink_params

    saved_env = {k: os.environ.get(k) for k in (*(env or {}), "EPCOMM_HT_TRANSFER", "EPCOMM_TUNE")}
    tables = [(t, dict(t)) for t in (nvlink_params.TUNE, nvlink_ll.TUNE)]
    sms = Buffer.num_sms
    os.environ.update(env or {})
    nvlink_params.TUNE.update(tune or {})
    try:
        yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for t, before in tables:
            t.clear()
            t.update(before)
        Buffer.num_sms = sms


def _ht(ctx, cpu_nvlink):
    from epcomm import Buffer
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    ref = Buffer(ctx.group)
    fast = cpu_nvlink.nvlink_buffer(ctx.group, num_nvl_bytes=32 << 20)
    assert fast.backend_name == "nvlink" and ref.backend_name == "reference"
    transfer = os.environ.get("EPCOMM_HT_TRANSFER", "sm")
    assert fast._backend.transfer == transfer, (fast._backend.transfer, transfer)  # the variant took effect
    if os.environ.get("EPCOMM_NATIVE") == "all":
        from epcomm import native

        assert native.module() is not None, f"the native extension was not built: {native._state.get('why')}"
    r = ctx.world_size
    cases = [Case(num_ranks=r, tokens=tuple(5 + 3 * i for i in range(r)), hidden=128, num_topk=4,
                  num_experts=4 * r, seed=1),
             Case(num_ranks=r, tokens=tuple(0 if i == 0 else 9 for i in range(r)), hidden=256, num_topk=2,
                  num_experts=2 * r, hot_expert=1, seed=2)]
    out = []
    for case in cases:
        for fp8 in (False, True):
            out.append(G.check_ht_case(ref, fast, case, ctx.rank, fp8, with_bias=not fp8))
        out.append(G.check_ht_case(ref, fast, case, ctx.rank, False, worst=sum(case.tokens) + 3))
    assert len(out) == 6 and any(o["n"] > 0 for o in out), out  # this rank received rows
    for fp8 in (False, True):  # no topk_idx: the outputs' plan has no ids or weights to make
        G.check_ht_no_topk(ref, fast, cases[0], ctx.rank, fp8)
    return [o["n"] for o in out]


CE = {"EPCOMM_HT_TRANSFER": "ce"}  # eager calls by the copy engine (the default is the SM push)
HT_VARIANTS = {
    "copy-engine": (CE, {}),  # the copy-engine path (copies are plain CPU copies here), NC chunks
    "sm-push": ({"EPCOMM_HT_TRANSFER": "sm"}, {"push_rb": 2, "push_block": 64}),  # the SM push, several tiles a row
    "variants": (CE, {"ce_chunks": 1, "gather_rb": 4}),  # tuning
    # the outputs of the plans (layout, dispatch, combine) made by the C++ extension (native.py)
    "native-outputs": ({"EPCOMM_HT_TRANSFER": "sm", "EPCOMM_NATIVE": "all"}, {}),
}


def _ll(ctx, cpu_nvlink):
    from epcomm import Buffer
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    r, m = ctx.world_size, 8
    case = Case(num_ranks=r, tokens=tuple(6 - i for i in range(r)), hidden=256, num_topk=4, num_experts=4 * r,
                seed=3)
    hint = Buffer.get_low_latency_rdma_size_hint(m, case.hidden, r, case.num_experts)
    ref = Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)
    fast = cpu_nvlink.nvlink_buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)
    out = []
    for i, kw in enumerate([dict(use_fp8=False), dict(use_fp8=True), dict(use_fp8=True, round_scale=True, ue8m0=True),
                            dict(use_fp8=True, hook=True), dict(use_fp8=False, zero_copy=True)]):
        out.append(G.check_ll_case(ref, fast, case, ctx.rank, m, seed_shift=i, **kw))
    # BF16 rows that are not whole groups of 128 channels (H % 8 == 0 is all BF16 needs)
    case = Case(num_ranks=r, tokens=(5,) * r, hidden=136, num_topk=2, num_experts=2 * r, seed=4)
    hint = Buffer.get_low_latency_rdma_size_hint(m, case.hidden, r, case.num_experts)
    ref = Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)
    fast = cpu_nvlink.nvlink_buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)
    out.append(G.check_ll_case(ref, fast, case, ctx.rank, m, use_fp8=False))
    assert len(out) == 6, out


LL_VARIANTS = {"one-kernel-per-op": {},
               "separate-dispatch-kernels": {"EPCOMM_TUNE": "ll.fused_dispatch=0"}}


def _ll_repeats(ctx, cpu_nvlink):
    """Repeated low-latency calls take the Buffer's repeat path (the launches made by the first call of
    their kind, no checks) and stay right; a call that differs in anything but its tensors' values is
    checked again."""
    import torch

    from epcomm import Buffer
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    r, m = ctx.world_size, 8
    case = Case(num_ranks=r, tokens=tuple(5 + i for i in range(r)), hidden=256, num_topk=4, num_experts=4 * r,
                seed=5)
    hint = Buffer.get_low_latency_rdma_size_hint(m, case.hidden, r, case.num_experts)
    ref = Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)
    fast = cpu_nvlink.nvlink_buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)
    firsts = []
    for name in ("_ll_dispatch_first", "_ll_combine_first"):
        def counted(*a, _f=getattr(fast, name), _n=name):
            firsts.append(_n)
            return _f(*a)
        setattr(fast, name, counted)
    for i in range(3):  # new tensors every time, same shapes: the first pair is checked, the rest repeat
        G.check_ll_case(ref, fast, case, ctx.rank, m, use_fp8=True, seed_shift=i)
    assert firsts == ["_ll_dispatch_first", "_ll_combine_first"], firsts
    for i in range(2):  # the hook is part of the kind of call
        G.check_ll_case(ref, fast, case, ctx.rank, m, use_fp8=True, hook=True, seed_shift=3 + i)
    assert len(firsts) == 4, firsts
    x, topk, _ = G.ll_inputs(case, ctx.rank, fast.device)
    e = case.num_experts
    try:  # the same shapes in another dtype: checked again, and refused
        fast.low_latency_dispatch(x.float(), topk, m, e)
    except (TypeError, ValueError) as err:
        refused = str(err)
    else:
        raise AssertionError("float32 x was accepted")
    assert "x" in refused and len(firsts) == 5, (refused, firsts)
    # a non-contiguous x of the same shape: checked, made contiguous, the same rows as its copy
    xt = x.t().contiguous().t()
    a = fast.low_latency_dispatch(xt, topk, m, e, use_fp8=False)
    rows_a = [a[0][l_, :n].clone() for l_, n in enumerate(a[1].tolist())]
    b = fast.low_latency_dispatch(x, topk, m, e, use_fp8=False)
    for l_, n in enumerate(b[1].tolist()):
        assert torch.equal(rows_a[l_].view(torch.int16), b[0][l_, :n].view(torch.int16))
    assert firsts[5:] == ["_ll_dispatch_first", "_ll_dispatch_first"], firsts
    assert len(firsts) == 7, firsts


def _absent(ctx, cpu_nvlink):
    from epcomm.backends.base import PeerTimeoutError
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    fast = cpu_nvlink.nvlink_buffer(ctx.group, spins=3e3, num_nvl_bytes=16 << 20)
    # the wait on the device (as for a repeat, or a call captured in a CUDA graph): no first exchange of the
    # arguments on the host (which test_dist_deadline checks), and rank 1 goes on to the next check's collectives
    fast._agree.check = lambda *a: None
    case = Case(num_ranks=ctx.world_size, tokens=(8,) * ctx.world_size, hidden=128, num_topk=2, num_experts=4)
    xin, x, topk, w = G.device_inputs(case, ctx.rank, fast.device)
    if ctx.rank == 1:
        return  # never dispatches
    try:
        G._dispatch(fast, xin, topk, w, case.num_experts)
    except PeerTimeoutError as e:
        assert "rank 1" in str(e) and "dispatch" in str(e), str(e)
        return
    raise AssertionError("a dispatch without its peer did not raise")


def _device_side_errors(ctx, cpu_nvlink):
    """Errors the nvlink backend finds on the device: an expert id out of range (at the dispatch's
    own synchronisation; with num_worst_tokens at the next call), a layout that is not the one of the ids and
    num_worst_tokens too small."""
    import torch

    from epcomm import layout
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    case = Case(num_ranks=ctx.world_size, tokens=(8,) * ctx.world_size, hidden=128, num_topk=2, num_experts=4,
                seed=4)
    e = case.num_experts
    xin, x, topk, w = G.device_inputs(case, ctx.rank, "cpu")
    bad = topk.clone()
    if ctx.rank == 0:
        bad[3, 1] = e + 7
    fast = cpu_nvlink.nvlink_buffer(ctx.group, num_nvl_bytes=16 << 20)
    pr, _, pe, ir, _ = fast.get_dispatch_layout(bad, e)
    kw = dict(num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe, topk_idx=bad, topk_weights=w)
    seen = []
    try:
        fast.dispatch(x, **kw)
        seen.append("eager: none")
    except ValueError as err:
        seen.append(f"eager: {err}")
    G.check_ht_case(G.Buffer(ctx.group), fast, case, ctx.rank, False)  # still in step
    # rank 0 passes the layout of other ids (its ids moved to its own experts): the exchange kernel's tile programs
    # find the lowest token whose is_token_in_rank row is not the ids' ranks (error 12); the call completes on
    # every rank, then raises on rank 0 (was: rows went by the layout, some to a rank with none of their experts)
    other = torch.where(topk >= 0, topk % (e // ctx.world_size), topk) if ctx.rank == 0 else topk
    lay = dict(zip(("num_tokens_per_rank", "_", "num_tokens_per_expert", "is_token_in_rank"),
                   fast.get_dispatch_layout(other, e)[:4]))
    del lay["_"]
    diff = (layout.dispatch_layout(topk, e, ctx.world_size)[2] != lay["is_token_in_rank"]).nonzero().tolist()
    try:
        fast.dispatch(x, topk_idx=topk, topk_weights=w, **lay)
        seen.append("layout: none")
    except ValueError as err:
        seen.append(f"layout: {err}")
    G.check_ht_case(G.Buffer(ctx.group), fast, case, ctx.rank, False)  # still in step
    worst = cpu_nvlink.nvlink_buffer(ctx.group, num_nvl_bytes=16 << 20)
    worst.dispatch(x, num_worst_tokens=sum(case.tokens), **kw)
    if ctx.rank == 0:  # raised before any exchange, so the other rank makes no call
        try:
            worst.dispatch(x, num_worst_tokens=sum(case.tokens), **kw)
            seen.append("worst: none")
        except ValueError as err:
            seen.append(f"worst: {err}")
    small = cpu_nvlink.nvlink_buffer(ctx.group, num_nvl_bytes=16 << 20)
    res = G._dispatch(small, xin, topk, w, e, num_worst_tokens=1)  # every rank receives more than one row
    # Inside one CUDA graph a combine follows with no host check between: its kernels still run to the
    # end (their reads of x are bounded by its length; the result is garbage, the error is recorded).
    # Here: hide the host mirror for that call.
    nvb = small._backend
    nvb.err_host.zero_()
    nvb.combine(res[0], res[4], res[2], ())
    nvb.err_host.copy_(nvb.err[:4])
    try:
        G._dispatch(small, xin, topk, w, e)
        seen.append("overflow: none")
    except RuntimeError as err:
        seen.append(f"overflow: {err}")
    if ctx.rank == 0:
        assert seen[0] == "eager: topk_idx holds expert id 11, outside [-1, 4) for num_experts=4", seen
        assert diff, "rank 0's ids all had their experts on rank 0: the case checks nothing"
        assert seen[1] == ("layout: is_token_in_rank does not match topk_idx at token "
                           f"{diff[0][0]}, rank {diff[0][1]}: pass the layout get_dispatch_layout made from this "
                           "topk_idx"), (seen, diff)
        assert seen[2].startswith("worst: topk_idx holds expert id 11, outside [-1, 4)"), seen
    else:
        assert seen[:2] == ["eager: none", "layout: none"], seen
    assert seen[-1].startswith(f"overflow: epcomm rank {ctx.rank}: num_worst_tokens=1 but "), seen


def _stress(ctx, cpu_nvlink):
    """Many calls with changing routings and sizes: counters, parities and flag levels across calls
    (6 pairs each: both parities three times, hot experts and drops change every call)."""
    from epcomm import Buffer
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    ref, fast = Buffer(ctx.group), cpu_nvlink.nvlink_buffer(ctx.group, num_nvl_bytes=64 << 20)
    G.check_ht_stress(fast, ref, ctx.rank, ctx.world_size, iters=6)  # full checks at 0 and 5
    r, m = ctx.world_size, 8
    case = Case(num_ranks=r, tokens=(m,) * r, hidden=256, num_topk=4, num_experts=4 * r, seed=5)
    hint = Buffer.get_low_latency_rdma_size_hint(m, case.hidden, r, case.num_experts)
    llr = Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)
    llf = cpu_nvlink.nvlink_buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)
    G.check_ll_stress(llr, llf, case, ctx.rank, m, iters=6)  # BF16 and FP8 in turn, full checks at 0 and 5


def _ll_faults(ctx, cpu_nvlink, what):
    import torch

    from epcomm import Buffer
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    r, h, e = ctx.world_size, 256, 4 * ctx.world_size
    case = Case(num_ranks=r, tokens=(8,) * r, hidden=h, num_topk=4, num_experts=e, seed=6)
    hint = Buffer.get_low_latency_rdma_size_hint(16, h, r, e)
    x, topk, w = G.ll_inputs(case, ctx.rank, "cpu")
    if what == "m-differs":  # M differs across ranks: named, not a hang
        buf = cpu_nvlink.nvlink_buffer(ctx.group, spins=3e3, num_rdma_bytes=hint, low_latency_mode=True)
        # the device's own check, which a call captured in a CUDA graph relies on: no exchange of the arguments on
        # the host (the first call of a kind has it: "arguments-that-differ")
        buf._agree.check = lambda *a: None
        m = 8 if ctx.rank == 0 else 16
        try:
            buf.low_latency_dispatch(x, topk, m, e)
            buf.low_latency_dispatch(x, topk, m, e)  # the error surfaces at the next call
        except ValueError as err:
            assert "num_max_dispatch_tokens_per_rank differs" in str(err) and "8 on rank 0" in str(err), str(err)
            return
        raise AssertionError("M differing across ranks raised nothing")
    # shrink: rank 1 never calls; rank 0 masks it at the deadline and carries on
    buf = cpu_nvlink.nvlink_buffer(ctx.group, spins=3e3, num_rdma_bytes=hint, low_latency_mode=True,
                                   enable_shrink=True)
    if ctx.rank == 1:
        return  # absent
    rx, cnt, handle, _, _ = buf.low_latency_dispatch(x, topk, 8, e, use_fp8=False)
    out, _, _ = buf.low_latency_combine(rx, topk, w, handle)
    status = torch.zeros(r, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    lx = e // r
    mine = (topk >= 0) & (topk < lx)  # experts on rank 0: only its own tokens arrive
    assert torch.equal(cnt, torch.bincount(topk[mine], minlength=lx).to(torch.int32)), cnt
    from epcomm.testing.compare import assert_within_budget

    assert_within_budget(out, x.double() * (w.double() * mine.double()).sum(1, keepdim=True),
                         x.double().abs() * (w.double().abs() * mine.double()).sum(1, keepdim=True),
                         2 * case.num_topk, "combine without the masked rank", extra_rel=2.0 ** -8)
    assert status.tolist() == [0, 1], status


def _arguments_that_differ(ctx, cpu_nvlink):
    """Ranks that disagree on the hidden size, the experts, the dtype, top-k, M: a ValueError on every rank naming
    them, at the first call of the kind, before any kernel (``agree_checks``)."""
    import agree_checks

    def make(**kw):
        return cpu_nvlink.nvlink_buffer(ctx.group, **kw)

    agree_checks.v1(ctx, make)
    agree_checks.low_latency(ctx, make)


def _edges(ctx, cpu_nvlink):
    """No tokens anywhere, top-1, top-32 with drops, a hidden size that is not a multiple of 128, 2 and
    4 SMs (grids of one or two programs), expert_alignment, a combine with one bias tensor."""
    import torch

    from epcomm import Buffer
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    r, ref = ctx.world_size, Buffer(ctx.group)
    for sms in (2, 4):
        Buffer.set_num_sms(sms)
        fast = cpu_nvlink.nvlink_buffer(ctx.group, num_nvl_bytes=32 << 20)
        for case in (Case(num_ranks=r, tokens=(0,) * r, hidden=128, num_topk=2, num_experts=2 * r, seed=1),
                     Case(num_ranks=r, tokens=(7, 3), hidden=136, num_topk=1, num_experts=r, seed=2),
                     Case(num_ranks=r, tokens=(33, 1), hidden=128, num_topk=32, num_experts=32 * r, seed=3,
                          drop_prob=0.5)):
            for fp8 in (False, True):
                if not fp8 or case.hidden % 128 == 0:
                    G.check_ht_case(ref, fast, case, ctx.rank, fp8)
            G.check_ht_case(ref, fast, case, ctx.rank, False, worst=sum(case.tokens) + 1)
    case = Case(num_ranks=r, tokens=(20, 9), hidden=128, num_topk=4, num_experts=4 * r, seed=4)
    xin, x, topk, w = G.device_inputs(case, ctx.rank, "cpu")
    rr = G._dispatch(ref, xin, topk, w, case.num_experts, expert_alignment=8)
    fr = G._dispatch(fast, xin, topk, w, case.num_experts, expert_alignment=8)
    assert fr[3] == rr[3] and all(v % 8 == 0 for v in fr[3]), (fr[3], rr[3])
    b = torch.randn(x.shape).to(torch.bfloat16)
    ro, _, _ = ref.combine(rr[0], rr[4], bias=b)
    fo, _, _ = fast.combine(fr[0], fr[4], bias=b)
    G._combine_check(fo, ro, ref, rr[0], rr[4], "combine with one bias", bias=(b,))


# Every check of a world size runs in one launch (a launch costs seconds of process start and imports), in
# this order, each in its own settings (``_variant``); each is reported as its own test. The fault checks
# come last: the ranks leave them at different times. A failed check stops its rank: later ones report
# "not run".
TWO_RANKS = [
    *((f"high-throughput[{k}]", _ht, {}, env, tune) for k, (env, tune) in HT_VARIANTS.items()),
    *((f"low-latency[{k}]", _ll, {}, env, {}) for k, env in LL_VARIANTS.items()),
    ("low-latency-repeats", _ll_repeats, {}, {}, {}),
    ("edge-cases", _edges, {}, {}, {}),
    ("stress", _stress, {}, {}, {}),
    ("device-side-input-errors", _device_side_errors, {}, {}, {}),
    ("arguments-that-differ", _arguments_that_differ, {}, {}, {}),
    ("a-rank-that-never-arrives-gives-the-deadline-error", _absent, {}, {}, {}),
    ("low-latency-m-differs", _ll_faults, {"what": "m-differs"}, {}, {}),
    ("low-latency-shrink", _ll_faults, {"what": "shrink"}, {}, {}),
]
# Three ranks: non-power-of-two rank loops and masks (found a misaligned staging view and the UE8M0 unpack
# of a one-row expert); both HT transfers (the SM gather kernel pushes to two peers). The tuning variants and
# the LL dispatch roles as separate kernels run at 2 ranks only.
THREE_RANKS = [
    ("high-throughput[copy-engine]", _ht, {}, CE, {}),
    ("high-throughput[sm-push]", _ht, {}, {"EPCOMM_HT_TRANSFER": "sm"}, {}),
    ("low-latency", _ll, {}, {}, {}),
    ("arguments-that-differ", _arguments_that_differ, {}, {}, {}),
]
CHECKS = {2: TWO_RANKS, 3: THREE_RANKS}
TAG = uuid.uuid4().hex[:12]  # this session's shared-memory files


def _rank(ctx, tag):
    cpu_nvlink = _setup(ctx, tag)

    def one(fn, kw, env, tune):
        def run(ctx):
            with _variant(env, tune):
                fn(ctx, cpu_nvlink, **kw)
        return run

    return harness.run_checks(ctx, [(name, one(*rest)) for name, *rest in CHECKS[ctx.world_size]], env={})


def start_early(items):  # (tests/conftest.py) this module's launches, in the background (tests/dist/background.py)
    harness.queue_gloo_once(dict.fromkeys((_rank, it.callspec.params["world"], TAG) for it in items), timeout_s=600)


stop_early = harness.stop_early


@pytest.mark.parametrize("world,name", [(w, n) for w, checks in CHECKS.items() for n, *_ in checks])
def test_nvlink_on_cpu_processes(world, name):
    harness.report(harness.launch_gloo_once(_rank, world, TAG, timeout_s=600), name)

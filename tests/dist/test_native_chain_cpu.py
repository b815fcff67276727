"""Tier 2: the wiring of the native chains (``native.Chain``: a call's outputs made and its launches made in one C++
call) on 2 CPU ranks of the nvlink backend, against the oracles. On CPU the kernels run under the Triton interpreter,
where no launch is ever bound and so no real chain is made; here each chain is made as on a GPU (every launch a
step, ``Direct.step`` / ``_Launch.step``) but runs its steps through the interpreter (``_EmuChain``): each step's
sources (the call's tensors and integers, the chain's outputs, the plan's constant buffers) resolved to tensors,
the outputs made by ``native.Outputs`` with the chain's own specs and packing. A source wired to the wrong tensor
gives rows that differ from the oracle's.

Checked, with ``EPCOMM_NATIVE=all`` (every native part: outputs, packing, chains, the extension's signatures):
``ElasticBuffer``'s contiguous no-sync dispatch (BF16, FP8 with UE8M0 packs and with fp32 scales) through the
merged chain (the backend's exchange + gather and ``recv_meta``'s launch: three steps); its contiguous combine
(the transport's two launches and the reduction: three steps); its expanded no-sync dispatch (the exchange +
gather, ``recv_meta``'s two launches and the scatter with its outputs, the scale packs TMA-aligned: five
steps) and a synchronised one (``recv_meta``'s chain of two); its expanded combine with 0/1/2 biases (the
pack, the transport's two launches and the reduction: four steps); the merged chains' results made by
position; ``Buffer``'s ``num_worst_tokens`` dispatch (two steps), BF16 and FP8, its combine and its cached
dispatch (one step each), and its synchronised dispatch (the exchange and the gather each a chain, around the
host's read); ``Buffer``'s low-latency dispatch and combine (each launch a one-step chain; with the hook the
send and the receive). Each kind's first call binds its launches (the Python path), the repeats take the
chain.
"""
import importlib.util
import os
import sys
import uuid

import harness
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_elastic_backends_cpu import _on_backend  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter)")


def _emulate():
    """Chains made and run as described above: ``(runs, undo)``, ``runs`` the step count of every chain call."""
    from epcomm import native
    from epcomm.backends import ht_dispatch
    from epcomm.kernels import launch

    runs: list = []

    def get(src, vals, made):
        kind, idx, value = src[:3]
        if kind in (1, 2):
            t = vals[idx] if kind == 1 else made[idx]
            if value:  # (an address ``value`` bytes on: the tensor's elements from there, flat)
                assert kind == 2 and value % t.element_size() == 0, src
                return t.view(-1)[value // t.element_size():]
            return t
        return vals[idx] if kind == 3 else value

    class EmuChain:
        def __init__(self, device, specs, rows, steps, nvals, dry=False, packed=(), stream=None):
            self.outs = native.Outputs(device, specs, True, packed)
            assert self.outs.native, native._state.get("why")
            self.rows, self.steps, self.nvals = rows, list(steps), nvals
            self.get_stream, self.dev = native.no_stream, None

        def run(self, stream, *vals):  # (as native.Chain's: the stream first)
            return self(*vals)

        def __call__(self, *vals):
            assert len(vals) == self.nvals, (len(vals), self.nvals)
            made = self.outs(get(self.rows, vals, ()))
            for go, grid, _block, _smem, params in self.steps:
                go(*(get(g, vals, made) for g in grid), *(get(p, vals, made) for p in params))
            runs.append(len(self.steps))
            return made

    def step(go, grid, holes, n_holes):
        assert len(holes) == n_holes, (len(holes), n_holes)
        return (go, [(*g, 4) for g in grid], 0, 0, [(*h, 8) for h in holes])

    def direct_step(self, grid, holes):
        return step(self, grid, holes, len(self.holes))

    def launch_step(self, grid, holes):
        def go(gx, gy, gz, *tensors):
            assert gy == gz == 1
            self(gx, *tensors)
        return step(go, grid, holes, len(self.go.holes))

    saved = (native.Chain, native.param, launch.Direct.step, ht_dispatch._Launch.step)
    native.Chain = EmuChain
    native.param = lambda src, size: (*src, size)  # (constant tensors stay tensors: the steps run on them)
    launch.Direct.step, ht_dispatch._Launch.step = direct_step, launch_step

    def undo():
        native.Chain, native.param, launch.Direct.step, ht_dispatch._Launch.step = saved

    return runs, undo


def _start(ctx, tag):
    """A fresh rank on the nvlink backend with the extension wanted on CPU (``EPCOMM_NATIVE=all``), its chains
    emulated: ``(ElasticBuffer class on the backend, runs, undo)`` (:func:`_emulate`)."""
    os.environ["EPCOMM_NATIVE"] = "all"
    OnBackend = _on_backend(ctx, tag, "nvlink")  # (first: it sets the interpreter's environment before any import)
    runs, undo = _emulate()
    return OnBackend, runs, undo


def _v2(ctx, tag):
    OnBackend, runs, undo = _start(ctx, tag)
    from epcomm.testing import elastic_cases as C

    try:
        case = C.V2Case(num_ranks=2, tokens=(5, 9), hidden=128, num_topk=3, num_experts=8, seed=11)
        buf = OnBackend(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden, num_topk=case.num_topk)
        for sf_kind in ("bf16", "ue8m0", "fp32"):  # contiguous, no CPU sync: a dispatch, a cached one, a second
            C.check_dispatch(buf, case, ctx.rank, sf_kind, False, 1, False)
        n_dispatch = len(runs)
        C.check_combine(buf, case, ctx.rank, False, 2, 1, False)
    finally:
        undo()
    # the merged chains ran (3 steps); a kind's first call may take chains another kind made (the backend's
    # plan, recv_meta's), 2 and 1 steps
    assert 3 in runs[:n_dispatch], runs
    return runs


def _v2_flat(ctx, tag):
    # the merged chains' results made by position (with the extension's signatures): each kind's calls from
    # the third merged one on; contiguous BF16, fp32 and UE8M0 packs; expanded BF16 (the TMA-aligned packs of an
    # expanded FP8 call are a view per call: it keeps the Python path); checked whole, then a combine on the handle
    OnBackend, runs, undo = _start(ctx, tag)
    from epcomm import elastic_chains
    from epcomm.testing import elastic_cases as C

    built, real = [], elastic_chains._flat_build
    elastic_chains._flat_build = lambda *a: built.append(real(*a)) or built[-1]
    try:
        case = C.V2Case(num_ranks=2, tokens=(5, 9), hidden=128, num_topk=3, num_experts=8, seed=23)
        buf = OnBackend(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden, num_topk=case.num_topk)
        for sf_kind, expand in (("bf16", False), ("fp32", False), ("ue8m0", False), ("bf16", True)):
            for _ in range(4):  # (two fresh calls each: the first binds, two are recorded, the rest are built)
                C.check_dispatch(buf, case, ctx.rank, sf_kind, expand, 1, False)
            C.check_combine(buf, case, ctx.rank, expand, 1, 1, False)
    finally:
        elastic_chains._flat_build = real
        undo()
    assert len(built) == 4 and all(b is not None for b in built), built
    return runs


def _v2_expanded(ctx, tag):
    OnBackend, runs, undo = _start(ctx, tag)
    from epcomm.testing import elastic_cases as C

    try:
        case = C.V2Case(num_ranks=2, tokens=(5, 9), hidden=128, num_topk=3, num_experts=8, seed=17)
        buf = OnBackend(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden, num_topk=case.num_topk)
        # expanded, no CPU sync (the scale packs column-major, TMA-aligned): a dispatch, a cached one, a second; twice
        # (a kind's first call binds its launches and makes its chain: every later one, checked whole, runs it)
        for sf_kind, alignment in (("bf16", 1), ("ue8m0", 4), ("fp32", 1)):
            for _ in range(2):
                C.check_dispatch(buf, case, ctx.rank, sf_kind, True, alignment, False)
        n_no_sync = len(runs)
        C.check_dispatch(buf, case, ctx.rank, "fp32", True, 1, True)  # synchronised: recv_meta's chain only
        C.check_combine(buf, case, ctx.rank, True, 2, 1, False)
    finally:
        undo()
    # the merged chains: the exchange and gather, recv_meta's two launches and the scatter (5 steps), at each kind's
    # second call; recv_meta's own chain (2 steps) where a call takes it alone
    assert 5 in runs[:n_no_sync] and 2 in runs[n_no_sync:], runs
    return runs


def _v2_combine(ctx, tag, expand: bool):
    # contiguous: top-4 (weight rows of 16 bytes move in place; top-3 ones are packed first and such a combine
    # is no chain); expanded: each token's local rows summed; the dispatches merged
    OnBackend, runs, undo = _start(ctx, tag)
    from epcomm.testing import elastic_cases as C

    combines: list = []  # the chains the combines ran (check_combine dispatches first)
    try:
        case = C.V2Case(num_ranks=2, tokens=(5, 9), hidden=128, num_topk=3 if expand else 4, num_experts=8,
                        seed=19 if expand else 13)
        buf = OnBackend(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden, num_topk=case.num_topk)
        real = buf.combine

        def combine(*a, **k):
            n = len(runs)
            out = real(*a, **k)
            combines.extend(runs[n:])
            return out

        buf.combine = combine
        for n_bias in (0, 1, 2):  # a kind's first combine binds its launches and makes its chain, the next runs it
            for _ in range(2):
                C.check_combine(buf, case, ctx.rank, expand, n_bias, 4 if expand else 1, False)
    finally:
        undo()
    # the combine's chains, once for each bias count: contiguous, the transport's two launches and the reduction (3
    # steps); expanded, the pack before them (4 steps); the dispatches before them merged (3 steps contiguous,
    # 5 expanded)
    assert combines == [4 if expand else 3] * 3, (combines, runs)
    others = list(runs)
    for n in combines:
        others.remove(n)
    assert (5 if expand else 3) in others, runs
    return runs


def _v1(ctx, tag):
    _, runs, undo = _start(ctx, tag)
    from epcomm import Buffer
    from epcomm import _validate as V
    from epcomm.testing import cpu_nvlink
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    try:
        ref = Buffer(ctx.group)
        fast = cpu_nvlink.nvlink_buffer(ctx.group, num_nvl_bytes=32 << 20)
        assert fast._sigs is not V.signatures  # (the kinds by native.key_functions)
        case = Case(num_ranks=2, tokens=(5, 8), hidden=128, num_topk=4, num_experts=8, seed=5)
        worst = sum(case.tokens) + 3
        for fp8 in (False, True):
            for _ in range(2):  # (the first binds the launches, the second is one chain call)
                G.check_ht_case(ref, fast, case, ctx.rank, fp8, worst=worst)
        wide = Case(num_ranks=2, tokens=(5, 8), hidden=256, num_topk=4, num_experts=8, seed=6)
        for _ in range(2):  # (another hidden size: kinds of dispatch, cached dispatch and combine that
            G.check_ht_case(ref, fast, wide, ctx.rank, False, worst=worst)  # differ only in their tensors' shapes)
        n_worst = len(runs)
        for fp8 in (False, True):  # synchronised: the layout, then the dispatch's two chains around the host's read
            for _ in range(2):
                G.check_ht_case(ref, fast, case, ctx.rank, fp8)
    finally:
        undo()
    # the dispatch's chains (2 steps), the combine's and the cached dispatch's (1 each: 2 calls a round, 2 rounds, BF16
    # and FP8, after each kind's first call); synchronised, only one-step chains (layout, exchange, gather, ...)
    assert runs[:n_worst] and set(runs[:n_worst]) == {1, 2} and runs[:n_worst].count(1) >= 4, runs
    assert set(runs[n_worst:]) == {1} and len(runs) - n_worst >= 8, runs
    return runs


def _ll(ctx, tag):
    _, runs, undo = _start(ctx, tag)
    from epcomm import Buffer
    from epcomm import _validate as V
    from epcomm.testing import cpu_nvlink
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    try:
        m = 8
        case = Case(num_ranks=2, tokens=(6, 5), hidden=256, num_topk=4, num_experts=8, seed=3)
        hint = Buffer.get_low_latency_rdma_size_hint(m, case.hidden, 2, case.num_experts)
        ref = Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)
        fast = cpu_nvlink.nvlink_buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)
        assert fast._sigs is not V.signatures  # (the kinds by native.key_functions)
        for i, kw in enumerate([dict(use_fp8=False), dict(use_fp8=True), dict(use_fp8=True, hook=True)]):
            for j in range(2):  # (a kind's first call makes its chain, the second runs it)
                G.check_ll_case(ref, fast, case, ctx.rank, m, seed_shift=2 * i + j, **kw)
        # fewer tokens, the same arguments otherwise: another kind by its tensors' shapes (a key from
        # native.key_functions that missed them would run the launches made for 6 and 5 tokens)
        few = Case(num_ranks=2, tokens=(3, 4), hidden=256, num_topk=4, num_experts=8, seed=9)
        for j in range(2):
            G.check_ll_case(ref, fast, few, ctx.rank, m, seed_shift=7 + j, use_fp8=True)
    finally:
        undo()
    # every launch a one-step chain: dispatch and combine of the two plain kinds, the hook's send and receive
    assert set(runs) == {1} and len(runs) >= 9, runs
    return runs


CHECKS = ["v2-merged", "v2-flat", "v2-expanded", "v2-combine", "v2-combine-expanded", "v1-worst", "v1-ll"]
TAG = uuid.uuid4().hex[:12]  # this session's shared-memory files


def _rank(ctx, tag):
    one = {"v2-merged": lambda c: _v2(c, tag), "v2-flat": lambda c: _v2_flat(c, tag),
           "v2-expanded": lambda c: _v2_expanded(c, tag), "v2-combine": lambda c: _v2_combine(c, tag, False),
           "v2-combine-expanded": lambda c: _v2_combine(c, tag, True),
           "v1-worst": lambda c: _v1(c, tag), "v1-ll": lambda c: _ll(c, tag)}
    return harness.run_checks(ctx, [(name, one[name]) for name in CHECKS], env={})


def start_early(items):  # (tests/conftest.py) this module's launch, in the background (tests/dist/background.py)
    harness.queue_gloo_once([(_rank, 2, TAG)], timeout_s=900)


stop_early = harness.stop_early


@pytest.mark.parametrize("name", CHECKS)
def test_native_chains_on_cpu_processes(name):
    harness.report(harness.launch_gloo_once(_rank, 2, TAG, timeout_s=900), name)

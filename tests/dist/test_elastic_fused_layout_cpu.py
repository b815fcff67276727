"""Tier 2: ``ElasticBuffer``'s dispatch with its layout made in the exchange kernel (for calls not captured
into a CUDA graph: ``HTDispatch.fuses_layout``, ``kernels/ht_layout.layout_tiles``) and without it (captured
calls) on the nvlink backend, 2 CPU ranks (Triton kernels under the interpreter, symmetric memory simulated:
``epcomm.testing.cpu_nvlink``). ``test_elastic_backends_cpu.py`` checks the eager (fused) plans against the
oracles of ``epcomm.testing.elastic_cases``; here the same checks run with every plan unfused
(``fuses_layout`` answering as for a capture, which CPU cannot make): dispatch bitwise, contiguous and
expanded, CPU sync and worst-case shapes, BF16 and FP8 with opaque packs, cached replays, a second dispatch;
combine bitwise with biases and weights back. A dispatch made while capturing gets an unfused plan, the same
dispatch eagerly a fused one, both the oracle's rows.

And the host budget: each fresh dispatch kind launches one kernel fewer fused than unfused (no layout kernel)
and does no more torch calls, allocations or host reads; every other kind does the same work. Both budgets
counted in this launch.
"""
import importlib.util
import os
import sys
import uuid

import harness
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_elastic_backends_cpu import HOST_BOUND, _host_budget, _on_backend, _run  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter)")


def _unfused():
    """``HTDispatch.fuses_layout`` answering False for every call (as for calls captured into a CUDA graph):
    the function that undoes it."""
    from epcomm.backends.ht_dispatch import HTDispatch

    fuses = HTDispatch.fuses_layout
    HTDispatch.fuses_layout = lambda self, capturing=False: False
    return lambda: setattr(HTDispatch, "fuses_layout", fuses)


def _recording():
    """``HTDispatch._make_dispatch`` wrapped: ``(made, undo)``, ``made`` the ``fused`` flag of every plan made."""
    from epcomm.backends.ht_dispatch import HTDispatch

    made = []
    make = HTDispatch._make_dispatch

    def recording(self, key, a, push, ce, scratch_rows=0, fused=False):
        made.append(fused)
        return make(self, key, a, push, ce, scratch_rows, fused)

    HTDispatch._make_dispatch = recording
    return made, lambda: setattr(HTDispatch, "_make_dispatch", make)


def _check_unfused(ctx, tag):
    """The checks with no fused layout (the plans a CUDA-graph capture makes)."""
    _on_backend(ctx, tag, "nvlink")
    made, undo = _recording()
    plain = _unfused()
    try:
        assert _run(ctx, tag, "nvlink", 0) == (1, 2)
    finally:
        plain()
        undo()
    assert made and not any(made), f"dispatch plans made (fused or not): {made}"


def _check_capture_picks_unfused(ctx, tag):
    """By default a dispatch made while a graph is captured (the buffer's ``_capturing``, made True here: there
    are no graphs on CPU) plans without the fused layout, the same dispatch made eagerly with it: two plans of
    one kind, each giving the oracle's rows."""
    OnBackend = _on_backend(ctx, tag, "nvlink")
    from epcomm.testing import elastic_cases as C

    case = C.V2Case(num_ranks=2, tokens=(5, 9), hidden=128, num_topk=3, num_experts=8, seed=7)
    buf = OnBackend(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden, num_topk=case.num_topk)
    made, undo = _recording()
    real = buf._capturing
    try:
        buf._capturing = lambda: True
        C.check_dispatch(buf, case, ctx.rank, "bf16", False, 1, False)
        buf._capturing = real
        C.check_dispatch(buf, case, ctx.rank, "bf16", False, 1, False)
    finally:
        buf._capturing = real
        undo()
    assert made[0] is False and True in made[1:], f"dispatch plans made (fused or not): {made}"


def _check_host_budget(ctx, tag):
    plain = _unfused()
    try:
        base = _host_budget(ctx, tag)
    finally:
        plain()
    got = _host_budget(ctx, tag)
    assert set(got) == set(base) == set(HOST_BOUND), sorted(got)
    for kind, (ops, meta, allocs, launches, syncs) in got.items():
        b = base[kind]
        fewer = 1 if kind.startswith("dispatch ") else 0  # a fresh dispatch: no layout kernel
        assert launches == b[3] - fewer, f"rank {ctx.rank} {kind}: {launches} launches, {b[3]} unfused"
        assert all(g <= m for g, m in zip((ops, meta, allocs, syncs), (b[0], b[1], b[2], b[4]))), (kind, got[kind], b)


CHECKS = ["unfused", "capture", "host-budget"]
TAG = uuid.uuid4().hex[:12]  # this session's shared-memory files


def _rank(ctx, tag):
    one = {"unfused": _check_unfused, "capture": _check_capture_picks_unfused,
           "host-budget": _check_host_budget}
    return harness.run_checks(ctx, [(name, lambda ctx, f=one[name]: f(ctx, tag)) for name in CHECKS], env={})


def start_early(items):  # (tests/conftest.py) this module's launch, in the background (tests/dist/background.py)
    harness.queue_gloo_once([(_rank, 2, TAG)], timeout_s=600)


stop_early = harness.stop_early


@pytest.mark.parametrize("name", CHECKS)
def test_fused_layout_on_cpu_processes(name):
    harness.report(harness.launch_gloo_once(_rank, 2, TAG, timeout_s=600), name)

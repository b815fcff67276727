"""Tier 2: ``ElasticBuffer``'s dispatch with its layout made in the exchange kernel (``EPCOMM_TUNE=v2_fused_layout=1``:
``HTDispatch.fuses_layout``, ``kernels/ht_layout.layout_tiles``), with its metadata written by the gather
(``v2_meta_in_gather=1``: ``HTDispatch.meta_in_gather``, ``backends/ht_v2meta.py``), and with both, on the nvlink
backend, 2 CPU ranks (Triton kernels
under the interpreter, symmetric memory simulated: ``epcomm.testing.cpu_nvlink``), against the oracles of
``epcomm.testing.elastic_cases`` as ``test_elastic_backends_cpu.py`` checks the default: dispatch bitwise, contiguous
and expanded, CPU sync and worst-case shapes, BF16 and FP8 with opaque packs, cached replays, a second dispatch;
combine bitwise with biases and weights back. With the fused layout every fresh dispatch plan made is a fused
one; with the metadata in the gather some are made so (the contiguous no-sync ones).

And the host budget in each mode: each fresh dispatch kind launches one kernel fewer than by default with the fused
layout (no layout kernel), each fresh contiguous no-sync one one fewer with the metadata in the gather (no meta
kernel), both with both; no kind does more torch calls, allocations or host reads; every other kind does the same
work. Both budgets counted in this launch (``EPCOMM_TUNE`` is read when a buffer is built).
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

# the modes: (EPCOMM_TUNE, the plan argument each fresh plan of the mode must have, the dispatch kinds that launch one
# kernel fewer: the fused layout no layout kernel, the metadata in the gather no meta kernel after it)
MODES = {
    "fused": ("v2_fused_layout=1", "fused", lambda kind: kind.startswith("dispatch ")),
    "meta": ("v2_meta_in_gather=1", "v2", lambda kind: kind.startswith("dispatch contiguous")),
    "fused+meta": ("v2_fused_layout=1,v2_meta_in_gather=1", "v2",
                   lambda kind: kind.startswith("dispatch ") + kind.startswith("dispatch contiguous")),
}
OFF = "v2_fused_layout=0,v2_meta_in_gather=0"


def _check_mode(ctx, tag, mode):
    """``test_elastic_backends_cpu``'s nvlink checks in ``mode``: every fresh dispatch plan is fused (``fused``), or
    some are made with the V2 metadata in their gather (the contiguous no-sync ones: ``meta``)."""
    _on_backend(ctx, tag, "nvlink")  # (the interpreter first: before anything imports Triton)
    from epcomm.backends.ht_dispatch import HTDispatch

    tune, arg, _ = MODES[mode]
    made = []
    make = HTDispatch._make_dispatch

    def recording(self, key, a, push, ce, scratch_rows=0, fused=False, v2=None):
        made.append(dict(fused=fused, v2=v2 is not None))
        return make(self, key, a, push, ce, scratch_rows, fused, v2)

    os.environ["EPCOMM_TUNE"] = tune
    HTDispatch._make_dispatch = recording
    try:
        assert _run(ctx, tag, "nvlink", 0) == (1, 2)
    finally:
        HTDispatch._make_dispatch = make
    got = [m[arg] for m in made]
    assert made and (all(got) if arg == "fused" else any(got)), f"dispatch plans made: {made}"


def _check_host_budget(ctx, tag, mode):
    tune, _, fewer_of = MODES[mode]
    os.environ["EPCOMM_TUNE"] = OFF
    base = _host_budget(ctx, tag)
    os.environ["EPCOMM_TUNE"] = tune
    got = _host_budget(ctx, tag)
    assert set(got) == set(base) == set(HOST_BOUND), sorted(got)
    for kind, (ops, meta, allocs, launches, syncs) in got.items():
        b = base[kind]
        fewer = int(fewer_of(kind))
        assert launches == b[3] - fewer, f"rank {ctx.rank} {mode} {kind}: {launches} launches, {b[3]} by default"
        assert all(g <= m for g, m in zip((ops, meta, allocs, syncs), (b[0], b[1], b[2], b[4]))), (kind, got[kind], b)


CHECKS = [f"{mode} {what}" for mode in MODES for what in ("checks", "host-budget")]
TAG = uuid.uuid4().hex[:12]  # this session's shared-memory files


def _rank(ctx, tag):
    def one(name):
        mode, what = name.split(" ")
        f = _check_mode if what == "checks" else _check_host_budget
        return lambda ctx: f(ctx, tag, mode)

    return harness.run_checks(ctx, [(name, one(name)) for name in CHECKS], env={})


@pytest.mark.parametrize("name", CHECKS)
def test_v2_tune_modes_on_cpu_processes(name):
    harness.report(harness.launch_gloo_once(_rank, 2, TAG, timeout_s=900), name)

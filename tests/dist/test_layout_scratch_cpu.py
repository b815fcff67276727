"""Tier 2: the nvlink backend's layout kernel keeps its scratch (partial counts and tickets) for the
backend's life (``ht_dispatch._make_layout``): a CUDA graph captured with a layout plan replays into that
scratch after the plans are cleared or replaced, so freeing it would hand its block to other tensors. On
CPU processes with the kernel under the interpreter (``epcomm.testing.cpu_nvlink``); also checks the
counts stay right across a cleared plan (a fresh scratch whose tickets start at zero)."""
import importlib.util
import uuid

import harness
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter)")


def _rank(ctx, tag):
    import torch

    from epcomm.layout import dispatch_layout
    from epcomm.testing import cpu_nvlink

    cpu_nvlink.install(tag, ctx.rank, ctx.world_size, ctx.group)
    buf = cpu_nvlink.nvlink_buffer(ctx.group, num_nvl_bytes=8 << 20)
    be = buf._backend
    assert be.name == "nvlink", be.name
    e = 8 * ctx.world_size
    gen = torch.Generator().manual_seed(5 + ctx.rank)
    first = None
    for call in range(3):
        topk = torch.randint(-1, e, (300 + 37 * call, 4), generator=gen, dtype=torch.int64)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, e)
        want_rank, want_expert, want_in = dispatch_layout(topk, e, ctx.world_size)[:3]
        assert torch.equal(per_rank, want_rank) and torch.equal(per_expert, want_expert), call
        assert torch.equal(in_rank, want_in), call
        if first is None:
            first = be._pinned[-1]
        be._plans.clear()  # as _MAX_PLANS does: the next call makes a new plan with a new scratch
    # every scratch made is still held (a captured graph may use any of them), the first among them
    assert len(be._pinned) == 3 and any(t is first for t in be._pinned), len(be._pinned)
    return True


def test_layout_scratch_outlives_its_plan():
    res = harness.launch_gloo_once(_rank, 2, uuid.uuid4().hex[:12])
    if isinstance(res, BaseException):
        raise res
    assert res == [True, True]

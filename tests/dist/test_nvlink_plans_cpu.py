"""Tier 2: the nvlink backend's per-kind plans (``Buffer`` keeps each kind's ``run``; backends/ht_dispatch.py,
ht_combine.py) on CPU processes, against the reference backend (``epcomm.testing.cpu_nvlink``).

The first call of a kind makes its plan; the repeats here bring other values every time (other routing, so
another received row count, other tensors), BF16, FP8 with column-major scales (as DeepEP's tests pass
them: copied per call) and ``num_worst_tokens``: dispatch bitwise, combine within the BF16 budget. A cached
dispatch of new rows, while one rank starts late, must wait for the peers' pushes (the slots still hold
the rows of the dispatch that made the handle, which a cached dispatch of the same rows would not tell
apart).
"""
import importlib.util
import time
import uuid

import harness
import pytest

from epcomm.testing.launcher import parallel_launch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter)")


def _plans(ctx, tag):
    from test_nvlink_cpu import _setup

    cpu_nvlink = _setup(ctx, tag)
    import torch

    from epcomm import Buffer
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.compare import assert_bitwise
    from epcomm.testing.inputs import Case

    ref = Buffer(ctx.group)
    fast = cpu_nvlink.nvlink_buffer(ctx.group, num_nvl_bytes=32 << 20)
    r, rank = ctx.world_size, ctx.rank
    tokens = tuple(7 + 2 * i for i in range(r))
    for i in range(3):  # the same kinds every round, other values
        case = Case(num_ranks=r, tokens=tokens, hidden=128, num_topk=4, num_experts=4 * r, seed=20 + i)
        G.check_ht_case(ref, fast, case, rank, False, with_bias=i == 1)
        G.check_ht_case(ref, fast, case, rank, True)
        G.check_ht_case(ref, fast, case, rank, False, worst=sum(tokens) + 2)
    kinds = len(fast._ht_fast)
    assert kinds >= 4, f"the repeats went through {kinds} plans kept by the Buffer"
    # a cached dispatch of other rows than its handle's dispatch moved, one rank late
    case = Case(num_ranks=r, tokens=tokens, hidden=128, num_topk=4, num_experts=4 * r, seed=30)
    xin, _, topk, w = G.device_inputs(case, rank, fast.device)
    rr, fr = (G._dispatch(b, xin, topk, w, case.num_experts) for b in (ref, fast))
    for j in range(2):
        x2 = (xin.float() * (3 + j) + rank).to(torch.bfloat16)
        cr = ref.dispatch(x2, handle=rr[4])
        if rank == 1:
            time.sleep(0.5)
        cf = fast.dispatch(x2, handle=fr[4])
        n = int(rr[4].rank_prefix_matrix[-1, rank])
        assert_bitwise(cf[0][:n], cr[0][:n], f"cached dispatch of new rows {j} rank={rank}")
    return len(fast._ht_fast)


def test_plans_serve_repeats_with_new_values():
    res = parallel_launch(2, _plans, uuid.uuid4().hex[:12], backend="gloo", timeout_s=300,
                          server=harness.INTERPRETER)
    assert all(k >= 4 for k in res), res

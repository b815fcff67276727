"""Tier 3: the nvlink backend's low-latency path against the reference backend on NCCL.

Dispatch bitwise (BF16 and FP8 with plain, power-of-two and UE8M0 scales), combine within the bf16
budget, with and without the receive hook, zero-copy and out=, CUDA-graph capture with many replays
on changing inputs, and a 1000-iteration stress loop with changing token counts.
"""
import os

from epcomm import Buffer
from epcomm.testing import gpu_cases as G
from epcomm.testing.inputs import Case
from epcomm.testing.launcher import parallel_launch

WORLD = int(os.environ.get("EPCOMM_TEST_WORLD", "2"))


def _rank_main(ctx, m, hidden, experts, stress):
    r = ctx.world_size
    hint = Buffer.get_low_latency_rdma_size_hint(m, hidden, r, experts)
    ref, fast = G.make_buffers(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)
    assert fast.backend_name == "nvlink"
    case = Case(num_ranks=r, tokens=tuple(max(1, m - 3 * i) for i in range(r)), hidden=hidden, num_topk=8,
                num_experts=experts, seed=11, hot_expert=5)
    out = []
    for kw in (dict(use_fp8=False), dict(use_fp8=True), dict(use_fp8=True, round_scale=True),
               dict(use_fp8=True, round_scale=True, ue8m0=True), dict(use_fp8=False, hook=True),
               dict(use_fp8=True, hook=True, zero_copy=True), dict(use_fp8=False, zero_copy=True)):
        out.append(G.check_ll_case(ref, fast, case, ctx.rank, m, **kw))
    small = Case(num_ranks=r, tokens=(1,) * r, hidden=hidden, num_topk=8, num_experts=experts, seed=12)
    out.append(G.check_ll_case(ref, fast, small, ctx.rank, m, use_fp8=True))
    G.check_ll_graph(ref, fast, case, ctx.rank, m, replays=50)
    secs = G.check_ll_stress(ref, fast, case, ctx.rank, m, iters=stress)
    return {"cases": out, "stress_s": secs}


def test_nvlink_low_latency_small():
    res = parallel_launch(WORLD, _rank_main, 32, 512, 16 * WORLD, 1000, backend="nccl", timeout_s=150)
    assert all(r["stress_s"] > 0 for r in res)


def test_nvlink_low_latency_dsv3():
    res = parallel_launch(WORLD, _rank_main, 128, 7168, 288, 100, backend="nccl", timeout_s=150)
    assert all(r["stress_s"] > 0 for r in res)

"""Tier 3: the nvlink backend's high-throughput path against the reference backend on NCCL.

Dispatch bitwise (random routings with -1 entries, ranks that receive nothing, hot experts, T = 0,
odd T, several hidden sizes, BF16 and FP8), combine within the bf16 budget, cached handle,
num_worst_tokens, async variants, CUDA-graph capture and replay, a 500-iteration stress loop and
the deadline error of a rank that never arrives.
"""
import os
import sys

import pytest

from epcomm.backends.base import PeerTimeoutError
from epcomm.testing import gpu_cases as G
from epcomm.testing.inputs import Case
from epcomm.testing.launcher import parallel_launch

WORLD = int(os.environ.get("EPCOMM_TEST_WORLD", "2"))


def _cases(r):
    return [
        Case(num_ranks=r, tokens=tuple(37 + 11 * i for i in range(r)), hidden=256, num_topk=4, num_experts=8 * r),
        Case(num_ranks=r, tokens=tuple(0 if i == 0 else 64 for i in range(r)), hidden=512, num_topk=8,
             num_experts=16 * r, hot_expert=3),
        Case(num_ranks=r, tokens=tuple(129 for _ in range(r)), hidden=7168, num_topk=8, num_experts=32 * r,
             empty_rank=r - 1, seed=3),
        Case(num_ranks=r, tokens=tuple(1 + 2 * i for i in range(r)), hidden=1024 + 128, num_topk=32,
             num_experts=32 * r, drop_prob=0.3, seed=4),
    ]  # the DeepSeek-V3 shape (4096 x 7168, top-8, 256 experts) is checked by `epcomm bench` before timing


def _log(ctx, msg):
    print(f"[rank {ctx.rank}] {msg}", file=sys.stderr, flush=True)


def _rank_cases(ctx, transfer="default"):
    if transfer != "default":  # read when the Buffer is made (this rank's process only)
        os.environ["EPCOMM_HT_TRANSFER"] = transfer
    ref, fast = G.make_buffers(ctx.group, num_nvl_bytes=1 << 30)
    assert fast.backend_name == "nvlink", fast.backend_name
    out = []
    for case in _cases(ctx.world_size):
        for fp8 in (False, True):
            if fp8 and case.hidden % 128:
                continue
            out.append(G.check_ht_case(ref, fast, case, ctx.rank, fp8, with_bias=not fp8))
            _log(ctx, f"ok {case} fp8={fp8}")
        out.append(G.check_ht_case(ref, fast, case, ctx.rank, False, worst=sum(case.tokens) + 5))
        _log(ctx, f"ok {case} num_worst_tokens")
    G.check_ht_no_topk(ref, fast, _cases(ctx.world_size)[0], ctx.rank)  # (no ids: a plan with no weights to make)
    return out


def _rank_async(ctx):
    ref, fast = G.make_buffers(ctx.group, num_nvl_bytes=1 << 30)
    G.check_ht_async(ref, fast, _cases(ctx.world_size)[0], ctx.rank)
    _log(ctx, "ok async")
    return True


def _rank_graph(ctx):
    ref, fast = G.make_buffers(ctx.group, num_nvl_bytes=1 << 30)
    case = _cases(ctx.world_size)[1]
    G.check_ht_graph(ref, fast, case, ctx.rank, worst=sum(case.tokens))
    _log(ctx, "ok graph")
    return True


def _rank_stress(ctx):
    ref, fast = G.make_buffers(ctx.group, num_nvl_bytes=1 << 30)
    return G.check_ht_stress(fast, ref, ctx.rank, ctx.world_size, iters=500)


@pytest.mark.parametrize("transfer", ["default", "sm"])  # sm: the fused push of captured calls, every case
def test_nvlink_high_throughput_cases(transfer):
    res = parallel_launch(WORLD, _rank_cases, transfer, backend="nccl", timeout_s=150)
    assert all(len(r) == len(res[0]) for r in res)
    assert all(sum(c["remote_rows"] for c in r) > 0 for r in res), res  # rows came from the peers


def test_nvlink_high_throughput_async():
    assert all(parallel_launch(WORLD, _rank_async, backend="nccl", timeout_s=120))


def test_nvlink_high_throughput_graph():
    assert all(parallel_launch(WORLD, _rank_graph, backend="nccl", timeout_s=120))


def test_nvlink_high_throughput_stress_500():
    res = parallel_launch(WORLD, _rank_stress, backend="nccl", timeout_s=150)
    # iterations 0, 50, ..., 450 and 499 compared with the reference, and rows crossed between the ranks
    assert all(r.iters == 500 and r.checked == 11 and r.remote_rows > 0 for r in res), res


def _late_rank(ctx):
    os.environ["EPCOMM_TIMEOUT_S"] = "2"
    _, fast = G.make_buffers(ctx.group, num_nvl_bytes=64 << 20)
    case = Case(num_ranks=ctx.world_size, tokens=(16,) * ctx.world_size)
    xin, x, topk, w = G.device_inputs(case, ctx.rank, fast.device)
    if ctx.rank == 1:
        import time

        time.sleep(8)  # never calls dispatch while rank 0 waits (deadline 2 s)
        return "absent"
    try:
        G._dispatch(fast, xin, topk, w, case.num_experts)
    except PeerTimeoutError as e:
        assert "dispatch" in str(e) and "rank 1" in str(e), str(e)
        return str(e)
    raise AssertionError("dispatch with an absent peer did not raise")


def _worst_too_small(ctx):
    _, fast = G.make_buffers(ctx.group, num_nvl_bytes=64 << 20)
    case = Case(num_ranks=ctx.world_size, tokens=(64,) * ctx.world_size, hidden=256, num_topk=4,
                num_experts=8 * ctx.world_size, seed=7)
    xin, x, topk, w = G.device_inputs(case, ctx.rank, fast.device)
    G._dispatch(fast, xin, topk, w, case.num_experts, num_worst_tokens=1)  # every rank receives more than 1 row
    import torch

    torch.cuda.synchronize()
    try:
        G._dispatch(fast, xin, topk, w, case.num_experts)
    except RuntimeError as e:  # found on the device (handle kernel), raised by the next call on the Buffer
        assert "num_worst_tokens=1" in str(e) and f"epcomm rank {ctx.rank}" in str(e), str(e)
        return str(e)
    raise AssertionError("a dispatch after an overflowing num_worst_tokens did not raise")


def test_num_worst_tokens_overflow_is_reported():
    res = parallel_launch(WORLD, _worst_too_small, backend="nccl", timeout_s=120)
    assert all("tokens arrived" in r for r in res)


def test_deadline_names_phase_and_rank():
    res = parallel_launch(2, _late_rank, backend="nccl", timeout_s=120)
    assert "rank 1" in res[0]


def _rank_caller_defaults(ctx):
    """The caller ran ``torch.set_default_device('cuda')`` and ``torch.set_default_dtype(torch.bfloat16)``
    first (DeepEP's scripts and many training scripts do): Buffers and every call still work, and
    match the reference."""
    import torch

    from epcomm import Buffer

    torch.set_default_device(ctx.device)
    torch.set_default_dtype(torch.bfloat16)
    ref, fast = G.make_buffers(ctx.group, num_nvl_bytes=256 << 20)
    case = _cases(ctx.world_size)[0]
    out = [G.check_ht_case(ref, fast, case, ctx.rank, fp8) for fp8 in (False, True)]
    m, h, e = 16, 512, 8 * ctx.world_size
    hint = Buffer.get_low_latency_rdma_size_hint(m, h, ctx.world_size, e)
    lref, lfast = G.make_buffers(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)
    ll = Case(num_ranks=ctx.world_size, tokens=(m,) * ctx.world_size, hidden=h, num_topk=4, num_experts=e, seed=9)
    out.append(G.check_ll_case(lref, lfast, ll, ctx.rank, m, use_fp8=True))
    return out


def test_caller_default_device_and_dtype():
    res = parallel_launch(WORLD, _rank_caller_defaults, backend="nccl", timeout_s=150)
    assert all(len(r) == 3 for r in res)

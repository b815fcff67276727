"""Tier 2 stand-in for the GPU checks' summaries: ``gpu_cases``' case and stress functions run on two
CPU processes (the reference backend on gloo as the "fast" one, ``torch.cuda`` calls stood in), and
their summaries say what the tier-3 tests assert: rows came from the other rank, and the stress loops
compared the iterations they say with the reference. A case whose only token selects no expert (the
old one-token case of the GPU tests) moves nothing, and its summary says so.

Also the sum of |terms| that ``check_ll_case`` sizes its combine budget with (``gpu_cases_ll.ll_combine_abs_sum``,
computed from the dispatch's inputs) against the reference backend's combine of ``|y|`` with ``|w|`` (what the
check asked the reference for before): within the rounding of that combine (float32 accumulation, one BF16
rounding), for BF16 and FP8 dispatches (float32 and UE8M0 scales), experts dropped and a hot expert.
"""
from epcomm.testing.launcher import parallel_launch


def _summaries(ctx):
    from epcomm.testing import cpu_nvlink

    cpu_nvlink.cuda_stand_ins()
    from epcomm import Buffer
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    r, m, h, e = ctx.world_size, 8, 256, 16
    hint = Buffer.get_low_latency_rdma_size_hint(m, h, r, e)
    ref, fast = G.make_buffers(ctx.group, fast="reference", num_rdma_bytes=hint, low_latency_mode=True)
    out = {}
    for name, kw in (("one token", dict(no_expert_token=False)), ("one token, no expert", {})):
        case = Case(num_ranks=r, tokens=(1,) * r, hidden=h, num_topk=8, num_experts=e, seed=12, **kw)
        out[name] = G.check_ll_case(ref, fast, case, ctx.rank, m, use_fp8=True)["remote_rows"]
    case = Case(num_ranks=r, tokens=(m, m - 3), hidden=h, num_topk=8, num_experts=e, seed=11, hot_expert=5)
    out["ll stress"] = G.check_ll_stress(ref, fast, case, ctx.rank, m, iters=12)
    out["abs sums"] = _abs_sums(ref, ctx, m, h, e)
    ht_ref, ht_fast = G.make_buffers(ctx.group, fast="reference")
    case = Case(num_ranks=r, tokens=(0, 77), hidden=h, num_topk=4, num_experts=e, seed=2, hot_expert=3)
    out["ht"] = G.check_ht_case(ht_ref, ht_fast, case, ctx.rank, False)["remote_rows"]
    out["ht stress"] = G.check_ht_stress(ht_fast, ht_ref, ctx.rank, r, iters=12)
    return out


def _abs_sums(ref, ctx, m, h, e):
    """``ll_combine_abs_sum`` against the reference's combine of ``|y|`` with ``|w|``; returns the cases checked."""
    from epcomm.testing import gpu_cases_ll as L
    from epcomm.testing.compare import assert_within_budget
    from epcomm.testing.inputs import Case

    r, lx, k = ctx.world_size, e // ctx.world_size, 8
    done = 0
    for i, (fp8, rnd, ue8m0) in enumerate(((False, False, False), (True, False, False), (True, True, False),
                                           (True, True, True))):
        case = Case(num_ranks=r, tokens=(m, m - 3)[:r] if r == 2 else (m,) * r, hidden=h, num_topk=k,
                    num_experts=e, seed=40 + i, drop_prob=0.1, hot_expert=3 if i % 2 else None)
        x, topk, w = L.ll_inputs(case, ctx.rank, ctx.device)
        rx, cnt, hd, _, _ = ref.low_latency_dispatch(x, topk, m, e, use_fp8=fp8, round_scale=rnd, use_ue8m0=ue8m0)
        y = L.ll_expert_outputs(rx, cnt, fp8, ue8m0)
        ref_abs, _, _ = ref.low_latency_combine(y.abs(), topk, w.abs(), hd)
        mine = L.ll_combine_abs_sum(x, topk, w, lx, fp8, rnd)
        assert bool((mine[1:] > 0).all()), "every token but the first (no expert) has terms"
        assert_within_budget(ref_abs, mine, mine, k, f"reference combine of |y| against ll_combine_abs_sum {case}")
        done += 1
    return done


def test_gpu_check_summaries_on_cpu():
    res = parallel_launch(2, _summaries, backend="gloo", timeout_s=300)
    for r in res:
        assert r["abs sums"] == 4, r
        assert r["one token"] > 0 and r["one token, no expert"] == 0, r
        for s in (r["ll stress"], r["ht stress"]):
            assert s.iters == 12 and s.checked == 2 and s.remote_rows > 0, r  # iterations 0 and 11 checked
    assert res[0]["ht"] > 0 and res[1]["ht"] == 0, res  # rank 0 has no tokens: only rank 0 receives

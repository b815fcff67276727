"""Tier 2 stand-in for the GPU checks' summaries: ``gpu_cases``' case and stress functions run on two
CPU processes (the reference backend on gloo as the "fast" one, ``torch.cuda`` calls stood in), and
their summaries say what the tier-3 tests assert: rows came from the other rank, and the stress loops
compared the iterations they say with the reference. A case whose only token selects no expert (the
old one-token case of the GPU tests) moves nothing, and its summary says so.
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
    ht_ref, ht_fast = G.make_buffers(ctx.group, fast="reference")
    case = Case(num_ranks=r, tokens=(0, 77), hidden=h, num_topk=4, num_experts=e, seed=2, hot_expert=3)
    out["ht"] = G.check_ht_case(ht_ref, ht_fast, case, ctx.rank, False)["remote_rows"]
    out["ht stress"] = G.check_ht_stress(ht_fast, ht_ref, ctx.rank, r, iters=12)
    return out


def test_gpu_check_summaries_on_cpu():
    res = parallel_launch(2, _summaries, backend="gloo", timeout_s=300)
    for r in res:
        assert r["one token"] > 0 and r["one token, no expert"] == 0, r
        for s in (r["ll stress"], r["ht stress"]):
            assert s.iters == 12 and s.checked == 2 and s.remote_rows > 0, r  # iterations 0 and 11 checked
    assert res[0]["ht"] > 0 and res[1]["ht"] == 0, res  # rank 0 has no tokens: only rank 0 receives

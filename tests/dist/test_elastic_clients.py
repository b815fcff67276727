"""Tier 2: the exact ``ElasticBuffer`` call sequences of DeepEP V2's clients, on 2 gloo CPU ranks, each
result bitwise against the oracle of ``epcomm.testing.elastic_cases`` (expert outputs computed at the
source with the same float ops as at the expert rank). Also the constructor's argument errors and
``deep_ep.ElasticBuffer`` under ``EPCOMM_AS_DEEP_EP=1``.

- SGLang ``deepep_v2``: decode (FP8 + fp32 scales, expanded, no CPU sync, per-expert segments read from
  ``psum_num_recv_tokens_per_expert``) and prefill (contiguous, rows sliced at ``psum[-1].item()``).
- vLLM ``deepep_v2``: ``num_max_tokens_per_rank`` in power-of-two buckets, contiguous, no sync, padding
  masked on the device from ``psum_num_recv_tokens_per_scaleup_rank[-1]``, ids globalised, MXFP8-style
  per-32 scales, weights applied before combine.
- Megatron-LM flex (PR #4632): forward with ``previous_event=capture()``/async/alloc, backward through a
  cached dispatch (``num_experts=handle.num_experts``, and the DeepEP #685 pitfall: none, ``num_sms=0``)
  and a combine carrying the top-k weight gradients back; ``set_num_sms``; an extra attribute.
- DeepGEMM mega-MoE baseline: expanded FP8 with packed UE8M0 int32 scales, TMA column-major scales,
  ``allow_multiple_reduction=False``, statistics, ``do_handle_copy=False``, ``barrier``, ``destroy``.
"""

import pytest
import torch

from epcomm.testing.launcher import parallel_launch


def _eq(what, got, want):
    assert got.shape == want.shape and torch.equal(got, want), f"{what}: {got.flatten()[:6]} vs {want.flatten()[:6]}"


def _lane_values(x, sf_scale, idx, w, le):
    """``bf16[T, K, H]``: what expert ``idx[t, j]`` returns for token ``t`` (``x * w * (local id + 1)``)."""
    xf = x.float() if sf_scale is None else x.float() * sf_scale
    loc = (idx % le + 1).float()
    return (xf.unsqueeze(1) * (w * loc).unsqueeze(2)).to(torch.bfloat16)


def _local_sum(vals, keep):
    """Per row, its kept lanes summed in lane order in float32, rounded once (the experts' own sum)."""
    acc = torch.zeros(vals.shape[0], vals.shape[2])
    for j in range(vals.shape[1]):
        acc = acc + torch.where(keep[:, j:j + 1], vals[:, j].float(), torch.zeros(()))
    return acc.to(torch.bfloat16)


def sglang(ctx, case):
    from epcomm import ElasticBuffer
    from epcomm.testing import elastic_cases as C

    _r, me, le = case.num_ranks, ctx.rank, case.num_experts // case.num_ranks
    buf = ElasticBuffer(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden, num_topk=case.num_topk,
                        use_fp8_dispatch=True, allow_hybrid_mode=True, sl_idx=0, prefer_overlap_with_compute=False)
    sms = buf.get_theoretical_num_sms(case.num_experts, case.num_topk)
    qps = buf.get_theoretical_num_qps(sms)
    assert buf.num_bytes > 0 and qps <= buf.num_allocated_qps
    q, sf, idx, w = C.inputs(case, me, "fp32")
    # decode: expanded, no CPU sync, alignment 128
    rx, ridx, rw, hd, ev = buf.dispatch((q, sf), topk_idx=idx, topk_weights=w, num_experts=case.num_experts,
                                        num_max_tokens_per_rank=case.m, expert_alignment=128, num_sms=sms,
                                        num_qps=qps, do_cpu_sync=False, do_expand=True)
    assert ridx is None and rw.dim() == 1 and ev.event is None
    (rq, rsf), psum = rx, hd.psum_num_recv_tokens_per_expert.tolist()
    y = torch.full((rq.shape[0], case.hidden), float("nan"), dtype=torch.bfloat16)
    start = 0
    for e in range(le):  # the masked slab: expert e's real rows
        rows = slice(start, psum[e])
        y[rows] = (rq[rows].float() * rsf[rows, :1] * (rw[rows] * (e + 1)).unsqueeze(1)).to(torch.bfloat16)
        start = (psum[e] + 127) // 128 * 128
    out = buf.combine(y, handle=hd, topk_weights=rw, num_sms=sms, num_qps=qps)[0]
    want = C.expected_reduce(_lane_values(q, sf[:, :1], idx, w, le), idx, le, True)
    _eq("sglang decode", out, want)
    # prefill: contiguous; the rows that are real are read back with .item()
    x, _, idx, w = C.inputs(case, me)
    rx, ridx, rw, hd, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=case.num_experts,
                                       num_max_tokens_per_rank=case.m, num_sms=sms, num_qps=qps)
    n = hd.psum_num_recv_tokens_per_scaleup_rank[-1].item()
    vals = _lane_values(rx[:n], None, torch.where(ridx[:n] >= 0, ridx[:n], 0), rw[:n], le)
    y = torch.zeros(rx.shape[0], case.hidden, dtype=torch.bfloat16)
    y[:n] = _local_sum(vals, ridx[:n] >= 0)
    out = buf.combine(y, handle=hd, topk_weights=rw)[0]
    _eq("sglang prefill", out, C.expected_reduce(_lane_values(x, None, idx, w, le), idx, le, True))
    return 1


def vllm(ctx, case):
    from epcomm import ElasticBuffer
    from epcomm.testing import elastic_cases as C

    me, le = ctx.rank, case.num_experts // case.num_ranks
    buf = ElasticBuffer(ctx.group, num_max_tokens_per_rank=64, hidden=case.hidden, num_topk=case.num_topk,
                        use_fp8_dispatch=True, allow_hybrid_mode=False, prefer_overlap_with_compute=True,
                        allow_multiple_reduction=True, explicitly_destroy=True)
    buf.get_theoretical_num_sms(num_experts=case.num_experts, num_topk=case.num_topk)
    for step, tokens in enumerate(((3, 1), (9, 13), (2, 0))):
        bucket = 1 << (max(max(tokens), 1) - 1).bit_length()  # every rank passes the same power of two
        c = type(case)(num_ranks=2, tokens=tokens, hidden=case.hidden, num_topk=case.num_topk,
                       num_experts=case.num_experts, seed=10 + step)
        x, _, idx, w = C.inputs(c, me)
        g = torch.Generator().manual_seed(step)
        q = (x.float() * 4).to(torch.float8_e4m3fn)
        sf = torch.rand(x.shape[0], case.hidden // 32, generator=g) + 0.5  # per-32 scales
        rx, ridx, rw, hd, _ev = buf.dispatch(x=(q, sf), topk_idx=idx, topk_weights=w, num_experts=case.num_experts,
                                            num_max_tokens_per_rank=bucket, do_expand=False, do_cpu_sync=False,
                                            async_with_compute_stream=False)
        rq, rsf = rx
        assert rq.shape[0] == 2 * bucket and hd.num_recv_tokens_per_expert_list == []
        valid = torch.arange(rq.shape[0]) < hd.psum_num_recv_tokens_per_scaleup_rank[-1]  # on the device
        gidx = torch.where((ridx >= 0) & valid.unsqueeze(1), ridx + me * le, torch.full_like(ridx, -1))
        loc = torch.where(gidx >= 0, gidx - me * le, 0)
        vals = _lane_values(rq, rsf[:, :1], loc, rw, le)  # weights applied before combine (TopKWeightAndReduce)
        y = _local_sum(vals, gidx >= 0)
        out, ow, _ = buf.combine(x=y, handle=hd, topk_weights=None, async_with_compute_stream=False)
        assert ow is None
        want = C.expected_reduce(_lane_values(q, sf[:, :1], idx, w, le), idx, le, True)
        _eq(f"vllm step {step} (bucket {bucket})", out, want)
    buf.destroy()
    return 1


def megatron(ctx, case):
    from epcomm import ElasticBuffer
    from epcomm.event import EventOverlap
    from epcomm.testing import elastic_cases as C

    me, le = ctx.rank, case.num_experts // case.num_ranks
    ElasticBuffer.set_num_sms(0)
    buf = ElasticBuffer(group=ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden,
                        num_topk=case.num_topk, use_fp8_dispatch=False, allow_hybrid_mode=True, num_allocated_qps=0)
    buf.num_nvl_bytes = 1 << 20  # Megatron sets attributes of its own on the instance
    x, _, idx, w = C.inputs(case, me)
    asynch = {"previous_event": buf.capture(), "async_with_compute_stream": True, "allocate_on_comm_stream": True}
    rx, ridx, rw, hd, ev = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=case.num_experts,
                                        num_max_tokens_per_rank=case.m, num_sms=0, num_qps=0, do_expand=False,
                                        **asynch)
    EventOverlap(ev).current_stream_wait()
    assert hd.num_recv_tokens_per_expert_list and hd.num_experts == case.num_experts
    n = rx.shape[0]
    vals = _lane_values(rx, None, torch.where(ridx >= 0, ridx, 0), rw, le)
    y = _local_sum(vals, ridx >= 0)
    out, _, ev = buf.combine(y, hd, num_sms=0, num_qps=0, **dict(asynch, previous_event=buf.capture()))
    ev.current_stream_wait()
    _eq("megatron forward", out, C.expected_reduce(_lane_values(x, None, idx, w, le), idx, le, True))
    # backward of combine: the gradient dispatched along the cached handle (num_experts from the handle, and
    # also left out with num_sms=0: DeepEP #685 raises there, epcomm reads it from the handle)
    grad = (x.float() * 3).to(torch.bfloat16)
    for kw in ({"num_experts": hd.num_experts}, {}):
        g, _, _, hd2, ev = buf.dispatch(grad, handle=hd, num_sms=0, num_qps=0, do_expand=False,
                                        **dict(asynch, previous_event=buf.capture()), **kw)
        ev.current_stream_wait()
        assert hd2 is hd
        _eq("megatron backward dispatch", g, (rx.float() * 3).to(torch.bfloat16)[:n])
    # backward of dispatch: combine carries the top-k weight gradients back
    grad_probs = (rw * 2 + torch.arange(case.num_topk)).to(torch.float32)
    _gx, gw, _ = buf.combine(g, hd, topk_weights=grad_probs.float())
    want_w = torch.where(idx >= 0, w * 2 + torch.arange(case.num_topk), torch.zeros(()))
    _eq("megatron weight gradients back", gw, want_w)
    ElasticBuffer.set_num_sms(8)
    assert buf.dispatch(x, topk_idx=idx, num_experts=case.num_experts)[3].num_sms == 8
    ElasticBuffer.set_num_sms(0)
    return 1


def deepgemm(ctx, case):
    from epcomm import ElasticBuffer
    from epcomm.testing import elastic_cases as C

    me, le = ctx.rank, case.num_experts // case.num_ranks
    buf = ElasticBuffer(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden, num_topk=case.num_topk,
                        use_fp8_dispatch=True, explicitly_destroy=True, allow_multiple_reduction=False,
                        num_gpu_timeout_secs=10, num_cpu_timeout_secs=30)
    q, sf, idx, w = C.inputs(case, me, "ue8m0")  # int32 [T, H/128]: four UE8M0 bytes per 128 elements
    stats = torch.zeros(le, dtype=torch.int32)
    rx, _, rw, hd, _ = buf.dispatch((q, sf), topk_idx=idx, topk_weights=w, cumulative_local_expert_recv_stats=stats,
                                    num_experts=case.num_experts, expert_alignment=128, do_cpu_sync=False,
                                    do_handle_copy=False, do_expand=True, use_tma_aligned_col_major_sf=True)
    rq, rsf = rx
    assert hd.topk_idx is idx and rsf.dtype == torch.int32 and rsf.stride(0) == 1
    want = C.expected_dispatch(case, me, "ue8m0", 128)
    assert stats.tolist() == want["counts"] and int(hd.psum_num_recv_tokens_per_expert[-1]) == (
        want["starts"][-1] + want["counts"][-1])
    y = torch.full((rq.shape[0], case.hidden), float("nan"), dtype=torch.bfloat16)
    start, psum = 0, hd.psum_num_recv_tokens_per_expert.tolist()
    for e in range(le):  # SwiGLU with the weights applied, as the mega-MoE baseline does
        rows = slice(start, psum[e])
        y[rows] = (rq[rows].float() * (rw[rows] * (e + 1)).unsqueeze(1)).to(torch.bfloat16)
        start = (psum[e] + 127) // 128 * 128
    out = buf.combine(y, handle=hd)[0]
    _eq("deepgemm (one reduction)", out, C.expected_reduce(_lane_values(q, None, idx, w, le), idx, le, False))
    buf.barrier(use_comm_stream=False)
    buf.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.dispatch((q, sf), topk_idx=idx, num_experts=case.num_experts)
    return 1


def constructor_errors(ctx, case):
    from epcomm import ElasticBuffer

    for kw, exc, word in [
        ({"num_bytes": 3 << 20}, ValueError, "num_bytes"),
        ({"num_cpu_bytes": 2 << 20}, ValueError, "num_cpu_bytes"),
        ({"num_bytes": 2 << 20, "num_cpu_bytes": 4 << 20}, ValueError, "num_cpu_bytes"),
        ({"num_topk": 33}, ValueError, "num_topk"),
        ({"hidden": -1}, ValueError, "hidden"),
        ({"num_gpu_timeout_secs": 0}, ValueError, "num_gpu_timeout_secs"),
        ({"allow_hybrid_mode": "yes"}, TypeError, "allow_hybrid_mode"),
        ({"bogus": 1}, TypeError, "bogus"),
    ]:
        with pytest.raises(exc, match=word):
            ElasticBuffer(ctx.group, **kw)
    with pytest.raises(TypeError, match="group"):
        ElasticBuffer(None)
    buf = ElasticBuffer(ctx.group, num_max_tokens_per_rank=4, hidden=128, gpu_timeout_secs=5, cpu_timeout_secs=6)
    assert buf.num_cpu_timeout_secs == 6 and buf.get_logical_domain_size() == (1, ctx.world_size)
    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        buf.destroy()
    import deep_ep  # EPCOMM_AS_DEEP_EP=1 in these ranks

    b = deep_ep.ElasticBuffer(ctx.group, num_max_tokens_per_rank=4, hidden=128)
    assert isinstance(b, ElasticBuffer) and deep_ep.get_logical_domain_size(ctx.group) == (1, ctx.world_size)
    assert deep_ep.get_physical_domain_size(ctx.group) == b.get_physical_domain_size()
    hint = ElasticBuffer.get_buffer_size_hint(ctx.group, 4, 128)
    assert hint == b.num_bytes, (hint, b.num_bytes)
    return 1


def _all(ctx):
    import os

    from epcomm.testing.elastic_cases import V2Case

    os.environ["EPCOMM_AS_DEEP_EP"] = "1"
    import _epcomm_as_deep_ep

    _epcomm_as_deep_ep.install()
    case = V2Case(num_ranks=2, tokens=(6, 11), num_experts=8, num_topk=3, masked=0.15, seed=5)
    return [f(ctx, case) for f in (sglang, vllm, megatron, deepgemm, constructor_errors)]


def test_client_call_sequences():
    res = parallel_launch(2, _all, backend="gloo", timeout_s=240)
    assert res == [[1] * 5] * 2

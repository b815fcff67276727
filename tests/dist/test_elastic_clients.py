"""Tier 2: the exact ``ElasticBuffer`` call sequences of DeepEP V2's clients, on 2 gloo CPU ranks, each
result bitwise against the oracle of ``epcomm.testing.elastic_cases`` (expert outputs computed at the
source with the same float ops as at the expert rank). Also the constructor's argument errors and
``deep_ep.ElasticBuffer`` under ``EPCOMM_AS_DEEP_EP=1``.

- SGLang 0.5.23 ``deepep_v2`` (``token_dispatcher/deepep_v2.py``, followed call by call): ``num_sms=0`` and no
  ``num_qps``; decode (FP8 + fp32 scales, expanded, no CPU sync, per-expert segments read from
  ``psum_num_recv_tokens_per_expert``), prefill expanded with the CPU sync, prefill with UE8M0 scales
  (contiguous, TMA-aligned column-major, rows sliced at ``psum[-1].item()``), and an idle rank's one dummy
  token (zeros, experts ``0..K-1``, weights 0; its combine cut to no rows).
- vLLM 0.33.0 ``deepep_v2`` (``prepare_finalize/deepep_v2.py``, ``all2all.py``): CUDA-graph mode
  (``num_max_tokens_per_rank`` in power-of-two buckets, contiguous, no sync, padding masked on the device from
  ``psum_num_recv_tokens_per_scaleup_rank[-1]``, ids globalised, block-FP8 fp32 scales) and ``enforce_eager``
  (expanded with the sync, ``num_max_tokens_per_rank=None``, one global id a row from
  ``num_recv_tokens_per_expert_list``, MXFP8 scales packed in int32); weights applied before the combine,
  which runs as ``finalize_async`` (``async_with_compute_stream`` and ``allocate_on_comm_stream``) and ``finalize``.
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


def _expert_rows(rq, rsf, rw, psum, le, alignment):
    """The expanded layout's expert outputs: expert ``e``'s real rows (its segment, from ``psum``) scaled by the
    row's weight and ``e + 1``; rows that are not real stay NaN (they must not reach a result)."""
    y = torch.full((rq.shape[0], rq.shape[1]), float("nan"), dtype=torch.bfloat16)
    xf = rq.float() if rsf is None else rq.float() * rsf[:, :1]
    start = 0
    for e in range(le):
        rows = slice(start, psum[e])
        y[rows] = (xf[rows] * (rw[rows] * (e + 1)).unsqueeze(1)).to(torch.bfloat16)
        start = (psum[e] + alignment - 1) // alignment * alignment
    return y


def sglang(ctx, case):
    """SGLang 0.5.23, python/sglang/srt/layers/moe/token_dispatcher/deepep_v2.py (``DeepEPv2Buffer.get_buffer``,
    ``_DeepEPv2Impl.dispatch`` / ``combine``) with its defaults: ``SGLANG_DEEPEP_V2_NUM_SMS=0`` and no
    ``num_qps``; prefill expanded unless the scales are UE8M0 (``SGLANG_DEEPEP_V2_ENABLE_PREFILL_EXPAND``)."""
    from epcomm import ElasticBuffer
    from epcomm.testing import elastic_cases as C

    me, le, e_, k = ctx.rank, case.num_experts // case.num_ranks, case.num_experts, case.num_topk
    buf = ElasticBuffer(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden, num_topk=k,
                        use_fp8_dispatch=True, allow_hybrid_mode=True, sl_idx=0, prefer_overlap_with_compute=False)

    def dispatch(x, sf, idx, w, is_decode, ue8m0):  # _DeepEPv2Impl.dispatch, the part that calls DeepEP
        use_expand = is_decode or not ue8m0  # prefill_expand defaults to "not ue8m0"
        tma = ue8m0  # use_tma_aligned_col_major_sf: ue8m0 when expanded, scale_format.tma_aligned else
        rx, ridx, rw, hd, ev = buf.dispatch((x, sf), topk_idx=idx, topk_weights=w, num_experts=e_,
                                            num_max_tokens_per_rank=case.m, expert_alignment=128, num_sms=0,
                                            use_tma_aligned_col_major_sf=tma, do_cpu_sync=not is_decode,
                                            do_expand=use_expand)
        if ev.event is not None:
            ev.current_stream_wait()
        (rq, rsf) = rx
        if use_expand:
            assert ridx is None and rw.shape == (rq.shape[0],), "expanded: weights per receive row"
            return rq, rsf, None, rw, hd
        n = int(hd.psum_num_recv_tokens_per_scaleup_rank[-1].item())
        return rq[:n], rsf[:n], ridx[:n], rw[:n], hd

    def combine(y, rw, hd):
        out, _, ev = buf.combine(y, handle=hd, topk_weights=rw)
        if ev.event is not None:
            ev.current_stream_wait()
        return out

    # decode: expanded, no CPU sync (masked GEMM); prefill: expanded with the sync (FP32 scales)
    q, sf, idx, w = C.inputs(case, me, "fp32")
    want = C.expected_reduce(_lane_values(q, sf[:, :1], idx, w, le), idx, le, True)
    for is_decode in (True, False):
        rq, rsf, _, rw, hd = dispatch(q, sf, idx, w, is_decode, ue8m0=False)
        if not is_decode:
            assert sum(hd.num_recv_tokens_per_expert_list) >= 0 and hd.num_recv_tokens_per_expert_list
        y = _expert_rows(rq, rsf, rw, hd.psum_num_recv_tokens_per_expert.tolist(), le, 128)
        _eq(f"sglang {'decode' if is_decode else 'prefill (expanded)'}", combine(y, rw, hd), want)
    # prefill with UE8M0 scales (DeepGEMM on Blackwell): contiguous, the real rows read with .item()
    q, sf, idx, w = C.inputs(case, me, "ue8m0")
    rq, rsf, ridx, rw, hd = dispatch(q, sf, idx, w, is_decode=False, ue8m0=True)
    exp = C.expected_dispatch(case, me, "ue8m0", 128)
    _eq("sglang prefill (UE8M0) scales moved untouched", rsf.contiguous(), exp["sf"])
    vals = _lane_values(rq, None, torch.where(ridx >= 0, ridx, 0), rw, le)
    out = combine(_local_sum(vals, ridx >= 0), rw, hd)
    _eq("sglang prefill (contiguous, UE8M0)", out, C.expected_reduce(_lane_values(q, None, idx, w, le), idx, le, True))
    # an idle rank in prefill: one dummy token (zeros, experts 0..K-1, weights 0), its combine cut to no rows
    idle = type(case)(num_ranks=2, tokens=(0, 7), hidden=case.hidden, num_topk=k, num_experts=e_, seed=9)
    q, sf, idx, w = C.inputs(idle, me, "fp32")
    pad = q.shape[0] == 0
    if pad:
        q = torch.zeros(1, case.hidden, dtype=torch.float8_e4m3fn)
        sf = torch.ones(1, case.hidden // 128)
        idx, w = torch.arange(k).unsqueeze(0), torch.zeros(1, k)
    rq, rsf, _, rw, hd = dispatch(q, sf, idx, w, is_decode=False, ue8m0=False)
    out = combine(_expert_rows(rq, rsf, rw, hd.psum_num_recv_tokens_per_expert.tolist(), le, 128), rw, hd)
    if pad:
        out = out[:0]
        assert out.shape == (0, case.hidden), out.shape
    else:
        _eq("sglang prefill beside an idle rank", out,
            C.expected_reduce(_lane_values(q, sf[:, :1], idx, w, le), idx, le, True))
    return 1


def vllm(ctx, case):
    """vLLM 0.33.0, vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_v2.py
    (``DeepEPV2PrepareAndFinalize``) with the buffer of vllm/distributed/device_communicators/all2all.py
    (``DeepEPV2All2AllManager``): CUDA-graph mode (contiguous, no sync, power-of-two buckets, block-FP8 FP32
    scales) and ``enforce_eager`` (expanded with the sync, ``num_max_tokens_per_rank=None``, MXFP8 scales packed
    four UE8M0 to an int32); the weights applied before the combine; ``finalize_async`` and ``finalize``."""
    from epcomm import ElasticBuffer
    from epcomm.testing import elastic_cases as C

    me, le, e_ = ctx.rank, case.num_experts // case.num_ranks, case.num_experts
    buf = ElasticBuffer(ctx.group, num_max_tokens_per_rank=64, hidden=case.hidden, num_topk=case.num_topk,
                        use_fp8_dispatch=True, allow_hybrid_mode=False, prefer_overlap_with_compute=True,
                        allow_multiple_reduction=True, explicitly_destroy=True)
    buf.get_theoretical_num_sms(num_experts=e_, num_topk=case.num_topk)

    def finalize(y, hd, do_async):  # _finalize: combine_async = do_async (no DBO)
        out, ow, ev = buf.combine(x=y, handle=hd, topk_weights=None, async_with_compute_stream=do_async,
                                  allocate_on_comm_stream=do_async)
        assert ow is None
        if do_async and ev.event is not None:
            ev.current_stream_wait()
        output = torch.empty_like(out)
        output.copy_(out, non_blocking=True)
        return output

    for step, tokens in enumerate(((3, 1), (9, 13), (2, 0))):
        c = type(case)(num_ranks=2, tokens=tokens, hidden=case.hidden, num_topk=case.num_topk, num_experts=e_,
                       seed=10 + step)
        use_cudagraph = step != 1
        q, sf, idx, w = C.inputs(c, me, "fp32" if use_cudagraph else "ue8m0")
        bucket = 1 << max(max(tokens) - 1, 0).bit_length() if use_cudagraph else None
        rx, ridx, rw, hd, ev = buf.dispatch(x=(q, sf), topk_idx=idx, topk_weights=w, num_experts=e_,
                                            num_max_tokens_per_rank=bucket, do_expand=not use_cudagraph,
                                            do_cpu_sync=not use_cudagraph, async_with_compute_stream=False)
        if ev.event is not None:
            ev.current_stream_wait()
        rq, rsf = rx
        if use_cudagraph:
            assert rq.shape[0] == 2 * bucket and hd.num_recv_tokens_per_expert_list == []
            n = hd.psum_num_recv_tokens_per_scaleup_rank  # _globalize_recv_topk_idx, on the device
            valid = torch.arange(rq.shape[0]) < n[-1]
            gidx = torch.where((ridx >= 0) & valid.unsqueeze(1), ridx + me * le, torch.full_like(ridx, -1))
            loc = torch.where(gidx >= 0, gidx - me * le, 0)
            y = _local_sum(_lane_values(rq, rsf[:, :1], loc, rw, le), gidx >= 0)  # TopKWeightAndReduceContiguous
            want = C.expected_reduce(_lane_values(q, sf[:, :1], idx, w, le), idx, le, True)
        else:  # recv_topk_idx is None: one global expert id a row, from num_recv_tokens_per_expert_list
            counts = hd.num_recv_tokens_per_expert_list
            assert ridx is None and rsf.dtype == torch.int32 and rw.ndim == 1
            gids = torch.repeat_interleave(torch.arange(le) + me * le, torch.tensor(counts),
                                           output_size=sum(counts)).unsqueeze(1)
            rw = rw.unsqueeze(1)
            y = (rq[:sum(counts)].float() * rw * (gids - me * le + 1)).to(torch.bfloat16)
            want = C.expected_reduce(_lane_values(q, None, idx, w, le), idx, le, True)
        for do_async in (True, False):
            _eq(f"vllm step {step} (cudagraph={use_cudagraph}, async={do_async})", finalize(y, hd, do_async), want)
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

"""Tier 2 (gloo on CPU, spawned processes, 2 and 3 ranks): epcomm driven through ``import deep_ep``
(the switch ``EPCOMM_AS_DEEP_EP=1``) the way vLLM 0.33.0 and SGLang 0.5.23 drive DeepEP V1. Neither framework
imports on a CPU machine without its serving stack, so each check re-enacts its newest release's calls, in its
order and with its arguments, file by file (named in each check); no code of theirs is copied. The surface is
written down in docs/clients.md.

- ``vllm_ht``: ``DeepEPHTAll2AllManager`` / ``DeepEPHTPrepareAndFinalize``: ``Buffer(**kwargs)`` with
  ``explicitly_destroy=True``, ``Buffer.set_num_sms``, per-rank config tables (``get_dispatch_config``
  / ``get_combine_config`` for 2..160 ranks, ``None`` for other counts), ``previous_event`` None, or
  ``capture()`` with synchronous calls under dual-batch overlap, dispatch by keyword (``x=``, ``handle=None``),
  the ``event.event is not None`` test, BF16 and the FP8 block-scale tuple, combine with ``topk_weights=None``
  as ``finalize_async`` and ``finalize``, ``destroy()``.
- ``vllm_ll``: ``DeepEPLLAll2AllManager`` / ``DeepEPLLPrepareAndFinalize``: the size hint by keyword, a
  low-latency Buffer with ``enable_shrink=True`` (fault tolerance), ``low_latency_dispatch(...,
  async_finish=False, return_recv_hook=True)`` then ``hook()`` (FP8, FP8 with packed UE8M0 scales, BF16),
  ``low_latency_combine(..., zero_copy=False, out=output, return_recv_hook=True/False)`` (the hook is None
  without it); ``low_latency_query_mask_buffer`` (``query_active_mask``, ``query_fault``), then
  ``clean_buffers``: ``get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()`` and
  ``low_latency_clean_mask_buffer()``, and a round on the cleaned buffer; a supported hidden size (2048).
- ``sglang``: ``DeepEPBuffer`` / ``DeepEPDispatcher`` in auto mode: ``Config(**json)`` from a tuned table or
  none (``config=None``, ``Buffer.num_sms``), one Buffer with ``low_latency_mode=True``, ``num_qps_per_rank``,
  ``allow_mnnvl=True`` and ``use_fabric=True`` for both modes; normal dispatch with ``Buffer.capture()`` and
  ``async_finish=True`` or neither, ``expert_alignment=128``; then ``clean_low_latency_buffer`` and
  low-latency calls (BF16 and FP8) with and without the receive hook, reading ``buffer.low_latency_mode`` and
  ``buffer.group_size``.
"""

from __future__ import annotations


import harness
import pytest
import torch
from harness import check, dev, equal

from epcomm.testing.compare import assert_bitwise, assert_within_budget
from epcomm.testing.inputs import Case, expected_dispatch, make_topk, make_x

WORLD_SIZES = (2, 3)
VLLM_RANK_CONFIGS = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)  # vLLM's available_rank_configs
SGLANG_TABLE = {  # the shape of SGLang's --deepep-config JSON
    "normal_dispatch": {
        "num_sms": 24,
        "num_max_nvl_chunked_send_tokens": 16,
        "num_max_nvl_chunked_recv_tokens": 256,
        "num_max_rdma_chunked_send_tokens": 6,
        "num_max_rdma_chunked_recv_tokens": 128,
    },
    "normal_combine": {
        "num_sms": 24,
        "num_max_nvl_chunked_send_tokens": 6,
        "num_max_nvl_chunked_recv_tokens": 256,
        "num_max_rdma_chunked_send_tokens": 6,
        "num_max_rdma_chunked_recv_tokens": 128,
    },
}


def _case(r_: int, hidden: int, seed: int) -> Case:
    return Case(
        num_ranks=r_,
        tokens=tuple(9 + 3 * r for r in range(r_)),
        hidden=hidden,
        num_topk=4,
        num_experts=4 * r_,
        seed=seed,
    )


def _deep_ep():
    import importlib.util

    import epcomm

    check(importlib.util.find_spec("deep_ep") is not None, "find_spec('deep_ep') is None with the switch on")
    import deep_ep

    check(issubclass(deep_ep.Buffer, epcomm.Buffer) and deep_ep.Buffer._cuda_whatever_the_group,
          f"deep_ep.Buffer is {deep_ep.Buffer!r}, not epcomm's with DeepEP's device rule")
    return deep_ep


def _combine_expected(case: Case, me: int, factor) -> tuple[torch.Tensor, torch.Tensor]:
    """HT combine of ``recv_x * factor(receiving rank)``: ``x[t] * sum of factor over its ranks``."""
    lx = case.num_experts // case.num_ranks
    idx = make_topk(case, me)[0]
    s = torch.tensor(
        [[sum(factor(d) for d in {int(e) // lx for e in row if e >= 0})] for row in idx], dtype=torch.float64
    ).reshape(-1, 1)
    x = make_x(case, me).double()
    return x * s, x.abs() * s


def check_vllm_ht(ctx):
    deep_ep = _deep_ep()
    r_, me = ctx.world_size, ctx.rank
    for n in VLLM_RANK_CONFIGS:
        for cfg in (deep_ep.Buffer.get_dispatch_config(n), deep_ep.Buffer.get_combine_config(n)):
            check(
                isinstance(cfg, deep_ep.Config) and cfg.get_nvl_buffer_size_hint(7168 * 2, n) > 0,
                f"config table for {n} ranks: {cfg!r}",
            )
    buf = deep_ep.Buffer(
        **dict(
            group=ctx.group,
            num_nvl_bytes=64 << 20,
            num_rdma_bytes=0,
            low_latency_mode=False,
            num_qps_per_rank=1,
            explicitly_destroy=True,
        )
    )
    deep_ep.Buffer.set_num_sms(min(20, 24))  # DeepEPHTAll2AllManager.set_num_sms: at most its 20
    dispatch_cfg = deep_ep.Buffer.get_dispatch_config(r_) if r_ in VLLM_RANK_CONFIGS else None
    combine_cfg = deep_ep.Buffer.get_combine_config(r_) if r_ in VLLM_RANK_CONFIGS else None
    case = _case(r_, 256, seed=31)
    exp = expected_dispatch(case, me)
    x = dev(ctx, make_x(case, me))
    idx, w = (dev(ctx, t) for t in make_topk(case, me))
    for fp8, dbo in ((False, False), (True, False), (False, True)):
        # dbo_get_previous_event(self.buffer.capture): capture() on the ubatch's compute stream under DBO, else None
        previous_event = buf.capture() if dbo else None
        per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(
            topk_idx=idx,
            num_experts=case.num_experts,
            previous_event=previous_event,
            async_finish=False,
            allocate_on_comm_stream=False,
        )
        if fp8:
            from epcomm.quant import per_token_cast_to_fp8

            data = per_token_cast_to_fp8(x, False)
        else:
            data = x
        recv, recv_idx, recv_w, per_expert_list, handle, event = buf.dispatch(
            x=data,
            handle=None,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=idx,
            topk_weights=w,
            expert_alignment=1,
            config=dispatch_cfg,
            previous_event=previous_event,
            async_finish=not dbo,  # self.async_prepare and not dbo_enabled()
            allocate_on_comm_stream=False,
        )
        check(isinstance(event, deep_ep.EventOverlap), f"dispatch event is {type(event).__name__}")
        if event.event is not None:
            event.current_stream_wait()
        what = ("fp8" if fp8 else "bf16") + (" (DBO)" if dbo else "")
        equal(recv_idx.cpu(), exp["recv_topk_idx"], f"{what}: recv_topk_idx")
        equal(recv_w.cpu(), exp["recv_topk_weights"], f"{what}: recv_topk_weights")
        equal(list(per_expert_list), exp["per_expert"].tolist(), f"{what}: num_recv_tokens_per_expert_list")
        if not fp8:
            assert_bitwise(recv, exp["recv_x"], f"{what}: recv_x")
            continue
        check(
            isinstance(recv, tuple) and len(recv) == 2,
            f"fp8 dispatch returns (data, scales), got {type(recv)}",
        )
        # the same rows as the BF16 dispatch, each quantised as its sender quantised it
        ends = handle.rank_prefix_matrix[:, me].tolist()
        q_rows, s_rows = [], []
        for s in range(r_):
            q, sc = per_token_cast_to_fp8(dev(ctx, make_x(case, s)), False)
            src = handle.recv_src_idx[(ends[s - 1] if s else 0) : ends[s]].long()
            q_rows.append(q[src].cpu())
            s_rows.append(sc[src].cpu())
        assert_bitwise(recv[0], torch.cat(q_rows), "fp8: recv_x data")
        assert_bitwise(recv[1], torch.cat(s_rows), "fp8: recv_x scales")
    y = recv * (2.0**me)  # the last dispatch's rows (BF16, under DBO)
    ref, mag = _combine_expected(case, me, lambda d: 2.0**d)
    for do_async, dbo in ((True, False), (False, False), (True, True)):  # finalize_async, finalize, under DBO
        combined, combined_w, event = buf.combine(
            x=y,
            handle=handle,
            topk_weights=None,
            config=combine_cfg,
            previous_event=buf.capture() if dbo else None,
            async_finish=do_async and not dbo,
            allocate_on_comm_stream=False,
        )
        check(combined_w is None, "combine without topk_weights returns None weights")
        if do_async and event.event is not None:
            event.current_stream_wait()
        output = torch.empty_like(combined)
        output.copy_(combined, non_blocking=True)
        assert_within_budget(output, ref, mag, r_, f"HT combine (async={do_async}, DBO={dbo})")
    buf.destroy()


def _ll_expected(case: Case, me: int, factor, x=None) -> tuple[torch.Tensor, torch.Tensor]:
    """LL combine of expert outputs ``recv_x * factor(global expert)``: ``sum_k w[t,k] factor(e_k) x[t]``
    (``x``: the rank's rows as the experts see them, default ``make_x``)."""
    idx, w = make_topk(case, me)
    f = torch.where(
        idx >= 0,
        w.double()
        * torch.tensor([factor(int(e)) for e in idx.flatten()], dtype=torch.float64).reshape(idx.shape),
        0.0,
    )
    x = (make_x(case, me) if x is None else x).double()
    return x * f.sum(1, keepdim=True), x.abs() * f.abs().sum(1, keepdim=True)


def expert_factor(e: int) -> float:
    """Expert ``e``'s output is its input times this power of two (exact in bf16): a row combined from
    the wrong slot or expert is off by a factor of at least two."""
    return 2.0 ** (e % 5 - 2)


def _scale_by_expert(recv: torch.Tensor, me: int, lx: int, factor) -> torch.Tensor:
    scale = torch.tensor([factor(me * lx + e) for e in range(lx)], dtype=torch.float32, device=recv.device)
    return (recv.float() * scale.view(-1, 1, 1)).to(torch.bfloat16)


def check_vllm_ll(ctx):
    """vLLM 0.33.0: vllm/distributed/device_communicators/all2all.py (``DeepEPLLAll2AllManager``, with fault
    tolerance on: ``enable_shrink``, ``query_active_mask``, ``query_fault``, ``clean_buffers``) and
    vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ll.py (``DeepEPLLPrepareAndFinalize``)."""
    deep_ep = _deep_ep()
    r_, me = ctx.world_size, ctx.rank
    m, h = 16, 2048  # vLLM's DeepEP LL path accepts only its SUPPORTED_HIDDEN_SIZES (2048 ... 8192)
    case = Case(
        num_ranks=r_,
        tokens=tuple(m - 2 * r for r in range(r_)),
        hidden=h,
        num_topk=4,
        num_experts=4 * r_,
        seed=41,
    )
    e_, lx = case.num_experts, case.num_experts // r_
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=m, hidden=h, num_ranks=r_, num_experts=e_
    )
    buf = deep_ep.Buffer(
        **dict(
            group=ctx.group,
            num_nvl_bytes=1 << 20,
            num_rdma_bytes=hint,
            low_latency_mode=True,
            num_qps_per_rank=lx,
            allow_nvlink_for_low_latency_mode=True,
            allow_mnnvl=False,
            explicitly_destroy=True,
            enable_shrink=True,  # parallel_config.enable_fault_tolerance
        )
    )
    x = dev(ctx, make_x(case, me))
    idx, w = (dev(ctx, t) for t in make_topk(case, me))
    exp_counts = torch.zeros(lx, dtype=torch.int32)
    for s in range(r_):
        ids = make_topk(case, s)[0]
        for e in ids[ids >= 0].tolist():
            if e // lx == me:
                exp_counts[e % lx] += 1
    factor = expert_factor
    mask = last_mask = None
    # (use_fp8, use_ue8m0 (post_init_setup: experts that take packed UE8M0 scales), the combine's hook)
    for round_, (use_fp8, ue8m0, recv_hook) in enumerate(
            ((True, False, True), (True, True, False), (False, False, True), (False, False, False))):
        expert_x, expert_num_tokens, handle, _, hook = buf.low_latency_dispatch(
            x,
            idx,
            m,
            e_,
            use_fp8=use_fp8,
            round_scale=ue8m0,
            use_ue8m0=ue8m0,
            async_finish=False,
            return_recv_hook=True,
        )
        hook()
        what = f"use_fp8={use_fp8}, use_ue8m0={ue8m0}, combine hook={recv_hook}"
        equal(expert_num_tokens.cpu(), exp_counts, f"{what}: expert_num_tokens")
        data = expert_x[0] if use_fp8 else expert_x
        equal(tuple(data.shape), (lx, r_ * m, h), f"{what}: expert_x shape")
        if use_fp8:
            scales = expert_x[1]
            want = (lx, r_ * m, h // 512) if ue8m0 else (lx, r_ * m, h // 128)
            equal((tuple(scales.shape), scales.dtype), (want, torch.int32 if ue8m0 else torch.float32),
                  f"{what}: scales")
            continue  # FP8 payloads are checked in test_dist_ll; here the surface
        y = _scale_by_expert(expert_x, me, lx, factor)
        output = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
        _, _, combine_hook = buf.low_latency_combine(
            y, idx, w, handle, async_finish=False, zero_copy=False, return_recv_hook=recv_hook, out=output
        )
        if recv_hook:
            combine_hook()
        else:
            check(combine_hook is None, f"{what}: the hook is None without return_recv_hook")
        ref, mag = _ll_expected(case, me, factor)
        assert_within_budget(output, ref, mag, case.num_topk, f"{what}: low_latency_combine out=")
        # query_active_mask / query_fault, then clean_buffers (its torch.accelerator.synchronize() calls are
        # no-ops for a CPU group, and are left out)
        if mask is None:
            mask = torch.zeros(r_, device=ctx.device, dtype=torch.int32)
        buf.low_latency_query_mask_buffer(mask)
        if last_mask is None:
            last_mask = torch.zeros_like(mask)
        check(not bool((mask != last_mask).any()), f"{what}: query_fault sees a fault: mask {mask.tolist()}")
        if round_ == 2:
            buf.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
            buf.low_latency_clean_mask_buffer()
            last_mask = None  # the last round runs on the cleaned buffer
    buf.destroy()


def check_sglang(ctx):
    """SGLang 0.5.23: python/sglang/srt/layers/moe/token_dispatcher/deepep.py (``DeepEPBuffer``,
    ``DeepEPConfig``, ``_DeepEPDispatcherImplNormal``, ``_DeepEPDispatcherImplLowLatency``) in auto mode, on a
    CUDA 13 build on MNNVL hardware (``allow_mnnvl=True`` and ``use_fabric=True``); once with a ``--deepep-config``
    table and ``async_finish=True``, once without either (``config=None``, ``Buffer.num_sms``)."""
    _deep_ep()
    from deep_ep import Buffer, Config

    from epcomm.quant import per_token_cast_back, per_token_cast_to_fp8

    r_, me = ctx.world_size, ctx.rank
    h, m = 256, 16
    case = _case(r_, h, seed=51)
    e_, lx = case.num_experts, case.num_experts // r_
    exp = expected_dispatch(case, me)
    x = dev(ctx, make_x(case, me))
    idx, w = (dev(ctx, t) for t in make_topk(case, me))
    for table, async_finish in ((SGLANG_TABLE, True), (None, False)):
        if table:  # DeepEPConfig
            dispatch_cfg, combine_cfg = Config(**table["normal_dispatch"]), Config(**table["normal_combine"])
            num_sms = table["normal_dispatch"]["num_sms"]
        else:
            dispatch_cfg = combine_cfg = None
            num_sms = Buffer.num_sms
        check(isinstance(num_sms, int) and num_sms > 0, f"num_sms = {num_sms!r}")
        # DeepEPBuffer.get_deepep_buffer (auto mode: normal and low-latency sizes)
        hidden_bytes = h * 2
        nvl = rdma = 0
        for c in (dispatch_cfg or Buffer.get_dispatch_config(r_), combine_cfg or Buffer.get_combine_config(r_)):
            nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, r_), nvl)
            rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, r_), rdma)
        rdma = max(Buffer.get_low_latency_rdma_size_hint(m, h, r_, e_), rdma)
        buf = Buffer(ctx.group, nvl, rdma, low_latency_mode=True, num_qps_per_rank=max(num_sms, e_ // r_),
                     allow_mnnvl=True, use_fabric=True)
        check(
            buf.low_latency_mode and buf.group_size == r_ and buf.group is ctx.group,
            f"attributes: low_latency_mode={buf.low_latency_mode}, group_size={buf.group_size}",
        )
        check(buf.num_nvl_bytes == nvl and buf.num_rdma_bytes == rdma, "num_nvl_bytes / num_rdma_bytes")
        # normal mode (prefill): dispatch_a, _dispatch_core, dispatch_b
        previous_event = Buffer.capture() if async_finish else None
        per_rank, per_rdma, per_expert, in_rank, previous_event = buf.get_dispatch_layout(
            idx, e_, previous_event=previous_event, async_finish=async_finish,
            allocate_on_comm_stream=previous_event is not None,
        )
        recv_x, _, _, per_expert_list, handle, event = buf.dispatch(
            x,
            topk_idx=idx,
            topk_weights=w,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            previous_event=previous_event,
            async_finish=async_finish,
            allocate_on_comm_stream=(previous_event is not None) and async_finish,
            expert_alignment=128,  # with DeepGEMM (ENABLE_JIT_DEEPGEMM)
            config=dispatch_cfg,
        )
        event.current_stream_wait() if async_finish else ()
        what = f"normal (table={table is not None}, async_finish={async_finish})"
        assert_bitwise(recv_x, exp["recv_x"], f"{what}: recv_x")
        equal(
            list(per_expert_list),
            [(c + 127) // 128 * 128 for c in exp["per_expert"].tolist()],
            f"{what}: num_recv_tokens_per_expert rounded to expert_alignment=128",
        )
        previous_event = Buffer.capture() if async_finish else None  # combine_a
        combined, _, event = buf.combine(  # _combine_core
            recv_x * (2.0**me),
            handle,
            async_finish=async_finish,
            previous_event=previous_event,
            allocate_on_comm_stream=previous_event is not None,
            config=combine_cfg,
        )
        event.current_stream_wait() if async_finish else ()
        ref, mag = _combine_expected(case, me, lambda d: 2.0**d)
        assert_within_budget(combined, ref, mag, r_, f"{what}: combine")
        # DeepEPBuffer.set_dispatch_mode_as_low_latency: from normal, clean_buffer first
        buf.clean_low_latency_buffer(m, h, e_)
        expected_m = (x.shape[0] * buf.group_size * idx.shape[1] + e_) // e_
        check(expected_m >= 1, "expected_m")
        xq = per_token_cast_back(*per_token_cast_to_fp8(make_x(case, me), False), torch.float32)
        for use_fp8, return_recv_hook in ((False, True), (False, False), (True, True)):
            fp8_opts = {"round_scale": False, "use_ue8m0": False} if use_fp8 else {}  # Hopper DeepGEMM
            recv, masked_m, handle, event, hook = buf.low_latency_dispatch(
                x, idx, m, e_, use_fp8=use_fp8, async_finish=not return_recv_hook,
                return_recv_hook=return_recv_hook, **fp8_opts,
            )
            hook() if return_recv_hook else event.current_stream_wait()
            equal(tuple(masked_m.shape), (lx,), "masked_m shape")
            if use_fp8:  # the experts take the FP8 rows: here they cast them back
                q, s = recv
                recv = (q.float() * s.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
            y = _scale_by_expert(recv, me, lx, expert_factor)
            out, event, hook = buf.low_latency_combine(
                x=y,
                topk_idx=idx,
                topk_weights=w,
                handle=handle,
                async_finish=not return_recv_hook,
                return_recv_hook=return_recv_hook,
            )
            hook() if return_recv_hook else event.current_stream_wait()
            if use_fp8:
                ref, mag = _ll_expected(case, me, expert_factor, xq)
                extra = 2.0**-8  # the expert's cast back to bf16 (one rounding of each term)
            else:
                ref, mag = _ll_expected(case, me, expert_factor)
                extra = 0.0
            assert_within_budget(out, ref, mag, case.num_topk,
                                 f"low-latency (use_fp8={use_fp8}, hook={return_recv_hook}) combine", extra)


CHECKS = [("vllm_ht", check_vllm_ht), ("vllm_ll", check_vllm_ll), ("sglang", check_sglang)]


def _rank(ctx):
    return harness.run_checks_as_deep_ep(ctx, CHECKS)


deep_ep_switch = harness.deep_ep_switch  # the fixture, for this module's tests
pytestmark = pytest.mark.usefixtures("deep_ep_switch")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", [n for n, _ in CHECKS])
def test_clients(world_size, name):
    harness.report(harness.launch_cached(_rank, world_size), name)

"""Tier 2 (gloo on CPU, spawned processes, 2 and 3 ranks): epcomm driven through ``import deep_ep``
(the switch ``EPCOMM_AS_DEEP_EP=1``) the way vLLM and SGLang drive DeepEP V1. The surface, call
order and arguments are written down in docs/clients.md; neither framework is installed here, and no
code of theirs is copied: each check calls the API as their DeepEP code paths do.

- ``vllm_ht``: ``DeepEPHTAll2AllManager`` / ``DeepEPHTPrepareAndFinalize``: ``Buffer(**kwargs)`` with
  ``explicitly_destroy=True``, ``Buffer.set_num_sms``, per-rank config tables (``get_dispatch_config``
  / ``get_combine_config`` for 2..160 ranks, ``None`` for other counts), ``capture()`` as
  ``previous_event``, dispatch by keyword (``x=``, ``handle=None``) with ``async_finish=True``, the
  ``event.event is not None`` test, BF16 and the FP8 block-scale tuple, combine with
  ``topk_weights=None``, ``destroy()``.
- ``vllm_ll``: ``DeepEPLLAll2AllManager`` / ``DeepEPLLPrepareAndFinalize``: the size hint by keyword,
  a low-latency Buffer, ``low_latency_dispatch(..., async_finish=False, return_recv_hook=True)`` then
  ``hook()``, ``low_latency_combine(..., out=output, return_recv_hook=True/False)`` (the hook is None
  without it), zero-copy through ``get_next_low_latency_combine_buffer``, a supported hidden size (2048).
- ``sglang``: ``DeepEPBuffer`` / ``DeepEPDispatcher`` in auto mode: ``Config(**json)`` from a tuned
  table, ``Buffer.num_sms``, one Buffer with ``low_latency_mode=True``, ``num_qps_per_rank`` and
  ``allow_mnnvl=True`` for both modes; normal dispatch with ``Buffer.capture()``, ``async_finish=True``,
  ``allocate_on_comm_stream=True``, ``expert_alignment=128`` and the table's configs; then
  ``clean_low_latency_buffer`` and low-latency calls with and without the receive hook, reading
  ``buffer.low_latency_mode`` and ``buffer.group_size``.
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
    deep_ep.Buffer.set_num_sms(min(20, 24))
    buf.set_num_sms(20)  # older vLLM calls it on the instance
    dispatch_cfg = deep_ep.Buffer.get_dispatch_config(r_) if r_ in VLLM_RANK_CONFIGS else None
    combine_cfg = deep_ep.Buffer.get_combine_config(r_) if r_ in VLLM_RANK_CONFIGS else None
    case = _case(r_, 256, seed=31)
    exp = expected_dispatch(case, me)
    x = dev(ctx, make_x(case, me))
    idx, w = (dev(ctx, t) for t in make_topk(case, me))
    for fp8 in (False, True):
        previous_event = buf.capture()
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
            async_finish=True,
            allocate_on_comm_stream=False,
        )
        check(isinstance(event, deep_ep.EventOverlap), f"dispatch event is {type(event).__name__}")
        if event.event is not None:
            event.current_stream_wait()
        what = "fp8" if fp8 else "bf16"
        equal(recv_idx.cpu(), exp["recv_topk_idx"], f"{what}: recv_topk_idx")
        equal(recv_w.cpu(), exp["recv_topk_weights"], f"{what}: recv_topk_weights")
        equal(list(per_expert_list), exp["per_expert"].tolist(), f"{what}: num_recv_tokens_per_expert_list")
        if not fp8:
            assert_bitwise(recv, exp["recv_x"], "bf16: recv_x")
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
    y = (recv_bf16 := buf.dispatch(x=x, handle=handle)[0]) * (2.0**me)
    check(recv_bf16.shape[0] == exp["recv_x"].shape[0], "cached dispatch row count")
    combined, combined_w, event = buf.combine(
        x=y,
        handle=handle,
        topk_weights=None,
        config=combine_cfg,
        previous_event=buf.capture(),
        async_finish=True,
        allocate_on_comm_stream=False,
    )
    check(combined_w is None, "combine without topk_weights returns None weights")
    if event.event is not None:
        event.current_stream_wait()
    ref, mag = _combine_expected(case, me, lambda d: 2.0**d)
    assert_within_budget(combined, ref, mag, r_, "HT combine")
    buf.destroy()


def _ll_expected(case: Case, me: int, factor) -> tuple[torch.Tensor, torch.Tensor]:
    """LL combine of expert outputs ``recv_x * factor(global expert)``: ``sum_k w[t,k] factor(e_k) x[t]``."""
    idx, w = make_topk(case, me)
    f = torch.where(
        idx >= 0,
        w.double()
        * torch.tensor([factor(int(e)) for e in idx.flatten()], dtype=torch.float64).reshape(idx.shape),
        0.0,
    )
    x = make_x(case, me).double()
    return x * f.sum(1, keepdim=True), x.abs() * f.abs().sum(1, keepdim=True)


def expert_factor(e: int) -> float:
    """Expert ``e``'s output is its input times this power of two (exact in bf16): a row combined from
    the wrong slot or expert is off by a factor of at least two."""
    return 2.0 ** (e % 5 - 2)


def _scale_by_expert(recv: torch.Tensor, me: int, lx: int, factor) -> torch.Tensor:
    scale = torch.tensor([factor(me * lx + e) for e in range(lx)], dtype=torch.float32, device=recv.device)
    return (recv.float() * scale.view(-1, 1, 1)).to(torch.bfloat16)


def check_vllm_ll(ctx):
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
    for use_fp8, recv_hook, zero_copy in ((True, True, False), (False, True, False), (False, False, True)):
        expert_x, expert_num_tokens, handle, _, hook = buf.low_latency_dispatch(
            x,
            idx,
            m,
            e_,
            use_fp8=use_fp8,
            round_scale=False,
            use_ue8m0=False,
            async_finish=False,
            return_recv_hook=True,
        )
        hook()
        what = f"use_fp8={use_fp8}, combine hook={recv_hook}, zero_copy={zero_copy}"
        equal(expert_num_tokens.cpu(), exp_counts, f"{what}: expert_num_tokens")
        data = expert_x[0] if use_fp8 else expert_x
        equal(tuple(data.shape), (lx, r_ * m, h), f"{what}: expert_x shape")
        if use_fp8:
            equal(tuple(expert_x[1].shape), (lx, r_ * m, h // 128), f"{what}: scales shape")
            continue  # FP8 payloads are checked in test_dist_ll; here the surface
        y = _scale_by_expert(expert_x, me, lx, factor)
        output = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
        if zero_copy:
            buf.get_next_low_latency_combine_buffer(handle).copy_(y)
        _, _, combine_hook = buf.low_latency_combine(
            y, idx, w, handle, async_finish=False, zero_copy=zero_copy, return_recv_hook=recv_hook, out=output
        )
        if recv_hook:
            combine_hook()
        else:
            check(combine_hook is None, f"{what}: the hook is None without return_recv_hook")
        ref, mag = _ll_expected(case, me, factor)
        assert_within_budget(output, ref, mag, case.num_topk, f"{what}: low_latency_combine out=")
    buf.destroy()


def check_sglang(ctx):
    _deep_ep()
    from deep_ep import Buffer, Config

    r_, me = ctx.world_size, ctx.rank
    dispatch_cfg, combine_cfg = (
        Config(**SGLANG_TABLE["normal_dispatch"]),
        Config(**SGLANG_TABLE["normal_combine"]),
    )
    check(isinstance(Buffer.num_sms, int) and Buffer.num_sms > 0, f"Buffer.num_sms = {Buffer.num_sms!r}")
    h, m = 256, 16
    case = _case(r_, h, seed=51)
    e_, lx = case.num_experts, case.num_experts // r_
    hidden_bytes = h * 2
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, r_) for c in (dispatch_cfg, combine_cfg))
    rdma = max(
        max(c.get_rdma_buffer_size_hint(hidden_bytes, r_) for c in (dispatch_cfg, combine_cfg)),
        Buffer.get_low_latency_rdma_size_hint(m, h, r_, e_),
    )
    buf = Buffer(
        ctx.group,
        nvl,
        rdma,
        low_latency_mode=True,
        num_qps_per_rank=max(dispatch_cfg.num_sms, lx),
        allow_mnnvl=True,
    )
    check(
        buf.low_latency_mode and buf.group_size == r_ and buf.group is ctx.group,
        f"attributes: low_latency_mode={buf.low_latency_mode}, group_size={buf.group_size}",
    )
    check(buf.num_nvl_bytes == nvl and buf.num_rdma_bytes == rdma, "num_nvl_bytes / num_rdma_bytes")
    exp = expected_dispatch(case, me)
    x = dev(ctx, make_x(case, me))
    idx, w = (dev(ctx, t) for t in make_topk(case, me))
    # normal mode (prefill)
    previous_event = Buffer.capture()
    per_rank, per_rdma, per_expert, in_rank, previous_event = buf.get_dispatch_layout(
        idx, e_, previous_event=previous_event, async_finish=True, allocate_on_comm_stream=True
    )
    recv_x, recv_idx, recv_w, per_expert_list, handle, event = buf.dispatch(
        x,
        topk_idx=idx,
        topk_weights=w,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        previous_event=previous_event,
        async_finish=True,
        allocate_on_comm_stream=True,
        expert_alignment=128,
        config=dispatch_cfg,
    )
    event.current_stream_wait()
    assert_bitwise(recv_x, exp["recv_x"], "normal: recv_x")
    equal(
        list(per_expert_list),
        [(c + 127) // 128 * 128 for c in exp["per_expert"].tolist()],
        "normal: num_recv_tokens_per_expert rounded to expert_alignment=128",
    )
    combined, _, event = buf.combine(
        recv_x * (2.0**me),
        handle,
        async_finish=True,
        previous_event=Buffer.capture(),
        allocate_on_comm_stream=True,
        config=combine_cfg,
    )
    event.current_stream_wait()
    ref, mag = _combine_expected(case, me, lambda d: 2.0**d)
    assert_within_budget(combined, ref, mag, r_, "normal: combine")
    # switching to low-latency mode (decode) cleans the low-latency buffer first
    buf.clean_low_latency_buffer(m, h, e_)
    factor = expert_factor
    expected_m = (x.shape[0] * buf.group_size * idx.shape[1] + e_) // e_
    check(expected_m >= 1, "expected_m")
    for return_recv_hook in (True, False):
        recv, masked_m, handle, event, hook = buf.low_latency_dispatch(
            x, idx, m, e_, use_fp8=False, async_finish=not return_recv_hook, return_recv_hook=return_recv_hook
        )
        hook() if return_recv_hook else event.current_stream_wait()
        equal(tuple(masked_m.shape), (lx,), "masked_m shape")
        y = _scale_by_expert(recv, me, lx, factor)
        out, event, hook = buf.low_latency_combine(
            x=y,
            topk_idx=idx,
            topk_weights=w,
            handle=handle,
            async_finish=not return_recv_hook,
            return_recv_hook=return_recv_hook,
        )
        hook() if return_recv_hook else event.current_stream_wait()
        ref, mag = _ll_expected(case, me, factor)
        assert_within_budget(out, ref, mag, case.num_topk, f"low-latency combine, hook={return_recv_hook}")


CHECKS = [("vllm_ht", check_vllm_ht), ("vllm_ll", check_vllm_ll), ("sglang", check_sglang)]


def _rank(ctx):
    return harness.run_checks_as_deep_ep(ctx, CHECKS)


deep_ep_switch = harness.deep_ep_switch  # the fixture, for this module's tests
pytestmark = pytest.mark.usefixtures("deep_ep_switch")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", [n for n, _ in CHECKS])
def test_clients(world_size, name):
    harness.report(harness.launch_cached(_rank, world_size), name)

"""Tier 2 (gloo on CPU, spawned processes, world sizes 1-4; or NCCL on GPUs, see ``harness``): the
low-latency API end to end through the reference backend, on the scenarios of ``harness.cases``
(random routing with -1 entries, a token with no expert, odd T, T = 0 on one rank, a hot expert, a
rank that receives nothing).

Covers: low_latency_dispatch with use_fp8 False/True, round_scale, use_ue8m0 — the recv_x layout
(``[L, R*M, H]``; FP8 scales a transposed view of an ``[L, G, R*M]`` allocation; UE8M0 packed
``int32[L, R*M, H/512]``), only the first recv_count[e] rows valid as one contiguous block per
source rank per layout_range, recv_src_info (-1 in unused slots), BF16 rows bitwise, FP8 rows
bitwise against ``quant.per_token_cast_to_fp8`` of the regenerated source rows (cast on the rank's
device, as the reference backend casts);
low_latency_combine against a float64 reference within the dtype budget, with expert outputs that
depend on the global expert id so a wrong slot is caught; cumulative_local_expert_recv_stats;
dispatch/combine wait-cost stats; return_recv_hook (outputs filled only by hook()); async_finish;
zero_copy with get_next_low_latency_combine_buffer; out=; two results alive at once;
clean_low_latency_buffer; the shrink/mask API (a masked rank is skipped by the others).
"""

from __future__ import annotations

import harness
import pytest
import torch
from harness import check, dev, equal

from epcomm import Buffer, EventOverlap, LowLatencyHandle, layout, quant
from epcomm.testing.compare import assert_bitwise, assert_within_budget
from epcomm.testing.inputs import Case, make_topk, make_x

HIDDEN = 512  # G = 4 scale groups, one packed UE8M0 int per token
M = 32        # num_max_dispatch_tokens_per_rank: >= every case's T
FP8_MODES = {"fp8": (False, False), "fp8_round_scale": (True, False), "fp8_ue8m0": (True, True)}


def make_buffer(ctx, hidden: int = HIDDEN, **kw) -> Buffer:
    e = harness.num_experts_for(ctx.world_size)
    hint = Buffer.get_low_latency_rdma_size_hint(M, hidden, ctx.world_size, e)
    return Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True, **kw)


def expert_factor(global_expert: int) -> float:
    return 1.0 + global_expert / 32.0


# ----------------------------------------------------------------------------- oracle


def expected_blocks(case: Case, me: int, dead: int | None = None) -> list[list[list[int]]]:
    """``blocks[l][r]`` = source token indices rank ``r`` sends to local expert ``l`` of ``me``, in
    (token, k) order. A ``dead`` (masked) rank neither sends nor receives."""
    r_, lx = case.num_ranks, case.num_experts // case.num_ranks
    blocks = [[[] for _ in range(r_)] for _ in range(lx)]
    for r in range(r_):
        if r == dead:
            continue
        idx = make_topk(case, r)[0]
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e >= 0 and e // lx == me:
                    blocks[e % lx][r].append(t)
    return blocks


def fp8_cast(ctx, x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.per_token_cast_to_fp8`` of the CPU tensor ``x``, evaluated on the rank's device (where
    the reference backend casts), returned on the CPU. On CUDA a division by a Python scalar is a
    multiplication by its float32 reciprocal, so ``amax / 448`` may differ from the CPU's by one ulp."""
    q, s = quant.per_token_cast_to_fp8(dev(ctx, x), round_scale)
    return q.cpu(), s.cpu()


def source_rows(ctx, case: Case, mode: str, round_scale: bool, use_ue8m0: bool):
    """Per source rank: what one of its tokens looks like on arrival, as a list of per-part tensors."""
    out = []
    for r in range(case.num_ranks):
        x = make_x(case, r)
        if mode == "bf16":
            out.append((x,))
        else:
            q, s = fp8_cast(ctx, x, round_scale)
            out.append((q, quant.pack_ue8m0(s) if use_ue8m0 else s))
    return out


def verify_dispatch(ctx, case: Case, recv_x, recv_count, handle, mode: str = "bf16", round_scale=False,
                    use_ue8m0=False, dead: int | None = None, what: str = "") -> None:
    me = ctx.rank
    r_, e = case.num_ranks, case.num_experts
    lx = e // r_
    blocks = expected_blocks(case, me, dead)
    what = f"{what or mode}"
    # handle
    check(isinstance(handle, LowLatencyHandle), f"{what}: handle type")
    equal(LowLatencyHandle._fields, ("recv_src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden",
                                     "num_experts"), "handle field names")
    check(handle[0] is handle.recv_src_info and handle[1] is handle.layout_range, "handle positions")
    equal((handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts), (M, case.hidden, e),
          f"{what}: handle M, H, E")
    # counts and layout_range: one contiguous block per source rank, ordered by source rank
    counts = [[len(blocks[l][r]) for r in range(r_)] for l in range(lx)]
    equal(recv_count, torch.tensor([sum(c) for c in counts], dtype=torch.int32), f"{what}: recv_count")
    begins = [[sum(c[:r]) for r in range(r_)] for c in counts]
    equal(handle.layout_range.dtype, torch.int64, f"{what}: layout_range dtype")
    equal(handle.layout_range, layout.layout_range(torch.tensor(begins), torch.tensor(counts)).view(lx, r_),
          f"{what}: layout_range = (begin << 32) | count")
    # recv_src_info: source token index in the valid rows, -1 elsewhere
    info = torch.full((lx, r_ * M), -1, dtype=torch.int32)
    for l in range(lx):
        flat = [t for r in range(r_) for t in blocks[l][r]]
        info[l, :len(flat)] = torch.tensor(flat, dtype=torch.int32)
    equal(handle.recv_src_info, info, f"{what}: recv_src_info")
    # payload rows
    src = source_rows(ctx, case, mode, round_scale, use_ue8m0)
    parts = (recv_x,) if mode == "bf16" else recv_x
    for p, got in enumerate(parts):
        for l in range(lx):
            n = sum(counts[l])
            want = torch.cat([src[r][p][blocks[l][r]] for r in range(r_)]) if n else got[l, :0]
            assert_bitwise(got[l, :n], want, f"{what}: part {p} of expert {l}'s valid rows")


def verify_layout(recv_x, r_: int, lx: int, mode: str, use_ue8m0: bool, hidden: int = HIDDEN) -> None:
    rows = r_ * M
    if mode == "bf16":
        check(isinstance(recv_x, torch.Tensor), "BF16 recv_x is a tensor")
        equal((recv_x.dtype, tuple(recv_x.shape)), (torch.bfloat16, (lx, rows, hidden)), "bf16 recv_x")
        return
    data, scales = recv_x
    equal((data.dtype, tuple(data.shape)), (torch.float8_e4m3fn, (lx, rows, HIDDEN)), "FP8 recv_x data")
    g = HIDDEN // 512 if use_ue8m0 else HIDDEN // 128
    dtype = torch.int32 if use_ue8m0 else torch.float32
    equal((scales.dtype, tuple(scales.shape)), (dtype, (lx, rows, g)), "scales dtype and shape")
    # a transposed view of an [L, G, R*M] allocation (column-major in the last two dims)
    equal(scales.stride(), (g * rows, 1, rows), "scales strides")
    check(scales.transpose(1, 2).is_contiguous(), "scales.transpose(1, 2) is contiguous")


def expert_outputs(ctx, recv_x, lx: int, mode: str, use_ue8m0: bool) -> torch.Tensor:
    """``bf16[L, R*M, H]`` on ``ctx.device``: what the experts of this rank return — the received rows
    (decoded) scaled by a factor of the global expert id, so a row combined from the wrong slot or
    expert is caught. Computed on the CPU, as ``expected_combine`` does."""
    if mode == "bf16":
        vals = recv_x.cpu().float()
    else:
        data, scales = recv_x[0].cpu(), recv_x[1].cpu()
        if use_ue8m0:
            scales = quant.unpack_ue8m0(scales, HIDDEN // 128)
        vals = quant.per_token_cast_back(data, scales, torch.float32)
    f = torch.tensor([expert_factor(ctx.rank * lx + l) for l in range(lx)]).view(lx, 1, 1)
    return dev(ctx, (vals * f).to(torch.bfloat16))


def expected_combine(ctx, case: Case, mode: str = "bf16", round_scale=False, dead: int | None = None):
    """float64 ``out[t] = sum_k w[t,k] * y[expert_k, slot(t,k)]`` on the sender (this rank); |terms| summed."""
    me = ctx.rank
    idx, w = make_topk(case, me)
    x = make_x(case, me)
    vals = x.float() if mode == "bf16" else quant.per_token_cast_back(*fp8_cast(ctx, x, round_scale), torch.float32)
    lx = case.num_experts // case.num_ranks
    ref = torch.zeros(x.shape, dtype=torch.float64)
    abs_sum = torch.zeros(x.shape, dtype=torch.float64)
    for k in range(idx.shape[1]):
        e = idx[:, k]
        live = (e >= 0) if dead is None else (e >= 0) & (e // lx != dead)
        factor = torch.tensor([expert_factor(int(v)) for v in e.tolist()], dtype=torch.float32).view(-1, 1)
        y = (vals * factor).to(torch.bfloat16).double()  # what expert e returns for this token
        term = torch.where(live.view(-1, 1), w[:, k].double().view(-1, 1) * y, torch.zeros((), dtype=torch.float64))
        ref += term
        abs_sum += term.abs()
    return ref, abs_sum


def combine_and_verify(ctx, buf, case, recv_x, handle, mode="bf16", round_scale=False, use_ue8m0=False,
                       dead=None, what="", **kw):
    lx = case.num_experts // case.num_ranks
    idx, w = dev(ctx, make_topk(case, ctx.rank))
    y = expert_outputs(ctx, recv_x, lx, mode, use_ue8m0)
    out, ev, hook = buf.low_latency_combine(y, idx, w, handle, **kw)
    check(isinstance(ev, EventOverlap) and hook is None, f"{what}: combine returns (out, event, None)")
    equal((out.dtype, tuple(out.shape)), (torch.bfloat16, (idx.shape[0], case.hidden)), f"{what}: combined_x")
    ref, abs_sum = expected_combine(ctx, case, mode, round_scale, dead)
    assert_within_budget(out, ref, abs_sum, case.num_topk, f"{what}: low_latency_combine")
    return y, out


# ----------------------------------------------------------------------------- checks


def rank_inputs(ctx, case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``(x bf16[T, H], topk_idx int64[T, K], topk_weights f32[T, K])`` on ``ctx.device``."""
    idx, w = make_topk(case, ctx.rank)
    return dev(ctx, (make_x(case, ctx.rank), idx, w))


def check_ll_bf16(ctx):
    buf = make_buffer(ctx)
    me, r_ = ctx.rank, ctx.world_size
    for name, case in harness.cases(r_, HIDDEN).items():
        x, idx, _ = rank_inputs(ctx, case)
        recv_x, recv_count, handle, ev, hook = buf.low_latency_dispatch(x, idx, M, case.num_experts, use_fp8=False)
        check(isinstance(ev, EventOverlap) and hook is None, f"{name}: dispatch returns (.., event, None)")
        verify_layout(recv_x, r_, case.num_experts // r_, "bf16", False)
        verify_dispatch(ctx, case, recv_x, recv_count, handle, what=f"{name}/bf16")
        if name == "empty_rank" and me == r_ - 1:
            equal(int(recv_count.sum()), 0, "the empty rank receives nothing")
        if name == "random":  # a non-contiguous x (a column slice of a wider tensor) travels the same
            wide = torch.cat([x, -x], dim=1)[:, :HIDDEN]
            rx2, rc2, h2, _, _ = buf.low_latency_dispatch(wide, idx, M, case.num_experts, use_fp8=False)
            verify_dispatch(ctx, case, rx2, rc2, h2, what="non-contiguous x")
        combine_and_verify(ctx, buf, case, recv_x, handle, what=f"{name}/bf16")


def check_ll_bf16_odd_hidden(ctx):
    """BF16 takes any hidden size that is a multiple of 8 (here 40: not a multiple of 128)."""
    r_ = ctx.world_size
    buf = make_buffer(ctx, hidden=40)
    for name in ("random", "zero_tokens"):
        case = harness.cases(r_, 40)[name]
        x, idx, _ = rank_inputs(ctx, case)
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, case.num_experts, use_fp8=False)
        verify_layout(recv_x, r_, case.num_experts // r_, "bf16", False, hidden=40)
        verify_dispatch(ctx, case, recv_x, recv_count, handle, what=f"{name}/H=40")
        combine_and_verify(ctx, buf, case, recv_x, handle, what=f"{name}/H=40")


def check_ll_fp8(ctx):
    buf = make_buffer(ctx)
    r_ = ctx.world_size
    for name in ("random", "zero_tokens", "hot"):
        case = harness.cases(r_, HIDDEN)[name]
        x, idx, w = rank_inputs(ctx, case)
        for mode, (round_scale, ue8m0) in FP8_MODES.items():
            what = f"{name}/{mode}"
            recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(
                x, idx, M, case.num_experts, use_fp8=True, round_scale=round_scale, use_ue8m0=ue8m0)
            verify_layout(recv_x, r_, case.num_experts // r_, mode, ue8m0)
            verify_dispatch(ctx, case, recv_x, recv_count, handle, mode, round_scale, ue8m0, what=what)
            if round_scale and not ue8m0:
                valid = torch.cat([recv_x[1][l, :int(c)] for l, c in enumerate(recv_count.tolist())])
                check(int((valid.view(torch.int32) & 0x7FFFFF).abs().sum()) == 0, f"{what}: power-of-two scales")
            # combine through the zero-copy buffer; x itself is ignored
            lx = case.num_experts // r_
            y = expert_outputs(ctx, recv_x, lx, mode, ue8m0)
            zc = buf.get_next_low_latency_combine_buffer(handle)
            equal((zc.dtype, tuple(zc.shape)), (torch.bfloat16, (lx, r_ * M, HIDDEN)), "zero-copy buffer")
            zc.copy_(y)
            out, _, _ = buf.low_latency_combine(torch.zeros_like(y), idx, w, handle, zero_copy=True)
            ref, abs_sum = expected_combine(ctx, case, mode, round_scale)
            assert_within_budget(out, ref, abs_sum, case.num_topk, f"{what}: zero-copy combine")


def check_ll_stats(ctx):
    buf = make_buffer(ctx)
    r_ = ctx.world_size
    case = harness.cases(r_, HIDDEN)["hot"]
    lx = case.num_experts // r_
    cumulative = torch.full((lx,), 5, dtype=torch.int32, device=ctx.device)
    wait = torch.zeros(r_, dtype=torch.int64, device=ctx.device)
    cwait = torch.zeros(r_, dtype=torch.int64, device=ctx.device)
    x, idx, w = rank_inputs(ctx, case)
    total = torch.full((lx,), 5, dtype=torch.int32)
    for step in range(2):
        before = wait.clone()
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(
            x, idx, M, case.num_experts, cumulative_local_expert_recv_stats=cumulative,
            dispatch_wait_recv_cost_stats=wait, use_fp8=False)
        total += recv_count.cpu()
        equal(cumulative, total, f"step {step}: cumulative_local_expert_recv_stats += recv_count")
        equal(wait.dtype, torch.int64, "wait stats stay int64")
        check(bool((wait >= before).all()) and bool((wait >= 0).all()), f"step {step}: wait stats {wait.tolist()}")
        cbefore = cwait.clone()
        y = expert_outputs(ctx, recv_x, lx, "bf16", False)
        buf.low_latency_combine(y, idx, w, handle, combine_wait_recv_cost_stats=cwait)
        check(bool((cwait >= cbefore).all()) and bool((cwait >= 0).all()), f"combine wait stats {cwait.tolist()}")
    equal(cumulative, 5 + 2 * recv_count, "two calls")


def check_ll_hook(ctx):
    buf = make_buffer(ctx)
    r_ = ctx.world_size
    for name in ("random", "zero_tokens"):
        case = harness.cases(r_, HIDDEN)[name]
        x, idx, w = rank_inputs(ctx, case)
        for mode, (round_scale, ue8m0) in {"bf16": (False, False), "fp8_ue8m0": (True, True)}.items():
            recv_x, recv_count, handle, ev, hook = buf.low_latency_dispatch(
                x, idx, M, case.num_experts, use_fp8=mode != "bf16", round_scale=round_scale,
                use_ue8m0=ue8m0, return_recv_hook=True)
            check(callable(hook) and isinstance(ev, EventOverlap), f"{name}/{mode}: hook returned")
            parts = (recv_x,) if mode == "bf16" else recv_x
            check(bool((handle.recv_src_info == -1).all()), f"{name}/{mode}: recv_src_info unfilled before hook()")
            check(all(int(p.reshape(-1).view(torch.uint8).count_nonzero()) == 0 for p in parts),
                  f"{name}/{mode}: recv_x unfilled before hook()")
            hook()
            verify_dispatch(ctx, case, recv_x, recv_count, handle, "bf16" if mode == "bf16" else "fp8", round_scale,
                            ue8m0, what=f"{name}/{mode} after hook()")
            lx = case.num_experts // r_
            y = expert_outputs(ctx, recv_x, lx, "bf16" if mode == "bf16" else "fp8", ue8m0)
            out = torch.zeros(idx.shape[0], HIDDEN, dtype=torch.bfloat16, device=ctx.device)
            res, ev, chook = buf.low_latency_combine(y, idx, w, handle, out=out, return_recv_hook=True)
            check(callable(chook) and res is out, f"{name}/{mode}: combine hook returned, result is out")
            ref, abs_sum = expected_combine(ctx, case, "bf16" if mode == "bf16" else "fp8", round_scale)
            if bool((ref != 0).any()):
                check(int(out.count_nonzero()) == 0, f"{name}/{mode}: out unfilled before hook()")
            chook()
            assert_within_budget(out, ref, abs_sum, case.num_topk, f"{name}/{mode}: combine after hook()")


def check_ll_out_and_async(ctx):
    buf = make_buffer(ctx)
    r_ = ctx.world_size
    case = harness.cases(r_, HIDDEN)["random"]
    x, idx, w = rank_inputs(ctx, case)
    recv_x, recv_count, handle, ev, hook = buf.low_latency_dispatch(x, idx, M, case.num_experts, use_fp8=False,
                                                                    async_finish=True)
    check(isinstance(ev, EventOverlap) and hook is None, "async_finish returns an event and no hook")
    ev.current_stream_wait()
    verify_dispatch(ctx, case, recv_x, recv_count, handle, what="async_finish")
    out = torch.empty(idx.shape[0], HIDDEN, dtype=torch.bfloat16, device=ctx.device)
    y = expert_outputs(ctx, recv_x, case.num_experts // r_, "bf16", False)
    res, ev, hook = buf.low_latency_combine(y, idx, w, handle, out=out, async_finish=True, use_logfmt=True)
    check(res is out and hook is None and isinstance(ev, EventOverlap), "out= is returned; async event")
    with ev:
        ref, abs_sum = expected_combine(ctx, case)
    assert_within_budget(out, ref, abs_sum, case.num_topk, "combine into out=")
    # a plain tuple works as the handle
    res2, _, _ = buf.low_latency_combine(y, idx, w, tuple(handle))
    assert_bitwise(res2, out, "tuple(handle)")


def check_ll_two_alive_and_clean(ctx):
    buf = make_buffer(ctx)
    r_ = ctx.world_size
    a = harness.cases(r_, HIDDEN)["random"]
    b = harness.cases(r_, HIDDEN)["hot"]
    (xa, ia, _), (xb, ib, _) = rank_inputs(ctx, a), rank_inputs(ctx, b)
    ra = buf.low_latency_dispatch(xa, ia, M, a.num_experts, use_fp8=False)
    rb = buf.low_latency_dispatch(xb, ib, M, b.num_experts, use_fp8=False)
    verify_dispatch(ctx, a, ra[0], ra[1], ra[2], what="first result still alive after a second call")
    verify_dispatch(ctx, b, rb[0], rb[1], rb[2], what="second result")
    combine_and_verify(ctx, buf, a, ra[0], ra[2], what="combine of the older result")
    buf.clean_low_latency_buffer(M, HIDDEN, a.num_experts)
    rc = buf.low_latency_dispatch(xa, ia, M, a.num_experts, use_fp8=False)
    verify_dispatch(ctx, a, rc[0], rc[1], rc[2], what="after clean_low_latency_buffer")
    combine_and_verify(ctx, buf, a, rc[0], rc[2], what="combine after clean")


def check_ll_shrink(ctx):
    harness.reference_only("the shrink mask: the nvlink backend does not skip masked ranks")
    buf = make_buffer(ctx, enable_shrink=True)
    me, r_ = ctx.rank, ctx.world_size
    status = torch.full((r_,), 7, dtype=torch.int32, device=ctx.device)
    buf.low_latency_query_mask_buffer(status)
    equal(status, torch.zeros(r_, dtype=torch.int32), "nothing masked at first")
    dead = r_ - 1
    buf.low_latency_update_mask_buffer(dead, True)
    buf.low_latency_query_mask_buffer(status)
    equal(status, torch.tensor([int(r == dead) for r in range(r_)], dtype=torch.int32), "query shows the mask")
    case = harness.cases(r_, HIDDEN)["random"]
    x, idx, _ = rank_inputs(ctx, case)
    if r_ > 1 and me != dead:  # the masked rank is gone: it calls nothing, the others skip it
        wait = torch.zeros(r_, dtype=torch.int64, device=ctx.device)
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, case.num_experts, use_fp8=False,
                                                                    dispatch_wait_recv_cost_stats=wait)
        verify_dispatch(ctx, case, recv_x, recv_count, handle, dead=dead, what="masked dispatch")
        equal(int(wait[dead]), 0, "no time spent waiting for the masked rank")
        combine_and_verify(ctx, buf, case, recv_x, handle, dead=dead, what="masked combine")
    buf.low_latency_clean_mask_buffer()
    buf.low_latency_query_mask_buffer(status)
    equal(status, torch.zeros(r_, dtype=torch.int32), "clean resets the mask")
    buf.low_latency_update_mask_buffer(dead, True)
    buf.low_latency_update_mask_buffer(dead, False)
    buf.low_latency_query_mask_buffer(status)
    equal(status, torch.zeros(r_, dtype=torch.int32), "mask=False unmasks")
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, case.num_experts, use_fp8=False)
    verify_dispatch(ctx, case, recv_x, recv_count, handle, what="all ranks again after clean")
    combine_and_verify(ctx, buf, case, recv_x, handle, what="full combine after clean")


CHECKS = [
    ("ll_bf16", check_ll_bf16),
    ("ll_bf16_odd_hidden", check_ll_bf16_odd_hidden),
    ("ll_fp8", check_ll_fp8),
    ("ll_stats", check_ll_stats),
    ("ll_hook", check_ll_hook),
    ("ll_out_and_async", check_ll_out_and_async),
    ("ll_two_alive_and_clean", check_ll_two_alive_and_clean),
    ("ll_shrink", check_ll_shrink),
]


def rank_main(ctx):
    return harness.run_checks(ctx, CHECKS)


def start_early(items):  # (tests/conftest.py) this module's launches, in the background (tests/dist/background.py)
    harness.queue_cached(dict.fromkeys((rank_main, it.callspec.params["world_size"], "") for it in items))


stop_early = harness.stop_early


@pytest.mark.parametrize("world_size", harness.WORLD_SIZES)
@pytest.mark.parametrize("check_name", [n for n, _ in CHECKS])
def test_low_latency(world_size, check_name):
    harness.report(harness.launch_cached(rank_main, world_size), check_name)

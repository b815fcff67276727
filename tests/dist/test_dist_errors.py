"""Tier 2 (gloo on CPU, spawned processes, world sizes 2 and 3; or NCCL on GPUs, see ``harness``): bad
input. Every user error is a ``ValueError`` or ``TypeError`` whose message names the argument and the
offending value, raised on every rank, and the ranks stay in step afterwards (each check ends with a
good call).

Covers: wrong dtypes and shapes for every tensor argument of get_dispatch_layout, dispatch (BF16 and
the FP8 tuple), combine, low_latency_dispatch, low_latency_combine and the mask API; topk_idx outside
[-1, E); E % R != 0; T > M; FP8 hidden % 128 != 0; buffers smaller than their hints (num_nvl_bytes,
num_rdma_bytes); M differing across ranks (detected in the exchange: ValueError on every rank, no
hang); num_worst_tokens smaller than a rank's receive count (every rank raises); use_ue8m0 without
round_scale; async_finish with return_recv_hook; allocate_on_comm_stream without previous_event;
Buffer constructor arguments.

Every bad tensor lives on the rank's device (``zeros``, ``dev``), so it fails for its dtype or shape,
not for its device. Under another backend than the reference, what relies on the reference's
host-side value checks is left out (expert ids out of range, counts that contradict each other) or
skipped with the reason (a too small num_worst_tokens, M differing across ranks): the nvlink backend
finds these on the device, later, with its own messages, and its Buffer may be unusable afterwards.
"""

from __future__ import annotations

import harness
import pytest
import torch
from harness import NotApplicable, check, dev, equal, raises

from epcomm import Buffer, Config, EventOverlap, quant
from epcomm.testing.compare import assert_bitwise
from epcomm.testing.inputs import expected_dispatch, make_topk, make_x

HIDDEN = 256
M = 32
WORLD_SIZES = (2, 3)
BF16, F32, I32, I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
HOST_CHECKS = harness.BACKEND == "reference"  # expert ids, count consistency: checked on the host


def zeros(ctx, *size, dtype=F32) -> torch.Tensor:
    return torch.zeros(*size, dtype=dtype, device=ctx.device)


def setup(ctx):
    case = harness.cases(ctx.world_size, HIDDEN)["random"]
    r_, e = ctx.world_size, case.num_experts
    cfg = Buffer.get_dispatch_config(r_)
    buf = Buffer(ctx.group, num_nvl_bytes=max(cfg.get_nvl_buffer_size_hint(HIDDEN * 2, r_),
                                              Buffer.get_combine_config(r_).get_nvl_buffer_size_hint(HIDDEN * 2, r_)))
    idx, w = dev(ctx, make_topk(case, ctx.rank))
    x = dev(ctx, make_x(case, ctx.rank))
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
    good = {"num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank, "num_tokens_per_expert": per_expert,
            "topk_idx": idx, "topk_weights": w}
    return case, buf, x, good


def good_dispatch(ctx, buf=None):
    """A correct dispatch after the errors: the ranks are still in step."""
    case, b, x, good = setup(ctx)
    recv_x, *_ = (buf or b).dispatch(x, **good)
    assert_bitwise(recv_x, expected_dispatch(case, ctx.rank)["recv_x"], "dispatch after the errors")


def ll_buffer(ctx, **kw) -> Buffer:
    e = harness.num_experts_for(ctx.world_size)
    return Buffer(ctx.group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(M, HIDDEN, ctx.world_size, e),
                  low_latency_mode=True, **kw)


def good_ll(ctx, buf):
    case = harness.cases(ctx.world_size, HIDDEN)["random"]
    idx, w = dev(ctx, make_topk(case, ctx.rank))
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(dev(ctx, make_x(case, ctx.rank)), idx, M,
                                                                case.num_experts, use_fp8=False)
    lx = case.num_experts // ctx.world_size
    want = [sum(int((make_topk(case, r)[0] == ctx.rank * lx + l).sum()) for r in range(ctx.world_size))
            for l in range(lx)]
    equal(recv_count.tolist(), want, "low-latency dispatch after the errors")
    out, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
    check(out.shape == (idx.shape[0], HIDDEN), "low-latency combine after the errors")
    return case, recv_x, handle


# ----------------------------------------------------------------------------- checks


def check_constructor(ctx):
    raises(ValueError, "num_nvl_bytes must be >= 0, got -1", Buffer, ctx.group, num_nvl_bytes=-1)
    raises(TypeError, r"num_rdma_bytes must be an int, got 1\.5", Buffer, ctx.group, num_rdma_bytes=1.5)
    raises(ValueError, "num_qps_per_rank must be >= 1, got 0", Buffer, ctx.group, num_qps_per_rank=0)
    raises(TypeError, "group must be a torch.distributed.ProcessGroup, got int", Buffer, 3)


def check_layout_args(ctx):
    case, buf, _, good = setup(ctx)
    idx, e, r_ = good["topk_idx"], case.num_experts, ctx.world_size
    raises(TypeError, "topk_idx must have dtype torch.int64, got torch.int32", buf.get_dispatch_layout, idx.int(), e)
    raises(TypeError, "topk_idx must have dtype torch.int64, got torch.float32", buf.get_dispatch_layout,
           idx.float(), e)
    raises(TypeError, "topk_idx must be a torch.Tensor, got list", buf.get_dispatch_layout, idx.tolist(), e)
    raises(ValueError, r"topk_idx must be 2-D, got shape \(\d+,\)", buf.get_dispatch_layout, idx[:, 0], e)
    if HOST_CHECKS:
        bad = idx.clone()
        bad[1, 0] = e
        raises(ValueError, rf"topk_idx holds expert id {e}, outside \[-1, {e}\)", buf.get_dispatch_layout, bad, e)
        bad[1, 0] = -2
        raises(ValueError, r"topk_idx holds expert id -2, outside \[-1, ", buf.get_dispatch_layout, bad, e)
    raises(ValueError, rf"num_experts={e + 1} must be divisible by the number of ranks \({r_}\)",
           buf.get_dispatch_layout, idx, e + 1)
    raises(ValueError, "num_experts must be >= 1, got 0", buf.get_dispatch_layout, idx, 0)
    raises(TypeError, r"num_experts must be an int, got 8\.0", buf.get_dispatch_layout, idx, 8.0)
    raises(ValueError, "topk_idx has top-k 33; at most 32", buf.get_dispatch_layout, zeros(ctx, 2, 33, dtype=I64), e)
    raises(TypeError, "previous_event must be an EventOverlap, got str", buf.get_dispatch_layout, idx, e,
           previous_event="ev")
    raises(ValueError, "allocate_on_comm_stream=True needs previous_event and async_finish=True, got "
           "previous_event=None", buf.get_dispatch_layout, idx, e, async_finish=True, allocate_on_comm_stream=True)
    good_dispatch(ctx, buf)


def check_dispatch_args(ctx):
    case, buf, x, good = setup(ctx)
    t, r_, e = x.shape[0], ctx.world_size, case.num_experts

    def d(xx=x, **over):
        return buf.dispatch(xx, **{**good, **over})

    # x, BF16
    raises(TypeError, "x must have dtype torch.bfloat16, got torch.float32", d, x.float())
    raises(TypeError, "x must be a torch.Tensor, got int", d, 3)
    raises(ValueError, rf"x must be 2-D, got shape \(1, {t}, {HIDDEN}\)", d, x.unsqueeze(0))
    raises(ValueError, "hidden size of x must be a multiple of 8.*got 12", d, x[:, :12])
    # x, the FP8 tuple
    q, s = dev(ctx, quant.per_token_cast_to_fp8(x.cpu()))
    raises(ValueError, "x as a tuple must be .* got 3 items", d, (q, s, s))
    raises(TypeError, "x\\[0\\] must have dtype torch.float8_e4m3fn, got torch.bfloat16", d, (x, s))
    raises(TypeError, "x\\[1\\] must have dtype torch.float32, got torch.float16", d, (q, s.half()))
    raises(ValueError, rf"x\[1\] must have shape \({t}, 2\), got \({t}, 3\)", d, (q, torch.ones(t, 3, device=ctx.device)))
    raises(ValueError, rf"x\[1\] has {t - 1} rows but x\[0\] has {t}", d, (q, s[1:]))
    raises(ValueError, rf"x\[0\] has {t - 1} rows but topk_idx has {t}", d, (q[1:], s[1:]))
    q200 = zeros(ctx, t, 200, dtype=torch.float8_e4m3fn)
    raises(ValueError, "FP8 needs the hidden size of x\\[0\\] to be a multiple of 128, got 200", d,
           (q200, torch.ones(t, 1, device=ctx.device)))
    # layout tensors
    raises(TypeError, "num_tokens_per_rank must have dtype torch.int32, got torch.int64", d,
           num_tokens_per_rank=good["num_tokens_per_rank"].long())
    raises(ValueError, rf"num_tokens_per_rank must have shape \({r_},\), got \({r_ + 1},\)", d,
           num_tokens_per_rank=zeros(ctx, r_ + 1, dtype=I32))
    raises(TypeError, "is_token_in_rank must have dtype torch.bool, got torch.int32", d,
           is_token_in_rank=good["is_token_in_rank"].int())
    raises(ValueError, rf"is_token_in_rank has {t - 1} rows but x has {t}", d,
           is_token_in_rank=good["is_token_in_rank"][1:])
    raises(ValueError, rf"is_token_in_rank must have shape \({t}, {r_}\), got \({t}, {r_ + 1}\)", d,
           is_token_in_rank=zeros(ctx, t, r_ + 1, dtype=torch.bool))
    raises(TypeError, "num_tokens_per_expert must have dtype torch.int32, got torch.int64", d,
           num_tokens_per_expert=good["num_tokens_per_expert"].long())
    raises(ValueError, rf"num_experts={e + 1} must be divisible by the number of ranks \({r_}\)", d,
           num_tokens_per_expert=zeros(ctx, e + 1, dtype=I32))
    raises(TypeError, "num_tokens_per_rdma_rank must have dtype torch.int32, got torch.float32", d,
           num_tokens_per_rdma_rank=zeros(ctx, 1))
    raises(ValueError, "got None for is_token_in_rank", d, is_token_in_rank=None)
    # top-k
    idx, w = good["topk_idx"], good["topk_weights"]
    raises(ValueError, rf"topk_idx has {t - 1} rows but x has {t}", d, topk_idx=idx[1:], topk_weights=w[1:])
    # x one row short of the layout and the ids it was made from: x is named (not the layout)
    raises(ValueError, rf"x has {t - 1} rows but topk_idx has {t}", d, x[1:])
    raises(TypeError, "topk_idx must have dtype torch.int64, got torch.int32", d, topk_idx=idx.int())
    if HOST_CHECKS:
        bad = idx.clone()
        bad[2, 1] = e + 3
        raises(ValueError, rf"topk_idx holds expert id {e + 3}, outside \[-1, {e}\)", d, topk_idx=bad)
    raises(TypeError, "topk_weights must have dtype torch.float32, got torch.float64", d, topk_weights=w.double())
    raises(ValueError, rf"topk_weights must have shape \({t}, 4\), got \({t}, 3\)", d, topk_weights=w[:, :3])
    raises(ValueError, "topk_idx and topk_weights must be given together, got topk_idx=a tensor, topk_weights=None",
           d, topk_weights=None)
    # scalars, config, events
    raises(ValueError, "expert_alignment must be >= 1, got 0", d, expert_alignment=0)
    raises(ValueError, "num_worst_tokens must be >= 0, got -1", d, num_worst_tokens=-1)
    raises(TypeError, "config must be an epcomm.Config, got dict", d, config={"num_sms": 20})
    raises(TypeError, "previous_event must be an EventOverlap, got int", d, previous_event=1)
    raises(ValueError, "allocate_on_comm_stream=True needs previous_event and async_finish=True, got "
           r"previous_event=None, async_finish=True", d, async_finish=True, allocate_on_comm_stream=True)
    raises(ValueError, "allocate_on_comm_stream=True needs .* async_finish=False", d,
           previous_event=EventOverlap(), allocate_on_comm_stream=True)
    # a buffer smaller than the config's hint
    need = Config(24, 8, 256).get_nvl_buffer_size_hint(HIDDEN * 2, r_)
    small = Buffer(ctx.group, num_nvl_bytes=need - 128)
    raises(ValueError, rf"num_nvl_bytes={need - 128} is too small: this config needs {need}", small.dispatch, x,
           config=Config(24, 8, 256), **good)
    if HOST_CHECKS:  # num_tokens_per_rank that contradicts is_token_in_rank (every rank passes a wrong one)
        raises(ValueError, "num_tokens_per_rank=.* does not match is_token_in_rank", d,
               num_tokens_per_rank=good["num_tokens_per_rank"] + 1)
        check_layout_of_other_ids(ctx, buf, d, good)
    # the cached path
    _, _, _, _, h, _ = d()
    raises(TypeError, "handle must be the handle dispatch returned, got str", buf.dispatch, x, handle="h")
    raises(ValueError, rf"x has {t - 1} tokens but the handle was made for {t}", buf.dispatch, x[1:], handle=h)
    raises(TypeError, "x must have dtype torch.bfloat16, got torch.float32", buf.dispatch, x.float(), handle=h)
    good_dispatch(ctx, buf)


def check_layout_of_other_ids(ctx, buf, d, good):
    """A layout that is not the one of the ids dispatched raises on every rank (the reference backend finds it on
    the host and says so in its layout exchange); was: the rows went by the layout, and some arrived on a rank
    that holds none of their experts."""
    r_, last = ctx.world_size, ctx.world_size - 1
    idx, e = good["topk_idx"], good["num_tokens_per_expert"].numel()
    lx = e // r_
    # the ids of each token moved to rank 0's experts (the same number of entries, other ranks)
    other = torch.where(idx >= 0, idx % lx, idx)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(other, e)
    lay = {"num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank, "num_tokens_per_expert": per_expert}
    if r_ > 1:
        raises(ValueError, r"is_token_in_rank does not match topk_idx: token \d+ goes to ranks \[.*\] by topk_idx "
               r"but to \[.*\] by is_token_in_rank; pass the layout get_dispatch_layout made from this topk_idx",
               d, **lay)
        # on the last rank only: it says what, the others which rank
        want = ("is_token_in_rank does not match topk_idx: token" if ctx.rank == last
                else f"^is_token_in_rank does not match topk_idx on rank {last}$")
        raises(ValueError, want, d, **(lay if ctx.rank == last else {}))
    # the counts per expert alone (every rank's is_token_in_rank is right)
    wrong = good["num_tokens_per_expert"].clone()
    wrong[0] += 1
    raises(ValueError, rf"num_tokens_per_expert does not match topk_idx: expert 0 has {int(wrong[0]) - 1} tokens by "
           rf"topk_idx but {int(wrong[0])} by num_tokens_per_expert", d, num_tokens_per_expert=wrong)


def check_num_worst_tokens_too_small(ctx):
    harness.reference_only("every rank raises ValueError and stays usable; the nvlink backend finds the "
                           "overflow on the device")
    case, buf, x, good = setup(ctx)
    receives = [expected_dispatch(case, r)["recv_x"].shape[0] for r in range(ctx.world_size)]
    worst = max(receives) - 1
    over = receives.index(max(receives))
    # every rank raises, including those that receive fewer rows than num_worst_tokens
    raises(ValueError, rf"num_worst_tokens={worst} is smaller than the {max(receives)} tokens rank {over} receives",
           buf.dispatch, x, num_worst_tokens=worst, **good)
    good_dispatch(ctx, buf)


def check_combine_args(ctx):
    _, buf, x, good = setup(ctx)
    recv_x, _, recv_w, _, h, _ = buf.dispatch(x, **good)
    n, t = recv_x.shape[0], x.shape[0]
    raises(TypeError, "x must have dtype torch.bfloat16, got torch.float32", buf.combine, recv_x.float(), h)
    raises(ValueError, rf"x must be 2-D, got shape \({n * HIDDEN},\)", buf.combine, recv_x.reshape(-1), h)
    raises(ValueError, rf"x must have the {n} rows dispatch returned, got shape \({n + 1}, {HIDDEN}\)", buf.combine,
           zeros(ctx, n + 1, HIDDEN, dtype=BF16), h)
    raises(ValueError, "hidden size of x must be a multiple of 8.*got 12", buf.combine, recv_x[:, :12], h)
    raises(TypeError, "handle must be the handle dispatch returned, got list", buf.combine, recv_x, [1, 2])
    raises(TypeError, "topk_weights must have dtype torch.float32, got torch.float64", buf.combine, recv_x, h,
           topk_weights=recv_w.double())
    raises(ValueError, rf"topk_weights must have {n} rows, got shape \({n + 2}, 4\)", buf.combine, recv_x, h,
           topk_weights=zeros(ctx, n + 2, 4))
    b = zeros(ctx, t, HIDDEN, dtype=BF16)
    raises(TypeError, r"bias\[0\] must have dtype torch.bfloat16, got torch.float32", buf.combine, recv_x, h,
           bias=b.float())
    raises(ValueError, rf"bias\[1\] must have shape \({t}, {HIDDEN}\), got \({t}, 8\)", buf.combine, recv_x, h,
           bias=(b, b[:, :8]))
    raises(ValueError, "bias takes one or two tensors, got 3", buf.combine, recv_x, h, bias=(b, b, b))
    raises(TypeError, "config must be an epcomm.Config, got int", buf.combine, recv_x, h, config=24)
    need = Buffer.get_combine_config(ctx.world_size).get_nvl_buffer_size_hint(HIDDEN * 2, ctx.world_size)
    small = Buffer(ctx.group, num_nvl_bytes=need - 128)
    raises(ValueError, rf"num_nvl_bytes={need - 128} is too small: this config needs {need}", small.combine,
           recv_x, h)
    out, _, _ = buf.combine(recv_x, h)  # still in step
    check(out.shape == x.shape, "combine after the errors")


def check_ll_dispatch_args(ctx):
    buf = ll_buffer(ctx)
    case = harness.cases(ctx.world_size, HIDDEN)["random"]
    r_, e, me = ctx.world_size, case.num_experts, ctx.rank
    x, idx = dev(ctx, (make_x(case, me), make_topk(case, me)[0]))
    t = x.shape[0]

    def d(xx=x, ii=idx, m=M, ee=e, **kw):
        return buf.low_latency_dispatch(xx, ii, m, ee, **kw)

    raises(TypeError, "x must have dtype torch.bfloat16, got torch.float32", d, x.float())
    raises(ValueError, r"x must be 2-D, got shape \(", d, x[0])
    raises(ValueError, rf"x has {t} tokens, more than num_max_dispatch_tokens_per_rank={t - 1}", d, m=t - 1)
    raises(ValueError, "num_max_dispatch_tokens_per_rank must be >= 1, got 0", d, m=0)
    raises(ValueError, "FP8 needs the hidden size of x to be a multiple of 128, got 136", d,
           zeros(ctx, t, 136, dtype=BF16))
    raises(ValueError, "hidden size of x must be a multiple of 8.*got 132", d, zeros(ctx, t, 132, dtype=BF16),
           use_fp8=False)
    raises(TypeError, "topk_idx must have dtype torch.int64, got torch.int32", d, ii=idx.int())
    raises(ValueError, rf"x has {t} rows but topk_idx has {t + 1}", d, ii=zeros(ctx, t + 1, 4, dtype=I64))
    if HOST_CHECKS:
        bad = idx.clone()
        bad[0, 0] = -5
        raises(ValueError, r"topk_idx holds expert id -5, outside \[-1, ", d, ii=bad)
    raises(ValueError, rf"num_experts={e + 1} must be divisible by the number of ranks \({r_}\)", d, ee=e + 1)
    raises(ValueError, "use_ue8m0=True needs use_fp8=True and round_scale=True, got use_fp8=True, round_scale=False",
           d, use_ue8m0=True)
    raises(ValueError, "round_scale=True needs use_fp8=True, got use_fp8=False", d, use_fp8=False, round_scale=True)
    raises(ValueError, "async_finish=True and return_recv_hook=True are mutually exclusive", d, async_finish=True,
           return_recv_hook=True)
    lx = e // r_
    raises(TypeError, "cumulative_local_expert_recv_stats must have dtype torch.int32, got torch.int64", d,
           cumulative_local_expert_recv_stats=zeros(ctx, lx, dtype=I64))
    raises(ValueError, rf"cumulative_local_expert_recv_stats must have shape \({lx},\), got \({lx + 1},\)", d,
           cumulative_local_expert_recv_stats=zeros(ctx, lx + 1, dtype=I32))
    raises(TypeError, "dispatch_wait_recv_cost_stats must have dtype torch.int64, got torch.int32", d,
           dispatch_wait_recv_cost_stats=zeros(ctx, r_, dtype=I32))
    raises(ValueError, rf"dispatch_wait_recv_cost_stats must have shape \({r_},\), got \({r_ + 1},\)", d,
           dispatch_wait_recv_cost_stats=zeros(ctx, r_ + 1, dtype=I64))
    # buffers smaller than the hint, and a buffer not in low-latency mode
    need = Buffer.get_low_latency_rdma_size_hint(M, HIDDEN, r_, e)
    raises(ValueError, rf"num_rdma_bytes={need - 128} is too small for M={M}, H={HIDDEN}, E={e}: "
           rf"get_low_latency_rdma_size_hint gives {need}",
           Buffer(ctx.group, num_rdma_bytes=need - 128, low_latency_mode=True).low_latency_dispatch, x, idx, M, e)
    raises(ValueError, rf"num_rdma_bytes={need} is too small for M={2 * M}", d, m=2 * M)
    raises(ValueError, "low_latency_mode=True, this one has low_latency_mode=False",
           Buffer(ctx.group, num_rdma_bytes=need).low_latency_dispatch, x, idx, M, e)
    good_ll(ctx, buf)


def check_ll_combine_args(ctx):
    buf = ll_buffer(ctx)
    case, recv_x, handle = good_ll(ctx, buf)
    r_, e, me = ctx.world_size, case.num_experts, ctx.rank
    lx = e // r_
    idx, w = dev(ctx, make_topk(case, me))
    t = idx.shape[0]

    def c(xx=recv_x, ii=idx, ww=w, hh=handle, **kw):
        return buf.low_latency_combine(xx, ii, ww, hh, **kw)

    raises(TypeError, "x must have dtype torch.bfloat16, got torch.float32", c, recv_x.float())
    raises(ValueError, rf"x must have shape \({lx}, {r_ * M}, {HIDDEN}\), got \({lx}, {r_ * M - 1}, {HIDDEN}\)", c,
           recv_x[:, 1:])
    raises(ValueError, r"x must be 3-D, got shape \(", c, recv_x[0])
    raises(TypeError, "handle must be the handle low_latency_dispatch returned, got dict", c, hh={})
    raises(TypeError, "topk_idx must have dtype torch.int64, got torch.int32", c, ii=idx.int())
    raises(ValueError, rf"topk_idx has {M + 1} tokens, more than num_max_dispatch_tokens_per_rank={M}", c,
           ii=zeros(ctx, M + 1, 4, dtype=I64), ww=zeros(ctx, M + 1, 4))
    raises(TypeError, "topk_weights must have dtype torch.float32, got torch.bfloat16", c, ww=w.bfloat16())
    raises(ValueError, rf"topk_weights must have shape \({t}, 4\), got \({t}, 2\)", c, ww=w[:, :2])
    raises(TypeError, "out must have dtype torch.bfloat16, got torch.float32", c, out=zeros(ctx, t, HIDDEN))
    raises(ValueError, rf"out must have shape \({t}, {HIDDEN}\), got \({t + 1}, {HIDDEN}\)", c,
           out=zeros(ctx, t + 1, HIDDEN, dtype=BF16))
    raises(TypeError, "combine_wait_recv_cost_stats must have dtype torch.int64, got torch.float32", c,
           combine_wait_recv_cost_stats=zeros(ctx, r_))
    raises(ValueError, rf"combine_wait_recv_cost_stats must be 1-D, got shape \(1, {r_}\)", c,
           combine_wait_recv_cost_stats=zeros(ctx, 1, r_, dtype=I64))
    raises(ValueError, rf"combine_wait_recv_cost_stats must have shape \({r_},\), got \({r_ + 1},\)", c,
           combine_wait_recv_cost_stats=zeros(ctx, r_ + 1, dtype=I64))
    raises(ValueError, "async_finish=True and return_recv_hook=True are mutually exclusive", c, async_finish=True,
           return_recv_hook=True)
    raises(TypeError, "handle must be the handle low_latency_dispatch returned, got str",
           buf.get_next_low_latency_combine_buffer, "h")
    good_ll(ctx, buf)


def check_m_differs_across_ranks(ctx):
    if ctx.world_size < 2:
        raise NotApplicable("needs two ranks")
    harness.reference_only("ValueError on every rank from the count exchange; the nvlink backend finds it on "
                           "the device")
    case = harness.cases(ctx.world_size, HIDDEN)["random"]
    e, me = case.num_experts, ctx.rank
    m = M + (1 if me == ctx.world_size - 1 else 0)  # the last rank disagrees
    buf = Buffer(ctx.group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(M + 1, HIDDEN, ctx.world_size, e),
                 low_latency_mode=True)
    other = M + 1 if me != ctx.world_size - 1 else M
    x, idx = dev(ctx, (make_x(case, me), make_topk(case, me)[0]))
    raises(ValueError, rf"num_max_dispatch_tokens_per_rank={m} on rank {me} but {other} on ranks? [\d, ]+: it must be "
           "the same on every rank", buf.low_latency_dispatch, x, idx, m, e)
    good_ll(ctx, buf)


def check_mask_and_clean_args(ctx):
    r_ = ctx.world_size
    e = harness.num_experts_for(r_)
    plain = ll_buffer(ctx)
    raises(ValueError, "enable_shrink=True, this one has enable_shrink=False", plain.low_latency_update_mask_buffer,
           0, True)
    raises(ValueError, "enable_shrink=True", plain.low_latency_query_mask_buffer, zeros(ctx, r_, dtype=I32))
    raises(ValueError, "enable_shrink=True", plain.low_latency_clean_mask_buffer)
    buf = ll_buffer(ctx, enable_shrink=True)
    raises(ValueError, rf"rank_to_mask={r_} is not a rank of this {r_}-rank group",
           buf.low_latency_update_mask_buffer, r_, True)
    raises(ValueError, "rank_to_mask must be >= 0, got -1", buf.low_latency_update_mask_buffer, -1, True)
    raises(TypeError, "mask_status must have dtype torch.int32, got torch.int64", buf.low_latency_query_mask_buffer,
           zeros(ctx, r_, dtype=I64))
    raises(ValueError, rf"mask_status must have shape \({r_},\), got \({r_ + 1},\)",
           buf.low_latency_query_mask_buffer, zeros(ctx, r_ + 1, dtype=I32))
    raises(ValueError, rf"num_experts={e + 1} must be divisible by the number of ranks \({r_}\)",
           buf.clean_low_latency_buffer, M, HIDDEN, e + 1)
    raises(ValueError, rf"num_rdma_bytes=\d+ is too small for M={M}, H={2 * HIDDEN}", buf.clean_low_latency_buffer,
           M, 2 * HIDDEN, e)
    raises(ValueError, "low_latency_mode=True, this one has low_latency_mode=False",
           Buffer(ctx.group).clean_low_latency_buffer, M, HIDDEN, e)
    buf.clean_low_latency_buffer(M, HIDDEN, e)
    good_ll(ctx, buf)


def check_ll_shape_change(ctx):
    """A new (M, H, E) on a live low-latency buffer needs clean_low_latency_buffer first: a ValueError
    naming both shapes, on every backend (on the nvlink backend the areas and flags move with the shape)."""
    case = harness.cases(ctx.world_size, HIDDEN)["random"]
    e = case.num_experts
    buf = Buffer(ctx.group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(M + 1, HIDDEN, ctx.world_size, e),
                 low_latency_mode=True)
    good_ll(ctx, buf)
    x, idx = dev(ctx, (make_x(case, ctx.rank), make_topk(case, ctx.rank)[0]))
    raises(ValueError, rf"changed from \({M}, {HIDDEN}, {e}\) to \({M + 1}, {HIDDEN}, {e}\); call "
           rf"clean_low_latency_buffer\({M + 1}, {HIDDEN}, {e}\)", buf.low_latency_dispatch, x, idx, M + 1, e)
    buf.clean_low_latency_buffer(M + 1, HIDDEN, e)
    recv_x, count, _, _, _ = buf.low_latency_dispatch(x, idx, M + 1, e, use_fp8=False)
    check(recv_x.shape[1] == ctx.world_size * (M + 1), "dispatch with the new M after the clean")
    buf.clean_low_latency_buffer(M, HIDDEN, e)
    good_ll(ctx, buf)


CHECKS = [
    ("constructor", check_constructor),
    ("layout_args", check_layout_args),
    ("dispatch_args", check_dispatch_args),
    ("num_worst_tokens_too_small", check_num_worst_tokens_too_small),
    ("combine_args", check_combine_args),
    ("ll_dispatch_args", check_ll_dispatch_args),
    ("ll_combine_args", check_ll_combine_args),
    ("m_differs_across_ranks", check_m_differs_across_ranks),
    ("mask_and_clean_args", check_mask_and_clean_args),
    ("ll_shape_change", check_ll_shape_change),
]


def rank_main(ctx):
    return harness.run_checks(ctx, CHECKS)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("check_name", [n for n, _ in CHECKS])
def test_bad_input(world_size, check_name):
    harness.report(harness.launch_cached(rank_main, world_size), check_name)

"""Tier 2 (gloo on CPU, spawned processes, world sizes 1-4; or NCCL on GPUs, see ``harness``): the
high-throughput API end to end through the reference backend.

One launch per world size runs every check below (see ``harness``); each check is its own pytest
test. Scenarios (``harness.cases``): random routing with -1 entries and a token with no expert, odd
T, T = 0 on one rank, a hot expert, a rank that receives nothing.

Covers: Buffer attributes; get_dispatch_layout against a brute-force count; dispatch with BF16 and
the FP8 tuple (scales contiguous, column-major, non-contiguous) compared bitwise with
``expected_dispatch`` (an oracle that regenerates every rank's inputs from one seed); top-k rewritten
to local ids with zeroed weights; dispatch without top-k; expert_alignment; num_worst_tokens;
cached dispatch; the handle's positions, names and the meaning of every field; combine (sum over
receiving ranks, float32 accumulation, within the dtype budget of a float64 reference) with
topk_weights and one or two biases; an explicit Config; async_finish / previous_event /
allocate_on_comm_stream (on CPU, and with real streams and events on CUDA); get_local_buffer_tensor;
explicitly_destroy / destroy.
"""

from __future__ import annotations

import dataclasses
import os

import harness
import pytest
import torch
from harness import check, dev, equal, raises

from epcomm import Buffer, Config, DispatchHandle, EventOverlap, quant
from epcomm.testing.compare import assert_bitwise, assert_within_budget
from epcomm.testing.inputs import Case, expected_dispatch, make_topk, make_x

HIDDEN = 256
HANDLE_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                 "is_token_in_rank", "send_head")
EXPLICIT_CONFIG = Config(24, 8, 256)  # DeepEP's positional form: 12 channels


def nvl_bytes(num_ranks: int) -> int:
    """Enough for every config used here (the Buffer checks it against the config's hint)."""
    configs = [Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks), EXPLICIT_CONFIG]
    return max(c.get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks) for c in configs)


def make_buffer(ctx, **kw) -> Buffer:
    return Buffer(ctx.group, num_nvl_bytes=nvl_bytes(ctx.world_size), **kw)


def layout_args(buf: Buffer, topk: torch.Tensor, num_experts: int) -> dict:
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, num_experts)
    return {"num_tokens_per_rank": per_rank, "num_tokens_per_rdma_rank": per_rdma,
            "num_tokens_per_expert": per_expert, "is_token_in_rank": in_rank}


def dispatch_case(ctx, buf: Buffer, case: Case, x=None, topk: bool = True, **kw):
    """Dispatch this rank's inputs of ``case`` (``x``: another payload, already on ``ctx.device``)."""
    idx, w = dev(ctx, make_topk(case, ctx.rank))
    x = dev(ctx, make_x(case, ctx.rank)) if x is None else x
    extra = {"topk_idx": idx, "topk_weights": w} if topk else {}
    return buf.dispatch(x, **layout_args(buf, idx, case.num_experts), **extra, **kw)


def brute_force_in_rank(topk: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    lx = num_experts // num_ranks
    out = torch.zeros(topk.shape[0], num_ranks, dtype=torch.bool)
    for t, row in enumerate(topk.tolist()):
        for e in row:
            if e >= 0:
                out[t, e // lx] = True
    return out


def send_counts(case: Case) -> torch.Tensor:
    """``int64[R, R]``: ``[i][j]`` = tokens rank ``i`` sends to rank ``j`` (from regenerated inputs)."""
    r_ = case.num_ranks
    return torch.stack([brute_force_in_rank(make_topk(case, i)[0], case.num_experts, r_).sum(0) for i in range(r_)])


def channel_of(num_tokens: int, num_channels: int) -> list[int]:
    per = max(-(-num_tokens // num_channels), 1)
    return [t // per for t in range(num_tokens)]


def rank_tags(recv_x: torch.Tensor) -> torch.Tensor:
    return recv_x[:, 0].float().to(torch.int64)


# ----------------------------------------------------------------------------- checks


def check_buffer_attributes(ctx):
    buf = make_buffer(ctx)
    equal(buf.rank, ctx.rank, "rank")
    equal(buf.group_size, ctx.world_size, "group_size")
    check(buf.group is ctx.group, "group")
    equal(buf.num_nvl_bytes, nvl_bytes(ctx.world_size), "num_nvl_bytes")
    equal(buf.num_rdma_bytes, 0, "num_rdma_bytes")
    equal(buf.low_latency_mode, False, "low_latency_mode")
    if ctx.device.type == "cpu":
        check(buf.get_comm_stream() is None, "no communication stream on CPU")
    else:
        check(isinstance(buf.get_comm_stream(), torch.cuda.Stream), "a CUDA communication stream")
    equal(buf.backend_name, harness.BACKEND, "gloo runs the reference backend; nccl the one EPCOMM_BACKEND forces")


def check_layout(ctx):
    buf = make_buffer(ctx)
    for name, case in harness.cases(ctx.world_size, HIDDEN).items():
        idx, _ = make_topk(case, ctx.rank)
        per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(dev(ctx, idx), case.num_experts)
        want_in = brute_force_in_rank(idx, case.num_experts, ctx.world_size)
        equal(in_rank, want_in, f"{name}: is_token_in_rank")
        equal(per_rank, want_in.sum(0).to(torch.int32), f"{name}: num_tokens_per_rank (once per rank)")
        want_e = torch.tensor([int((idx == e).sum()) for e in range(case.num_experts)], dtype=torch.int32)
        equal(per_expert, want_e, f"{name}: num_tokens_per_expert (per (token, k) entry)")
        check(per_rdma is None, f"{name}: num_tokens_per_rdma_rank is None on one node")
        check(isinstance(ev, EventOverlap), f"{name}: event")
    # a token with two experts on one rank counts once there
    lx = harness.num_experts_for(ctx.world_size) // ctx.world_size
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1]], dtype=torch.int64, device=ctx.device)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, lx * ctx.world_size)
    equal(per_rank[0].item(), 2, "two experts of rank 0 in one token")
    equal(per_expert[:2].tolist(), [1, 2], "per expert")


def check_layout_per_node(ctx):
    """Virtual nodes (``EPCOMM_GPUS_PER_NODE``): ``num_tokens_per_rdma_rank`` counts, per node, the
    tokens that go to at least one of its ranks (brute force); nodes of 2 ranks at 4 ranks, else of 1."""
    n = 2 if ctx.world_size == 4 else 1
    if ctx.world_size == 1:
        raise harness.NotApplicable("one rank is one node: num_tokens_per_rdma_rank is None")
    os.environ["EPCOMM_GPUS_PER_NODE"] = str(n)
    try:
        buf = make_buffer(ctx)
    finally:
        del os.environ["EPCOMM_GPUS_PER_NODE"]
    for name, case in harness.cases(ctx.world_size, HIDDEN).items():
        idx, _ = make_topk(case, ctx.rank)
        _, per_node, _, in_rank, _ = buf.get_dispatch_layout(dev(ctx, idx), case.num_experts)
        want = brute_force_in_rank(idx, case.num_experts, ctx.world_size)
        nodes = [[t for t in range(want.shape[0]) if bool(want[t, j * n:(j + 1) * n].any())]
                 for j in range(ctx.world_size // n)]
        equal(per_node, torch.tensor([len(ts) for ts in nodes], dtype=torch.int32),
              f"{name}: num_tokens_per_rdma_rank with nodes of {n}")


def check_dispatch_bf16(ctx):
    buf = make_buffer(ctx)
    me, r_ = ctx.rank, ctx.world_size
    for name, case in harness.cases(r_, HIDDEN).items():
        recv_x, recv_idx, recv_w, lst, handle, ev = dispatch_case(ctx, buf, case)
        exp = expected_dispatch(case, me)
        assert_bitwise(recv_x, exp["recv_x"], f"{name}: recv_x")
        assert_bitwise(recv_idx, exp["recv_topk_idx"], f"{name}: recv_topk_idx")
        assert_bitwise(recv_w, exp["recv_topk_weights"], f"{name}: recv_topk_weights")
        assert_bitwise(handle.recv_src_idx, exp["recv_src_idx"], f"{name}: recv_src_idx")
        lx = case.num_experts // r_
        check(bool(((recv_idx >= -1) & (recv_idx < lx)).all()), f"{name}: local ids in [-1, L)")
        check(bool((recv_w[recv_idx < 0] == 0).all()), f"{name}: weights zero where recv_topk_idx == -1")
        equal(lst, exp["per_expert"].tolist(), f"{name}: num_recv_tokens_per_expert_list")
        equal(len(lst), lx, f"{name}: list length L")
        check(isinstance(handle, DispatchHandle) and isinstance(ev, EventOverlap), f"{name}: handle/event types")
        # order: by source rank ascending, then source token ascending
        src = rank_tags(recv_x) * 100000 + handle.recv_src_idx.to(torch.int64)
        check(bool((src[1:] > src[:-1]).all()), f"{name}: rows sorted by (source rank, token)")
        if name == "empty_rank" and me == r_ - 1:
            equal(recv_x.shape[0], 0, "the empty rank receives nothing")
        if name == "random":  # a non-contiguous x (a column slice of a wider tensor) travels the same
            x = dev(ctx, make_x(case, me))
            wide = torch.cat([x, -x], dim=1)[:, :HIDDEN]
            check(x.shape[0] <= 1 or not wide.is_contiguous(), "non-contiguous x")
            assert_bitwise(dispatch_case(ctx, buf, case, x=wide)[0], exp["recv_x"], "non-contiguous x")
        if name == "hot":
            hot_owner = case.hot_expert // lx
            hot = sum(int((make_topk(case, i)[0] == case.hot_expert).sum()) for i in range(r_))
            check(hot >= sum(case.tokens) // 4, f"hot expert takes {hot} of {sum(case.tokens)} tokens")
            if me == hot_owner:
                equal(lst[case.hot_expert % lx], hot, "hot expert count")


def check_handle_fields(ctx):
    buf = make_buffer(ctx)
    me, r_ = ctx.rank, ctx.world_size
    c = Buffer.get_dispatch_config(r_).num_channels
    for name, case in harness.cases(r_, HIDDEN).items():
        recv_x, _, _, _, h, _ = dispatch_case(ctx, buf, case)
        idx, _ = make_topk(case, me)
        x = make_x(case, me)
        t, n = idx.shape[0], recv_x.shape[0]
        # positions and names
        equal(DispatchHandle._fields, HANDLE_FIELDS, "handle field names")
        for pos, field in enumerate(HANDLE_FIELDS):
            check(h[pos] is getattr(h, field), f"handle[{pos}] is handle.{field}")
        for field, dtype, shape in [("rank_prefix_matrix", torch.int32, (r_, r_)),
                                    ("channel_prefix_matrix", torch.int32, (r_, c)),
                                    ("recv_channel_prefix_matrix", torch.int32, (r_, c)),
                                    ("recv_src_idx", torch.int32, (n,)),
                                    ("is_token_in_rank", torch.bool, (t, r_)),
                                    ("send_head", torch.int32, (t, r_))]:
            v = getattr(h, field)
            check(v.dtype == dtype and tuple(v.shape) == shape,
                  f"{name}: {field} is {v.dtype}{tuple(v.shape)}, expected {dtype}{shape}")
        counts = send_counts(case)
        # rank_prefix_matrix[i][j] = tokens ranks 0..i send to rank j
        equal(h.rank_prefix_matrix, counts.cumsum(0).to(torch.int32), f"{name}: rank_prefix_matrix")
        # rows [rpm[i-1][me], rpm[i][me]) of recv_x came from rank i
        col = [0] + h.rank_prefix_matrix[:, me].tolist()
        for i in range(r_):
            tags = rank_tags(recv_x[col[i]:col[i + 1]])
            check(bool((tags == i).all()), f"{name}: rows {col[i]}..{col[i + 1]} must come from rank {i}")
        equal(col[-1], n, f"{name}: rank_prefix_matrix[R-1][me] = received tokens")
        # channel_prefix_matrix[j][c] = tokens this rank sends to rank j from channels 0..c
        in_rank = brute_force_in_rank(idx, case.num_experts, r_)
        ch = channel_of(t, c)
        want = torch.tensor([[sum(1 for s in range(t) if in_rank[s, j] and ch[s] <= cc) for cc in range(c)]
                             for j in range(r_)], dtype=torch.int32).view(r_, c)
        equal(h.channel_prefix_matrix, want, f"{name}: channel_prefix_matrix")
        # recv_channel_prefix_matrix[i][c] = first row of recv_x holding rank i's channel c
        rows = []
        for i in range(r_):
            ti = case.tokens_of(i)
            in_i = brute_force_in_rank(make_topk(case, i)[0], case.num_experts, r_)[:, me]
            ch_i = channel_of(ti, c)
            rows.append([col[i] + sum(1 for s in range(ti) if in_i[s] and ch_i[s] < cc) for cc in range(c)])
        equal(h.recv_channel_prefix_matrix, torch.tensor(rows, dtype=torch.int32).view(r_, c),
              f"{name}: recv_channel_prefix_matrix")
        for i in range(r_):  # each channel's first row really holds a token of that channel
            src_rows = h.recv_src_idx[col[i]:col[i + 1]].tolist()
            ch_i = channel_of(case.tokens_of(i), c)
            for cc in range(c):
                first = int(h.recv_channel_prefix_matrix[i, cc]) - col[i]
                if first < len(src_rows):
                    check(ch_i[src_rows[first]] >= cc, f"{name}: row of rank {i} channel {cc}")
        equal(h.is_token_in_rank, in_rank, f"{name}: is_token_in_rank")
        # send_head[t][j] = row of rank j's recv_x holding token t, -1 if not sent there
        for j in range(r_):
            exp_j = expected_dispatch(case, j)
            for s in range(t):
                row = int(h.send_head[s, j])
                if not in_rank[s, j]:
                    equal(row, -1, f"{name}: send_head[{s}][{j}] for a token not sent there")
                    continue
                check(0 <= row < exp_j["recv_x"].shape[0], f"{name}: send_head[{s}][{j}] = {row} out of range")
                assert_bitwise(exp_j["recv_x"][row], x[s], f"{name}: rank {j} row {row} holds token {s}")
                equal(int(exp_j["recv_src_idx"][row]), s, f"{name}: send_head[{s}][{j}] source index")


def fp8_inputs(case: Case, rank: int):
    """``(fp8[T, H], f32[T, H/128])`` of ``rank``, cast on the CPU (a payload: dispatch only copies it)."""
    return quant.per_token_cast_to_fp8(make_x(case, rank))


def scale_layouts(s: torch.Tensor) -> dict[str, torch.Tensor]:
    """``s`` as contiguous, column-major and strided tensors, all on ``s.device``."""
    wide = torch.full((s.shape[0], 2 * s.shape[1]), -7.0, device=s.device)
    wide[:, ::2] = s
    return {"contiguous": s, "column_major": s.t().contiguous().t(), "strided": wide[:, ::2]}


def check_odd_hidden(ctx):
    """BF16 takes any hidden size that is a multiple of 8 (here 40: not a multiple of 128)."""
    me, r_ = ctx.rank, ctx.world_size
    buf = Buffer(ctx.group, num_nvl_bytes=Buffer.get_dispatch_config(r_).get_nvl_buffer_size_hint(80, r_))
    for name in ("random", "zero_tokens", "hot"):
        case = harness.cases(r_, 40)[name]
        recv_x, recv_idx, _, lst, h, _ = dispatch_case(ctx, buf, case)
        exp = expected_dispatch(case, me)
        assert_bitwise(recv_x, exp["recv_x"], f"{name}/H=40: recv_x")
        assert_bitwise(recv_idx, exp["recv_topk_idx"], f"{name}/H=40: recv_topk_idx")
        equal(lst, exp["per_expert"].tolist(), f"{name}/H=40: list")
        out, _, _ = buf.combine(expert_side(ctx, recv_x), h)
        ref, abs_sum = expected_combine(case, me)
        assert_within_budget(out, ref, abs_sum, r_, f"{name}/H=40: combine")


def check_dispatch_fp8(ctx):
    buf = make_buffer(ctx)
    me, r_ = ctx.rank, ctx.world_size
    for name in ("random", "zero_tokens", "hot"):
        case = harness.cases(r_, HIDDEN)[name]
        q, s = dev(ctx, fp8_inputs(case, me))
        qs = [fp8_inputs(case, i) for i in range(r_)]
        exp_q = expected_dispatch(case, me, xs=[a for a, _ in qs])
        exp_s = expected_dispatch(case, me, xs=[b for _, b in qs])
        for how, scales in scale_layouts(s).items():
            check(how == "contiguous" or s.shape[0] <= 1 or not scales.is_contiguous(), f"{how} layout")
            recv_x, recv_idx, recv_w, lst, _, _ = dispatch_case(ctx, buf, case, x=(q, scales))
            check(isinstance(recv_x, tuple) and len(recv_x) == 2, "FP8 in gives (data, scales) out")
            assert_bitwise(recv_x[0], exp_q["recv_x"], f"{name}/{how}: recv_x data")
            assert_bitwise(recv_x[1], exp_s["recv_x"], f"{name}/{how}: recv_x scales")
            assert_bitwise(recv_idx, exp_q["recv_topk_idx"], f"{name}/{how}: recv_topk_idx")
            assert_bitwise(recv_w, exp_q["recv_topk_weights"], f"{name}/{how}: recv_topk_weights")
            equal(lst, exp_q["per_expert"].tolist(), f"{name}/{how}: list")


def check_dispatch_without_topk(ctx):
    buf = make_buffer(ctx)
    me = ctx.rank
    case = harness.cases(ctx.world_size, HIDDEN)["random"]
    recv_x, recv_idx, recv_w, lst, h, _ = dispatch_case(ctx, buf, case, topk=False)
    exp = expected_dispatch(case, me)
    assert_bitwise(recv_x, exp["recv_x"], "recv_x")
    check(recv_idx is None and recv_w is None, "no top-k in, no top-k out")
    equal(lst, exp["per_expert"].tolist(), "list still from num_tokens_per_expert")
    assert_bitwise(h.recv_src_idx, exp["recv_src_idx"], "recv_src_idx")


def check_expert_alignment(ctx):
    buf = make_buffer(ctx)
    me = ctx.rank
    for name in ("random", "hot"):
        case = harness.cases(ctx.world_size, HIDDEN)[name]
        raw = expected_dispatch(case, me)["per_expert"].tolist()
        for align in (1, 3, 4, 128):
            _, _, _, lst, _, _ = dispatch_case(ctx, buf, case, expert_alignment=align)
            equal(lst, [-(-v // align) * align for v in raw], f"{name}: expert_alignment={align}")
            check(all(v % align == 0 and v >= r for v, r in zip(lst, raw)), "rounded up")


def check_num_worst_tokens(ctx):
    buf = make_buffer(ctx)
    me, r_ = ctx.rank, ctx.world_size
    for name in ("random", "zero_tokens", "empty_rank"):
        case = harness.cases(r_, HIDDEN)[name]
        worst = sum(case.tokens) + 5
        exp = expected_dispatch(case, me)
        n = exp["recv_x"].shape[0]
        recv_x, recv_idx, recv_w, lst, h, _ = dispatch_case(ctx, buf, case, num_worst_tokens=worst)
        equal(lst, [], f"{name}: the list is empty with num_worst_tokens")
        equal(tuple(recv_x.shape), (worst, HIDDEN), f"{name}: fixed rows")
        equal(tuple(recv_idx.shape), (worst, case.num_topk), f"{name}: recv_topk_idx rows")
        equal(tuple(recv_w.shape), (worst, case.num_topk), f"{name}: recv_topk_weights rows")
        assert_bitwise(recv_x[:n], exp["recv_x"], f"{name}: real rows")
        assert_bitwise(recv_idx[:n], exp["recv_topk_idx"], f"{name}: real recv_topk_idx")
        assert_bitwise(recv_w[:n], exp["recv_topk_weights"], f"{name}: real weights")
        check(bool((recv_idx[n:] == -1).all()), f"{name}: rows past the real count have recv_topk_idx == -1")
        check(bool((recv_w[n:] == 0).all()), f"{name}: padded weights are zero")
        assert_bitwise(h.recv_src_idx[:n], exp["recv_src_idx"], f"{name}: recv_src_idx")
        equal(h.recv_src_idx.shape[0], worst, f"{name}: handle has the fixed row count")
        # combine on the padded layout ignores the padding rows
        y = recv_x.clone()
        y[n:] = 1000.0
        out, w_out, _ = buf.combine(y, h, topk_weights=recv_w)
        ref, abs_sum = expected_combine(case, me, lambda j: 1.0)
        assert_within_budget(out, ref, abs_sum, r_, f"{name}: combine after num_worst_tokens")
        assert_bitwise(w_out, make_topk(case, me)[1], f"{name}: combined weights")
        # cached dispatch on the padded handle, and the FP8 path
        rx2, *_ = buf.dispatch(dev(ctx, make_x(case, me)), handle=h)
        equal(rx2.shape[0], worst, f"{name}: cached dispatch keeps the fixed rows")
        assert_bitwise(rx2[:n], exp["recv_x"], f"{name}: cached rows")
        q, s = dev(ctx, fp8_inputs(case, me))
        (rq, rs), *_ = dispatch_case(ctx, buf, case, x=(q, s.t().contiguous().t()), num_worst_tokens=worst)
        qs = [fp8_inputs(case, i) for i in range(r_)]
        equal(rq.shape[0], worst, "FP8 fixed rows")
        assert_bitwise(rq[:n], expected_dispatch(case, me, xs=[a for a, _ in qs])["recv_x"], f"{name}: FP8 data")
        assert_bitwise(rs[:n], expected_dispatch(case, me, xs=[b for _, b in qs])["recv_x"], f"{name}: FP8 scales")


def check_cached_dispatch(ctx):
    buf = make_buffer(ctx)
    me, r_ = ctx.rank, ctx.world_size
    for name, case in harness.cases(r_, HIDDEN).items():
        _, _, _, _, h, _ = dispatch_case(ctx, buf, case)
        other = dataclasses.replace(case, seed=case.seed + 1000)  # same routing, new payload
        xs = [make_x(other, i) for i in range(r_)]
        res = buf.dispatch(dev(ctx, xs[me]), handle=h)
        equal(len(res), 6, "cached dispatch returns six values")
        check(all(v is None for v in res[1:5]), f"{name}: cached dispatch returns (recv_x, None x4, event)")
        check(isinstance(res[5], EventOverlap), "event")
        assert_bitwise(res[0], expected_dispatch(case, me, xs=xs)["recv_x"], f"{name}: cached recv_x")
        # a plain tuple works as a handle too
        res2 = buf.dispatch(dev(ctx, xs[me]), handle=tuple(h))
        assert_bitwise(res2[0], res[0], f"{name}: tuple(handle)")
        # FP8 through the cached layout, column-major scales
        qs = [quant.per_token_cast_to_fp8(x) for x in xs]
        q, s = dev(ctx, qs[me])
        (rq, rs), *rest = buf.dispatch((q, s.t().contiguous().t()), handle=h)
        check(all(v is None for v in rest[:4]), "cached FP8: Nones")
        assert_bitwise(rq, expected_dispatch(case, me, xs=[a for a, _ in qs])["recv_x"], f"{name}: cached FP8 data")
        assert_bitwise(rs, expected_dispatch(case, me, xs=[b for _, b in qs])["recv_x"], f"{name}: cached FP8 scales")


def rank_factor(j: int) -> float:
    return 1.0 + j / 4.0


def expert_side(ctx, recv_x: torch.Tensor) -> torch.Tensor:
    """What this rank returns to combine: its received rows scaled by a rank-dependent factor,
    computed on the CPU as ``expected_combine`` does, on ``ctx.device``."""
    return dev(ctx, (recv_x.cpu().float() * rank_factor(ctx.rank)).to(torch.bfloat16))


def expected_combine(case: Case, me: int, factor=rank_factor, biases=()):
    """float64 reference of combine on rank ``me`` and the sum of |terms| for the budget."""
    x = make_x(case, me)
    in_rank = brute_force_in_rank(make_topk(case, me)[0], case.num_experts, case.num_ranks)
    terms = [torch.where(in_rank[:, j:j + 1], (x.float() * factor(j)).to(torch.bfloat16).double(),
                         torch.zeros((), dtype=torch.float64)) for j in range(case.num_ranks)]
    terms += [b.double() for b in biases]
    return sum(terms), sum(t.abs() for t in terms)


def check_combine(ctx):
    buf = make_buffer(ctx)
    me, r_ = ctx.rank, ctx.world_size
    for name, case in harness.cases(r_, HIDDEN).items():
        recv_x, _, recv_w, _, h, _ = dispatch_case(ctx, buf, case)
        idx, w = make_topk(case, me)
        y = expert_side(ctx, recv_x)
        t = idx.shape[0]
        out, w_out, ev = buf.combine(y, h, topk_weights=recv_w)
        check(out.dtype == torch.bfloat16 and tuple(out.shape) == (t, HIDDEN), f"{name}: combined_x bf16[T, H]")
        check(isinstance(ev, EventOverlap), "event")
        ref, abs_sum = expected_combine(case, me)
        assert_within_budget(out, ref, abs_sum, r_, f"{name}: combine")
        # the received weights summed over ranks give back the originals (zero where -1)
        assert_bitwise(w_out, w, f"{name}: combined topk_weights")
        nowhere = ~brute_force_in_rank(idx, case.num_experts, r_).any(dim=1)
        check(bool((out.cpu()[nowhere] == 0).all()), f"{name}: a token sent nowhere combines to zero")
        out2, w2, _ = buf.combine(y, h)
        check(w2 is None, "no weights in, None out")
        assert_bitwise(out2, out, f"{name}: combine without weights")
        g = torch.Generator().manual_seed(case.seed * 31 + me)
        b0 = torch.randn(t, HIDDEN, generator=g).to(torch.bfloat16)
        b1 = torch.randn(t, HIDDEN, generator=g).to(torch.bfloat16)
        for label, bias, terms in [("one bias", b0, (b0,)), ("two biases", (b0, b1), (b0, b1)),
                                   ("(bias, None)", (b0, None), (b0,)), ("[bias, bias]", [b0, b1], (b0, b1))]:
            ob, _, _ = buf.combine(y, h, bias=dev(ctx, bias))
            ref, abs_sum = expected_combine(case, me, biases=terms)
            assert_within_budget(ob, ref, abs_sum, r_ + len(terms), f"{name}: combine with {label}")
        # combine through a plain tuple handle and an explicit config
        oc, _, _ = buf.combine(y, tuple(h), config=Buffer.get_combine_config(r_))
        assert_bitwise(oc, out, f"{name}: tuple handle + explicit config")


def check_explicit_config(ctx):
    buf = make_buffer(ctx)
    me, r_ = ctx.rank, ctx.world_size
    case = harness.cases(r_, HIDDEN)["random"]
    _, _, _, _, h, _ = dispatch_case(ctx, buf, case, config=EXPLICIT_CONFIG)
    c = EXPLICIT_CONFIG.num_channels
    equal(c, 12, "Config(24, 8, 256) has 12 channels")
    equal(tuple(h.channel_prefix_matrix.shape), (r_, c), "channel_prefix_matrix follows config.num_sms")
    idx, _ = make_topk(case, me)
    in_rank = brute_force_in_rank(idx, case.num_experts, r_)
    ch = channel_of(idx.shape[0], c)
    want = [[sum(1 for s in range(idx.shape[0]) if in_rank[s, j] and ch[s] <= cc) for cc in range(c)]
            for j in range(r_)]
    equal(h.channel_prefix_matrix, torch.tensor(want, dtype=torch.int32), "channel_prefix_matrix, C = 12")
    equal(tuple(h.recv_channel_prefix_matrix.shape), (r_, c), "recv_channel_prefix_matrix shape")
    zeros = torch.zeros(h.recv_src_idx.shape[0], HIDDEN, dtype=torch.bfloat16, device=ctx.device)
    out, _, _ = buf.combine(zeros, h, config=EXPLICIT_CONFIG)
    equal(out, torch.zeros(idx.shape[0], HIDDEN, dtype=torch.bfloat16), "combine of zeros with a config")


def check_events(ctx):
    buf = make_buffer(ctx)
    me, r_ = ctx.rank, ctx.world_size
    case = harness.cases(r_, HIDDEN)["random"]
    topk = make_topk(case, me)
    idx, w = dev(ctx, topk)
    x = dev(ctx, make_x(case, me))
    kw = {"previous_event": Buffer.capture(), "async_finish": True, "allocate_on_comm_stream": True}
    per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, case.num_experts, **kw)
    check(isinstance(ev, EventOverlap), "layout event")
    with ev:
        pass
    ev.current_stream_wait()
    equal(in_rank, brute_force_in_rank(topk[0], case.num_experts, r_), "layout with events")
    recv_x, _, recv_w, _, h, ev = buf.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, previous_event=EventOverlap(),
        async_finish=True, allocate_on_comm_stream=True)
    check(isinstance(ev, EventOverlap), "dispatch event")
    ev.current_stream_wait()
    exp = expected_dispatch(case, me)
    assert_bitwise(recv_x, exp["recv_x"], "dispatch with events")
    rx2, *_, ev2 = buf.dispatch(x, handle=h, async_finish=True)
    check(isinstance(ev2, EventOverlap), "cached dispatch event")
    ev2.current_stream_wait()  # on CUDA rx2 is written on the communication stream
    assert_bitwise(rx2, exp["recv_x"], "cached dispatch with async_finish")
    out, _, ev3 = buf.combine(expert_side(ctx, recv_x), h, topk_weights=recv_w, async_finish=True,
                              previous_event=ev, allocate_on_comm_stream=True)
    check(isinstance(ev3, EventOverlap), "combine event")
    with ev3:
        ref, abs_sum = expected_combine(case, me)
    assert_within_budget(out, ref, abs_sum, r_, "combine with events")
    out4, _, _ = buf.combine(expert_side(ctx, recv_x), h, previous_event=Buffer.capture())
    assert_bitwise(out4, out, "combine after previous_event only")


def check_local_buffer_tensor(ctx):
    buf = make_buffer(ctx)
    nbytes = buf.num_nvl_bytes
    a = buf.get_local_buffer_tensor(torch.int32)
    equal(a.numel(), nbytes // 4, "int32 view covers the buffer")
    a[2] = 0x04030201
    b = buf.get_local_buffer_tensor(torch.uint8, (4,), offset=8)
    equal(b.tolist(), [1, 2, 3, 4], "views share memory (little-endian bytes at offset 8)")
    c = buf.get_local_buffer_tensor(torch.bfloat16, torch.Size([2, 3]), offset=64)
    equal(tuple(c.shape), (2, 3), "shaped view")
    equal(c.dtype, torch.bfloat16, "dtype")
    raises(ValueError, rf"size=\(1, {nbytes}\) needs {nbytes * 4} bytes", buf.get_local_buffer_tensor, torch.float32,
           (1, nbytes))
    raises(ValueError, rf"offset={nbytes + 1} is past the end of the {nbytes}-byte buffer",
           buf.get_local_buffer_tensor, torch.uint8, None, nbytes + 1)
    raises(ValueError, "offset must be >= 0, got -1", buf.get_local_buffer_tensor, torch.uint8, None, -1)
    raises(TypeError, "dtype must be a torch.dtype, got 'int32'", buf.get_local_buffer_tensor, "int32")
    m, e = 8, harness.num_experts_for(ctx.world_size)
    rdma = Buffer.get_low_latency_rdma_size_hint(m, HIDDEN, ctx.world_size, e)
    ll = Buffer(ctx.group, num_rdma_bytes=rdma, low_latency_mode=True)
    equal(ll.get_local_buffer_tensor(torch.bfloat16, use_rdma_buffer=True).numel(), rdma // 2, "RDMA buffer view")
    equal(ll.low_latency_mode, True, "low_latency_mode")
    equal(ll.num_rdma_bytes, rdma, "num_rdma_bytes")


def check_destroy(ctx):
    me = ctx.rank
    case = harness.cases(ctx.world_size, HIDDEN)["random"]
    buf = make_buffer(ctx, explicitly_destroy=True)
    recv_x, *_ = dispatch_case(ctx, buf, case)
    assert_bitwise(recv_x, expected_dispatch(case, me)["recv_x"], "dispatch before destroy")
    buf.destroy()
    raises(RuntimeError, "destroyed", buf.get_dispatch_layout, dev(ctx, make_topk(case, me)[0]), case.num_experts)
    raises(RuntimeError, "destroyed", buf.get_local_buffer_tensor, torch.uint8)
    buf.destroy()  # a second destroy is a no-op
    plain = make_buffer(ctx)
    raises(RuntimeError, "explicitly_destroy=True", plain.destroy)


def check_caller_default_dtype(ctx):
    """``torch.set_default_dtype(torch.bfloat16)`` by the caller (and, on CUDA ranks,
    ``torch.set_default_device``): a Buffer made after it dispatches and combines as before."""
    case = harness.cases(ctx.world_size, HIDDEN)["random"]
    exp = expected_dispatch(case, ctx.rank)  # the oracle computes on the host: before the defaults change
    x64 = make_x(case, ctx.rank).double()
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    if ctx.device.type == "cuda":
        torch.set_default_device(ctx.device)
    try:
        buf = make_buffer(ctx)
        recv_x, recv_idx, recv_w, counts, handle, _ = dispatch_case(ctx, buf, case)
        assert_bitwise(recv_x, exp["recv_x"], "recv_x under default dtype bf16")
        equal(recv_w.dtype, torch.float32, "recv_topk_weights dtype")
        combined, _, _ = buf.combine(recv_x, handle)
        in_rank = layout_args(buf, dev(ctx, make_topk(case, ctx.rank)[0]), case.num_experts)["is_token_in_rank"]
        ranks = in_rank.sum(1).double().cpu().unsqueeze(1)  # the ranks each token went to
        assert_within_budget(combined, x64 * ranks, x64.abs() * ranks, ctx.world_size, "combine(dispatch(x))")
    finally:
        torch.set_default_dtype(old_dtype)
        if ctx.device.type == "cuda":
            torch.set_default_device(None)


CHECKS = [
    ("buffer_attributes", check_buffer_attributes),
    ("layout", check_layout),
    ("layout_per_node", check_layout_per_node),
    ("dispatch_bf16", check_dispatch_bf16),
    ("handle_fields", check_handle_fields),
    ("odd_hidden", check_odd_hidden),
    ("dispatch_fp8", check_dispatch_fp8),
    ("dispatch_without_topk", check_dispatch_without_topk),
    ("expert_alignment", check_expert_alignment),
    ("num_worst_tokens", check_num_worst_tokens),
    ("cached_dispatch", check_cached_dispatch),
    ("combine", check_combine),
    ("explicit_config", check_explicit_config),
    ("events", check_events),
    ("local_buffer_tensor", check_local_buffer_tensor),
    ("destroy", check_destroy),
    ("caller_default_dtype", check_caller_default_dtype),
]


def rank_main(ctx):
    return harness.run_checks(ctx, CHECKS)


def start_early(items):  # (tests/conftest.py) this module's launches, in the background (tests/dist/background.py)
    harness.queue_cached(dict.fromkeys((rank_main, it.callspec.params["world_size"], "") for it in items))


stop_early = harness.stop_early


@pytest.mark.parametrize("world_size", harness.WORLD_SIZES)
@pytest.mark.parametrize("check_name", [n for n, _ in CHECKS])
def test_high_throughput(world_size, check_name):
    harness.report(harness.launch_cached(rank_main, world_size), check_name)

"""Tier-3 checks of the low-latency calls: a fast backend against the reference backend on the same NCCL group
and inputs (``gpu_cases`` has the high-throughput ones and says how the checks report).
"""

from __future__ import annotations

import time

import torch

from .. import Buffer, quant
from .compare import (
    any_true,
    assert_bitwise,
    assert_bitwise_all,
    assert_fp8_within_one_step,
    assert_within_budget,
    differs,
    fp8_within_one_step,
)
from .graphs import capture, progress
from .inputs import Case, make_topk
from .traffic import Stress, ll_remote_rows


def ll_inputs(case: Case, rank: int, device, seed_shift: int = 0):
    c = Case(**{**case.__dict__, "seed": case.seed + seed_shift})
    topk, w = make_topk(c, rank)
    g = torch.Generator(device=device)
    g.manual_seed(c.seed * 131 + rank + 7)
    x = torch.randn(c.tokens_of(rank), c.hidden, generator=g, device=device).to(torch.bfloat16)
    return x, topk.to(device), w.to(device)


def ll_expert_outputs(recv_x, count: torch.Tensor, use_fp8: bool, ue8m0: bool) -> torch.Tensor:
    """The expert outputs ``check_ll_case`` combines, ``bf16[L, R*M, H]`` on the dispatch's device: every valid
    row (the first ``count[l]`` of expert ``l``; FP8 dequantized) times ``1 + l / 8``, so that a row combined
    from a wrong expert's slot is caught; zeros elsewhere."""
    if use_fp8:
        q, s = recv_x
        if ue8m0:
            s = quant.unpack_ue8m0(s, q.shape[-1] // quant.GROUP)
        vals = quant.per_token_cast_back(q, s, torch.float32)
    else:
        vals = recv_x.float()
    lx, rows = vals.shape[:2]
    factor = 1 + torch.arange(lx, device=vals.device).float() / 8
    y = (vals * factor.view(lx, 1, 1)).to(torch.bfloat16)
    return y.masked_fill_(~_valid_rows(count, rows).unsqueeze(2), 0)


def ll_combine_abs_sum(x: torch.Tensor, topk: torch.Tensor, w: torch.Tensor, lx: int, use_fp8: bool,
                       round_scale: bool) -> torch.Tensor:
    """``sum_k |w[t, k]| * |y[t, k]|`` (float64 ``[T, H]``) over the lanes with ``topk >= 0``: the terms'
    magnitudes of the combine that ``check_ll_case`` checks, computed here from the dispatch's inputs. ``y[t, k]``
    is the row :func:`ll_expert_outputs` makes of token ``t`` at its expert ``topk[t, k]`` (local id
    ``topk % lx``): ``x[t]`` as the dispatch delivers it (FP8: cast and cast back, as ``quant`` defines) times
    ``1 + (topk % lx) / 8``, rounded to BF16. The reference's combine of ``|y|`` with ``|w|`` is this sum in
    float32, rounded to BF16 (tests/dist/test_gpu_summaries_cpu.py holds the two together)."""
    if use_fp8:
        xv = quant.per_token_cast_back(*quant.per_token_cast_to_fp8(x, round_scale), torch.float32)
    else:
        xv = x.float()
    factor = 1 + (topk.clamp_min(0) % lx).float() / 8  # [T, K]
    y = (xv.unsqueeze(1) * factor.unsqueeze(2)).to(torch.bfloat16)  # [T, K, H]
    lane = w.double().abs() * (topk >= 0)  # [T, K]
    return (y.double().abs() * lane.unsqueeze(2)).sum(1)


def _valid_rows(count: torch.Tensor, rows: int) -> torch.Tensor:
    """``bool[L, rows]``: slot ``s`` of expert ``l`` holds a received row (``s < count[l]``)."""
    return torch.arange(rows, device=count.device).unsqueeze(0) < count.long().unsqueeze(1)


def _ll_recv_differs(fr, rr, use_fp8: bool):
    """Whether the fast dispatch's valid rows differ from the reference's (every local expert in one comparison,
    on the device): ``recv_src_info`` and ``recv_x`` bitwise (FP8: within one step) and the scales bitwise.
    ``True`` where a shape differs; else a 0-d bool tensor."""
    pairs = [(fr[2].recv_src_info, rr[2].recv_src_info)]
    pairs += [(fr[0][0], rr[0][0]), (fr[0][1], rr[0][1])] if use_fp8 else [(fr[0], rr[0])]
    if any(a.shape != b.shape or a.dtype != b.dtype or a.device != b.device for a, b in pairs):
        return True
    valid = _valid_rows(rr[1], rr[2].recv_src_info.shape[1])
    rows = valid.unsqueeze(2)
    bad = [((pairs[0][0] != pairs[0][1]) & valid).any()]
    if use_fp8:
        bad.append((~fp8_within_one_step(*pairs[1]) & rows).any())
        (fs, rs) = pairs[2]  # (transposed views: compared as they are, element by element)
        bad.append(((fs.view(torch.int32) != rs.view(torch.int32)) & rows).any())
    else:
        bad.append(((pairs[1][0].view(torch.int16) != pairs[1][1].view(torch.int16)) & rows).any())
    return torch.stack(bad).any()


def _ll_recv_per_expert(fr, rr, use_fp8: bool, tag: str) -> None:
    """Every local expert's valid rows compared one by one, on the host: the messages name the expert, the
    tensor and the first differing element (run where :func:`_ll_recv_differs` found a difference)."""
    f_src, r_src = fr[2].recv_src_info.cpu(), rr[2].recv_src_info.cpu()
    f_x, r_x = (fr[0][0].cpu(), rr[0][0].cpu()) if use_fp8 else (fr[0].cpu(), rr[0].cpu())
    f_s, r_s = (fr[0][1].cpu(), rr[0][1].cpu()) if use_fp8 else (None, None)
    for l_, n in enumerate(rr[1].tolist()):
        assert_bitwise(f_src[l_, :n], r_src[l_, :n], f"recv_src_info[{l_}] {tag}")
        if use_fp8:
            # within the FP8 budget: one e4m3 rounding step (the issue allows it; we also count exact rows)
            assert_fp8_within_one_step(f_x[l_, :n], r_x[l_, :n], f"recv_x fp8[{l_}] {tag}")
            assert_bitwise(f_s[l_, :n], r_s[l_, :n], f"recv scales[{l_}] {tag}")
        else:
            assert_bitwise(f_x[l_, :n], r_x[l_, :n], f"recv_x[{l_}] {tag}")


_WAIT_MARK = 1 << 40  # where check_ll_case's wait statistics start


def check_wait_stats(fast: Buffer, stats: torch.Tensor, waits: int, what: str) -> None:
    """``stats``: a low-latency call's wait statistics (``int64[R]``, nanoseconds per source rank), which
    started at ``_WAIT_MARK``; the call waited ``waits`` times on each rank. What was added must be a
    duration: never negative (not overwritten), at most ``waits`` deadlines on a GPU (not a timestamp).
    Under the Triton interpreter (the CPU tier) the kernels read a simulated clock that moves at every
    read (``kernels/common.now_ns``), so there every rank's share must be positive: statistics that
    are never filled fail here. (On a GPU a wait whose data had arrived may add 0: the timer is coarse.)"""
    added = (stats - _WAIT_MARK).cpu()
    assert bool((added >= 0).all()), f"wait stats overwritten or decreased {what}: {added.tolist()}"
    if fast.device.type == "cuda":
        bound = waits * (fast.timeout_s * 1e9 + 1e6)
        assert bool((added <= bound).all()), f"wait stats not durations {what}: {added.tolist()} > {bound:g}"
    elif fast.backend_name in ("nvlink", "internode"):  # the kernels under the interpreter
        assert bool((added > 0).all()), f"wait stats not filled {what}: {added.tolist()}"


def check_ll_case(ref: Buffer, fast: Buffer, case: Case, rank: int, m: int, use_fp8: bool, round_scale=False,
                  ue8m0=False, hook=False, zero_copy=False, seed_shift: int = 0) -> dict:
    dev = fast.device
    e = case.num_experts
    x, topk, w = ll_inputs(case, rank, dev, seed_shift)
    tag = f"{case} M={m} fp8={use_fp8} round={round_scale} ue8m0={ue8m0} hook={hook} zc={zero_copy} rank={rank}"
    lx = e // case.num_ranks
    cum_r = torch.zeros(lx, dtype=torch.int32, device=dev)
    cum_f = torch.zeros(lx, dtype=torch.int32, device=dev)
    # wait statistics start at a mark: the kernels must add to them (never overwrite), per source rank
    wait_f = torch.full((case.num_ranks,), _WAIT_MARK, dtype=torch.int64, device=dev)
    wait_c = wait_f.clone()
    rr = ref.low_latency_dispatch(x, topk, m, e, cumulative_local_expert_recv_stats=cum_r, use_fp8=use_fp8,
                                  round_scale=round_scale, use_ue8m0=ue8m0)
    fr = fast.low_latency_dispatch(x, topk, m, e, cumulative_local_expert_recv_stats=cum_f,
                                   dispatch_wait_recv_cost_stats=wait_f, use_fp8=use_fp8, round_scale=round_scale,
                                   use_ue8m0=ue8m0, return_recv_hook=hook)
    if hook:
        fr[4]()
    torch.cuda.synchronize()
    # the counts, the layout, the statistics and every local expert's valid rows compared on the device, read
    # back once; where anything differs, compared again one by one for the message
    heads = [(fr[1], rr[1], f"recv_count {tag}"), (fr[2].layout_range, rr[2].layout_range, f"layout_range {tag}"),
             (cum_f, cum_r, f"cumulative stats {tag}")]
    if any_true([differs(a, b) for a, b, _ in heads] + [_ll_recv_differs(fr, rr, use_fp8)]):
        assert_bitwise_all(heads)
        check_wait_stats(fast, wait_f, lx, f"dispatch {tag}")
        _ll_recv_per_expert(fr, rr, use_fp8, tag)
        shapes = [tuple(t.shape) for t in (fr[0] if use_fp8 else (fr[0],)) + (rr[0] if use_fp8 else (rr[0],))]
        raise AssertionError(f"received rows differ, but not within an expert's valid rows: recv_x shapes (fast, "
                             f"then reference) {shapes} {tag}")
    check_wait_stats(fast, wait_f, lx, f"dispatch {tag}")
    if use_fp8:
        assert fr[0][1].stride(1) == 1 or fr[0][1].shape[1] == 1, "scales must be a transposed (column-major) view"
    # combine: expert outputs depend on the local expert id so a wrong slot is caught
    y = ll_expert_outputs(rr[0], rr[1], use_fp8, ue8m0)
    ro, _, _ = ref.low_latency_combine(y, topk, w, rr[2])
    if zero_copy:
        fast.get_next_low_latency_combine_buffer(fr[2]).copy_(y)
        fo, _, hk = fast.low_latency_combine(y, topk, w, fr[2], zero_copy=True, return_recv_hook=hook,
                                             combine_wait_recv_cost_stats=wait_c)
    else:
        out = torch.empty_like(ro)
        fo, _, hk = fast.low_latency_combine(y, topk, w, fr[2], out=out, return_recv_hook=hook,
                                             combine_wait_recv_cost_stats=wait_c)
        assert fo.data_ptr() == out.data_ptr(), "out= must be written in place"
    if hook:
        hk()
    torch.cuda.synchronize()
    check_wait_stats(fast, wait_c, 1, f"combine {tag}")
    # the budget's sum of |terms| from the inputs (ll_combine_abs_sum), not from a second reference combine
    abs_sum = ll_combine_abs_sum(x, topk, w, lx, use_fp8, round_scale)
    assert_within_budget(fo, ro.double(), abs_sum, case.num_topk + case.num_ranks, f"ll combine {tag}",
                         extra_rel=2.0 ** -8)
    return {"bitwise_combine": bool(torch.equal(fo.view(torch.int16), ro.view(torch.int16))),
            "remote_rows": int(ll_remote_rows(rr[2].layout_range, rank))}


def check_ll_graph(ref: Buffer, fast: Buffer, case: Case, rank: int, m: int, replays: int) -> None:
    """Capture a dispatch (FP8) + combine pair; replay on changing inputs against the reference."""
    dev = fast.device
    e = case.num_experts
    lx = e // case.num_ranks
    x, topk, w = ll_inputs(case, rank, dev)
    sx, st, sw = x.clone(), topk.clone(), w.clone()
    scale = (1 + torch.arange(lx, device=dev, dtype=torch.float32) / 8).view(lx, 1, 1)

    def step():
        rx, cnt, h, _, _ = fast.low_latency_dispatch(sx, st, m, e, use_fp8=False)
        y = (rx.float() * scale).to(torch.bfloat16)
        out, _, _ = fast.low_latency_combine(y, st, sw, h)
        return rx, cnt, h, out

    progress(rank, "graph: warm-up and capture")
    g, (rx, cnt, h, out) = capture(step, warmup=2)
    for it in range(replays):
        x2, t2, w2 = ll_inputs(case, rank, dev, seed_shift=1000 + it)
        sx.copy_(x2)
        st.copy_(t2)
        sw.copy_(w2)
        torch.cuda.synchronize()
        torch.distributed.barrier()
        g.replay()
        torch.cuda.synchronize()
        if it % 10 == 0 or it == replays - 1:
            r = ref.low_latency_dispatch(x2, t2, m, e, use_fp8=False)
            assert_bitwise(cnt, r[1], f"graph replay {it} recv_count")
            for l_, n in enumerate(r[1].tolist()):
                assert_bitwise(rx[l_, :n], r[0][l_, :n], f"graph replay {it} recv_x[{l_}]")
            y = (r[0].float() * scale).to(torch.bfloat16)
            ro, _, _ = ref.low_latency_combine(y, t2, w2, r[2])
            ro_abs, _, _ = ref.low_latency_combine(y.abs(), t2, w2.abs(), r[2])
            assert_within_budget(out, ro.double(), ro_abs.double(), case.num_topk + case.num_ranks,
                                 f"graph replay {it} combine", extra_rel=2.0 ** -8)


def check_ll_stress(ref: Buffer, fast: Buffer, case: Case, rank: int, m: int, iters: int) -> Stress:
    """``iters`` low-latency dispatch + combine pairs with changing token counts and routings, BF16 and
    FP8 in turn; every 100th and the last compared with the reference."""
    dev = fast.device
    e = case.num_experts
    lx = e // case.num_ranks
    t0 = time.perf_counter()
    checked, remote = 0, torch.zeros((), dtype=torch.int64, device=dev)
    for it in range(iters):
        tokens = tuple(int(v) for v in torch.randint(0, m + 1, (case.num_ranks,),
                                                     generator=torch.Generator().manual_seed(it)))
        c = Case(**{**case.__dict__, "tokens": tokens, "seed": case.seed + it})
        x, topk, w = ll_inputs(c, rank, dev)
        use_fp8 = it % 2 == 1
        rx, cnt, h, _, _ = fast.low_latency_dispatch(x, topk, m, e, use_fp8=use_fp8)
        y = torch.ones(lx, case.num_ranks * m, case.hidden, dtype=torch.bfloat16, device=dev) if use_fp8 else rx
        out, _, _ = fast.low_latency_combine(y, topk, w, h)
        remote += ll_remote_rows(h.layout_range, rank)
        if it % 100 == 0 or it == iters - 1:
            checked += 1
            r = ref.low_latency_dispatch(x, topk, m, e, use_fp8=use_fp8)
            assert_bitwise(cnt, r[1], f"stress {it} recv_count {c}")
            ro, _, _ = ref.low_latency_combine(y, topk, w, r[2])
            ro_abs, _, _ = ref.low_latency_combine(y.abs(), topk, w.abs(), r[2])
            assert_within_budget(out, ro.double(), ro_abs.double(), case.num_topk + case.num_ranks,
                                 f"stress {it} combine {c}", extra_rel=2.0 ** -8)
    torch.cuda.synchronize()
    return Stress(iters, checked, int(remote), time.perf_counter() - t0)

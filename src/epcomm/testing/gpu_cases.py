"""Tier-3 checks: a fast backend against the reference backend on the same NCCL group and inputs.

Each ``check_*`` function runs inside a rank (launched by ``parallel_launch`` with NCCL) and raises
``AssertionError`` with the case on the first mismatch; it returns a short summary (a dict, or
``traffic.Stress`` for the stress loops) that says how many rows came from other ranks.
Dispatch is compared bitwise; combine within the budget of epcomm.testing.compare.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from .. import Buffer, quant
from .compare import any_true, assert_bitwise, assert_bitwise_all, assert_within_budget, differs
from .graphs import capture, progress
from .inputs import Case, make_topk
from .traffic import Stress, ht_remote_rows


@contextlib.contextmanager
def forced_backend(name: str):
    old = os.environ.get("EPCOMM_BACKEND")
    os.environ["EPCOMM_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("EPCOMM_BACKEND", None)
        else:
            os.environ["EPCOMM_BACKEND"] = old


def make_buffers(group, fast: str = "nvlink", **kw) -> tuple[Buffer, Buffer]:
    with forced_backend("reference"):
        ref = Buffer(group, **kw)
    with forced_backend(fast):
        fast_buf = Buffer(group, **kw)
    return ref, fast_buf


def device_inputs(case: Case, rank: int, device, fp8: bool = False):
    topk, w = make_topk(case, rank)
    g = torch.Generator(device=device)
    g.manual_seed(case.seed * 131 + rank)
    x = torch.randn(case.tokens_of(rank), case.hidden, generator=g, device=device).to(torch.bfloat16)
    xin = x
    if fp8:
        q, s = quant.per_token_cast_to_fp8(x)
        xin = (q, s.t().contiguous().t())  # column-major scales, as DeepEP's tests pass them
    return xin, x, topk.to(device), w.to(device)


def _dispatch(buf: Buffer, xin, topk, w, e, **kw):
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, e)
    return buf.dispatch(xin, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, **kw)


def _rows(t):
    return t[0] if isinstance(t, tuple) else t


def _combine_check(out, ref_out, ref: Buffer, y: torch.Tensor, handle, what: str, bias=None):
    """``out`` against the reference combine ``ref_out`` within the bf16 budget: both round a float32
    sum of the same terms, so they may differ by one rounding of the output (``extra_rel = 2**-8``
    of the sum of |terms|, which the reference combine of ``|y|`` gives)."""
    abs_sum = ref.combine(y.abs(), handle)[0].double()
    for b in bias or ():
        abs_sum = abs_sum + b.double().abs()
    assert_within_budget(out, ref_out.double(), abs_sum, ref.group_size + 2, what, extra_rel=2.0 ** -8)


def check_ht_no_topk(ref: Buffer, fast: Buffer, case: Case, rank: int, fp8: bool = False) -> int:
    """A high-throughput dispatch given its layout but no ``topk_idx`` / ``topk_weights`` (as some of DeepEP's tests
    make), then a combine of its rows: ``fast`` against ``ref``, the dispatch bit for bit, the combine within its
    budget (``_combine_check``), the received ids and weights None.
    Returns the rows received."""
    xin, _, topk, _ = device_inputs(case, rank, fast.device, fp8)
    per_rank, _, per_expert, in_rank, _ = ref.get_dispatch_layout(topk, case.num_experts)
    kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
              config=fast.get_dispatch_config(fast.group_size))
    rr, fr = ref.dispatch(xin, **kw), fast.dispatch(xin, **kw)
    assert fr[1] is None and fr[2] is None, "a dispatch without topk_idx receives no ids and no weights"
    assert_bitwise(_rows(fr[0]), _rows(rr[0]), "recv_x of a dispatch without topk_idx")
    if fp8:
        assert_bitwise(fr[0][1], rr[0][1], "recv scales of a dispatch without topk_idx")
    y = _rows(rr[0]).to(torch.bfloat16)
    ccfg = fast.get_combine_config(fast.group_size)
    c_ref, c_fast = ref.combine(y, rr[4], config=ccfg), fast.combine(y, fr[4], config=ccfg)
    assert c_fast[1] is None, "a combine without topk_weights returns no weights"
    _combine_check(c_fast[0], c_ref[0], ref, y, rr[4], "combine after a dispatch without topk_idx")
    return _rows(rr[0]).shape[0]


def _ht_dispatch_pairs(fr, rr, n: int, fp8: bool, tag: str) -> list:
    """``(fast, reference, what)`` of a high-throughput dispatch's results that must be equal bit for bit: the
    received rows (and scales), ids, weights, then the handle's tensors."""
    pairs = [(_rows(fr[0])[:n], _rows(rr[0])[:n], f"recv_x {tag}")]
    if fp8:
        pairs.append((fr[0][1][:n], rr[0][1][:n], f"recv scales {tag}"))
    pairs += [(fr[1][:n], rr[1][:n], f"recv_topk_idx {tag}"), (fr[2][:n], rr[2][:n], f"recv_topk_weights {tag}")]
    pairs += [(getattr(fr[4], name), getattr(rr[4], name), f"handle.{name} {tag}")
              for name in ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "send_head")]
    pairs.append((fr[4].recv_src_idx[:n], rr[4].recv_src_idx[:n], f"handle.recv_src_idx {tag}"))
    return pairs


def _check_ht_dispatch(fr, rr, n: int, fp8: bool, worst: int, tag: str) -> None:
    """A high-throughput dispatch's results (``fr``) against the reference's (``rr``; ``n`` rows received): every
    tensor compared where it lives and read back once; where anything differs, compared again one by one, in
    order, for the message (the first difference: its tensor and element)."""
    pairs = _ht_dispatch_pairs(fr, rr, n, fp8, tag)
    flags = [differs(a, b) for a, b, _ in pairs]
    if worst:
        flags.append(~(fr[1][n:] == -1).all())
    if not any_true(flags) and fr[3] == rr[3]:
        return
    assert_bitwise_all(pairs[:4 if fp8 else 3])
    if worst:
        assert bool((fr[1][n:] == -1).all()), f"padding rows of recv_topk_idx must be -1 ({tag})"
    assert fr[3] == rr[3], f"num_recv_tokens_per_expert_list {fr[3]} != {rr[3]} ({tag})"
    assert_bitwise_all(pairs[4 if fp8 else 3:])
    raise AssertionError(f"_check_ht_dispatch: a comparison failed that none of its checks repeats ({tag})")


def check_ht_case(ref: Buffer, fast: Buffer, case: Case, rank: int, fp8: bool, worst: int = 0,
                  with_bias: bool = False, configs: tuple | None = None) -> dict:
    """``configs``: ``(dispatch, combine)`` Configs for ``fast``'s calls (else its defaults); the dispatch's
    for the reference's dispatch too (its channels shape the handle)."""
    dev = fast.device
    dcfg, ccfg = configs or (None, None)
    xin, x, topk, w = device_inputs(case, rank, dev, fp8)
    e = case.num_experts
    rr = _dispatch(ref, xin, topk, w, e, num_worst_tokens=worst, config=dcfg)  # (its channels: the handle's)
    fr = _dispatch(fast, xin, topk, w, e, num_worst_tokens=worst, config=dcfg)
    n = int(rr[4].rank_prefix_matrix[-1, rank])
    tag = f"{case} fp8={fp8} worst={worst} rank={rank}" + (f" configs={configs}" if configs else "")
    _check_ht_dispatch(fr, rr, n, fp8, worst, tag)
    # combine: expert outputs = received rows scaled by a per-row factor that depends on the row
    y = _rows(rr[0]) if not fp8 else quant.per_token_cast_back(rr[0][0], rr[0][1])
    scale = (1.0 + torch.arange(y.shape[0], device=dev, dtype=torch.float32) % 7 / 8).unsqueeze(1)
    y = (y.float() * scale).to(torch.bfloat16)
    bias = None
    if with_bias:
        gb = torch.Generator(device=dev)
        gb.manual_seed(rank + 77)
        bias = (torch.randn(x.shape, generator=gb, device=dev).to(torch.bfloat16),
                torch.randn(x.shape, generator=gb, device=dev).to(torch.bfloat16))
    ro, rw, _ = ref.combine(y, rr[4], topk_weights=rr[2], bias=bias)
    fo, fw, _ = fast.combine(y, fr[4], topk_weights=fr[2], bias=bias, config=ccfg)
    _combine_check(fo, ro, ref, y, rr[4], f"combine {tag}", bias)
    assert_within_budget(fw, rw.double(), rw.double().abs(), case.num_ranks, f"combined weights {tag}")
    bitwise = bool(torch.equal(fo.view(torch.int16), ro.view(torch.int16)))
    # cached dispatch
    cr = ref.dispatch(xin, handle=rr[4])
    cf = fast.dispatch(xin, handle=fr[4], config=dcfg)
    assert cf[1] is None and cf[4] is None
    assert_bitwise(_rows(cf[0])[:n], _rows(cr[0])[:n], f"cached recv_x {tag}")
    return {"n": n, "combine_bitwise": bitwise, "remote_rows": int(ht_remote_rows(rr[4].rank_prefix_matrix, rank))}


def check_ht_async(ref: Buffer, fast: Buffer, case: Case, rank: int) -> None:
    """previous_event / async_finish / allocate_on_comm_stream give the same results."""
    dev = fast.device
    xin, x, topk, w = device_inputs(case, rank, dev)
    e = case.num_experts
    prev = Buffer.capture()
    per_rank, _, per_expert, in_rank, ev = fast.get_dispatch_layout(topk, e, previous_event=prev, async_finish=True,
                                                                     allocate_on_comm_stream=True)
    ev.current_stream_wait()
    prev = Buffer.capture()
    out = fast.dispatch(xin, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=topk, topk_weights=w, previous_event=prev, async_finish=True,
                        allocate_on_comm_stream=True)
    out[5].current_stream_wait()
    rr = _dispatch(ref, xin, topk, w, e)
    assert_bitwise(out[0], rr[0], f"async recv_x {case}")
    with fast.combine(out[0], out[4], async_finish=True)[2] as _:
        pass
    fo, _, ev = fast.combine(out[0], out[4], async_finish=True, previous_event=Buffer.capture())
    ev.current_stream_wait()
    ro, _, _ = ref.combine(rr[0], rr[4])
    _combine_check(fo, ro, ref, rr[0], rr[4], f"async combine {case}")


def check_ht_graph(ref: Buffer, fast: Buffer, case: Case, rank: int, worst: int, replays: int = 20) -> None:
    """Capture dispatch + combine with num_worst_tokens in a CUDA graph; replay on changing inputs."""
    dev = fast.device
    e = case.num_experts
    xin, x, topk, w = device_inputs(case, rank, dev)
    sx, stopk, sw = x.clone(), topk.clone(), w.clone()
    per_rank, _, per_expert, in_rank, _ = fast.get_dispatch_layout(stopk, e)
    progress(rank, "graph: warm-up")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up (compiles kernels) outside the capture
            o = fast.dispatch(sx, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                              num_tokens_per_expert=per_expert, topk_idx=stopk, topk_weights=sw,
                              num_worst_tokens=worst)
            fast.combine(o[0], o[4], topk_weights=o[2])
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    torch.distributed.barrier()
    progress(rank, "graph: capture")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        p_rank, _, p_exp, p_in, _ = fast.get_dispatch_layout(stopk, e)
        o = fast.dispatch(sx, num_tokens_per_rank=p_rank, is_token_in_rank=p_in, num_tokens_per_expert=p_exp,
                          topk_idx=stopk, topk_weights=sw, num_worst_tokens=worst)
        comb, _, _ = fast.combine(o[0], o[4], topk_weights=o[2])
    failures = []
    for it in range(replays):
        c2 = Case(**{**case.__dict__, "seed": case.seed + 1000 + it})
        _, x2, t2, w2 = device_inputs(c2, rank, dev)
        sx.copy_(x2)
        stopk.copy_(t2)
        sw.copy_(w2)
        torch.distributed.barrier()
        progress(rank, f"graph: replay {it}")
        g.replay()
        torch.cuda.synchronize()
        # every collective of this replay first, then the checks: a rank whose check fails still
        # takes part in the others' collectives, and all replays run (a pattern across them says more)
        rr = _dispatch(ref, x2, t2, w2, e)
        ro, _, _ = ref.combine(rr[0], rr[4])
        abs_sum = ref.combine(rr[0].abs(), rr[4])[0].double()
        n = rr[0].shape[0]
        try:
            assert_bitwise(o[0][:n], rr[0], f"graph replay {it} recv_x {c2}")
            assert bool((o[1][n:] == -1).all()), f"graph replay {it}: recv_topk_idx padding rows are not -1"
            assert_within_budget(comb, ro.double(), abs_sum, ref.group_size + 2, f"graph replay {it} combine {c2}",
                                 extra_rel=2.0 ** -8)
        except AssertionError as err:
            failures.append(str(err))
    if failures:
        raise AssertionError(f"{len(failures)} of {replays} graph replays failed:\n" + "\n".join(failures))


def check_ht_combine_graph(ref: Buffer, fast: Buffer, cases: list[Case], rank: int, rounds: int = 8) -> None:
    """One combine alone per case (on an eager dispatch's handle), each captured in its own CUDA graph, as
    ``epcomm bench`` times them; the graphs replayed in turn ``rounds`` times, back to back, no
    synchronisation between: ranks drift apart, so a replay must not overwrite what a slower rank
    still reads, nor take another call's rows for its own. Each replay adds its output into its case's
    accumulator (captured too), which must end at ``rounds`` times the reference's combine."""
    dev = fast.device
    runs, graphs = [], []
    progress(rank, "combine graphs: capture")
    for case in cases:
        xin, _, topk, w = device_inputs(case, rank, dev)
        fr = _dispatch(fast, xin, topk, w, case.num_experts)
        y, h = fr[0].clone(), fr[4]
        acc = torch.zeros(xin.shape, dtype=torch.float32, device=dev)

        def step(y=y, h=h, acc=acc):
            comb = fast.combine(y, h)[0]
            acc.add_(comb.float())
            return comb

        g, comb = capture(step, warmup=2)
        acc.zero_()  # (the warm-up calls added to it)
        runs.append((case, xin, topk, w, y, h))  # (the graph reads y and h at every replay: kept alive)
        graphs.append((g, acc, comb.dtype))
    torch.distributed.barrier()
    progress(rank, f"combine graphs: {rounds} rounds of {len(graphs)}")
    for _ in range(rounds):
        for g, _, _ in graphs:
            g.replay()
    torch.cuda.synchronize()
    # replays of one combine give the same BF16 values, whose float32 sum (``rounds`` a power of two) is
    # exact: the mean is that BF16 combine, held to the dtype's budget; one bad replay moves it
    assert rounds & (rounds - 1) == 0, rounds
    failures = []
    for (case, xin, topk, w, _, _), (_, acc, dtype) in zip(runs, graphs):
        rr = _dispatch(ref, xin, topk, w, case.num_experts)
        ro, _, _ = ref.combine(rr[0], rr[4])
        abs_sum = ref.combine(rr[0].abs(), rr[4])[0].double()
        try:
            assert_within_budget((acc / rounds).to(dtype), ro.double(), abs_sum, ref.group_size + 2,
                                 f"{rounds} rounds of combine-only graph replays {case}")
        except AssertionError as err:
            failures.append(str(err))
    if failures:
        raise AssertionError("\n".join(failures))


def check_ht_stress(fast: Buffer, ref: Buffer, rank: int, num_ranks: int, iters: int,
                    seed: int = 5) -> Stress:
    """``iters`` dispatch + combine pairs with changing routings and sizes; every 50th and the last checked
    fully."""
    dev = fast.device
    t0 = time.perf_counter()
    checked, remote = 0, torch.zeros((), dtype=torch.int64, device=dev)
    for it in range(iters):
        tokens = tuple(int(v) for v in torch.randint(0, 300, (num_ranks,), generator=torch.Generator().manual_seed(it)))
        # routing, token counts and hot experts change every iteration; shapes stay (one compile)
        case = Case(num_ranks=num_ranks, tokens=tokens, hidden=512, num_topk=8, num_experts=8 * num_ranks,
                    seed=seed + it, hot_expert=it % 5 if it % 2 else None, drop_prob=0.05 * (it % 4))
        xin, x, topk, w = device_inputs(case, rank, dev)
        fr = _dispatch(fast, xin, topk, w, case.num_experts)
        fo, _, _ = fast.combine(fr[0], fr[4])
        remote += ht_remote_rows(fr[4].rank_prefix_matrix, rank)
        if it % 50 == 0 or it == iters - 1:
            checked += 1
            rr = _dispatch(ref, xin, topk, w, case.num_experts)
            assert_bitwise(fr[0], rr[0], f"stress {it} recv_x {case}")
            ro, _, _ = ref.combine(rr[0], rr[4])
            _combine_check(fo, ro, ref, rr[0], rr[4], f"stress {it} combine {case}")
    torch.cuda.synchronize()
    return Stress(iters, checked, int(remote), time.perf_counter() - t0)


# the low-latency checks, for the callers that find every check here
from .gpu_cases_ll import (  # noqa: E402
    check_ll_case,
    check_ll_graph,
    check_ll_stress,
    check_wait_stats,
    ll_inputs,
)

__all__ = ["check_ht_async", "check_ht_case", "check_ht_combine_graph", "check_ht_graph", "check_ht_no_topk",
           "check_ht_stress", "check_ll_case", "check_ll_graph", "check_ll_stress", "check_wait_stats", "capture",
           "device_inputs", "forced_backend", "ll_inputs", "make_buffers"]

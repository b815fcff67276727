"""Checks shared by the tier-2 modules: ranks that disagree on an argument every rank must pass alike (the
hidden size, the number of experts, the dtype, top-k, ``num_max_dispatch_tokens_per_rank`` /
``num_max_tokens_per_rank``, ...) get a ``ValueError`` on every rank naming the argument and each rank's value,
at the first call of the kind (``epcomm._agree``), and stay in step: a good call follows. Was: the exchange's
sizes differed, and gloo aborted one process in C++ ("Received data size doesn't match expected size") while
its peer lost it; the device backends read a peer's area in another layout.

In each scenario the last rank disagrees with the others. ``make(**kw)`` builds a ``Buffer`` on the backend
under test (``epcomm.Buffer`` for the reference; ``cpu_nvlink.nvlink_buffer``, ...); ``v2_cls`` an
``ElasticBuffer`` class whose engine runs it. Letters: ``T`` tokens, ``H`` hidden, ``E`` experts, ``M`` max
tokens a rank."""

from __future__ import annotations

import re

import pytest
import torch

from epcomm import Buffer, quant
from epcomm.testing.compare import assert_bitwise
from epcomm.testing.inputs import Case, expected_dispatch, make_topk, make_x

H, M = 128, 8


def _case(r: int) -> Case:
    return Case(num_ranks=r, tokens=(6,) * r, hidden=H, num_topk=2, num_experts=2 * r, seed=11)


def expect(ctx, name: str, mine, theirs, call: str):
    """The message of ``_agree`` on this rank: its value first, then the other ranks' (the last rank disagrees)."""
    last = ctx.world_size - 1
    if ctx.rank == last:
        others = list(range(last))
        who = f"rank {others[0]}" if len(others) == 1 else "ranks " + ", ".join(map(str, others))
        mine, theirs = theirs, mine
    else:
        who = f"rank {last}"
    return "^" + re.escape(f"{name}={mine} on rank {ctx.rank} but {theirs} on {who}") + r"(;.*)?" + re.escape(
        f": it must be the same on every rank ({call})") + "$"


def v1(ctx, make) -> None:
    """``Buffer``'s high-throughput calls, then the low-latency dispatch, on buffers of ``make``."""
    r, me = ctx.world_size, ctx.rank
    odd = me == r - 1
    case = _case(r)
    e = case.num_experts
    x, (idx, w) = make_x(case, me), make_topk(case, me)
    buf = make(num_nvl_bytes=32 << 20)
    good = dict(zip(("num_tokens_per_rank", "_", "num_tokens_per_expert", "is_token_in_rank"),
                    buf.get_dispatch_layout(idx, e)[:4]))
    del good["_"]

    def d(xx=x, **over):
        return buf.dispatch(xx, **{**good, "topk_idx": idx, "topk_weights": w, **over})

    # the number of experts: the last rank's layout is of twice as many (its ids are the same)
    lay = dict(zip(("num_tokens_per_rank", "_", "num_tokens_per_expert", "is_token_in_rank"),
                   buf.get_dispatch_layout(idx, 2 * e)[:4]))
    del lay["_"]
    for _ in range(2):  # (the same call again: still compared, its kind never agreed)
        with pytest.raises(ValueError, match=expect(ctx, "num_experts", e, 2 * e, "dispatch")):
            d(**(lay if odd else {}))
    # the hidden size, the dtype
    with pytest.raises(ValueError, match=expect(ctx, "x.shape[1]", H, H // 2, "dispatch")):
        d(x[:, :H // 2].contiguous() if odd else x)
    with pytest.raises(ValueError, match=expect(ctx, "x.dtype", torch.bfloat16, torch.float8_e4m3fn, "dispatch")):
        d(quant.per_token_cast_to_fp8(x) if odd else x)
    # top-k given or not (the rows carry the ids and weights)
    with pytest.raises(ValueError, match=expect(ctx, "topk_idx.shape[1]", 2, None, "dispatch")):
        d(topk_idx=None, topk_weights=None) if odd else d()
    recv_x, _, recv_w, _, handle, _ = d()  # in step
    assert_bitwise(recv_x, expected_dispatch(case, me)["recv_x"], "dispatch after the errors")
    with pytest.raises(ValueError, match=expect(ctx, "x.shape[1]", H, H // 2, "dispatch with a handle")):
        buf.dispatch(x[:, :H // 2].contiguous() if odd else x, handle=handle)
    for _ in range(2):
        with pytest.raises(ValueError, match=expect(ctx, "x.shape[1]", H, H // 2, "combine")):
            buf.combine(recv_x[:, :H // 2].contiguous() if odd else recv_x, handle)
    with pytest.raises(ValueError, match=expect(ctx, "topk_weights given", True, False, "combine")):
        buf.combine(recv_x, handle, topk_weights=None if odd else recv_w)
    out, _, _ = buf.combine(recv_x, handle)  # in step
    assert out.shape == x.shape, out.shape


def low_latency(ctx, make) -> None:
    """``low_latency_dispatch``: the number of experts, the hidden size, ``num_max_dispatch_tokens_per_rank``;
    then a good dispatch and combine; then a first call of another operation on the last rank."""
    r, me = ctx.world_size, ctx.rank
    odd = me == r - 1
    case = _case(r)
    e = case.num_experts
    x, (idx, w) = make_x(case, me), make_topk(case, me)
    hint = Buffer.get_low_latency_rdma_size_hint(2 * M, H, r, 2 * e)  # (fits every shape tried below)
    buf = make(num_rdma_bytes=hint, low_latency_mode=True)
    call = "low_latency_dispatch"
    with pytest.raises(ValueError, match=expect(ctx, "num_experts", e, 2 * e, call)):
        buf.low_latency_dispatch(x, idx, M, 2 * e if odd else e, use_fp8=False)
    with pytest.raises(ValueError, match=expect(ctx, "x.shape[1]", H, H // 2, call)):
        buf.low_latency_dispatch(x[:, :H // 2].contiguous() if odd else x, idx, M, e, use_fp8=False)
    with pytest.raises(ValueError, match=expect(ctx, "num_max_dispatch_tokens_per_rank", M, 2 * M, call)):
        buf.low_latency_dispatch(x, idx, 2 * M if odd else M, e, use_fp8=False)
    with pytest.raises(ValueError, match=expect(ctx, "use_fp8", False, True, call)):
        buf.low_latency_dispatch(x, idx, M, e, use_fp8=odd)
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, e, use_fp8=False)  # in step
    lx = e // r
    want = [sum(int((make_topk(case, s)[0] == me * lx + j).sum()) for s in range(r)) for j in range(lx)]
    assert count.tolist() == want, (count.tolist(), want)
    out, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
    assert out.shape == x.shape, out.shape
    # another operation's first call: named, not a mismatched exchange
    fresh = make(num_nvl_bytes=32 << 20, num_rdma_bytes=hint, low_latency_mode=True)
    lay = dict(zip(("num_tokens_per_rank", "_", "num_tokens_per_expert", "is_token_in_rank"),
                   fresh.get_dispatch_layout(idx, e)[:4]))
    del lay["_"]
    theirs = "low_latency_dispatch" if not odd else "dispatch"
    with pytest.raises(ValueError, match=f"calls (dispatch|low_latency_dispatch) but rank \\d+ calls {theirs}: every "
                                         "rank must make the same calls in the same order"):
        if odd:
            fresh.low_latency_dispatch(x, idx, M, e, use_fp8=False)
        else:
            fresh.dispatch(x, topk_idx=idx, topk_weights=w, **lay)


def v2(ctx, v2_cls) -> None:
    """``ElasticBuffer``'s dispatch (fresh and with a handle) and combine."""
    from epcomm.testing import elastic_cases as C

    r, me = ctx.world_size, ctx.rank
    odd = me == r - 1
    case = C.V2Case(num_ranks=r, tokens=(5,) * r, hidden=H, num_topk=2, num_experts=2 * r, seed=13)
    e, m = case.num_experts, case.m
    buf = v2_cls(ctx.group, num_max_tokens_per_rank=2 * m, hidden=H, num_topk=2)
    x, _, idx, w = C.inputs(case, me)
    call = "ElasticBuffer.dispatch"

    def d(xx=x, **over):
        return buf.dispatch(xx, **{"topk_idx": idx, "topk_weights": w, "num_experts": e, "num_max_tokens_per_rank": m,
                                   **over})

    with pytest.raises(ValueError, match=expect(ctx, "num_experts", e, 2 * e, call)):
        d(num_experts=2 * e if odd else e)
    with pytest.raises(ValueError, match=expect(ctx, "x.shape[1]", H, H // 2, call)):
        d(x[:, :H // 2].contiguous() if odd else x)
    with pytest.raises(ValueError, match=expect(ctx, "num_max_tokens_per_rank", m, 2 * m, call)):
        d(num_max_tokens_per_rank=2 * m if odd else m)
    rx, _, _, hd, _ = d()  # in step
    with pytest.raises(ValueError, match=expect(ctx, "x.shape[1]", H, H // 2, call + " with a handle")):
        buf.dispatch(x[:, :H // 2].contiguous() if odd else x, handle=hd, num_experts=e)
    with pytest.raises(ValueError, match=expect(ctx, "x.shape[1]", H, H // 2, "ElasticBuffer.combine")):
        buf.combine(rx[:, :H // 2].contiguous() if odd else rx, hd)
    out, _, _ = buf.combine(rx, hd)  # in step
    assert out.shape == x.shape, out.shape

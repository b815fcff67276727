"""Tier 2: ``ElasticBuffer`` (DeepEP V2's API) on gloo CPU ranks against the oracles of
``epcomm.testing.elastic_cases`` (every rank's inputs from one seed, expected rows written out by hand).

Dispatch bitwise for both layouts, alignment 1 and 4 (128 on one case), BF16 / FP8 with fp32 scales /
FP8 with opaque int32 packs, CPU sync and worst-case shapes (same valid rows), cached replays (same
rows), zero padding, a second dispatch equal to the first; combine bitwise with 0, 1 and 2 biases,
multiple reduction on and off, top-k weights back; FP8 dispatches where no rank receives a row (every lane
-1); every argument error of the spec's limits, each
followed by a working call. One launch per world size runs all checks (process start-up dominates).
"""

import pytest
import torch

from epcomm.testing.elastic_cases import check_combine, check_dispatch
from epcomm.testing.launcher import parallel_launch


def check_errors(buf, case, rank):
    """Every limit: a clear ValueError/TypeError naming the argument, and the buffer works afterwards."""
    from epcomm.event import EventHandle
    from epcomm.testing import elastic_cases as C

    x, _, idx, w = C.inputs(case, rank)
    e, m = case.num_experts, case.m
    ok = {"topk_idx": idx, "topk_weights": w, "num_experts": e, "num_max_tokens_per_rank": m}
    _, _, _, hd, _ = buf.dispatch(x, **ok)
    bad = [
        (dict(ok, num_experts=e + 1), ValueError, "num_experts"),
        (dict(ok, num_experts=None), ValueError, "num_experts"),
        (dict(ok, num_max_tokens_per_rank=max(case.tokens[rank] - 1, 1)), ValueError, "num_max_tokens_per_rank"),
        (dict(ok, topk_idx=idx.to(torch.int32)), TypeError, "topk_idx"),
        (dict(ok, topk_idx=torch.full_like(idx, e)), ValueError, "topk_idx"),
        (dict(ok, topk_idx=torch.zeros(idx.shape[0], 33, dtype=torch.int64), topk_weights=None), ValueError, "top-k"),
        (dict(ok, topk_weights=w.double()), TypeError, "topk_weights"),
        (dict(ok, do_zero_padding=True), ValueError, "do_zero_padding"),
        (dict(ok, previous_event=EventHandle()), ValueError, "allocate_on_comm_stream"),
        (dict(ok, previous_event=object(), allocate_on_comm_stream=True), TypeError, "previous_event"),
        (dict(ok, num_qps=buf.num_allocated_qps + 1), ValueError, "num_qps"),
        (dict(ok, expert_alignment=0), ValueError, "expert_alignment"),
        (dict(ok, cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int64)), TypeError, "cumulative"),
        (dict(ok, num_max_tokens_per_rank=1 << 20), ValueError, "num_bytes"),
        ({"handle": hd, "do_cpu_sync": True}, ValueError, "do_cpu_sync"),
        ({"handle": hd, "topk_idx": idx}, ValueError, "topk_idx"),
        ({"handle": hd, "num_experts": e * 2}, ValueError, "num_experts"),
        ({"handle": hd, "cumulative_local_expert_recv_stats": torch.zeros(e // case.num_ranks, dtype=torch.int32)},
         ValueError, "cumulative"),
    ]
    if case.num_topk > 1 and case.tokens[rank]:
        dup = idx.clone()
        dup[0, :] = 0
        bad.append((dict(ok, topk_idx=dup), ValueError, "repeats"))
    for i, (kw, exc, word) in enumerate(bad):
        with pytest.raises(exc, match=word):
            buf.dispatch(x, **kw)
    t = x.shape[0]
    with pytest.raises(ValueError, match=rf"sf has {t + 1} rows but x has {t}"):
        buf.dispatch((x.to(torch.float8_e4m3fn), torch.zeros(t + 1, 2)), **ok)
    with pytest.raises(ValueError, match=rf"x has {t - 1} rows but topk_idx has {t}"):  # x is named, not the ids
        buf.dispatch(x[1:], **ok)
    # DeepEP V2's dtypes: BF16, or FP8 with its scales
    with pytest.raises(TypeError, match=r"x must have dtype torch.bfloat16, or be the FP8 pair \(x, sf\), got "
                                        r"torch.float32"):
        buf.dispatch(x.float(), **ok)
    with pytest.raises(TypeError, match=r"x of the pair \(x, sf\) must have dtype torch.float8_e4m3fn, got "
                                        r"torch.bfloat16"):
        buf.dispatch((x, torch.ones(t, 2)), **ok)
    with pytest.raises(TypeError, match="x must have dtype torch.bfloat16, or be the FP8 pair"):
        buf.dispatch(x.float(), handle=hd)
    rx, _ridx, rw, hd, _ = buf.dispatch(x, **ok)  # still usable
    n = rx.shape[0]
    for kw, exc, word in [
        ({"x": rx.float(), "handle": hd}, TypeError, "x"),
        ({"x": rx[: max(n - 1, 0)], "handle": hd} if n else {"x": torch.zeros(1, case.hidden, dtype=torch.bfloat16),
                                                               "handle": hd}, ValueError, "rows"),
        ({"x": rx, "handle": hd, "topk_weights": rw[:, :1]}, ValueError, "topk_weights"),
        ({"x": rx, "handle": hd, "bias": (x, x, x)}, ValueError, "bias"),
        ({"x": rx, "handle": hd, "bias": x[:, :8].contiguous()}, ValueError, "bias"),
        ({"x": rx, "handle": "handle"}, TypeError, "handle"),
    ]:
        with pytest.raises(exc, match=word):
            buf.combine(**kw)
    buf.combine(rx, hd)  # still usable
    return len(bad)


def _all(ctx, seed):
    from epcomm import ElasticBuffer
    from epcomm.testing.elastic_cases import V2Case

    r, me = ctx.world_size, ctx.rank
    case = V2Case(num_ranks=r, tokens=tuple(7 + 3 * i if i != 1 else 0 for i in range(r)), num_experts=4 * r,
                  seed=seed)
    buf = ElasticBuffer(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden, num_topk=case.num_topk,
                        explicitly_destroy=True, num_cpu_timeout_secs=20)
    done = 0
    for expand in (False, True):
        for alignment, sync in ((1, True), (4, False), (4, True)):
            check_dispatch(buf, case, me, "bf16", expand, alignment, sync)
            done += 1
    for sf_kind in ("fp32", "ue8m0"):  # the scales: both layouts, synced and worst-case
        for expand, alignment, sync in ((False, 4, False), (True, 1, True), (True, 4, False)):
            check_dispatch(buf, case, me, sf_kind, expand, alignment, sync)
            done += 1
    check_dispatch(buf, case, me, "bf16", True, 128, False)
    none = V2Case(num_ranks=r, tokens=case.tokens, num_experts=4 * r, seed=seed, masked=1.0)  # every lane -1
    for sf_kind in ("fp32", "ue8m0"):  # no rank receives a row: no rows, no scales
        for expand, alignment, sync in ((False, 1, True), (False, 4, False), (True, 4, False)):
            check_dispatch(buf, none, me, sf_kind, expand, alignment, sync)
            done += 1
    for expand in (False, True):
        for n_bias in (0, 1, 2):
            check_combine(buf, case, me, expand, n_bias, 4 if expand else 1, n_bias != 1)
    done += check_errors(buf, V2Case(num_ranks=r, tokens=tuple(5 + i for i in range(r)), num_experts=4 * r,
                                     seed=seed), me)  # every rank has tokens: every bad value raises everywhere
    buf.destroy()
    single = ElasticBuffer(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden,
                           allow_multiple_reduction=False)
    for n_bias in (0, 2):
        check_combine(single, case, me, True, n_bias, 1, True)
    with pytest.raises(ValueError, match="allow_multiple_reduction"):
        x, _, idx, w = __import__("epcomm.testing.elastic_cases", fromlist=["x"]).inputs(case, me)
        _, _, rw, hd, _ = single.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=case.num_experts,
                                          do_expand=True)
        single.combine(torch.zeros(hd.num_expanded_tokens, case.hidden, dtype=torch.bfloat16), hd, topk_weights=rw)
    return done


@pytest.mark.parametrize("world", [3])
def test_elastic_buffer_against_the_oracle(world):
    res = parallel_launch(world, _all, 3, backend="gloo", timeout_s=240)
    assert all(n > 31 for n in res), res

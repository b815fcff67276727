"""Tier 1: the pieces of the benchmark's correctness check that need no process group: seeded
inputs, and the canonical order that makes two backends' low-latency results comparable."""

from __future__ import annotations

import torch

from epcomm import layout, quant
from epcomm.bench.cases import BenchCase
from epcomm.bench.workloads import canonical_ll, make_routing, make_x

CASE = BenchCase("t", "ll", 6, 128, 2, 4, drop_prob=0.2)


def test_inputs_are_seeded_random_and_distinct_per_rank_and_set():
    cpu = torch.device("cpu")
    x = make_x(CASE, 0, 0, cpu)
    assert x.dtype == torch.bfloat16 and x.shape == (6, 128) and bool((x != 0).any())
    assert torch.equal(x, make_x(CASE, 0, 0, cpu))
    assert not torch.equal(x, make_x(CASE, 1, 0, cpu)) and not torch.equal(x, make_x(CASE, 0, 1, cpu))
    idx, w = make_routing(CASE, 0, 0, cpu)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == (6, 2)
    for row in idx.tolist():  # distinct experts per token
        v = [e for e in row if e >= 0]
        assert len(v) == len(set(v)) and all(0 <= e < 4 for e in v)
    assert bool((w[idx < 0] == 0).all()) and bool((w[idx >= 0] > 0).all())


def _ll_result(order_within_block):
    """A fake low-latency FP8 result: L = 2, R = 2, M = 3. Expert 0 holds 2 rows from rank 0 then 1
    from rank 1; expert 1 holds 1 row from rank 1. ``order_within_block`` permutes rank 0's block."""
    lx, r_, m, h = 2, 2, 3, 128
    x = torch.randn(6, h).to(torch.bfloat16)
    q, s = quant.per_token_cast_to_fp8(x)
    rows = [(0, 0, 0, 1), (0, 1, 0, 2), (0, 2, 1, 0), (1, 0, 1, 2)]  # (expert, slot, src rank, src token)
    perm = dict(enumerate(order_within_block))  # slot -> slot, rank 0's block of expert 0
    recv_q = torch.zeros(lx, r_ * m, h, dtype=torch.float8_e4m3fn)
    recv_s = torch.zeros(lx, 4, r_ * m).transpose(1, 2)[:, :, :1]
    src_info = torch.full((lx, r_ * m), -1, dtype=torch.int32)
    for i, (e, slot, rank, tok) in enumerate(rows):
        slot = perm.get(slot, slot) if e == 0 else slot
        recv_q.view(torch.uint8)[e, slot] = q[i].view(torch.uint8)
        recv_s[e, slot] = s[i]
        src_info[e, slot] = tok
    begin = torch.tensor([[0, 2], [0, 0]])
    count = torch.tensor([[2, 1], [0, 1]])
    handle = layout.LowLatencyHandle(src_info, layout.layout_range(begin, count), m, h, 4)
    return (recv_q, recv_s), torch.tensor([3, 1], dtype=torch.int32), handle


def test_canonical_ll_ignores_the_order_within_a_source_block():
    torch.manual_seed(0)
    a = canonical_ll(*_ll_result((0, 1)))
    torch.manual_seed(0)
    b = canonical_ll(*_ll_result((1, 0)))
    for k in ("recv_count", "block_count", "key", "q", "scales"):
        assert torch.equal(a[k], b[k]), k
    assert a["key"].tolist() == sorted(a["key"].tolist()) and a["q"].shape == (4, 128)
    assert int(a["valid"].sum()) == 4

"""Tier 1: logical and link byte accounting, checked against a routing worked out by hand.

Routing (R = 2, E = 4, so L = 2: experts 0-1 on rank 0, 2-3 on rank 1; K = 2, H = 128)::

    rank 0: topk_idx = [[0, 3], [1, -1], [-1, -1]]   token 0 -> ranks 0, 1; token 1 -> rank 0
    rank 1: topk_idx = [[2, 3], [0, 1]]              token 0 -> rank 1;     token 1 -> rank 0

High-throughput counts (tokens once per destination rank): rank 0 sends [2, 1], rank 1 sends [1, 1].
Rank 0 receives 2 (own) + 1 (from rank 1) = 3 rows, 1 over the link; rank 1 receives 1 + 1 = 2,
1 over the link. BF16 row = 256 B; FP8 row = 128 + 4 = 132 B.

Low-latency messages (one per (token, expert)): rank 0 sends 2 to rank 0 (experts 0, 1) and 1 to
rank 1 (expert 3); rank 1 sends 2 to rank 0 (experts 0, 1) and 2 to rank 1 (2, 3).
"""

from __future__ import annotations

import pytest
import torch

from epcomm import layout
from epcomm.bench import accounting

TOPK = [torch.tensor([[0, 3], [1, -1], [-1, -1]]), torch.tensor([[2, 3], [0, 1]])]
R, E, H = 2, 4, 128


def ht_counts() -> torch.Tensor:
    return torch.stack([layout.dispatch_layout(t, E, R)[0] for t in TOPK])


def ll_counts() -> torch.Tensor:
    rows = []
    for t in TOPK:
        v = t[t >= 0]
        rows.append(torch.bincount(v // (E // R), minlength=R))
    return torch.stack(rows)


def test_row_bytes():
    assert accounting.row_bytes(7168, "bf16") == 14336
    assert accounting.row_bytes(7168, "fp8") == 7168 + 56 * 4
    assert accounting.row_bytes(128, "fp8") == 132
    with pytest.raises(ValueError, match="dtype"):
        accounting.row_bytes(128, "fp16")


def test_counts_match_the_hand_worked_routing():
    assert ht_counts().tolist() == [[2, 1], [1, 1]]
    assert ll_counts().tolist() == [[2, 1], [2, 2]]


def test_ht_dispatch_bytes():
    c = ht_counts()
    assert accounting.ht_dispatch_bytes(c, 0, H, "bf16") == (3 * 256, 1 * 256)
    assert accounting.ht_dispatch_bytes(c, 1, H, "bf16") == (2 * 256, 1 * 256)
    assert accounting.ht_dispatch_bytes(c, 0, H, "fp8") == (3 * 132, 1 * 132)


def test_ht_combine_bytes_are_the_dispatched_rows_going_back():
    c = ht_counts()
    assert accounting.ht_combine_bytes(c, 0, H) == (3 * 256, 256)
    assert accounting.ht_combine_bytes(c, 1, H) == (2 * 256, 256)


def test_ll_dispatch_bytes():
    c = ll_counts()
    assert accounting.ll_dispatch_bytes(c, 0, H) == (4 * 132, 2 * 132)  # 2 own + 2 from rank 1
    assert accounting.ll_dispatch_bytes(c, 1, H) == (3 * 132, 1 * 132)  # 1 from rank 0 + 2 own


def test_ll_combine_bytes_one_row_per_selection():
    # rank 0 has 3 valid selections, one (expert 3) on rank 1; rank 1 has 4, two (experts 0, 1) on rank 0
    assert accounting.ll_combine_bytes(TOPK[0], E, R, 0, H) == (3 * 256, 1 * 256)
    assert accounting.ll_combine_bytes(TOPK[1], E, R, 1, H) == (4 * 256, 2 * 256)


def test_gbps():
    assert accounting.gbps(2e9, 1.0) == pytest.approx(2.0)
    assert accounting.gbps(None, 1.0) is None
    assert accounting.gbps(10, 0.0) is None

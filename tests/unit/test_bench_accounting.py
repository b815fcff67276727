"""Tier 1: logical and link byte accounting, checked against a routing worked out by hand.

Routing (R = 2, E = 4, so L = 2: experts 0-1 on rank 0, 2-3 on rank 1; K = 2, H = 128)::

    rank 0: topk_idx = [[0, 3], [1, -1], [-1, -1]]   token 0 -> ranks 0, 1; token 1 -> rank 0; token 2 -> none
    rank 1: topk_idx = [[2, 3], [0, 1]]              token 0 -> rank 1;     token 1 -> rank 0 (two experts)

tokens = [3, 2]; tokens per destination rank (token_ranks) = [[2, 1], [1, 1]]; (token, expert)
selections per destination rank = [[2, 1], [2, 2]]. BF16 row = 256 B; FP8 row = 128 + 4 = 132 B.

The low-latency link figures are what kernels/ll.py writes (one message per (token, rank)): the old
count, one row per (token, expert), gives different numbers for every one of them (the asserts say
which), so a return to it fails here.
"""

from __future__ import annotations

import pytest
import torch

from epcomm import layout
from epcomm.bench import accounting

TOPK = [torch.tensor([[0, 3], [1, -1], [-1, -1]]), torch.tensor([[2, 3], [0, 1]])]
R, E, H, K = 2, 4, 128, 2
BF16, FP8 = 256, 132


@pytest.fixture
def rt() -> accounting.Routing:
    return accounting.Routing.from_rows(torch.stack([accounting.local_routing(t, E, R) for t in TOPK]))


def test_row_bytes():
    assert accounting.row_bytes(7168, "bf16") == 14336
    assert accounting.row_bytes(7168, "fp8") == 7168 + 56 * 4
    assert accounting.row_bytes(128, "fp8-worst") == 132  # a padded dispatch moves the same rows
    with pytest.raises(ValueError, match="dtype"):
        accounting.row_bytes(128, "fp16")


def test_routing_matches_the_hand_worked_counts(rt):
    assert rt.tokens.tolist() == [3, 2]
    assert rt.token_ranks.tolist() == [[2, 1], [1, 1]]
    assert rt.selections.tolist() == [[2, 1], [2, 2]]
    # the tokens per rank are high-throughput's num_tokens_per_rank
    assert rt.token_ranks.tolist() == [layout.dispatch_layout(t, E, R)[0].tolist() for t in TOPK]
    with pytest.raises(ValueError, match="routing rows"):
        accounting.Routing.from_rows(torch.zeros(2, 4, dtype=torch.int64))


def test_logical_bytes_are_deepeps_convention(rt):
    lg = accounting.logical_bytes
    assert lg("ht", "dispatch", "bf16", rt, 0, H) == 3 * BF16  # 2 own + 1 from rank 1
    assert lg("ht", "dispatch", "fp8", rt, 1, H) == 2 * FP8
    assert lg("ht", "combine", "bf16", rt, 0, H) == 3 * BF16
    # low-latency: per valid selection of the rank's own tokens; FP8 messages count 16 B more (DeepEP's test)
    assert lg("ll", "dispatch", "fp8", rt, 0, H) == 3 * (FP8 + 16)
    assert lg("ll", "dispatch", "fp8", rt, 1, H) == 4 * (FP8 + 16)
    assert lg("ll", "combine", "bf16", rt, 0, H) == 3 * BF16   # rank 0's 3 valid selections
    assert lg("ll", "combine", "bf16", rt, 1, H) == 4 * BF16


def test_low_latency_link_counts_messages_per_token_and_rank(rt):
    lk = accounting.link_bytes
    # into rank 0 from rank 1: both tokens' ids (2 x 128 B) and token 1's row once (it selects two experts
    # of rank 0): 388 B; one row per selection would be 2 x 132 = 264 B
    assert lk("ll-rank-messages", "dispatch", "fp8", rt, 0, H, K) == 2 * 128 + FP8 == 388
    # into rank 1 from rank 0: three tokens' ids, token 0's row (expert 3): 516 B (per selection: 132)
    assert lk("ll-rank-messages", "dispatch", "fp8", rt, 1, H, K) == 3 * 128 + FP8 == 516
    # combine into rank 0: rank 1's (id, weight) pairs of its 2 tokens (2 x 256 B), and one float32
    # partial sum (4 * 128 B) for rank 0's token 0 from rank 1: 1024 B (per selection: 1 x 256)
    assert lk("ll-rank-messages", "combine", "bf16", rt, 0, H, K) == 2 * 256 + 4 * H == 1024
    assert lk("ll-rank-messages", "combine", "bf16", rt, 1, H, K) == 3 * 256 + 4 * H == 1280


def test_per_selection_links(rt):
    lk = accounting.link_bytes
    assert lk("per-selection", "dispatch", "fp8", rt, 0, H, K) == 2 * FP8
    assert lk("per-selection", "dispatch", "bf16", rt, 1, H, K) == 1 * BF16
    assert lk("per-selection", "combine", "bf16", rt, 0, H, K) == 1 * BF16  # expert 3 sends token 0 back
    assert lk("per-selection", "combine", "bf16", rt, 1, H, K) == 2 * BF16
    # the reference's low-latency rows carry a 4 B token index on dispatch
    assert lk("ll-reference-rows", "dispatch", "fp8", rt, 0, H, K) == 2 * (FP8 + 4)
    assert lk("ll-reference-rows", "combine", "bf16", rt, 1, H, K) == 2 * BF16


def test_high_throughput_links(rt):
    lk = accounting.link_bytes
    side = 12 * K  # int64 ids + float32 weights per row
    # copy engine: rank 1's whole batch (2 rows) lands in rank 0, rank 0's (3 rows) in rank 1
    assert lk("ht-whole-batch", "dispatch", "bf16", rt, 0, H, K) == 2 * (BF16 + side)
    assert lk("ht-whole-batch", "dispatch", "fp8", rt, 1, H, K) == 3 * (FP8 + side)
    assert lk("ht-whole-batch", "dispatch", "bf16", rt, 0, H, K, cached=True) == 2 * BF16
    # SM push: only the rows each rank needs (rank 1's token 1 for rank 0; rank 0's token 0 for rank 1)
    assert lk("ht-rank-rows", "dispatch", "bf16", rt, 0, H, K) == 1 * (BF16 + side)
    assert lk("ht-rank-rows", "dispatch", "fp8", rt, 1, H, K) == 1 * (FP8 + side)
    assert lk("ht-reference-rows", "dispatch", "bf16", rt, 0, H, K) == BF16 + side + 4
    assert lk("ht-reference-rows", "dispatch", "fp8", rt, 0, H, K, cached=True) == FP8
    for counting in ("ht-whole-batch", "ht-rank-rows", "ht-reference-rows"):
        # combine: each row a rank sent out comes back once (rank 0's token 0 from rank 1, rank 1's token 1)
        assert lk(counting, "combine", "bf16", rt, 0, H, K) == BF16
        assert lk(counting, "combine", "bf16", rt, 1, H, K) == BF16
    with pytest.raises(ValueError, match="counting"):
        lk("per-expert", "dispatch", "bf16", rt, 0, H, K)


def test_one_rank_moves_nothing_over_a_link():
    one = accounting.Routing.from_rows(accounting.local_routing(torch.tensor([[0, 1], [2, 3]]), E, 1).unsqueeze(0))
    for counting in accounting.COUNTINGS:
        assert accounting.link_bytes(counting, "dispatch", "fp8", one, 0, H, K) == 0


def test_link_counting_follows_the_backend_and_how_it_moved_bytes():
    lc = accounting.link_counting
    assert lc("nvlink", "ll") == lc("internode", "ll") == "ll-rank-messages"
    assert lc("nvlink", "ht") == "ht-rank-rows"                    # the default: SM push, eager too
    assert lc("nvlink", "ht", ht_transfer="ce") == "ht-whole-batch"  # eager with the copy engine
    assert lc("nvlink", "ht", graph=True, ht_transfer="ce") == "ht-rank-rows"  # captured: SM push
    assert lc("reference", "ht") == "ht-reference-rows" and lc("reference", "ll") == "ll-reference-rows"
    assert lc("gloo-a2a", "ll") == lc("nccl-a2a", "ht") == "per-selection"
    assert lc("internode", "ht") is None  # no rule written down: the row says "not modelled"


def test_mean_and_gbps(rt):
    assert accounting.mean_bytes([rt, rt], lambda r: int(r.tokens.sum())) == 5
    assert accounting.gbps(2e9, 1.0) == pytest.approx(2.0)
    assert accounting.gbps(None, 1.0) is None
    assert accounting.gbps(10, 0.0) is None

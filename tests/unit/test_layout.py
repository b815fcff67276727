"""Tier 1 (no process group): the routing math of ``epcomm.layout`` and the reference backend's
``_block_rows`` against hand-worked examples. Every expected value below is written out by hand
from the definitions in docs/api.md and the docstrings, not computed by the code under test.

Covers: dispatch_layout, send_order, channel_ranges, channel_prefix_matrix, rank_prefix_matrix,
recv_channel_prefix_matrix, send_head, local_topk, align_up, low_latency_sends, layout_range
pack/unpack, reference._block_rows, low_latency_buffer_layout.
"""

from __future__ import annotations

import pytest
import torch

from epcomm import layout
from epcomm.backends.reference import _block_rows

T_, F_ = True, False


def i64(rows):
    return torch.tensor(rows, dtype=torch.int64)


def i32(rows):
    return torch.tensor(rows, dtype=torch.int32)


def exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    assert torch.equal(actual, expected), f"\n{actual}\n!=\n{expected}"


# Example B (R = 3, E = 6, L = 2, T = 5, K = 3): expert e lives on rank e // 2.
TOPK_B = i64([[0, 1, 5],      # token 0: experts 0, 1 (rank 0) and 5 (rank 2)  -> ranks {0, 2}
              [2, -1, 3],     # token 1: experts 2, 3 (both rank 1)             -> ranks {1}
              [-1, -1, -1],   # token 2: no expert                              -> nowhere
              [4, 0, -1],     # token 3: experts 4 (rank 2), 0 (rank 0)         -> ranks {0, 2}
              [5, 4, 2]])     # token 4: experts 5, 4 (rank 2), 2 (rank 1)      -> ranks {1, 2}
IN_RANK_B = torch.tensor([[T_, F_, T_],
                          [F_, T_, F_],
                          [F_, F_, F_],
                          [T_, F_, T_],
                          [F_, T_, T_]])


# ----------------------------------------------------------------------------- dispatch_layout


def test_dispatch_layout_docstring_example():
    per_rank, per_expert, in_rank = layout.dispatch_layout(i64([[0, 3], [1, -1], [-1, -1]]), 4, 2)
    exact(per_rank, i32([2, 1]))
    exact(per_expert, i32([1, 1, 0, 1]))
    exact(in_rank, torch.tensor([[T_, T_], [T_, F_], [F_, F_]]))


def test_dispatch_layout_example_b_counts_a_token_once_per_rank():
    per_rank, per_expert, in_rank = layout.dispatch_layout(TOPK_B, 6, 3)
    # token 0 has two experts on rank 0 and token 4 two on rank 2: each still counts once there.
    exact(per_rank, i32([2, 2, 3]))
    # per (token, k) entry: e0 <- t0,t3; e1 <- t0; e2 <- t1,t4; e3 <- t1; e4 <- t3,t4; e5 <- t0,t4
    exact(per_expert, i32([2, 1, 2, 1, 2, 2]))
    exact(in_rank, IN_RANK_B)


def test_dispatch_layout_empty_inputs():
    per_rank, per_expert, in_rank = layout.dispatch_layout(torch.empty(0, 4, dtype=torch.int64), 8, 2)
    exact(per_rank, i32([0, 0]))
    exact(per_expert, i32([0] * 8))
    assert in_rank.shape == (0, 2) and in_rank.dtype == torch.bool
    # K = 0: tokens exist but go nowhere
    per_rank, per_expert, in_rank = layout.dispatch_layout(torch.empty(3, 0, dtype=torch.int64), 4, 2)
    exact(per_rank, i32([0, 0]))
    exact(in_rank, torch.zeros(3, 2, dtype=torch.bool))


# ----------------------------------------------------------------------------- send order / channels


def test_send_order():
    exact(layout.send_order(torch.tensor([[T_, T_], [T_, F_], [F_, T_]])), i64([0, 1, 0, 2]))
    # Example B: rank 0 gets t0, t3; rank 1 gets t1, t4; rank 2 gets t0, t3, t4.
    exact(layout.send_order(IN_RANK_B), i64([0, 3, 1, 4, 0, 3, 4]))
    exact(layout.send_order(torch.zeros(0, 3, dtype=torch.bool)), i64([]))


def test_channel_ranges():
    exact(layout.channel_ranges(5, 2), i64([0, 0, 0, 1, 1]))      # ceil(5/2) = 3 tokens per channel
    exact(layout.channel_ranges(5, 3), i64([0, 0, 1, 1, 2]))      # ceil(5/3) = 2
    exact(layout.channel_ranges(3, 8), i64([0, 1, 2]))            # more channels than tokens
    exact(layout.channel_ranges(0, 4), i64([]))


def test_channel_prefix_matrix_docstring_example():
    in_rank = torch.tensor([[T_], [F_], [T_], [T_]])  # T = 4, rank 0 gets tokens {0, 2, 3}
    exact(layout.channel_prefix_matrix(in_rank, 2), i32([[1, 3]]))


def test_channel_prefix_matrix_example_b():
    # C = 2: channel 0 = tokens 0..2, channel 1 = tokens 3..4
    exact(layout.channel_prefix_matrix(IN_RANK_B, 2), i32([[1, 2],     # rank 0: t0 | t3
                                                           [1, 2],     # rank 1: t1 | t4
                                                           [1, 3]]))   # rank 2: t0 | t3, t4
    # C = 3: channels {t0, t1}, {t2, t3}, {t4}
    exact(layout.channel_prefix_matrix(IN_RANK_B, 3), i32([[1, 2, 2],
                                                           [1, 1, 2],
                                                           [1, 2, 3]]))
    # C = 8 > T: one token per channel, channels 5..7 empty
    exact(layout.channel_prefix_matrix(IN_RANK_B, 8), i32([[1, 1, 1, 2, 2, 2, 2, 2],
                                                           [0, 1, 1, 1, 2, 2, 2, 2],
                                                           [1, 1, 1, 2, 3, 3, 3, 3]]))
    exact(layout.channel_prefix_matrix(torch.zeros(0, 2, dtype=torch.bool), 3), i32([[0, 0, 0], [0, 0, 0]]))


# ----------------------------------------------------------------------------- prefix matrices


def test_rank_prefix_matrix():
    counts = i64([[2, 2, 3],   # rank 0 sends 2, 2, 3 tokens to ranks 0, 1, 2
                  [1, 0, 4],
                  [0, 3, 1]])
    exact(layout.rank_prefix_matrix(counts), i32([[2, 2, 3],
                                                  [3, 2, 7],
                                                  [3, 5, 8]]))


def test_recv_channel_prefix_matrix():
    rank_prefix = i32([[2, 2, 3], [3, 2, 7], [3, 5, 8]])
    # Receiver is rank 2: rank 0's rows start at 0, rank 1's at 3, rank 2's at 7.
    # Each source's inclusive channel prefix towards rank 2 (C = 2):
    #   rank 0 sends 3 tokens: 1 in ch0, 2 in ch1;  rank 1 sends 4, all in ch0;  rank 2 sends 1, in ch1.
    recv_cp = i64([[1, 3], [4, 4], [0, 1]])
    exact(layout.recv_channel_prefix_matrix(rank_prefix, recv_cp, 2), i32([[0, 1],
                                                                            [3, 7],
                                                                            [7, 7]]))
    # Receiver rank 0 (column [2, 3, 3]): starts 0, 2, 3; rank 2 sends it nothing.
    recv_cp0 = i64([[2, 2], [0, 1], [0, 0]])
    exact(layout.recv_channel_prefix_matrix(rank_prefix, recv_cp0, 0), i32([[0, 2],
                                                                             [2, 2],
                                                                             [3, 3]]))


def test_send_head():
    # Example B's tokens as rank 1's batch; rank 0 sends 4, 1, 2 tokens to ranks 0, 1, 2 first.
    rank_prefix = i32([[4, 1, 2], [6, 3, 5], [6, 4, 6]])
    exact(layout.send_head(IN_RANK_B, rank_prefix, 1), i32([[4, -1, 2],
                                                            [-1, 1, -1],
                                                            [-1, -1, -1],
                                                            [5, -1, 3],
                                                            [-1, 2, 4]]))
    # The same tokens as rank 0's batch: no earlier rank, rows start at 0 on every receiver.
    exact(layout.send_head(IN_RANK_B, rank_prefix, 0), i32([[0, -1, 0],
                                                            [-1, 0, -1],
                                                            [-1, -1, -1],
                                                            [1, -1, 1],
                                                            [-1, 1, 2]]))


def test_local_topk():
    idx = i64([[0, 1, 5], [4, 0, -1], [5, 4, 2]])
    w = torch.tensor([[0.5, 0.25, 0.125], [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    # rank 2 of L = 2 owns experts 4, 5 -> local 0, 1
    li, lw = layout.local_topk(idx, w, 2, 2)
    exact(li, i64([[-1, -1, 1], [0, -1, -1], [1, 0, -1]]))
    exact(lw, torch.tensor([[0.0, 0.0, 0.125], [1.0, 0.0, 0.0], [4.0, 5.0, 0.0]]))
    # rank 0 owns experts 0, 1; no weights given
    li, lw = layout.local_topk(idx, None, 0, 2)
    exact(li, i64([[0, 1, -1], [-1, 0, -1], [-1, -1, -1]]))
    assert lw is None


def test_align_up():
    exact(layout.align_up(i64([0, 1, 4, 5, 7]), 4), i64([0, 4, 4, 8, 8]))
    exact(layout.align_up(i64([0, 3]), 1), i64([0, 3]))


# ----------------------------------------------------------------------------- low-latency layout


def test_low_latency_sends_docstring_example():
    s = layout.low_latency_sends(i64([[2, 0], [0, -1]]), 4)
    exact(s.expert, i64([0, 0, 2]))
    exact(s.token, i64([0, 1, 0]))
    exact(s.k, i64([1, 0, 0]))
    exact(s.per_expert, i64([2, 0, 1, 0]))


def test_low_latency_sends_example_b():
    s = layout.low_latency_sends(TOPK_B, 6)
    # one message per valid (token, k), sorted by expert then (token, k):
    # e0: (0,0) (3,1) | e1: (0,1) | e2: (1,0) (4,2) | e3: (1,2) | e4: (3,0) (4,1) | e5: (0,2) (4,0)
    exact(s.expert, i64([0, 0, 1, 2, 2, 3, 4, 4, 5, 5]))
    exact(s.token, i64([0, 3, 0, 1, 4, 1, 3, 4, 0, 4]))
    exact(s.k, i64([0, 1, 1, 0, 2, 2, 0, 1, 2, 0]))
    exact(s.per_expert, i64([2, 1, 2, 1, 2, 2]))
    empty = layout.low_latency_sends(torch.empty(0, 3, dtype=torch.int64), 6)
    assert empty.token.numel() == 0 and empty.expert.numel() == 0
    exact(empty.per_expert, i64([0] * 6))
    none = layout.low_latency_sends(i64([[-1, -1]]), 2)
    exact(none.per_expert, i64([0, 0]))


def test_layout_range_pack_unpack():
    begin = i64([[0, 3], [5, 0]])
    count = i64([[3, 2], [0, 7]])
    packed = layout.layout_range(begin, count)
    exact(packed, i64([[3, (3 << 32) | 2], [5 * 4294967296, 7]]))
    assert int(packed[0, 1]) == 12884901890 and int(packed[1, 0]) == 21474836480
    b, c = layout.unpack_layout_range(packed)
    exact(b, begin)
    exact(c, count)
    # int32 inputs are widened; large values survive
    p = layout.layout_range(i32([1, 70000]), i32([5, 2**31 - 1]))
    exact(p, i64([4294967301, (70000 << 32) + 2**31 - 1]))
    b, c = layout.unpack_layout_range(p)
    exact(b, i64([1, 70000]))
    exact(c, i64([5, 2**31 - 1]))


def test_block_rows_docstring_example():
    cnt = i64([[1, 2], [0, 1]])
    begin = cnt.cumsum(1) - cnt
    exact(begin, i64([[0, 1], [0, 0]]))
    row_l, slot = _block_rows(cnt, begin)
    exact(row_l, i64([0, 0, 0, 1]))
    exact(slot, i64([0, 1, 2, 0]))


def test_block_rows_three_ranks():
    # L = 2, R = 3. Expert 0 gets 2 rows from rank 0 and 1 from rank 2; expert 1 gets 1 from rank 0
    # and 1 from rank 1. begin = [[0, 2, 2], [0, 1, 2]]. Rows arrive rank by rank, expert by expert:
    # (r0,e0) x2 -> slots 0, 1; (r0,e1) -> slot 0; (r1,e1) -> slot 1; (r2,e0) -> slot 2.
    cnt = i64([[2, 0, 1], [1, 1, 0]])
    begin = i64([[0, 2, 2], [0, 1, 2]])
    row_l, slot = _block_rows(cnt, begin)
    exact(row_l, i64([0, 0, 1, 1, 0]))
    exact(slot, i64([0, 1, 0, 1, 2]))
    row_l, slot = _block_rows(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64))
    assert row_l.numel() == 0 and slot.numel() == 0


def test_low_latency_buffer_layout_hand_worked():
    # M = 4, H = 256, R = 2, E = 4: G = 2; message = align16(max(512, 256 + 8) + 32 ids * 4) = 640 bytes
    lay = layout.low_latency_buffer_layout(4, 256, 2, 4)
    assert lay.dispatch_msg_bytes == 640
    assert lay.dispatch_src_bytes == 2688     # 128-byte header + 4 * 640
    assert lay.dispatch_area == 5376          # 2 sources
    assert lay.weights_area == 2048           # 2 * 4 * 32 * (4 + 4)
    assert lay.slot_area == 1024              # 2 * 4 * 32 * 4
    assert lay.combine_area == 8192           # 2 * 4 * 256 * 4
    assert lay.signal_area == 128             # 2 * 16 + 64 = 96 -> 128
    assert lay.parity_bytes == 16768
    assert lay.parity_offset(0) == 0 and lay.parity_offset(1) == 16768
    assert (lay.weights_offset, lay.slot_offset, lay.combine_offset, lay.signal_offset) == (5376, 7424, 8448, 16640)
    assert lay.zero_copy_offset == 33536
    assert lay.zero_copy_bytes == 8192        # L=2 * R*M=8 * H=256 * 2 bytes
    assert lay.total == 41728


def test_low_latency_buffer_layout_rounds_up_to_128():
    # M = 3, H = 136, R = 3, E = 6: G = 2; message = align16(max(272, 144) + 128) = 400
    lay = layout.low_latency_buffer_layout(3, 136, 3, 6)
    assert lay.dispatch_msg_bytes == 400
    assert lay.dispatch_src_bytes == 1408     # 128 + 3 * 400 = 1328 -> 11 * 128
    assert lay.dispatch_area == 4224
    assert lay.weights_area == 2304           # 3 * 3 * 32 * 8
    assert lay.slot_area == 1152              # 3 * 3 * 32 * 4
    assert lay.combine_area == 4992           # 9 * 136 * 4 = 4896 -> 39 * 128
    assert lay.signal_area == 128             # 3 * 16 + 64 = 112 -> 128
    assert lay.parity_bytes == 12800
    assert lay.zero_copy_offset == 25600
    assert lay.zero_copy_bytes == 4992        # 2 * 9 * 136 * 2 = 4896 -> 39 * 128
    assert lay.total == 30592


@pytest.mark.parametrize("m,h,r,e", [(1, 128, 1, 1), (7, 136, 3, 9), (128, 7168, 8, 256), (33, 2048, 5, 10)])
def test_low_latency_buffer_layout_regions_do_not_overlap(m, h, r, e):
    lay = layout.low_latency_buffer_layout(m, h, r, e)
    assert lay.total % 128 == 0 and lay.parity_bytes % 128 == 0
    areas = [f for f in lay._fields if f.endswith("_area")]
    assert {"dispatch_area", "weights_area", "slot_area", "combine_area", "signal_area"} <= set(areas)
    assert all(getattr(lay, f) % 128 == 0 for f in areas), "every area starts 128-byte aligned"
    assert lay.parity_bytes == sum(getattr(lay, f) for f in areas)
    assert lay.dispatch_area >= r * m * lay.dispatch_msg_bytes
    assert lay.dispatch_msg_bytes >= 2 * h + 32 * 4      # a BF16 row plus 32 expert ids fits
    assert lay.combine_area >= r * m * h * 4
    assert lay.zero_copy_offset >= lay.parity_offset(1) + lay.parity_bytes
    assert lay.zero_copy_bytes >= (e // r) * r * m * h * 2
    assert lay.total >= lay.zero_copy_offset + lay.zero_copy_bytes


def test_reference_pack_round_trip_with_one_row():
    """One token whose packed row mixes dtypes (bf16 row, fp32 scales, int64 ids): the unpacked parts
    must come back exactly, though a one-row column slice keeps the packed row's stride (14436 bytes
    at hidden 7168 once, which view(int64) rejected)."""
    from epcomm.backends.reference import _pack, _unpack

    for rows in (1, 3):
        x = torch.randn(rows, 7168).to(torch.bfloat16)
        s = torch.rand(rows, 56)
        k = torch.arange(rows * 8, dtype=torch.int64).view(rows, 8)
        w = torch.rand(rows, 1)
        parts = _unpack(_pack([x, s, w, k]), [(torch.bfloat16, (7168,)), (torch.float32, (56,)),
                                              (torch.float32, (1,)), (torch.int64, (8,))])
        for got, want in zip(parts, (x, s, w, k)):
            assert torch.equal(got, want)


def test_tokens_per_node_example_and_errors():
    in_rank = torch.tensor([[1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert layout.tokens_per_node(in_rank, 2).tolist() == [2, 2]
    assert layout.tokens_per_node(in_rank, 1).tolist() == in_rank.sum(0).tolist()  # a node per rank
    assert layout.tokens_per_node(in_rank, 4).tolist() == [3]
    with pytest.raises(ValueError, match="ranks_per_node=3 must divide the 4 ranks"):
        layout.tokens_per_node(in_rank, 3)

"""Routing math for dispatch and combine, in pure torch (any device, no process group).

Letters: ``T`` tokens on this rank, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E / R`` local
experts, ``C`` channels, ``N`` received tokens, ``M`` low-latency max tokens per rank.

Expert ``e`` lives on rank ``e // L``. A token goes once to every rank holding at least one of its
experts; ``-1`` in ``topk_idx`` means "no expert".

Example (R = 2, E = 4, so L = 2; T = 3, K = 2)::

    topk_idx = [[0, 3],     token 0 -> experts 0 (rank 0) and 3 (rank 1)
                [1, -1],    token 1 -> expert 1 (rank 0)
                [-1, -1]]   token 2 -> nowhere
    is_token_in_rank      = [[T, T], [T, F], [F, F]]
    num_tokens_per_rank   = [2, 1]
    num_tokens_per_expert = [1, 1, 0, 1]
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class DispatchHandle(NamedTuple):
    """Layout of one high-throughput dispatch; positions match DeepEP's intranode handle.

    - ``rank_prefix_matrix int32[R, R]``: ``[i][j]`` = tokens ranks ``0..i`` send to rank ``j``.
    - ``channel_prefix_matrix int32[R, C]``: ``[j][c]`` = tokens this rank sends to rank ``j`` from
      channels ``0..c`` (inclusive prefix; channel ``c`` covers tokens ``[c*ceil(T/C), (c+1)*ceil(T/C))``).
    - ``recv_channel_prefix_matrix int32[R, C]``: ``[i][c]`` = first row of ``recv_x`` holding rank
      ``i``'s channel ``c``.
    - ``recv_src_idx int32[N]``: index of each received row in its sender's batch.
    - ``is_token_in_rank bool[T, R]``.
    - ``send_head int32[T, R]``: ``[t][j]`` = row of rank ``j``'s ``recv_x`` holding token ``t``, ``-1``
      if not sent there.
    """

    rank_prefix_matrix: torch.Tensor
    channel_prefix_matrix: torch.Tensor
    recv_channel_prefix_matrix: torch.Tensor
    recv_src_idx: torch.Tensor
    is_token_in_rank: torch.Tensor
    send_head: torch.Tensor


class LowLatencyHandle(NamedTuple):
    """Layout of one low-latency dispatch; positions match DeepEP's.

    - ``recv_src_info int32[L, R*M]``: the token's index in its sender's batch.
    - ``layout_range int64[L, R]``: ``(begin << 32) | count`` of source rank ``r``'s block in expert ``l``.
    """

    recv_src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


def tokens_per_node(is_token_in_rank: torch.Tensor, ranks_per_node: int) -> torch.Tensor:
    """``int32[R / N]``: how many tokens go to at least one rank of each node (node ``n`` holds ranks
    ``[n*N, (n+1)*N)``, ``N = ranks_per_node``): DeepEP's ``num_tokens_per_rdma_rank``.

    Example: ``is_token_in_rank = [[1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 1, 1]]``, ``N = 2`` -> ``[2, 2]``
    (token 0 goes to both nodes, token 1 to node 0, token 2 to node 1).
    """
    t, r = is_token_in_rank.shape
    if ranks_per_node < 1 or r % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide the {r} ranks")
    return is_token_in_rank.view(t, r // ranks_per_node, ranks_per_node).any(2).sum(0).to(torch.int32)


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """``topk_idx int64[T, K]`` → ``(num_tokens_per_rank int32[R], num_tokens_per_expert int32[E],
    is_token_in_rank bool[T, R])``. Each (token, k) entry counts for its expert; a token counts once
    per rank."""
    t = topk_idx.shape[0]
    per_rank = num_experts // num_ranks
    valid = (topk_idx >= 0) & (topk_idx < num_experts)  # out-of-range ids are the caller's to report
    experts = topk_idx.masked_fill(~valid, 0)
    num_tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64, device=topk_idx.device)
    num_tokens_per_expert.index_add_(0, experts.flatten(), valid.flatten().to(torch.int64))
    is_token_in_rank = torch.zeros(t, num_ranks, dtype=torch.bool, device=topk_idx.device)
    if t > 0 and topk_idx.shape[1] > 0:
        ranks = torch.where(valid, experts // per_rank, num_ranks)  # invalid -> spill column
        spill = torch.zeros(t, num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
        spill.scatter_(1, ranks, True)
        is_token_in_rank = spill[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int64)
    return num_tokens_per_rank.to(torch.int32), num_tokens_per_expert.to(torch.int32), is_token_in_rank


def send_order(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """Token indices in send order: all tokens for rank 0 ascending, then rank 1, ... → ``int64[S]``.

    Example: ``is_token_in_rank = [[T, T], [T, F], [F, T]]`` → ``[0, 1, 0, 2]``.
    """
    return is_token_in_rank.t().nonzero()[:, 1].contiguous()


def channel_ranges(num_tokens: int, num_channels: int, device=None) -> torch.Tensor:
    """Channel id of every token: ``int64[T]``; channel ``c`` covers ``[c*ceil(T/C), (c+1)*ceil(T/C))``."""
    per = max((num_tokens + num_channels - 1) // num_channels, 1)
    return torch.arange(num_tokens, device=device or "cpu") // per


def channel_prefix_matrix(is_token_in_rank: torch.Tensor, num_channels: int) -> torch.Tensor:
    """``int32[R, C]``: inclusive prefix over channels of tokens sent to each rank.

    Example: T = 4, C = 2, tokens to rank 0 = {0, 2, 3} → channel counts [1, 2] → row [1, 3].
    """
    t, r = is_token_in_rank.shape
    ch = channel_ranges(t, num_channels, is_token_in_rank.device)
    counts = torch.zeros(num_channels, r, dtype=torch.int64, device=is_token_in_rank.device)
    counts.index_add_(0, ch, is_token_in_rank.to(torch.int64))
    return counts.t().cumsum(1).to(torch.int32).contiguous()


def rank_prefix_matrix(counts: torch.Tensor) -> torch.Tensor:
    """``counts[i][j]`` = tokens rank ``i`` sends to rank ``j`` → inclusive prefix over ``i`` (int32)."""
    return counts.to(torch.int64).cumsum(0).to(torch.int32)


def recv_channel_prefix_matrix(rank_prefix: torch.Tensor, recv_channel_prefix: torch.Tensor, rank: int):
    """First ``recv_x`` row of each (source rank, channel): ``int32[R, C]``.

    ``recv_channel_prefix[i]`` is source rank ``i``'s ``channel_prefix_matrix[rank]`` (inclusive).
    """
    col = rank_prefix[:, rank].to(torch.int64)
    start = torch.cat([col.new_zeros(1), col[:-1]])
    inclusive = recv_channel_prefix.to(torch.int64)
    exclusive = torch.cat([inclusive.new_zeros(inclusive.shape[0], 1), inclusive[:, :-1]], dim=1)
    return (start.unsqueeze(1) + exclusive).to(torch.int32)


def send_head(is_token_in_rank: torch.Tensor, rank_prefix: torch.Tensor, rank: int) -> torch.Tensor:
    """``int32[T, R]``: row of rank ``j``'s ``recv_x`` that holds token ``t``, or ``-1``.

    Rank ``rank``'s tokens start at ``rank_prefix[rank-1][j]`` on rank ``j`` and keep their order.
    """
    flags = is_token_in_rank.to(torch.int64)
    before = flags.cumsum(0) - flags
    if rank > 0:
        before = before + rank_prefix[rank - 1].to(torch.int64).unsqueeze(0)
    return torch.where(is_token_in_rank, before, torch.full_like(before, -1)).to(torch.int32)


def local_topk(recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor | None, rank: int, num_local: int):
    """Rewrite global expert ids to this rank's local ids ``0..L-1`` (``-1`` elsewhere); zero the
    weights of the ``-1`` slots."""
    lo = rank * num_local
    local = recv_topk_idx - lo
    here = (recv_topk_idx >= lo) & (recv_topk_idx < lo + num_local)
    idx = torch.where(here, local, torch.full_like(local, -1))
    w = None
    if recv_topk_weights is not None:
        w = torch.where(here, recv_topk_weights, torch.zeros_like(recv_topk_weights))
    return idx, w


def align_up(counts: torch.Tensor, alignment: int) -> torch.Tensor:
    return (counts + alignment - 1) // alignment * alignment


# ----------------------------------------------------------------------------- low-latency layout


class LowLatencySends(NamedTuple):
    """The messages one rank sends in low-latency mode, one per valid (token, k) entry, sorted by
    (expert, token, k). ``token int64[S]``, ``expert int64[S]``, ``k int64[S]``,
    ``per_expert int64[E]`` (messages per expert)."""

    token: torch.Tensor
    expert: torch.Tensor
    k: torch.Tensor
    per_expert: torch.Tensor


def low_latency_sends(topk_idx: torch.Tensor, num_experts: int) -> LowLatencySends:
    """Example: ``topk_idx = [[2, 0], [0, -1]]``, E = 4 → messages (expert, token, k):
    (0, 0, 1), (0, 1, 0), (2, 0, 0); ``per_expert = [2, 0, 1, 0]``."""
    t, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    pos = (flat >= 0).nonzero().squeeze(1)
    expert = flat[pos]
    # Stable sort by expert keeps (token, k) order within an expert.
    order = torch.sort(expert, stable=True).indices
    pos, expert = pos[order], expert[order]
    per_expert = torch.bincount(expert, minlength=num_experts) if pos.numel() else torch.zeros(
        num_experts, dtype=torch.int64, device=topk_idx.device
    )
    return LowLatencySends(pos // max(k, 1), expert, pos % max(k, 1), per_expert)


def layout_range(begin: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Pack ``(begin << 32) | count`` (int64) as DeepEP does."""
    return (begin.to(torch.int64) << 32) | count.to(torch.int64)


def unpack_layout_range(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return packed >> 32, packed & 0xFFFFFFFF


class LowLatencyBufferLayout(NamedTuple):
    """Byte layout of the low-latency buffer (``num_rdma_bytes``), shared by every backend.

    Two areas alternate between calls (``parity`` 0/1). Each holds, in order:

    - dispatch: per source rank a 128-byte header then ``M`` messages of ``dispatch_msg_bytes``
      (one per (source rank, token): its top-k ids, then its row, BF16 or FP8 + float32 scales);
    - weights: per source rank ``M x MAX_TOPK`` (expert id int32, weight float32) pairs, pushed by
      the token's owner when combine starts;
    - slots: per source rank ``M x MAX_TOPK`` int32, where dispatch put each (token, k) in ``recv_x``;
    - combine: per source rank ``M`` float32 rows, the partial sum of that rank's experts;
    - signals: int32 counters.

    The zero-copy combine buffer ``bf16[L, R*M, H]`` exists once, not twice: a combine reads it
    before its send phase ends.
    """

    dispatch_msg_bytes: int
    dispatch_src_bytes: int
    dispatch_area: int
    weights_area: int
    slot_area: int
    combine_area: int
    signal_area: int
    parity_bytes: int
    zero_copy_offset: int
    zero_copy_bytes: int
    total: int

    def parity_offset(self, parity: int) -> int:
        return parity * self.parity_bytes

    @property
    def weights_offset(self) -> int:
        return self.dispatch_area

    @property
    def slot_offset(self) -> int:
        return self.dispatch_area + self.weights_area

    @property
    def combine_offset(self) -> int:
        return self.dispatch_area + self.weights_area + self.slot_area

    @property
    def signal_offset(self) -> int:
        return self.combine_offset + self.combine_area


def _align(n: int, a: int = 128) -> int:
    return (n + a - 1) // a * a


LL_MAX_TOPK = 32
LL_HEADER_BYTES = 128


def low_latency_buffer_layout(m: int, hidden: int, num_ranks: int, num_experts: int) -> LowLatencyBufferLayout:
    """Example: M = 4, H = 256, R = 2, E = 4: messages of 512 + 128 = 640 bytes; dispatch area
    2 x (128 + 4 x 640) = 5376; weights and slots 2 x 4 x 32 x 8 = 2048 and 1024; combine
    2 x 4 x 256 x 4 = 8192; signals 2 x 16 + 64 = 96 -> 128; zero-copy 2 x 2 x 4 x 256 x 2 = 8192 bytes."""
    groups = (hidden + 127) // 128
    msg = _align(max(hidden * 2, hidden + groups * 4) + LL_MAX_TOPK * 4, 16)
    src = _align(LL_HEADER_BYTES + m * msg)
    dispatch_area = num_ranks * src
    weights_area = _align(num_ranks * m * LL_MAX_TOPK * 8)
    slot_area = _align(num_ranks * m * LL_MAX_TOPK * 4)
    combine_area = _align(num_ranks * m * hidden * 4)
    signal_area = _align(num_ranks * 4 * 4 + 64)
    parity = dispatch_area + weights_area + slot_area + combine_area + signal_area
    local = num_experts // num_ranks
    zero_copy = _align(local * num_ranks * m * hidden * 2)
    return LowLatencyBufferLayout(msg, src, dispatch_area, weights_area, slot_area, combine_area, signal_area,
                                  parity, 2 * parity, zero_copy, 2 * parity + zero_copy)

"""``EPHandle``: what an ``ElasticBuffer`` dispatch returns (DeepEP V2's fields, a plain object).

Letters: ``T`` tokens, ``K`` top-k, ``R`` ranks, ``LE`` local experts, ``M`` = ``num_max_tokens_per_rank``,
``N`` contiguous rows, ``X`` expanded rows.
"""

from __future__ import annotations

import torch


class EPHandle:
    """What a dispatch returns for its cached replays and its combine (DeepEP's fields; a plain object).

    - ``do_expand``, ``num_experts``, ``expert_alignment``, ``num_max_tokens_per_rank``, ``num_sms``.
    - ``topk_idx int64[T, K]``: a copy (``do_handle_copy``) or the caller's tensor.
    - ``num_recv_tokens``: ``N`` exact with CPU sync, else ``R*M``; ``num_expanded_tokens``: ``X`` likewise.
    - ``num_recv_tokens_per_expert_list``: aligned counts per local expert (CPU sync), else ``[]``.
    - ``psum_num_recv_tokens_per_scaleup_rank int32[R]``: inclusive prefix of rows per source rank.
    - ``psum_num_recv_tokens_per_expert int32[LE]``: contiguous: inclusive prefix of aligned counts;
      expanded: aligned start plus real count.
    - ``num_unaligned_recv_tokens_per_expert int32[LE]``: real counts.
    - ``recv_src_metadata int32[N, K+2]``: column 0 ``src_rank*M + src_token`` (``-1`` for padding
      rows), column 1 private, columns 2.. the expanded row of each lane (``-1``; contiguous: ``-1``).
    - ``dst_buffer_slot_idx int32[T, K]``: ``rank*M + row`` where each lane's token landed, or ``-1``.
    - ``token_metadata_at_forward``, ``channel_linked_list``: None (DeepEP's hybrid mode only).
    """

    def __init__(self, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, topk_idx: torch.Tensor, num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: list, psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
                 psum_num_recv_tokens_per_expert: torch.Tensor, num_unaligned_recv_tokens_per_expert: torch.Tensor,
                 recv_src_metadata: torch.Tensor, dst_buffer_slot_idx: torch.Tensor,
                 token_metadata_at_forward: torch.Tensor | None = None,
                 channel_linked_list: torch.Tensor | None = None):
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self.cached_recv_src_metadata_before_sort = None
        self._state = None  # elastic_engine.DispatchState, set by ElasticBuffer.dispatch
        self._owner = None  # the ElasticBuffer that made it

    def __repr__(self) -> str:
        return (f"EPHandle(do_expand={self.do_expand}, num_experts={self.num_experts}, "
                f"expert_alignment={self.expert_alignment}, num_max_tokens_per_rank={self.num_max_tokens_per_rank}, "
                f"num_recv_tokens={self.num_recv_tokens})")

"""The peer baseline: MoE dispatch and combine as a user writes them with torch.distributed alone.

This is what torchtitan's and Megatron-Core's all-to-all token dispatchers do, and what a user picks
instead of any expert-parallel library (the reference backend is an oracle, not a peer):

- dispatch: sort the (token, expert) pairs by expert (one row per pair: a token going to two experts
  on one rank is sent twice), exchange the per-expert counts with one ``all_to_all_single``, read
  the split sizes on the host, then one ``all_to_all_single`` of the permuted rows (FP8: a second
  one of the scales);
- combine: the reverse ``all_to_all_single`` of the expert outputs, then ``index_add_`` of
  ``weight * row`` back into token order in float32, rounded once to BF16.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``N`` rows received.
Eager only: the split sizes come through the host.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass
class A2AState:
    """What combine needs from dispatch."""

    token: torch.Tensor        # int64[P]: source token of each sent row, in send order
    weight: torch.Tensor       # f32[P]: its top-k weight
    send_splits: list[int]     # rows sent to each rank
    recv_splits: list[int]     # rows received from each rank


def dispatch(x, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, group):
    """``x``: ``bf16[T, H]`` or ``(fp8[T, H], f32[T, H/128])`` → ``(rows received bf16[N, H] or
    (fp8[N, H], f32[N, H/128]), counts received per (source rank, local expert) int64[R*L], state)``."""
    r_ = dist.get_world_size(group)
    lx = num_experts // r_
    data, scales = x if isinstance(x, tuple) else (x, None)
    k = topk_idx.shape[1]
    flat = topk_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, num_experts)  # dropped slots sort last and are not sent
    order = torch.argsort(key, stable=True)
    per_expert = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    recv_per_expert = torch.empty_like(per_expert)
    dist.all_to_all_single(recv_per_expert, per_expert, group=group)
    counts = torch.stack([per_expert.view(r_, lx).sum(1), recv_per_expert.view(r_, lx).sum(1)]).tolist()
    send_splits, recv_splits = counts
    n_send = sum(send_splits)
    sent = order[:n_send]
    token = sent // k
    rows = data.index_select(0, token)
    out = torch.empty(sum(recv_splits), data.shape[1], dtype=data.dtype, device=data.device)
    if data.dtype == torch.float8_e4m3fn:  # collectives move bytes
        dist.all_to_all_single(out.view(torch.uint8), rows.view(torch.uint8), recv_splits, send_splits,
                               group=group)
    else:
        dist.all_to_all_single(out, rows, recv_splits, send_splits, group=group)
    recv = out
    if scales is not None:
        sc_out = torch.empty(out.shape[0], scales.shape[1], dtype=scales.dtype, device=scales.device)
        dist.all_to_all_single(sc_out, scales.index_select(0, token), recv_splits, send_splits, group=group)
        recv = (out, sc_out)
    state = A2AState(token, topk_weights.reshape(-1).index_select(0, sent), send_splits, recv_splits)
    return recv, recv_per_expert, state


def combine(y: torch.Tensor, state: A2AState, num_tokens: int, group) -> torch.Tensor:
    """``y: bf16[N, H]`` (rows in the order dispatch delivered them) → ``bf16[T, H]``:
    ``out[t] = Σ weight · row`` over the rows token ``t`` sent, in float32."""
    back = torch.empty(sum(state.send_splits), y.shape[1], dtype=y.dtype, device=y.device)
    dist.all_to_all_single(back, y, state.send_splits, state.recv_splits, group=group)
    acc = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
    acc.index_add_(0, state.token, back.float() * state.weight.unsqueeze(1))
    return acc.to(torch.bfloat16)

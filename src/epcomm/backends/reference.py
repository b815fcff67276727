"""The reference backend: every operation over ``torch.distributed`` collectives and point-to-point.

This is the specification in executable form and the oracle for every fast backend: exactly
right, not fast. It runs on any process group — gloo with CPU tensors, NCCL with CUDA tensors —
and moves every payload as raw bytes (``uint8`` views), so BF16/FP8/int64 rows travel bit-exact
through any backend.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``N`` received tokens, ``M`` low-latency max tokens per rank, ``G = H/128``.

High-throughput mode: one ``all_gather`` of per-destination counts (tokens, channel prefixes,
per-expert counts), then one ``all_to_all_single`` of packed token rows with uneven splits.
Low-latency mode: point-to-point among the ranks not masked (shrink), so a masked rank is skipped.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.distributed as dist

from .. import _validate as V
from .. import layout, quant
from ..layout import DispatchHandle, LowLatencyHandle
from . import deadline
from .base import (
    Backend,
    DispatchArgs,
    DispatchResult,
    LowLatencyCombineArgs,
    LowLatencyDispatchArgs,
    LowLatencyDispatchResult,
)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``[T, ...]`` → ``uint8[T, row_bytes]`` (a copy only if ``t`` is not contiguous)."""
    rows = t.shape[0]
    cols = math.prod(t.shape[1:]) if t.dim() > 1 else 1
    if t.numel() == 0:  # an empty tensor counts as contiguous with any strides, which view() may reject
        return torch.empty(rows, cols * t.element_size(), dtype=torch.uint8, device=t.device)
    return t.contiguous().reshape(rows, cols).view(torch.uint8)


def _pack(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([_bytes(p) for p in parts], dim=1)


def _unpack(buf: torch.Tensor, specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Inverse of :func:`_pack`: ``specs`` = (dtype, per-row shape) of each part, in order."""
    out, col = [], 0
    rows = buf.shape[0]
    for dtype, shape in specs:
        width = math.prod(shape) * dtype.itemsize
        if rows == 0 or width == 0:  # an empty slice keeps its strides, which view(dtype) may reject
            part = torch.empty((0, *shape), dtype=dtype, device=buf.device)
        else:
            # a fresh tensor: .contiguous() keeps a one-row slice's row stride, which view(dtype) rejects
            part = torch.empty(rows, width, dtype=torch.uint8, device=buf.device)
            part.copy_(buf[:, col:col + width])
            part = part.view(dtype).reshape(rows, *shape)
        out.append(part)
        col += width
    return out


class ReferenceBackend(Backend):
    name = "reference"

    def __init__(self, group, rank, num_ranks, device, timeout_s, num_nvl_bytes: int, num_rdma_bytes: int):
        super().__init__(group, rank, num_ranks, device, timeout_s)
        self._global = [dist.get_global_rank(group, r) for r in range(num_ranks)]
        # CUDA tensors on a gloo group (the tests' shared-GPU mode): stage every transfer through the host
        self._staged = device.type == "cuda" and "nccl" not in str(dist.get_backend(group)).lower()
        # Local byte buffers: views of them are what get_local_buffer_tensor and zero-copy return.
        self.nvl_buffer = torch.empty(num_nvl_bytes, dtype=torch.uint8, device=device)
        self.rdma_buffer = torch.empty(num_rdma_bytes, dtype=torch.uint8, device=device)

    # ------------------------------------------------------------------ waiting with deadlines

    def _wait(self, work, phase: str, peer: int | None = None) -> None:
        """Wait for ``work`` with the deadline; on expiry raise naming the phase and the peer (``deadline.wait``:
        NCCL work is polled, gloo's ends itself at the deadline)."""
        deadline.wait(work, self.group, torch.device("cpu") if self._staged else self.device, self.rank, phase,
                      self.timeout_s, peer)

    def _all_gather(self, t: torch.Tensor, phase: str) -> torch.Tensor:
        src = t.cpu() if self._staged else t.contiguous()
        out = [torch.empty_like(src) for _ in range(self.num_ranks)]
        self._wait(deadline.issue_all_gather(self.group, out, src, self.timeout_s), phase)
        return torch.stack(out).to(t.device)

    def _all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                    phase: str) -> torch.Tensor:
        src = send.cpu() if self._staged else send.contiguous()
        recv = src.new_empty((sum(recv_counts), *send.shape[1:]))
        self._wait(deadline.issue_all_to_all(self.group, recv, src, recv_counts, send_counts, self.timeout_s), phase)
        return recv.to(send.device)

    def _p2p(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], phase: str):
        """Post sends/receives (self handled by a copy); return ``wait(peer_filter)`` callable."""
        ops, peers, staged = [], [], []
        for peer, t in sends.items():
            if peer == self.rank:
                recvs[peer].copy_(t)
            elif t.numel() > 0:
                ops.append(dist.P2POp(dist.isend, t.cpu() if self._staged else t.contiguous(),
                                      self._global[peer], self.group))
                peers.append(peer)
        for peer, t in recvs.items():
            if peer != self.rank and t.numel() > 0:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu") if self._staged else t
                if self._staged:
                    staged.append((t, host))
                ops.append(dist.P2POp(dist.irecv, host, self._global[peer], self.group))
                peers.append(peer)
        works = dist.batch_isend_irecv(ops) if ops else []
        if len(works) == len(ops):
            pairs = list(zip(peers, works))
        else:  # NCCL returns one work for the whole batch: name the peer when there is only one
            only = peers[0] if peers and all(p == peers[0] for p in peers) else None
            pairs = [(only, w) for w in works]

        def wait(stats: torch.Tensor | None = None) -> None:
            for peer, w in pairs:
                t0 = time.perf_counter_ns()
                self._wait(w, phase, peer)
                if stats is not None and peer is not None:
                    stats[peer] += time.perf_counter_ns() - t0
            for t, host in staged:
                t.copy_(host)

        return wait

    # ------------------------------------------------------------------ high-throughput

    def dispatch(self, a: DispatchArgs) -> DispatchResult:
        r_, me = self.num_ranks, self.rank
        e = a.num_tokens_per_expert.numel()
        lx = e // r_
        c = a.num_channels
        is_in = a.is_token_in_rank
        counts_here = is_in.sum(0, dtype=torch.int64)
        code, why = _layout_error(a, counts_here, r_)
        cpm = layout.channel_prefix_matrix(is_in, c)
        meta = torch.cat([counts_here.view(r_, 1), cpm.to(torch.int64),
                          a.num_tokens_per_expert.to(torch.int64).view(r_, lx),
                          torch.full((r_, 1), code, dtype=torch.int64, device=is_in.device)], dim=1)
        g = self._all_gather(meta, "dispatch/notify").cpu()  # [src, dst, 1 + C + L + 1]
        # a layout that contradicts itself or its ids, on any rank: every rank raises (none is left waiting in
        # the payload exchange for one that gave up)
        bad = g[:, 0, -1].nonzero().flatten().tolist()
        if bad:
            raise ValueError(why if me in bad else f"{_LAYOUT_ERRORS[int(g[bad[0], 0, -1])]} on rank {bad[0]}")
        counts = g[:, :, 0]
        rank_prefix = layout.rank_prefix_matrix(counts)
        recv_cp = layout.recv_channel_prefix_matrix(rank_prefix, g[:, me, 1:1 + c], me)
        per_expert = layout.align_up(g[:, me, 1 + c:1 + c + lx].sum(0), a.expert_alignment)
        send_counts, recv_counts = counts[me].tolist(), counts[:, me].tolist()
        n = sum(recv_counts)
        # Every rank knows every rank's receive count here, so all raise together (no rank is left
        # waiting in the payload exchange for one that gave up).
        check_worst(counts, a.num_worst_tokens)
        order = layout.send_order(is_in)
        recv = self._all_to_all(pack_dispatch_rows(a)[order], send_counts, recv_counts, "dispatch/payload")
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = unpack_dispatch_rows(
            recv, a, me, lx, a.num_worst_tokens or n)
        dev = a.x.device
        handle = DispatchHandle(
            rank_prefix.to(dev), cpm.to(dev), recv_cp.to(dev), recv_src_idx, is_in,
            layout.send_head(is_in, rank_prefix.to(dev), me),
        )
        lst = [] if a.num_worst_tokens else per_expert.tolist()
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, lst, handle)

    @staticmethod
    def _counts_from_handle(handle: DispatchHandle) -> torch.Tensor:
        prefix = handle.rank_prefix_matrix.to(torch.int64).cpu()
        return torch.cat([prefix[:1], prefix[1:] - prefix[:-1]], dim=0)

    def cached_dispatch(self, x, x_scales, handle: DispatchHandle, config=None):
        counts = self._counts_from_handle(handle)
        me = self.rank
        parts = [x] + ([x_scales] if x_scales is not None else [])
        order = layout.send_order(handle.is_token_in_rank)
        recv = self._all_to_all(_pack(parts)[order], counts[me].tolist(), counts[:, me].tolist(),
                                "cached_dispatch/payload")
        specs = [(x.dtype, (x.shape[1],))] + ([(torch.float32, (x_scales.shape[1],))] if x_scales is not None else [])
        fields = _unpack(recv, specs)
        rows = handle.recv_src_idx.numel()
        recv_x = _pad_rows(fields[0], rows, 0)
        recv_scales = _pad_rows(fields[1], rows, 0) if x_scales is not None else None
        return recv_x, recv_scales

    def combine(self, x, handle: DispatchHandle, topk_weights, bias, config=None):
        counts = self._counts_from_handle(handle)
        me = self.rank
        n = int(counts[:, me].sum())
        t = handle.is_token_in_rank.shape[0]
        parts = [x[:n]] + ([topk_weights[:n]] if topk_weights is not None else [])
        recv_counts = counts[me].tolist()
        recv = self._all_to_all(_pack(parts), counts[:, me].tolist(), recv_counts, "combine/payload")
        specs = [(x.dtype, (x.shape[1],))] + ([(torch.float32, (topk_weights.shape[1],))]
                                               if topk_weights is not None else [])
        fields = _unpack(recv, specs)
        order = layout.send_order(handle.is_token_in_rank)
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        w_out = None if topk_weights is None else torch.zeros(t, topk_weights.shape[1], dtype=torch.float32,
                                                               device=x.device)
        start = 0
        for cnt in recv_counts:  # rank by rank: a deterministic float32 summation order
            rows = order[start:start + cnt]
            out[rows] += fields[0][start:start + cnt].float()
            if w_out is not None:
                w_out[rows] += fields[1][start:start + cnt]
            start += cnt
        for b in bias:
            out += b.float()
        return out.to(x.dtype), w_out

    # ------------------------------------------------------------------ low-latency

    def _active(self, mask: torch.Tensor | None) -> list[bool]:
        """Ranks not masked (shrink): ``mask`` is the Buffer's int32[R], 1 = masked; None = all active."""
        return [True] * self.num_ranks if mask is None else [v == 0 for v in mask.tolist()]

    def _masked_topk(self, topk_idx: torch.Tensor, num_experts: int, active: list[bool]) -> torch.Tensor:
        if all(active):
            return topk_idx
        lx = num_experts // self.num_ranks
        ok = torch.tensor(active, device=topk_idx.device)[(topk_idx.clamp_min(0) // lx)]
        return torch.where((topk_idx >= 0) & ok, topk_idx, torch.full_like(topk_idx, -1))

    def low_latency_dispatch(self, a: LowLatencyDispatchArgs) -> Callable[[], LowLatencyDispatchResult]:
        r_, me, m, e = self.num_ranks, self.rank, a.num_max_dispatch_tokens_per_rank, a.num_experts
        lx = e // r_
        x = a.x
        t, h = x.shape
        dev = x.device
        active = self._active(a.mask)
        sends = layout.low_latency_sends(self._masked_topk(a.topk_idx, e, active), e)
        per_dst = sends.per_expert.view(r_, lx)
        header = torch.cat([torch.full((r_, 1), m, dtype=torch.int64, device=dev), per_dst], dim=1)
        recv_hdr = torch.zeros(r_, 1 + lx, dtype=torch.int64, device=dev)
        peers = [r for r in range(r_) if active[r]]
        self._p2p({r: header[r] for r in peers}, {r: recv_hdr[r] for r in peers},
                  "low_latency_dispatch/counts")()
        hdr = recv_hdr.cpu()
        bad = [r for r in peers if int(hdr[r, 0]) != m]
        if bad:
            raise ValueError(
                f"num_max_dispatch_tokens_per_rank={m} on rank {me} but "
                + ", ".join(f"{int(hdr[r, 0])} on rank {r}" for r in bad)
                + ": it must be the same on every rank"
            )
        cnt = hdr[:, 1:].t().contiguous()  # [L, R]
        if cnt.numel() and int(cnt.max()) > m:
            raise ValueError(f"an expert of rank {me} got more than num_max_dispatch_tokens_per_rank={m} messages "
                             "from one rank: topk_idx must not repeat an expert within a token")

        g = h // quant.GROUP if a.use_fp8 else 0
        if a.use_fp8:
            q, s = quant.per_token_cast_to_fp8(x, a.round_scale)
            parts, specs = [q, s], [(torch.float8_e4m3fn, (h,)), (torch.float32, (g,))]
        else:
            parts, specs = [x], [(x.dtype, (h,))]
        parts.append(torch.arange(t, dtype=torch.int32, device=dev).view(t, 1))
        specs.append((torch.int32, (1,)))
        rows = _pack(parts)[sends.token]
        send_split = per_dst.sum(1).tolist()
        recv_split = cnt.sum(0).tolist()
        send_chunks = dict(zip(range(r_), rows.split(send_split)))
        recv_buf = rows.new_empty((sum(recv_split), rows.shape[1]))
        recv_chunks = dict(zip(range(r_), recv_buf.split(recv_split)))
        wait = self._p2p({r: send_chunks[r] for r in peers}, {r: recv_chunks[r] for r in peers},
                         "low_latency_dispatch/payload")

        # Outputs are allocated now (fixed shapes); receive() fills them in place.
        begin = cnt.cumsum(1) - cnt  # [L, R]: blocks ordered by source rank
        recv_src_info = torch.full((lx, r_ * m), -1, dtype=torch.int32, device=dev)
        if a.use_fp8:
            recv_q = torch.zeros(lx, r_ * m, h, dtype=torch.float8_e4m3fn, device=dev)
            sg = (g + 3) // 4 if a.use_ue8m0 else g
            sdt = torch.int32 if a.use_ue8m0 else torch.float32
            sc = torch.zeros(lx, sg, r_ * m, dtype=sdt, device=dev).transpose(1, 2)
            recv_x = (recv_q, sc)
        else:
            recv_x = torch.zeros(lx, r_ * m, h, dtype=x.dtype, device=dev)
        recv_count = cnt.sum(1).to(torch.int32).to(dev)
        handle = LowLatencyHandle(recv_src_info, layout.layout_range(begin, cnt).to(dev), m, h, e)

        def receive() -> None:
            wait(a.dispatch_wait_recv_cost_stats)
            row_l, slot = (v.to(dev) for v in _block_rows(cnt, begin))
            fields = _unpack(recv_buf, specs)
            recv_src_info[row_l, slot] = fields[-1].view(-1)
            if a.use_fp8:
                recv_q.view(torch.uint8)[row_l, slot] = fields[0].view(torch.uint8)
                sc[row_l, slot] = quant.pack_ue8m0(fields[1]) if a.use_ue8m0 else fields[1]
            else:
                recv_x[row_l, slot] = fields[0]
            if a.cumulative_local_expert_recv_stats is not None:
                a.cumulative_local_expert_recv_stats += recv_count

        return LowLatencyDispatchResult(recv_x, recv_count, handle), receive

    def low_latency_combine(self, a: LowLatencyCombineArgs) -> tuple[torch.Tensor, Callable[[], None]]:
        r_ = self.num_ranks
        hd = a.handle
        e = hd.num_experts
        lx = e // r_
        dev = a.x.device
        active = self._active(a.mask)
        begin, cnt = (v.cpu() for v in layout.unpack_layout_range(hd.layout_range))
        if not all(active):
            cnt = cnt * torch.tensor(active, dtype=cnt.dtype, device=cnt.device).view(1, r_)
        # Rows back to each source rank r: expert by expert, in slot order (= the sender's message order).
        order_cnt = cnt.t().contiguous()  # [R, L]
        row_l, slot = _block_rows(cnt, begin)
        rows = a.x[row_l.to(dev), slot.to(dev)]
        sends = layout.low_latency_sends(self._masked_topk(a.topk_idx, e, active), e)
        recv_split = sends.per_expert.view(r_, lx).sum(1).tolist()
        recv_buf = rows.new_empty((sum(recv_split), a.x.shape[2]))
        peers = [r for r in range(r_) if active[r]]
        send_chunks = dict(zip(range(r_), rows.split(order_cnt.sum(1).tolist())))
        recv_chunks = dict(zip(range(r_), recv_buf.split(recv_split)))
        wait = self._p2p({r: send_chunks[r] for r in peers}, {r: recv_chunks[r] for r in peers},
                         "low_latency_combine/payload")
        t = a.topk_idx.shape[0]
        out = a.out if a.out is not None else torch.empty(t, a.x.shape[2], dtype=torch.bfloat16, device=dev)

        def receive() -> None:
            wait(a.combine_wait_recv_cost_stats)
            w = a.topk_weights[sends.token, sends.k].float()
            acc = torch.zeros(t, a.x.shape[2], dtype=torch.float32, device=dev)
            acc.index_add_(0, sends.token, recv_buf.float() * w.unsqueeze(1))
            out.copy_(acc)

        return out, receive

    def low_latency_zero_copy_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        r_, m, h, e = self.num_ranks, handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        lay = layout.low_latency_buffer_layout(m, h, r_, e)
        n = (e // r_) * r_ * m * h * 2
        region = self.rdma_buffer[lay.zero_copy_offset:lay.zero_copy_offset + n]
        return region.view(torch.bfloat16).view(e // r_, r_ * m, h)

    def destroy(self) -> None:
        self.nvl_buffer = self.rdma_buffer = None


_LAYOUT_ERRORS = {1: "num_tokens_per_rank does not match is_token_in_rank",
                  2: "is_token_in_rank does not match topk_idx", 3: "num_tokens_per_expert does not match topk_idx"}


def _layout_error(a: DispatchArgs, counts_here: torch.Tensor, r_: int) -> tuple[int, str]:
    """``(code, message)`` of what in a dispatch's layout contradicts the rest (a key of ``_LAYOUT_ERRORS``), or
    ``(0, "")``: ``num_tokens_per_rank`` against ``is_token_in_rank`` (its per-rank sums ``counts_here``), then the
    layout against ``topk_idx`` where given (``_validate.layout_mismatch``)."""
    if not torch.equal(counts_here.cpu(), a.num_tokens_per_rank.to(torch.int64).cpu()):
        return 1, (f"num_tokens_per_rank={a.num_tokens_per_rank.tolist()} does not match is_token_in_rank, "
                   f"which sends {counts_here.tolist()} tokens per rank")
    if a.topk_idx is None:
        return 0, ""
    why = V.layout_mismatch(a.topk_idx, a.is_token_in_rank, a.num_tokens_per_expert, r_)
    if why is None:
        return 0, ""
    return (2 if why.startswith("is_token_in_rank") else 3), why


def check_worst(counts: torch.Tensor, num_worst_tokens: int) -> None:
    """Raise if a rank receives more than ``num_worst_tokens`` rows (``counts [src, dst]`` on the host;
    0: no padding asked for)."""
    if num_worst_tokens:
        recv_per_rank = counts.sum(0).tolist()
        over = [j for j in range(len(recv_per_rank)) if recv_per_rank[j] > num_worst_tokens]
        if over:
            raise ValueError(f"num_worst_tokens={num_worst_tokens} is smaller than the "
                             f"{recv_per_rank[over[0]]} tokens rank {over[0]} receives")


def pack_dispatch_rows(a: DispatchArgs) -> torch.Tensor:
    """A dispatch's rows as bytes ``uint8 [T, row]``: x, its scales, top-k ids and weights, the token
    index (what the receiver unpacks with :func:`unpack_dispatch_rows`)."""
    t = a.x.shape[0]
    parts = [a.x] + ([a.x_scales] if a.x_scales is not None else [])
    if a.topk_idx is not None:
        parts += [a.topk_idx, a.topk_weights]
    parts.append(torch.arange(t, dtype=torch.int32, device=a.x.device).view(t, 1))
    return _pack(parts)


def unpack_dispatch_rows(recv: torch.Tensor, a: DispatchArgs, me: int, lx: int, rows: int):
    """Received rows of :func:`pack_dispatch_rows` (``uint8 [n, row]``) -> ``(recv_x, recv_scales,
    recv_topk_idx, recv_topk_weights, recv_src_idx)``: ids made local to rank ``me`` (``lx`` experts
    per rank), each padded to ``rows`` rows (num_worst_tokens)."""
    specs = [(a.x.dtype, (a.x.shape[1],))]
    if a.x_scales is not None:
        specs.append((torch.float32, (a.x_scales.shape[1],)))
    if a.topk_idx is not None:
        k = a.topk_idx.shape[1]
        specs += [(torch.int64, (k,)), (torch.float32, (k,))]
    specs.append((torch.int32, (1,)))
    fields = _unpack(recv, specs)
    recv_x = fields.pop(0)
    recv_scales = fields.pop(0) if a.x_scales is not None else None
    recv_topk_idx = recv_topk_weights = None
    if a.topk_idx is not None:
        recv_topk_idx, recv_topk_weights = layout.local_topk(fields.pop(0), fields.pop(0), me, lx)
    recv_src_idx = fields.pop(0).view(-1)
    return (_pad_rows(recv_x, rows, 0), _pad_rows(recv_scales, rows, 0), _pad_rows(recv_topk_idx, rows, -1),
            _pad_rows(recv_topk_weights, rows, 0), _pad_rows(recv_src_idx, rows, -1))


def _pad_rows(t: torch.Tensor | None, rows: int, fill: int) -> torch.Tensor | None:
    """Pad ``t`` to ``rows`` rows with ``fill`` (byte-wise zero for FP8)."""
    if t is None or t.shape[0] == rows:
        return t
    if t.dtype == torch.float8_e4m3fn:
        return _pad_rows(t.view(torch.uint8), rows, 0).view(t.dtype)
    out = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    out[:t.shape[0]] = t
    return out


def _block_rows(cnt: torch.Tensor, begin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows concatenated source rank by source rank, expert by expert (``cnt``/``begin``:
    ``[L, R]``), return each row's local expert and slot.

    Example: L = 2, R = 2, ``cnt = [[1, 2], [0, 1]]`` (expert 0 gets 1 row from rank 0 and 2 from
    rank 1) → ``begin = [[0, 1], [0, 0]]``; rows (r0,e0), (r1,e0), (r1,e0), (r1,e1) →
    experts ``[0, 0, 0, 1]``, slots ``[0, 1, 2, 0]``.
    """
    lx, r_ = cnt.shape
    flat_cnt = cnt.t().reshape(-1)  # (r, l) order
    flat_begin = begin.t().reshape(-1)
    experts = torch.arange(lx, device=cnt.device).repeat(r_)
    total = int(flat_cnt.sum())
    row_l = torch.repeat_interleave(experts, flat_cnt)
    start = torch.repeat_interleave(flat_cnt.cumsum(0) - flat_cnt, flat_cnt)
    slot = torch.repeat_interleave(flat_begin, flat_cnt) + (torch.arange(total, device=cnt.device) - start)
    return row_l, slot

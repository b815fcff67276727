"""The steps of ``ElasticBuffer``'s dispatch and combine (DeepEP V2's API) on epcomm's one engine.

A dispatch is the backend's high-throughput dispatch (``Backend.dispatch`` / ``cached_dispatch``, the
same kernels ``Buffer.dispatch`` runs): rows arrive in source rank, then source token order, exact
(CPU sync) or padded to ``R*M`` rows (``num_worst_tokens``: no host wait, capturable where the backend's
is). What V2 adds is done here in torch, once for every backend: the payload (FP8 with opaque 4-byte
scale packs of any width travels as bytes), the handle's counts and prefix sums, the expanded layout
(``elastic_layout.expanded_layout``) and its scatter (``dispatch_copy_epilogue_impl``).

A combine sends each partial row back to its owner into a fixed slot (``Backend.return_rows``:
``combine_impl``), then reduces at the source in the order DeepEP fixes: float32, ``bias0 + bias1``
first, partials in top-k lane order at each rank's master lane, one BF16 rounding
(``combine_reduce_epilogue_impl``); an expanded combine first sums a token's local rows at the expert
rank (``allow_multiple_reduction``), or sends every (token, expert) row on its own.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``LE = E/R``,
``M`` = ``num_max_tokens_per_rank``, ``N`` contiguous rows, ``X`` expanded rows, ``P`` scale packs.
"""

from __future__ import annotations

import torch

from . import elastic_layout as EL
from . import layout
from .backends.base import DispatchArgs
from .config import Config


class Payload:
    """How a dispatch's ``x`` (and ``sf``, and top-k weights of a cached dispatch) travel: as the backend's
    own BF16 or FP8 + float32-per-128 rows when they are that (bytes unchanged: ``sf`` viewed as
    float32), else packed side by side as bytes in a BF16 row."""

    def __init__(self, x: torch.Tensor, sf: torch.Tensor | None, extra: torch.Tensor | None = None):
        h = x.shape[1]
        self.x_dtype, self.h = x.dtype, h
        self.sf_dtype = None if sf is None else sf.dtype
        self.p = 0 if sf is None else sf.shape[1]
        self.k = 0 if extra is None else extra.shape[1]
        direct_bf16 = sf is None and extra is None and x.dtype == torch.bfloat16 and h % 8 == 0
        direct_fp8 = (extra is None and sf is not None and x.dtype == torch.float8_e4m3fn and h % 128 == 0
                      and self.p == h // 128)
        self.packed = not (direct_bf16 or direct_fp8)
        if not self.packed:
            self.data = x.contiguous()
            self.scales = None if sf is None else sf.contiguous().view(torch.float32)
        else:
            parts = [x] + ([sf.contiguous()] if sf is not None else []) + ([extra] if extra is not None else [])
            self.data = EL.pack_rows(parts).view(torch.bfloat16)
            self.scales = None

    def unpack(self, recv_x: torch.Tensor, recv_scales: torch.Tensor | None):
        """The received rows -> ``(x, sf or None, extra or None)``."""
        if not self.packed:
            return recv_x, None if recv_scales is None else recv_scales.view(self.sf_dtype), None
        specs = [(self.x_dtype, self.h)]
        if self.p:
            specs.append((self.sf_dtype, self.p))
        if self.k:
            specs.append((torch.float32, self.k))
        parts = EL.unpack_rows(recv_x.view(torch.uint8), specs)
        x = parts.pop(0)
        sf = parts.pop(0) if self.p else None
        return x, sf, parts.pop(0) if self.k else None


def _sf_layout(sf: torch.Tensor | None, tma: bool) -> torch.Tensor | None:
    """``sf [rows, P]`` row-major, or (``tma``) column-major with a 4-row aligned column stride."""
    if sf is None or not tma:
        return sf
    rows, p = sf.shape
    out = torch.empty_strided((rows, p), (1, EL.align(max(rows, 1), 4)), dtype=sf.dtype, device=sf.device)
    out.copy_(sf)
    return out


def _gather_rows(t: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``t[rows]`` (any dtype, FP8 through bytes); rows where ``keep`` is False become zero bytes."""
    raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    out = raw[rows]
    if keep is not None:
        out = torch.where(keep.view(-1, *([1] * (out.dim() - 1))), out, torch.zeros((), dtype=out.dtype,
                                                                                       device=out.device))
    return out.view(t.dtype) if t.dtype == torch.float8_e4m3fn else out


class DispatchState:
    """What a dispatch leaves behind for its cached replays and its combine (private to the handle)."""

    def __init__(self, v1, payload_shape, local, recv_w_mask, gid, slots, source, num_rows, num_expanded,
                 device_sms=0):
        self.v1 = v1                      # the backend's DispatchHandle
        self.payload_shape = payload_shape
        self.local = local                # int64[N, K] local expert ids (-1: not here, padding rows)
        self.recv_w_mask = recv_w_mask    # bool[N, K]: lanes whose weight a row carries (local lanes)
        self.gid = gid                    # int64[N] src_rank * M + src_token, -1 for padding rows
        self.slots = slots                # int32[N, K] expanded rows (expanded dispatch), else None
        self.source = source              # int64[X] row * K + lane of each expanded row, -1 padding
        self.num_rows = num_rows
        self.num_expanded = num_expanded
        self.device_sms = device_sms      # the copy epilogue's programs: 4 a SM


def dispatch(eb, x, sf, topk_idx, topk_weights, num_experts, m, alignment, num_sms, expand, sync, zero_pad,
             tma_sf, cum_stats, handle_copy, before_epilogue):
    """A fresh dispatch on ``eb``'s backend; returns ``(recv_x, recv_sf, recv_topk_idx, recv_topk_weights,
    fields of the handle (dict), DispatchState)``."""
    be, r_, me = eb._backend, eb.num_ranks, eb.rank_idx
    t, k = topk_idx.shape
    le = num_experts // r_
    dev = x.device
    pay = Payload(x, sf)
    per_rank, per_expert, in_rank = layout.dispatch_layout(topk_idx, num_experts, r_)
    w = topk_weights if topk_weights is not None else torch.zeros(t, k, dtype=torch.float32, device=dev)
    config = eb._configs.get(num_sms)
    if config is None:
        config = eb._configs[num_sms] = Config.default_dispatch(r_, EL.align(max(num_sms, 2), 2))
    args = DispatchArgs(pay.data, pay.scales, topk_idx, w, per_rank, in_rank, per_expert, alignment,
                        0 if sync else r_ * m, config.num_channels, config.num_sms,
                        config.num_max_rdma_chunked_send_tokens)
    res = be.dispatch(args)
    _wait_event(before_epilogue)
    v1 = res.handle
    recv_x, recv_sf, _ = pay.unpack(res.recv_x, res.recv_x_scales)
    n = recv_x.shape[0]
    local = res.recv_topk_idx
    recv_w = res.recv_topk_weights if topk_weights is not None else None
    psum_rank = v1.rank_prefix_matrix[:, me].to(torch.int32).contiguous()
    rows = torch.arange(n, device=dev)
    src_rank = torch.searchsorted(psum_rank.to(torch.int64), rows, right=True)
    valid_row = rows < psum_rank[-1].to(torch.int64)
    gid = torch.where(valid_row, src_rank * m + v1.recv_src_idx.to(torch.int64), torch.full_like(rows, -1))
    local = torch.where(valid_row.unsqueeze(1), local, torch.full_like(local, -1))  # padding rows: no expert
    lst = list(res.num_recv_tokens_per_expert_list)
    n_exp = (sum(lst) if sync else EL.worst_expanded_rows(r_, m, k, le, alignment)) if expand else 0
    lay = EL.expanded_layout(local, le, alignment, n_exp)
    if cum_stats is not None:
        cum_stats += lay.counts
    lane = torch.arange(k, device=dev)
    master = torch.where(local >= 0, lane, torch.full_like(local, -1)).max(1).values if k else rows * 0
    meta = torch.full((n, k + 2), -1, dtype=torch.int32, device=dev)
    meta[:, 0] = gid.to(torch.int32)
    meta[:, 1] = torch.where(valid_row & (master >= 0), src_rank * k + master, torch.full_like(rows, -1)).to(torch.int32)
    if expand:
        meta[:, 2:] = lay.slots
    d = torch.where(topk_idx >= 0, topk_idx // le, torch.zeros_like(topk_idx))
    row_there = v1.send_head.to(torch.int64).gather(1, d)
    dst_slot = torch.where(topk_idx >= 0, d * m + row_there, torch.full_like(d, -1)).to(torch.int32)
    fields = {
        "topk_idx": topk_idx.clone() if handle_copy else topk_idx,
        "num_recv_tokens": n if sync else r_ * m,
        "num_expanded_tokens": n_exp if expand else (sum(lst) if sync else EL.worst_expanded_rows(r_, m, k, le,
                                                                                                  alignment)),
        "num_recv_tokens_per_expert_list": lst if sync else [],
        "psum_num_recv_tokens_per_scaleup_rank": psum_rank,
        "psum_num_recv_tokens_per_expert": lay.psum_expanded if expand else lay.psum_contiguous,
        "num_unaligned_recv_tokens_per_expert": lay.counts,
        "recv_src_metadata": meta,
        "dst_buffer_slot_idx": dst_slot,
    }
    state = DispatchState(v1, tuple(pay.data.shape), local, local >= 0, gid, lay.slots if expand else None,
                          lay.source if expand else None, n, n_exp, eb.device_sms)
    out_x, out_sf, out_idx, out_w = _layout_outputs(state, expand, recv_x, recv_sf, local, recv_w, zero_pad,
                                                    tma_sf, k)
    return out_x, out_sf, out_idx, out_w, fields, state


def cached_dispatch(eb, state: DispatchState, expand: bool, x, sf, topk_weights, zero_pad, tma_sf,
                    before_epilogue):
    """A dispatch replayed on a handle: the same rows as the dispatch that made it."""
    k = state.local.shape[1]
    pay = Payload(x, sf, topk_weights)
    recv, recv_scales = eb._backend.cached_dispatch(pay.data, pay.scales, state.v1, None)
    _wait_event(before_epilogue)
    recv_x, recv_sf, recv_w = pay.unpack(recv, recv_scales)
    if recv_w is not None:
        recv_w = torch.where(state.recv_w_mask, recv_w, torch.zeros((), dtype=recv_w.dtype, device=recv_w.device))
    return _layout_outputs(state, expand, recv_x, recv_sf, state.local, recv_w, zero_pad, tma_sf, k)


def _layout_outputs(state: DispatchState, expand: bool, recv_x, recv_sf, local, recv_w, zero_pad, tma_sf, k):
    """The contiguous rows as they came, or scattered to the expanded layout
    (``dispatch_copy_epilogue_impl``): ``(recv_x, recv_sf, recv_topk_idx, recv_topk_weights)``."""
    if not expand:
        return recv_x, _sf_layout(recv_sf, tma_sf), local.clone(), recv_w
    src = state.source
    keep = (src >= 0) if zero_pad else None
    row = src.clamp(min=0) // max(k, 1)
    ex = (_copy_epilogue(recv_x, src, k, zero_pad, state.device_sms) if recv_x.is_cuda
          else _gather_rows(recv_x, row, keep))
    esf = None if recv_sf is None else _sf_layout(_gather_rows(recv_sf, row, keep), tma_sf)
    ew = None
    if recv_w is not None:
        ew = _gather_rows(recv_w.reshape(-1), src.clamp(min=0), keep)
    return ex, esf, None, ew


def _copy_epilogue(recv_x: torch.Tensor, source: torch.Tensor, k: int, zero_pad: bool, sms: int) -> torch.Tensor:
    """``recv_x [N, H]`` -> the expanded ``[X, H]`` by ``kernels/v2._dispatch_copy_epilogue_impl_kernel``: only
    real rows are copied (and, with ``zero_pad``, padding rows zeroed); the same bytes as :func:`_gather_rows`
    in the real rows."""
    from .kernels import v2

    x_rows = source.shape[0]
    out = torch.empty(x_rows, recv_x.shape[1], dtype=recv_x.dtype, device=recv_x.device)
    if x_rows and recv_x.numel():
        src = recv_x.contiguous()
        grid = (max(1, min(x_rows, 4 * sms)),)
        v2._dispatch_copy_epilogue_impl_kernel[grid](src.view(torch.uint8), source, out.view(torch.uint8), x_rows,
                                                     max(k, 1), ROW=src.shape[1] * src.element_size(),
                                                     ZERO=bool(zero_pad), BLOCK=1024, num_warps=4)
    elif zero_pad:
        out.view(torch.uint8).zero_()
    return out


def _wait_event(ev) -> None:
    """The current stream waits for ``ev`` (an ``EventHandle``; None: nothing to wait for)."""
    if ev is not None:
        ev.current_stream_wait()


# ----------------------------------------------------------------------------- combine


def combine(eb, x, state: DispatchState, topk_idx, num_experts, m, expand, topk_weights, bias, multi,
            before_epilogue, num_sms: int = 0):
    """``(combined_x bf16[T, H], combined_topk_weights f32[T, K] or None)``; ``num_sms``: the transport's
    programs (``Backend.return_rows``)."""
    be, r_ = eb._backend, eb.num_ranks
    t, k = topk_idx.shape
    h = x.shape[1]
    dev = x.device
    le = num_experts // r_
    tok = torch.arange(t, device=dev)
    valid = topk_idx >= 0
    owner = torch.where(valid, topk_idx // le, torch.zeros_like(topk_idx))
    zero_bf16 = torch.zeros((), dtype=torch.bfloat16, device=dev)

    if expand and not multi:
        # every (token, expert) row travels on its own, one lane at a time; one reduction at the source
        def lanes(j: int) -> torch.Tensor:
            s = state.slots[:, j].to(torch.int64)
            dst = torch.where((s >= 0) & (state.gid >= 0), state.gid, torch.full_like(state.gid, -1))
            got = be.return_rows(EL.pack_rows([x[s.clamp(min=0)]]), dst, m, "combine/rows", num_sms).view(r_ * m, -1)
            _wait_event(before_epilogue if j == 0 else None)
            mine = got[owner[:, j] * m + tok][:, :2 * h].contiguous().view(torch.bfloat16)
            return torch.where(valid[:, j].unsqueeze(1), mine, zero_bf16)

        return EL.ordered_reduce(lanes, k, bias, (t, h), dev), None

    if expand:
        partial = EL.local_reduce(x, state.slots)  # the expert rank's stage: fp32, one BF16 rounding
        w_rows = None
        if topk_weights is not None:
            s = state.slots.to(torch.int64)
            w_rows = torch.where(s >= 0, topk_weights[s.clamp(min=0)], torch.zeros((), device=dev))
    else:
        partial = x[:state.num_rows]
        w_rows = topk_weights
    parts = [partial] + ([w_rows] if w_rows is not None else [])
    got = be.return_rows(EL.pack_rows(parts), state.gid, m, "combine/rows", num_sms).view(r_ * m, -1)
    _wait_event(before_epilogue)
    master = EL.master_lanes(topk_idx, le)
    out_w = None
    if w_rows is not None:  # lane j: the weight its owner sent back (0 for -1 lanes)
        wcols = got[:, h * 2:h * 2 + 4 * k].view(torch.float32)
        wv = wcols[owner * m + tok.unsqueeze(1), torch.arange(k, device=dev).unsqueeze(0)]
        out_w = torch.where(valid, wv, torch.zeros((), device=dev))
    if x.is_cuda:
        return _reduce_epilogue(got, master, owner, bias, t, h, m), out_w

    def lanes(j: int) -> torch.Tensor:
        row = got[owner[:, j] * m + tok]  # [T, W]: what lane j's owner sent for each token
        return torch.where(master[:, j].unsqueeze(1), row[:, :h * 2].contiguous().view(torch.bfloat16), zero_bf16)

    return EL.ordered_reduce(lanes, k, bias, (t, h), dev), out_w


def _reduce_epilogue(got: torch.Tensor, use: torch.Tensor, owner: torch.Tensor, bias: tuple, t: int, h: int,
                     m: int) -> torch.Tensor:
    """``EL.ordered_reduce`` of the rows sent back (``got uint8[R*M, W]``) in one kernel
    (``kernels/v2._combine_reduce_epilogue_impl_kernel``): the same float32 additions in the same order."""
    from .kernels import v2

    out = torch.empty(t, h, dtype=torch.bfloat16, device=got.device)
    if t == 0:
        return out
    k = use.shape[1]
    b0 = bias[0].contiguous() if bias else out
    b1 = bias[1].contiguous() if len(bias) > 1 else out
    block = 1024
    v2._combine_reduce_epilogue_impl_kernel[(t, (h + block - 1) // block)](
        got.view(torch.bfloat16), use.to(torch.int8).contiguous(), owner.contiguous(), b0, b1, out, m, k,
        got.shape[1] // 2, h, NB=len(bias), OUT_F32=False, BLOCK=block, num_warps=4)
    return out

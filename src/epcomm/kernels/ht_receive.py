"""High-throughput kernels, receive phase: ``_dispatch_impl_kernel`` (the dispatch's transfer, a gather:
rows from local x or the staging slots into ``recv_x`` in (source rank, token) order, top-k ids rewritten
to local experts; with ``PUSH`` it also does the dispatch's SM push: push and own block first, then the
peers' rows; named as DeepEP names its dispatch kernel, so that DeepEP's profiler-based timing finds it:
docs/v2.md, "Kernel names"), ``reduce`` (combine: float32 sum, rank by rank, of the rows every rank
returned, plus bias) and ``combine`` (the combine's SM push, then ``reduce``, in one launch).

Letters: ``T`` tokens, ``H`` hidden (elements of the row dtype), ``K`` top-k, ``R`` ranks, ``L = E/R``,
``N`` received rows, ``P`` programs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import ticket_last
from .ht_common import (
    CCONSUMED,
    CDATA,
    DCONSUMED,
    DDATA,
    _i64,
    _push_tile,
    _signal_peers,
    _wait_peers,
    _wait_sources,
)
from .ht_transfer import _combine_push_rows


@triton.jit
def _tile_src(v0, v_hi, total, start_me, rr, R, incl, excl, src_lists_ptr, src_lists_stride, out_src,
              RB: tl.constexpr, CACHED: tl.constexpr):
    """Source token of each row of the gather tile at rotated position ``v0`` (0 past the end): from
    the handle (``out_src``) when cached, else from source ``i``'s send list."""
    vv = v0 + tl.arange(0, RB)
    real = vv < tl.minimum(total, v_hi)
    nn = tl.where(real, (vv + start_me) % tl.maximum(total, 1), vv)
    if CACHED:
        s = tl.load(out_src + nn, mask=real, other=0)
    else:
        i = tl.sum(tl.where((rr[None, :] < R) & (incl[None, :] <= nn[:, None]), 1, 0), 1)
        start = tl.sum(tl.where(rr[None, :] == i[:, None], excl[None, :], 0), 1)
        s = tl.load(src_lists_ptr + i * src_lists_stride + (nn - start), mask=real, other=0)
    return s


@triton.jit
def _gather_rows(v_lo, v_hi, pid, P, known, x_ptr, xs_ptr, topk_ptr, w_ptr, row_elems, G, K, me, R,
                 lo_expert, L,
                 src_lists_ptr, src_lists_stride, n_rows, total, start_me, rr, incl, excl, chunk_rows,
                 stage_ptr, stage_src_elems, stage_s_ptr, stage_s_src, stage_k_ptr, stage_k_src,
                 stage_w_ptr, stage_w_src,
                 out_x, out_s, out_s_stride_row, out_s_stride_col, out_k, out_w, out_src,
                 ptr_table, flags_off, base, err_ptr, timeout_ns,
                 CACHED: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, NC: tl.constexpr,
                 RB: tl.constexpr, BLOCK: tl.constexpr, K_POW2: tl.constexpr, G_POW2: tl.constexpr,
                 HAS_TIMER: tl.constexpr, STAGES: tl.constexpr):
    """Output rows at rotated positions ``v_lo <= v < v_hi`` (``v = 0`` is this rank's own block),
    tiles of ``RB`` rows, tile ``u`` by program ``u % P``; returns the updated ``known`` levels."""
    kk = tl.arange(0, K_POW2)
    gg = tl.arange(0, G_POW2)
    cols = tl.arange(0, BLOCK)
    for v0 in range(v_lo + pid * RB, v_hi, P * RB):
        vv = v0 + tl.arange(0, RB)
        inb = vv < v_hi
        real = vv < tl.minimum(total, v_hi)
        nn = tl.where(real, (vv + start_me) % tl.maximum(total, 1), vv)
        nn64 = nn.to(tl.int64)
        i = tl.sum(tl.where((rr[None, :] < R) & (incl[None, :] <= nn[:, None]), 1, 0), 1)
        s = _tile_src(v0, v_hi, total, start_me, rr, R, incl, excl, src_lists_ptr, src_lists_stride, out_src,
                      RB, CACHED)
        if not CACHED:
            tl.store(out_src + nn, tl.where(real, s, -1), mask=inb)
        if not CACHED:
            ch = tl.sum(tl.where(rr[None, :] == i[:, None], chunk_rows[None, :], 1), 1)
            lvl = tl.where(real & (i != me), s // ch + 1, 0)
            need = tl.max(tl.where(rr[None, :] == i[:, None], lvl[:, None], 0), 0)
            known = _wait_sources(need, known, rr, ptr_table, flags_off, DDATA, R, me, base, err_ptr, 3,
                                  timeout_ns, NC, HAS_TIMER)
        s64 = s.to(tl.int64)
        mine = real & (i == me)
        peer = real & (i != me)
        lrow = s64 * row_elems
        srow = i.to(tl.int64) * stage_src_elems + s64 * row_elems
        orow = nn64 * row_elems
        row_src = tl.where(mine, x_ptr + lrow, stage_ptr + srow)  # one load per element: local x or staging
        for h0 in tl.range(0, row_elems, BLOCK, num_stages=STAGES):
            cc = h0 + cols
            cm = real[:, None] & (cc[None, :] < row_elems)
            v = tl.load(row_src[:, None] + cc[None, :], mask=cm)
            tl.store(out_x + orow[:, None] + cc[None, :], v, mask=cm)
        if HAS_SCALES:
            gm = gg[None, :] < G
            sa = tl.load(xs_ptr + s64[:, None] * G + gg[None, :], mask=mine[:, None] & gm)
            sb = tl.load(stage_s_ptr + i.to(tl.int64)[:, None] * stage_s_src + s64[:, None] * G + gg[None, :],
                         mask=peer[:, None] & gm)
            tl.store(out_s + nn64[:, None] * out_s_stride_row + gg[None, :] * out_s_stride_col,
                     tl.where(mine[:, None], sa, sb), mask=real[:, None] & gm)
        if HAS_TOPK:
            km = kk[None, :] < K
            ka = tl.load(topk_ptr + s64[:, None] * K + kk[None, :], mask=mine[:, None] & km, other=-1)
            kb = tl.load(stage_k_ptr + i.to(tl.int64)[:, None] * stage_k_src + s64[:, None] * K + kk[None, :],
                         mask=peer[:, None] & km, other=-1)
            wa = tl.load(w_ptr + s64[:, None] * K + kk[None, :], mask=mine[:, None] & km, other=0.0)
            wb = tl.load(stage_w_ptr + i.to(tl.int64)[:, None] * stage_w_src + s64[:, None] * K + kk[None, :],
                         mask=peer[:, None] & km, other=0.0)
            kv = tl.where(mine[:, None], ka, kb)
            wv = tl.where(mine[:, None], wa, wb)
            here = real[:, None] & (kv >= lo_expert) & (kv < lo_expert + L)
            tl.store(out_k + nn64[:, None] * K + kk[None, :], tl.where(here, kv - lo_expert, -1),
                     mask=inb[:, None] & km)
            tl.store(out_w + nn64[:, None] * K + kk[None, :], tl.where(here, wv, 0.0), mask=inb[:, None] & km)
    return known


@triton.jit(do_not_specialize=['n_rows', 'T_send'])
def _dispatch_impl_kernel(x_ptr, xs_ptr, topk_ptr, w_ptr, row_elems, G, K,
                        counts_ptr, counts_stride, me, R, lo_expert, L, tok_ptr,
                        src_lists_ptr, src_lists_stride, n_rows,
                        stage_ptr, stage_src_elems, stage_s_ptr, stage_s_src, stage_k_ptr, stage_k_src,
                        stage_w_ptr, stage_w_src,
                        out_x, out_s, out_s_stride_row, out_s_stride_col, out_k, out_w, out_src,
                        ptr_table, flags_off, ctr_ptr, ticket_ptr, err_ptr, timeout_ns,
                        is_in_ptr, T_send, push_off, push_slot_bytes, push_s_off, push_k_off, push_w_off,
                        send_ctr_ptr, push_ticket_ptr,
                        CACHED: tl.constexpr, IS_PREFIX: tl.constexpr, HAS_SCALES: tl.constexpr,
                        HAS_TOPK: tl.constexpr, NC: tl.constexpr, RB: tl.constexpr, BLOCK: tl.constexpr,
                        R_POW2: tl.constexpr, K_POW2: tl.constexpr, G_POW2: tl.constexpr, HAS_TIMER: tl.constexpr,
                        STAGES: tl.constexpr = 3, PUSH: tl.constexpr = False,
                        PUSH_RB: tl.constexpr = 8, PUSH_BLOCK: tl.constexpr = 512, ELEM: tl.constexpr = tl.int32,
                        PUSH_TOPK: tl.constexpr = False):
    """The dispatch's transfer (the gather; ``dispatch_impl`` in DeepEP's names): row ``n`` of the outputs = token ``s`` of source rank ``i`` (rank-major order).

    Tiles of ``RB`` rows; rows are visited rotated so this rank's own block (no wait) comes first,
    then the peers' blocks in token order, waiting chunk by chunk (``NC`` copy-engine chunks per
    source; chunk of token ``s`` = ``s // ceil(T_i / NC)``; cached mode waits for all chunks).

    ``PUSH`` (the SM transfer): this kernel also sends. Its programs first push this
    rank's rows into the peers' staging (``_push_kernel``'s work: ``T_send`` rows, ``is_in``, scales
    and, with ``PUSH_TOPK``, ids and weights) interleaved with copying the own block (local
    reads, so NVLink and HBM work at once); the last program to finish that raises the peers' data
    flags; then every program copies the peers' rows as they are flagged (``CACHED``: once every chunk of
    every peer is in). Every program of the grid must be resident (grid <= SMs), as for the waits
    elsewhere.
    """
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    base = tl.load(ctr_ptr)
    rr = tl.arange(0, R_POW2)
    col = tl.load(counts_ptr + rr * counts_stride + me, mask=rr < R, other=0)
    if IS_PREFIX:
        incl = col
        excl = tl.load(counts_ptr + (rr - 1) * counts_stride + me, mask=(rr < R) & (rr > 0), other=0)
    else:
        incl = tl.cumsum(col, 0)
        excl = incl - col
    # rows this call may write: every row arriving, or fewer when num_worst_tokens is too small (the
    # handle kernel records that error; the rows beyond the output are dropped, never written past it)
    total = tl.minimum(tl.max(tl.where(rr < R, incl, 0), 0), n_rows)
    start_me = tl.sum(tl.where(rr == me, excl, 0), 0)
    known = tl.zeros((R_POW2,), dtype=tl.int32)
    if CACHED:
        if not PUSH:  # (with the push: after it, below)
            known = _wait_sources(tl.full((R_POW2,), NC, tl.int32), known, rr, ptr_table, flags_off, DDATA, R,
                                  me, base, err_ptr, 3, timeout_ns, NC, HAS_TIMER)
        chunk_rows = tl.full((R_POW2,), 1, tl.int32)
    else:
        toks = tl.load(tok_ptr + rr, mask=rr < R, other=0)
        chunk_rows = tl.maximum((toks + NC - 1) // NC, 1)
    v_lo = 0
    if PUSH:
        n_send = tl.load(send_ctr_ptr)
        _wait_peers(ptr_table, flags_off, DCONSUMED, R, me, n_send, err_ptr, 2, timeout_ns, HAS_TIMER)
        own = tl.minimum(tl.sum(tl.where(rr == me, incl - excl, 0), 0), total)  # (col, or its prefix's step)
        n_push = (T_send + PUSH_RB - 1) // PUSH_RB
        n_own = (own + RB - 1) // RB
        for u in range(pid, tl.maximum(n_push, n_own), P):
            if u < n_push:
                _push_tile(u * PUSH_RB, x_ptr, row_elems, T_send, R, me, is_in_ptr, ptr_table, push_off,
                           push_slot_bytes, xs_ptr, G, topk_ptr, w_ptr, K, push_s_off, push_k_off, push_w_off,
                           PUSH_RB, PUSH_BLOCK, ELEM, HAS_SCALES, PUSH_TOPK, G_POW2, K_POW2)
            if u < n_own:
                known = _gather_rows(u * RB, tl.minimum(u * RB + RB, own), 0, 1, known, x_ptr, xs_ptr,
                                     topk_ptr,
                                     w_ptr, row_elems, G, K, me, R, lo_expert, L, src_lists_ptr,
                                     src_lists_stride,
                                     n_rows, total, start_me, rr, incl, excl, chunk_rows, stage_ptr,
                                     stage_src_elems, stage_s_ptr, stage_s_src, stage_k_ptr, stage_k_src,
                                     stage_w_ptr, stage_w_src, out_x, out_s, out_s_stride_row,
                                     out_s_stride_col,
                                     out_k, out_w, out_src, ptr_table, flags_off, base, err_ptr, timeout_ns,
                                     CACHED, HAS_SCALES, HAS_TOPK, NC, RB, BLOCK, K_POW2, G_POW2, HAS_TIMER,
                                     STAGES)
        if ticket_last(push_ticket_ptr):
            _signal_peers(ptr_table, flags_off, DDATA, R, me, NC)
            tl.store(send_ctr_ptr, n_send + 1)
        v_lo = own
        if CACHED:  # the rows of a cached call come from the slots as a whole
            known = _wait_sources(tl.full((R_POW2,), NC, tl.int32), known, rr, ptr_table, flags_off, DDATA, R,
                                  me, base, err_ptr, 3, timeout_ns, NC, HAS_TIMER)
    known = _gather_rows(v_lo, n_rows, pid, P, known, x_ptr, xs_ptr, topk_ptr, w_ptr, row_elems, G, K, me, R,
                         lo_expert, L, src_lists_ptr, src_lists_stride, n_rows, total, start_me, rr, incl,
                         excl,
                         chunk_rows, stage_ptr, stage_src_elems, stage_s_ptr, stage_s_src, stage_k_ptr,
                         stage_k_src, stage_w_ptr, stage_w_src, out_x, out_s, out_s_stride_row,
                         out_s_stride_col,
                         out_k, out_w, out_src, ptr_table, flags_off, base, err_ptr, timeout_ns,
                         CACHED, HAS_SCALES, HAS_TOPK, NC, RB, BLOCK, K_POW2, G_POW2, HAS_TIMER, STAGES)
    if ticket_last(ticket_ptr):
        _signal_peers(ptr_table, flags_off, DCONSUMED, R, me, 1)
        tl.store(ctr_ptr, base + 1)


@triton.jit
def _reduce_rows(pid, P, x_ptr, H, T, R, me, send_head_ptr, rpm_ptr, w_ptr, K, x_rows,
                 stage_ptr, stage_src_elems, stage_w_ptr, stage_w_src,
                 bias0_ptr, bias1_ptr, out_ptr, out_w_ptr,
                 ptr_table, flags_off, ctr_ptr, ticket_ptr, err_ptr, timeout_ns,
                 HAS_W: tl.constexpr, NUM_BIAS: tl.constexpr, NC: tl.constexpr, TB: tl.constexpr,
                 BLOCK: tl.constexpr, R_POW2: tl.constexpr, K_POW2: tl.constexpr, HAS_TIMER: tl.constexpr,
                 STAGES: tl.constexpr):
    """Program ``pid`` of ``P``'s share of the combine's receive (``_reduce_kernel``): tiles ``pid, pid + P,
    ...`` of ``TB`` tokens; the last program of the grid hands the staging slots back."""
    base_ctr = tl.load(ctr_ptr)
    rr = tl.arange(0, R_POW2)
    mine_row = tl.load(rpm_ptr + me * R + rr, mask=rr < R, other=0)
    if me > 0:
        base = tl.load(rpm_ptr + (me - 1) * R + rr, mask=rr < R, other=0)
    else:
        base = tl.zeros((R_POW2,), dtype=tl.int32)
    chunk_rows = tl.maximum((mine_row - base + NC - 1) // NC, 1)
    known = tl.zeros((R_POW2,), dtype=tl.int32)
    kk = tl.arange(0, K_POW2)
    cols = tl.arange(0, BLOCK)
    for t0 in range(pid * TB, T, P * TB):
        tt = t0 + tl.arange(0, TB)
        tm = tt < T
        tt64 = tt.to(tl.int64)
        heads = tl.load(send_head_ptr + tt64[:, None] * R + rr[None, :], mask=tm[:, None] & (rr[None, :] < R),
                        other=-1)
        rel = heads - base[None, :]
        lvl = tl.where((heads >= 0) & (rr[None, :] != me), rel // chunk_rows[None, :] + 1, 0)
        need = tl.max(lvl, 0)
        known = _wait_sources(need, known, rr, ptr_table, flags_off, CDATA, R, me, base_ctr, err_ptr, 5,
                              timeout_ns, NC, HAS_TIMER)
        for h0 in tl.range(0, H, BLOCK, num_stages=STAGES):
            cc = h0 + cols
            cm = cc[None, :] < H
            acc = tl.zeros((TB, BLOCK), dtype=tl.float32)
            for j in tl.static_range(R_POW2):  # unrolled: straight-line loads the pipeliner can prefetch
                row = tl.sum(tl.where(rr[None, :] == j, heads, 0), 1)
                ok = tm & (row >= 0) & (j < R)
                relj = row - tl.sum(tl.where(rr == j, base, 0), 0)
                a = tl.load(x_ptr + row.to(tl.int64)[:, None] * H + cc[None, :],
                            mask=(ok & (me == j) & (row < x_rows))[:, None] & cm, other=0.0)
                b = tl.load(stage_ptr + j * stage_src_elems + relj.to(tl.int64)[:, None] * H + cc[None, :],
                            mask=(ok & (me != j))[:, None] & cm, other=0.0)
                acc += a.to(tl.float32) + b.to(tl.float32)  # one of a, b is 0: the same sum, rank by rank
            if NUM_BIAS >= 1:
                acc += tl.load(bias0_ptr + tt64[:, None] * H + cc[None, :], mask=tm[:, None] & cm,
                               other=0.0).to(tl.float32)
            if NUM_BIAS >= 2:
                acc += tl.load(bias1_ptr + tt64[:, None] * H + cc[None, :], mask=tm[:, None] & cm,
                               other=0.0).to(tl.float32)
            tl.store(out_ptr + tt64[:, None] * H + cc[None, :], acc.to(tl.bfloat16), mask=tm[:, None] & cm)
        if HAS_W:
            km = kk[None, :] < K
            accw = tl.zeros((TB, K_POW2), dtype=tl.float32)
            for j in range(0, R):
                row = tl.sum(tl.where(rr[None, :] == j, heads, 0), 1)
                ok = tm & (row >= 0)
                if j == me:
                    wv = tl.load(w_ptr + row.to(tl.int64)[:, None] * K + kk[None, :],
                                 mask=(ok & (row < x_rows))[:, None] & km, other=0.0)
                else:
                    relj = row - tl.sum(tl.where(rr == j, base, 0), 0)
                    wv = tl.load(stage_w_ptr + _i64(j) * stage_w_src + relj.to(tl.int64)[:,
                                 None] * K + kk[None, :],
                                 mask=ok[:, None] & km, other=0.0)
                accw += wv
            tl.store(out_w_ptr + tt64[:, None] * K + kk[None, :], accw, mask=tm[:, None] & km)
    # every chunk of every peer must have arrived before the slot is handed back
    known = _wait_sources(tl.full((R_POW2,), NC, tl.int32), known, rr, ptr_table, flags_off, CDATA, R, me,
                          base_ctr,
                          err_ptr, 5, timeout_ns, NC, HAS_TIMER)
    if ticket_last(ticket_ptr):
        _signal_peers(ptr_table, flags_off, CCONSUMED, R, me, 1)
        tl.store(ctr_ptr, base_ctr + 1)


@triton.jit(do_not_specialize=['T', 'x_rows'])
def _reduce_kernel(x_ptr, H, T, R, me, send_head_ptr, rpm_ptr, w_ptr, K, x_rows,
                   stage_ptr, stage_src_elems, stage_w_ptr, stage_w_src,
                   bias0_ptr, bias1_ptr, out_ptr, out_w_ptr,
                   ptr_table, flags_off, ctr_ptr, ticket_ptr, err_ptr, timeout_ns,
                   HAS_W: tl.constexpr, NUM_BIAS: tl.constexpr, NC: tl.constexpr, TB: tl.constexpr,
                   BLOCK: tl.constexpr, R_POW2: tl.constexpr, K_POW2: tl.constexpr, HAS_TIMER: tl.constexpr,
                   STAGES: tl.constexpr = 3):
    """Combine receive: ``out[t] = Σ_j row_j(t)`` (float32, ranks in order) ``+ bias``, as bf16.

    ``row_j(t)`` is row ``send_head[t, j]`` of rank ``j``'s x: local x for ``j == me``, else row
    ``send_head[t, j] - rpm[me-1, j]`` of staging slot ``j`` (rank ``j`` copied my block there in
    ``NC`` chunks of ``ceil(count / NC)`` rows; this program waits chunk by chunk). Local rows at or
    past ``x_rows`` are not read (after a num_worst_tokens overflow, recorded as an error).
    """
    _reduce_rows(tl.program_id(0), tl.num_programs(0), x_ptr, H, T, R, me, send_head_ptr, rpm_ptr, w_ptr, K,
                 x_rows, stage_ptr, stage_src_elems, stage_w_ptr, stage_w_src, bias0_ptr, bias1_ptr, out_ptr,
                 out_w_ptr, ptr_table, flags_off, ctr_ptr, ticket_ptr, err_ptr, timeout_ns, HAS_W, NUM_BIAS, NC,
                 TB, BLOCK, R_POW2, K_POW2, HAS_TIMER, STAGES)


@triton.jit(do_not_specialize=['T', 'x_rows'])
def _combine_kernel(x_ptr, H, T, R, me, send_head_ptr, rpm_ptr, w_ptr, K, x_rows,
                    stage_ptr, stage_src_elems, stage_w_ptr, stage_w_src,
                    bias0_ptr, bias1_ptr, out_ptr, out_w_ptr,
                    ptr_table, flags_off, ctr_ptr, ticket_ptr, err_ptr, timeout_ns,
                    push_off, push_src_bytes, push_w_off, push_w_src_bytes, send_ctr_ptr, push_ticket_ptr,
                    HAS_W: tl.constexpr, NUM_BIAS: tl.constexpr, NC: tl.constexpr, TB: tl.constexpr,
                    BLOCK: tl.constexpr, R_POW2: tl.constexpr, K_POW2: tl.constexpr, HAS_TIMER: tl.constexpr,
                    STAGES: tl.constexpr, PUSH_RB: tl.constexpr, PUSH_BLOCK: tl.constexpr):
    """The whole combine in one launch: ``_combine_push_kernel``'s work (every program its share of the
    rows of x going back to their owners; the last raises the owners' data flags), then
    ``_reduce_kernel``'s. Every program of the grid must be resident (grid <= SMs): one waits for rows
    that others push, as in the gather that pushes."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n = _combine_push_rows(pid, P, x_ptr.to(tl.pointer_type(tl.int32)), w_ptr, H // 2, K, R, me, rpm_ptr,
                           ptr_table, flags_off, push_off, push_src_bytes, push_w_off, push_w_src_bytes,
                           send_ctr_ptr, err_ptr, timeout_ns, x_rows, HAS_W, PUSH_RB, PUSH_BLOCK, K_POW2, HAS_TIMER)
    if ticket_last(push_ticket_ptr):
        _signal_peers(ptr_table, flags_off, CDATA, R, me, NC)
        tl.store(send_ctr_ptr, n + 1)
    _reduce_rows(pid, P, x_ptr, H, T, R, me, send_head_ptr, rpm_ptr, w_ptr, K, x_rows, stage_ptr, stage_src_elems,
                 stage_w_ptr, stage_w_src, bias0_ptr, bias1_ptr, out_ptr, out_w_ptr, ptr_table, flags_off, ctr_ptr,
                 ticket_ptr, err_ptr, timeout_ns, HAS_W, NUM_BIAS, NC, TB, BLOCK, R_POW2, K_POW2, HAS_TIMER, STAGES)

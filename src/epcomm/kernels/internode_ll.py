"""Low-latency send kernels of the internode backend (Triton + NVSHMEM): what ``kernels/ll.py``'s send
side does, with every write to a rank on another node made as an NVSHMEM put from this rank's own
symmetric buffer. The receive side is ``ll.py``'s (``_ll_dispatch_recv_kernel``,
``_ll_combine_recv_kernel`` with ``SIG_STRIDE=8``): it reads local memory only.

Letters: ``T`` tokens, ``H`` hidden, ``G = H/128``, ``K`` top-k (``<= 32``), ``E`` experts, ``R``
ranks, ``L = E/R``, ``M`` max tokens per rank, ``N`` ranks per node (nodes are runs of ``N``
consecutive ranks).

Buffer layout: ``layout.LowLatencyBufferLayout`` (as nvlink), except the signals: NVSHMEM's ``uint64``
words at ``sig_off + (kind * R + src) * 8`` (kinds ``ll.SIG_D``, ``SIG_W``, ``SIG_C``), only ever
increased by one per call (``SIGNAL_ADD``), polled on their low 32 bits.

Which way a write to rank ``j`` goes (``direct(j)``): plain stores through ``j``'s mapped buffer when
``j`` is this rank, or (``NVL``: ``allow_nvlink_for_low_latency_mode``) on this rank's node; otherwise
an NVSHMEM put (``kernels/nvshmem.py``) of bytes staged in this rank's symmetric buffer. Staging
costs no extra memory for dispatch and weights: a rank's messages to itself sit at the same offset
in its own buffer as its messages to peer ``j`` in ``j``'s (slot ``me``), so the self copy is the
staging. Combine partial sums for ``R`` sources need their own staging area (``stage_off``, ``R*M``
float32 rows).

Signals never overtake data: a direct write's flag is a release atomic after a CTA barrier (as
nvlink); an NVSHMEM flag travels in a put-with-signal after its own data, and every program calls
``quiet`` (its puts delivered) before the ticket that lets the last program raise the flags.

Example (R = 2, N = 1, NVL, me = 0, one token with topk_idx [3, 0]): rank 0's program writes the ids
and the row into its own slot 0 (the row for its expert 0) and puts ids and row (expert 3 is on rank
1) from there to slot 0 of rank 1; the last program writes the header ``[1, M]`` into its own slot,
raises its own flag with an atomic and rank 1's with a put-with-signal of the 8 header bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvshmem as nv
from .common import peer_ptr, record_error, signal, ticket_last_n
from .ll import HEADER, MAX_TOPK, SIG_C, SIG_D, SIG_W, _alive, _fp8_cast, _header_tokens, _i64

SIG_BYTES = tl.constexpr(8)


@triton.jit
def _direct(j, me, N, NVL: tl.constexpr):
    """Whether rank ``j`` is written with plain stores: itself, or a rank of this node with ``NVL``."""
    if NVL:
        d = (j == me) | ((j // N) == (me // N))
    else:
        d = j == me
    return d


@triton.jit
def _raise(ptr_table, me, j, sig_word_off, src, nbytes, dst_off, direct, SIM: tl.constexpr):
    """Make ``nbytes`` at ``src`` (this rank's buffer, offset ``dst_off``) visible at ``j`` and add 1 to
    ``j``'s signal word at ``sig_word_off``: a direct rank already holds the data (plain stores
    before), so a release atomic; else one put-with-signal (``nbytes`` may be 0)."""
    if direct:
        signal(peer_ptr(ptr_table, j, sig_word_off, tl.int64), 1)
    else:
        nv.put_signal(ptr_table, me, j, dst_off, src, nbytes, sig_word_off, SIM)


@triton.jit(do_not_specialize=['T'])
def _il_dispatch_send_kernel(x_ptr, topk_ptr, T, H, G, K, me, R, L, E, M, N, ptr_table, area_off, src_bytes,
                             msg_bytes, sig_off, ticket_ptr, err_ptr, mask_ptr, USE_FP8: tl.constexpr,
                             ROUND_SCALE: tl.constexpr, GC: tl.constexpr, R_POW2: tl.constexpr,
                             SHRINK: tl.constexpr, NVL: tl.constexpr, SIM: tl.constexpr):
    """Program ``(t, b)``: channel groups ``[b*GC, (b+1)*GC)`` of token ``t`` (FP8-cast when asked) into
    this rank's own slot (message ``t``), then to every rank holding one of its experts; program
    ``(t, 0)`` also sends the top-k ids to every rank. The last program writes the header ``[T, M]``
    and raises every rank's dispatch signal (a put-with-signal carrying the header where not direct)."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    kk = tl.arange(0, MAX_TOPK)
    rr = tl.arange(0, R_POW2)
    if t < T:
        t64 = t.to(tl.int64)
        msg_off = area_off + me * src_bytes + HEADER + t64 * msg_bytes  # the same offset at every rank
        ids = tl.load(topk_ptr + t64 * K + kk, mask=kk < K, other=-1)
        bad = (kk < K) & ((ids < -1) | (ids >= E))
        ids32 = tl.where(bad, -1, ids).to(tl.int32)
        owner = tl.where(ids32 >= 0, ids32 // L, -1)
        dest = tl.sum(tl.where(owner[:, None] == rr[None, :], 1, 0), 0)  # [R_POW2] experts per rank
        gg = b * GC + tl.arange(0, GC)
        cc = tl.arange(0, 128)
        gm = gg < G
        offs = gg[:, None] * 128 + cc[None, :]
        om = gm[:, None] & (offs < H)
        v = tl.load(x_ptr + t64 * H + offs, mask=om, other=0.0)
        if USE_FP8:
            q, scale = _fp8_cast(v, GC, ROUND_SCALE)
        if b == 0:
            nbad = tl.sum(bad.to(tl.int32), 0)
            if nbad > 0:
                badv = tl.max(tl.where(bad, ids, -(1 << 40)), 0)
                record_error(err_ptr, 10, -1, badv.to(tl.int32), E)
        # this rank's own copy of the message: its self-send and the source of every put
        stage = peer_ptr(ptr_table, me, msg_off, tl.uint8)
        if b == 0:
            tl.store(stage.to(tl.pointer_type(tl.int32)) + kk, ids32)
        row = stage + MAX_TOPK * 4
        if USE_FP8:
            tl.store(row.to(tl.pointer_type(tl.float8e4nv)) + offs, q, mask=om)
            tl.store((row + H).to(tl.pointer_type(tl.float32)) + gg, scale, mask=gm)
        else:
            tl.store(row.to(tl.pointer_type(tl.bfloat16)) + offs, v, mask=om)
        tl.debug_barrier()  # the staged bytes are written before any thread's put reads them
        if USE_FP8:  # payload bytes per channel
            es = 1
        else:
            es = 2
        lo_c = b * GC * 128
        hi_c = tl.minimum(H, (b + 1) * GC * 128)
        lo_g = b * GC
        hi_g = tl.minimum(G, (b + 1) * GC)
        for j in range(0, R):
            alive = _alive(mask_ptr, j, SHRINK)
            nj = tl.sum(tl.where(rr == j, dest, 0), 0) * alive
            if (alive != 0) & (j != me):
                if _direct(j, me, N, NVL):
                    dst = peer_ptr(ptr_table, j, msg_off, tl.uint8)
                    if b == 0:
                        tl.store(dst.to(tl.pointer_type(tl.int32)) + kk, ids32)
                    if nj > 0:
                        drow = dst + MAX_TOPK * 4
                        if USE_FP8:
                            tl.store(drow.to(tl.pointer_type(tl.float8e4nv)) + offs, q, mask=om)
                            tl.store((drow + H).to(tl.pointer_type(tl.float32)) + gg, scale, mask=gm)
                        else:
                            tl.store(drow.to(tl.pointer_type(tl.bfloat16)) + offs, v, mask=om)
                else:
                    # one put for [ids (program 0)][row channels lo_c..hi_c), one for the scales
                    start = tl.where(b == 0, 0, MAX_TOPK * 4 + lo_c * es)
                    end = tl.where(nj > 0, MAX_TOPK * 4 + hi_c * es, tl.where(b == 0, MAX_TOPK * 4, start))
                    if end > start:
                        nv.put(ptr_table, me, j, msg_off + start, stage + start, end - start, SIM)
                    if USE_FP8:
                        if (nj > 0) & (hi_g > lo_g):
                            s0 = MAX_TOPK * 4 + H + lo_g * 4
                            nv.put(ptr_table, me, j, msg_off + s0, stage + s0, (hi_g - lo_g) * 4, SIM)
    nv.quiet(SIM)  # this program's puts delivered before its ticket
    n_programs = tl.num_programs(0) * tl.num_programs(1)
    if ticket_last_n(ticket_ptr, n_programs):
        hdr_off = area_off + me * src_bytes
        hdr = peer_ptr(ptr_table, me, hdr_off, tl.int32)
        tl.store(hdr, T)
        tl.store(hdr + 1, M)
        tl.debug_barrier()
        for j in range(0, R):
            if _alive(mask_ptr, j, SHRINK) != 0:
                d = _direct(j, me, N, NVL)
                if d & (j != me):
                    dh = peer_ptr(ptr_table, j, hdr_off, tl.int32)
                    tl.store(dh, T)
                    tl.store(dh + 1, M)
                _raise(ptr_table, me, j, sig_off + (SIG_D * R + me) * SIG_BYTES, hdr, 8, hdr_off, d, SIM)
        nv.quiet(SIM)


@triton.jit(do_not_specialize=['T'])
def _il_weights_kernel(topk_ptr, w_ptr, T, K, me, R, M, N, ptr_table, w_off, sig_off, ticket_ptr, mask_ptr,
                       SHRINK: tl.constexpr, NVL: tl.constexpr, SIM: tl.constexpr):
    """Owner role of the combine: this rank's (expert id, weight) pairs of tokens ``pid, pid + P, ...``
    into its own slot (``w_off + (me*M + t) * MAX_TOPK * 8``) and every direct rank's; the last program
    sends the whole block ``[T, MAX_TOPK]`` to every other rank with one put-with-signal each and
    raises the weight signals."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    kk = tl.arange(0, MAX_TOPK)
    km = kk < K
    for t in range(pid, T, P):
        t64 = _i64(t)
        ids = tl.load(topk_ptr + t64 * K + kk, mask=km, other=-1).to(tl.int32)
        w = tl.load(w_ptr + t64 * K + kk, mask=km, other=0.0)
        row_off = w_off + (me * M + t64) * MAX_TOPK * 8
        for j in range(0, R):
            if _alive(mask_ptr, j, SHRINK) != 0:
                if _direct(j, me, N, NVL):
                    dst = peer_ptr(ptr_table, j, row_off, tl.int32)
                    tl.store(dst + kk, ids)
                    tl.store(dst.to(tl.pointer_type(tl.float32)) + MAX_TOPK + kk, w)
    if ticket_last_n(ticket_ptr, P):
        blk_off = w_off + _i64(me) * M * MAX_TOPK * 8
        blk = peer_ptr(ptr_table, me, blk_off, tl.uint8)
        for j in range(0, R):
            if _alive(mask_ptr, j, SHRINK) != 0:
                _raise(ptr_table, me, j, sig_off + (SIG_W * R + me) * SIG_BYTES, blk, T * MAX_TOPK * 8, blk_off,
                       _direct(j, me, N, NVL), SIM)
        nv.quiet(SIM)


@triton.jit
def _il_reduce_kernel(y_ptr, H, K, me, R, L, M, N, ptr_table, d_area_off, src_bytes, w_off, slot_off, c_off,
                      stage_off, sig_off, CW, wlevel_ptr, ticket_ptr, err_ptr, timeout_ns, mask_ptr,
                      K_POW2: tl.constexpr, BLOCK: tl.constexpr, HAS_TIMER: tl.constexpr, SHRINK: tl.constexpr,
                      NVL: tl.constexpr, SIM: tl.constexpr):
    """Expert role of the combine. Program ``(r*M + t, s)``: if token ``t`` of rank ``r`` has experts
    here, ``partial = Σ_k w[k] · y[slot(k)]`` in float32 over channels ``[s*CW, (s+1)*CW)``, once ``r``'s
    weights arrived; stored into ``r``'s combine area (``c_off + (me*M + t) * H * 4``) directly, or
    staged at ``stage_off + (r*M + t) * H * 4`` here and put. The last program raises the flags."""
    idx = tl.program_id(0)
    cs = tl.program_id(1)
    n_programs = tl.num_programs(0) * tl.num_programs(1)
    kk = tl.arange(0, MAX_TOPK)
    level = tl.load(wlevel_ptr)
    r = idx // M
    t = idx % M
    t_r = _header_tokens(peer_ptr(ptr_table, me, d_area_off + r * src_bytes, tl.int32), M, err_ptr, r,
                         _alive(mask_ptr, r, SHRINK))
    if t < t_r:
        nv.wait_signal(ptr_table, me, sig_off + (SIG_W * R + r) * SIG_BYTES, level + 1, err_ptr, 7, r, timeout_ns,
                       HAS_TIMER, mask_ptr, SHRINK)
        lo = me * L
        wrow = peer_ptr(ptr_table, me, w_off + (_i64(r) * M + t) * MAX_TOPK * 8, tl.int32)
        ids = tl.load(wrow + kk)
        w = tl.load(wrow.to(tl.pointer_type(tl.float32)) + MAX_TOPK + kk)
        here = (kk < K) & (ids >= lo) & (ids < lo + L)
        if tl.sum(here.to(tl.int32), 0) > 0:
            slots = tl.load(peer_ptr(ptr_table, me, slot_off + (_i64(r) * M + t) * MAX_TOPK * 4, tl.int32) + kk,
                            mask=here, other=0)
            d = _direct(r, me, N, NVL)
            dst_off = c_off + (me * M + _i64(t)) * H * 4
            if d:
                out = peer_ptr(ptr_table, r, dst_off, tl.float32)
            else:
                out = peer_ptr(ptr_table, me, stage_off + (_i64(r) * M + t) * H * 4, tl.float32)
            k2 = tl.arange(0, K_POW2)
            h2 = tl.sum(tl.where(kk[None, :] == k2[:, None], here[None, :].to(tl.int32), 0), 1) > 0
            s2 = tl.sum(tl.where(kk[None, :] == k2[:, None], slots[None, :], 0), 1).to(tl.int64)
            w2 = tl.sum(tl.where(kk[None, :] == k2[:, None], w[None, :], 0.0), 1)
            cols = tl.arange(0, BLOCK)
            c_lo = cs * CW
            c_hi = tl.minimum(H, (cs + 1) * CW)
            for c0 in range(c_lo, c_hi, BLOCK):
                cc = c0 + cols
                cm = cc < c_hi
                tile = tl.load(y_ptr + s2[:, None] * H + cc[None, :], mask=h2[:, None] & cm[None, :], other=0.0)
                acc = tl.sum(tile.to(tl.float32) * w2[:, None], 0)
                tl.store(out + cc, acc, mask=cm)
            if (not d) & (c_hi > c_lo):
                tl.debug_barrier()
                nv.put(ptr_table, me, r, dst_off + c_lo * 4, out + c_lo, (c_hi - c_lo) * 4, SIM)
    nv.quiet(SIM)
    if ticket_last_n(ticket_ptr, n_programs):
        tl.store(wlevel_ptr, level + 1)
        src = peer_ptr(ptr_table, me, stage_off, tl.uint8)
        for j in range(0, R):
            if _alive(mask_ptr, j, SHRINK) != 0:
                _raise(ptr_table, me, j, sig_off + (SIG_C * R + me) * SIG_BYTES, src, 0, stage_off,
                       _direct(j, me, N, NVL), SIM)
        nv.quiet(SIM)


@triton.jit
def _il_announce_kernel(ptr_table, me, R, N, mtab_off, m, NVL: tl.constexpr, SIM: tl.constexpr):
    """Word ``me`` of every rank's M table (``int32[R]`` at ``mtab_off``) = ``m``: a rank whose dispatch
    finds another rank's header with another M names both values, not a timeout."""
    mine = peer_ptr(ptr_table, me, mtab_off + me * 4, tl.int32)
    tl.store(mine, m)
    tl.debug_barrier()
    for j in range(0, R):
        if j != me:
            if _direct(j, me, N, NVL):
                tl.store(peer_ptr(ptr_table, j, mtab_off + me * 4, tl.int32), m)
            else:
                nv.put(ptr_table, me, j, mtab_off + me * 4, mine, 4, SIM)
    nv.quiet(SIM)

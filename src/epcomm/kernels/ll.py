"""Low-latency kernels (Triton): one message per (token, destination rank), expanded to experts on
the receiver; combine pre-reduced per (token, expert rank) in float32 on the expert side.

Letters: ``T`` tokens, ``H`` hidden, ``G = H/128``, ``K`` top-k (``<= 32``), ``E`` experts, ``R``
ranks, ``L = E/R``, ``M`` max tokens per rank, ``RM = R*M``.

Buffer layout: ``layout.LowLatencyBufferLayout``. Signal words per parity (int32 index):
``[0*R + src]`` dispatch data from ``src``, ``[1*R + src]`` combine weights from ``src``,
``[2*R + src]`` combine partial sums from ``src``. Counters only grow; each receiving kernel keeps
the level it expects next in local memory (per parity), so CUDA-graph replays stay in step.

Example (R = 2, L = 2, me = 1, one token with topk_idx [3, 0, 2]): the sender writes the ids to
both ranks and the row to rank 0 (expert 0) and rank 1 (experts 2, 3); rank 1's program for local
expert 0 (= expert 2) places the row in its block for source 1 and records slot (token, k = 2).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import now_ns, peer_ptr, record_error, signal, symbol, ticket_last_n, wait_ge

SIG_D = tl.constexpr(0)
SIG_W = tl.constexpr(1)
SIG_C = tl.constexpr(2)
MAX_TOPK = tl.constexpr(32)
HEADER = tl.constexpr(128)


@triton.jit
def _e4m3_rne(v):
    """Round float32 ``v`` (|v| <= 448) to the nearest e4m3 value, ties to even, in float32: add and
    subtract ``1.5 * 2**(q + 23)`` where ``2**q`` is the e4m3 step at |v| (the float32 adder rounds
    at that step). The result is exactly representable, so the final cast to FP8 cannot round again
    (a direct cast may go through FP16 and round twice)."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    q = tl.maximum(e, -6) - 3
    c = (((q + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = tl.minimum((a + c) - c, 448.0)
    sign = v.to(tl.int32, bitcast=True) & -2147483648  # copy the sign bit (Triton's -x is 0 - x: loses -0.0)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_cast(v, GC: tl.constexpr, ROUND_SCALE: tl.constexpr):
    """``v: [GC, 128]`` (bf16) -> (e4m3 ``[GC, 128]``, float32 scales ``[GC]``): per 128 channels
    ``scale = max(amax, 1e-4) / 448`` (a power of two, rounded up, with ``ROUND_SCALE``)."""
    vf = v.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(vf), 1), 1e-4)
    scale = tl.math.div_rn(amax, tl.full((GC,), 448.0, tl.float32))
    if ROUND_SCALE:
        bits = scale.to(tl.int32, bitcast=True)
        up = (bits & 0x7F800000) + tl.where((bits & 0x7FFFFF) != 0, 0x800000, 0)
        scale = up.to(tl.float32, bitcast=True)
    q = _e4m3_rne(tl.math.div_rn(vf, scale[:, None])).to(tl.float8e4nv)
    return q, scale


@triton.jit
def _alive(mask_ptr, r, SHRINK: tl.constexpr):
    """1 unless shrink is on and rank ``r`` is masked."""
    if SHRINK:
        a = (tl.load(mask_ptr + r, volatile=True) == 0).to(tl.int32)
    else:
        a = tl.full((), 1, tl.int32)
    return a


@triton.jit(do_not_specialize=['T'])
def _ll_dispatch_send_kernel(x_ptr, topk_ptr, T, H, G, K, me, R, L, E, M,
                             ptr_table, area_off, src_bytes, msg_bytes, sig_off, ticket_ptr, err_ptr, mask_ptr,
                             USE_FP8: tl.constexpr, ROUND_SCALE: tl.constexpr, GC: tl.constexpr,
                             K_POW2: tl.constexpr, R_POW2: tl.constexpr, SHRINK: tl.constexpr):
    """Program ``(t, b)``: channel groups ``[b*GC, (b+1)*GC)`` of token ``t`` (FP8-cast when asked) to
    every rank holding one of its experts; program ``(t, 0)`` also sends the top-k ids to every rank.
    The last program writes the headers ``[T, M]`` and raises the flags."""
    _ll_send(tl.program_id(0), tl.program_id(1), tl.num_programs(0) * tl.num_programs(1), x_ptr, topk_ptr, T, H,
             G, K, me, R, L, E, M, ptr_table, area_off, src_bytes, msg_bytes, sig_off, ticket_ptr, err_ptr, mask_ptr,
             USE_FP8, ROUND_SCALE, GC, R_POW2, SHRINK)


@triton.jit
def _ll_send(t, b, n_programs, x_ptr, topk_ptr, T, H, G, K, me, R, L, E, M,
             ptr_table, area_off, src_bytes, msg_bytes, sig_off, ticket_ptr, err_ptr, mask_ptr,
             USE_FP8: tl.constexpr, ROUND_SCALE: tl.constexpr, GC: tl.constexpr, R_POW2: tl.constexpr,
             SHRINK: tl.constexpr):
    """The send kernel's work for its program ``(t, b)`` of ``n_programs``."""
    kk = tl.arange(0, MAX_TOPK)
    rr = tl.arange(0, R_POW2)
    if t < T:
        t64 = t.to(tl.int64)
        ids = tl.load(topk_ptr + t64 * K + kk, mask=kk < K, other=-1)
        bad = (kk < K) & ((ids < -1) | (ids >= E))
        ids32 = tl.where(bad, -1, ids).to(tl.int32)
        owner = tl.where(ids32 >= 0, ids32 // L, -1)
        dest = tl.sum(tl.where(owner[:, None] == rr[None, :], 1, 0), 0)  # [R_POW2] experts per rank
        if b == 0:
            nbad = tl.sum(bad.to(tl.int32), 0)
            if nbad > 0:
                badv = tl.max(tl.where(bad, ids, -(1 << 40)), 0)
                record_error(err_ptr, 10, -1, badv.to(tl.int32), E)
            for j in range(0, R):
                if _alive(mask_ptr, j, SHRINK) != 0:
                    msg = peer_ptr(ptr_table, j, area_off + me * src_bytes + HEADER + t64 * msg_bytes, tl.int32)
                    tl.store(msg + kk, ids32)
        gg = b * GC + tl.arange(0, GC)
        cc = tl.arange(0, 128)
        gm = gg < G
        offs = gg[:, None] * 128 + cc[None, :]
        om = gm[:, None] & (offs < H)  # (BF16 rows need not be whole groups of 128: H % 8 == 0)
        v = tl.load(x_ptr + t64 * H + offs, mask=om, other=0.0)
        if USE_FP8:
            q, scale = _fp8_cast(v, GC, ROUND_SCALE)
        for j in range(0, R):
            nj = tl.sum(tl.where(rr == j, dest, 0), 0) * _alive(mask_ptr, j, SHRINK)
            if nj > 0:
                base = peer_ptr(ptr_table, j, area_off + me * src_bytes + HEADER + t64 * msg_bytes + MAX_TOPK * 4,
                                tl.uint8)
                if USE_FP8:
                    tl.store(base.to(tl.pointer_type(tl.float8e4nv)) + offs, q, mask=gm[:, None])
                    tl.store((base + H).to(tl.pointer_type(tl.float32)) + gg, scale, mask=gm)
                else:
                    tl.store(base.to(tl.pointer_type(tl.bfloat16)) + offs, v, mask=om)
    if ticket_last_n(ticket_ptr, n_programs):
        for j in range(0, R):
            if _alive(mask_ptr, j, SHRINK) != 0:
                hdr = peer_ptr(ptr_table, j, area_off + me * src_bytes, tl.int32)
                tl.store(hdr, T)
                tl.store(hdr + 1, M)
                signal(peer_ptr(ptr_table, j, sig_off + (SIG_D * R + me) * 4, tl.int32), 1)


@triton.jit
def _hits(src, msg_bytes, tt, tm, kk, e, K):
    """For the message tile of tokens ``tt``: (does the token select expert ``e``, at which k)."""
    msg = src + (HEADER // 4) + tt.to(tl.int64) * (msg_bytes // 4)
    ids = tl.load(msg[:, None] + kk[None, :], mask=tm[:, None] & (kk[None, :] < K), other=-1)
    ids = tl.where(tm[:, None], ids, -1)
    hitk = ids == e
    hit = tl.sum(hitk.to(tl.int32), 1) > 0
    kpos = tl.sum(tl.where(hitk, kk[None, :], 0), 1)
    return hit, kpos


@triton.jit
def _header_tokens(hdr_ptr, M, err_ptr, r, alive):
    """Source ``r``'s token count from its header ``[T, M]``; 0 for a masked source (``alive == 0``,
    not checked) and unless the header is sane. A source
    with another M writes at other offsets: its data can land on this rank's flag (a wrapped int32
    compare passes half the time) and its header is garbage; reading on would use garbage counts as
    offsets (a misaligned-address fault on nvidia-h200-x2). Recorded as code 6, which the host reports
    by the ranks' announced M."""
    t = tl.load(hdr_ptr, volatile=True)
    m = tl.load(hdr_ptr + 1, volatile=True)
    bad = (m != M) | (t < 0) | (t > M)
    if (alive != 0) & bad:
        record_error(err_ptr, 6, r, m, M)
    return tl.where(bad | (alive == 0), 0, t)


@triton.jit
def _ll_dispatch_recv_kernel(ptr_table, area_off, src_bytes, msg_bytes, sig_off, slot_off, me, R, L, M, H, G, K,
                             out_x, out_s, out_src, out_range, out_count, cum_ptr, wait_ptr,
                             level_ptr, ticket_ptr, err_ptr, timeout_ns, mask_ptr,
                             SHRINK: tl.constexpr, USE_FP8: tl.constexpr, UE8M0: tl.constexpr, HAS_CUM: tl.constexpr,
                             HAS_WAIT: tl.constexpr, TB: tl.constexpr, QB: tl.constexpr, BLOCK: tl.constexpr,
                             G_POW2: tl.constexpr, HAS_TIMER: tl.constexpr, K_POW2: tl.constexpr,
                             SIG_STRIDE: tl.constexpr = 4):
    """Program ``(l, r, s)``: the block of local expert ``l`` (expert ``me*L + l``) that comes from
    source rank ``r``, in token order, after the blocks of sources ``< r`` (their messages are only
    counted); ``s`` of ``S`` programs share the row copies. Program ``s = 0`` records each
    (source, token, k) slot, the source info and the layout range; ``r = R-1`` the count."""
    _ll_recv(tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(2),
             tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2), ptr_table, area_off, src_bytes,
             msg_bytes, sig_off, slot_off, me, R, L, M, H, G, K, out_x, out_s, out_src, out_range, out_count,
             cum_ptr, wait_ptr, level_ptr, ticket_ptr, err_ptr, timeout_ns, mask_ptr, SHRINK, USE_FP8, UE8M0,
             HAS_CUM, HAS_WAIT, TB, QB, BLOCK, G_POW2, HAS_TIMER, K_POW2, SIG_STRIDE)


@triton.jit(do_not_specialize=['T', 'n_send'])
@symbol("_ZN6epcomm2ll8dispatchEv")  # epcomm::ll::dispatch()
def _ll_dispatch_kernel(x_ptr, topk_ptr, T, H, G, K, me, R, L, E, M, ptr_table, area_off, src_bytes,
                              msg_bytes, sig_off, send_ticket_ptr, err_ptr, mask_ptr, slot_off,
                              out_x, out_s, out_src, out_range, out_count, cum_ptr, wait_ptr,
                              level_ptr, recv_ticket_ptr, role_ptr, timeout_ns, n_gb, n_send, S,
                              USE_FP8: tl.constexpr, ROUND_SCALE: tl.constexpr, GC: tl.constexpr,
                              R_POW2: tl.constexpr, SHRINK: tl.constexpr, UE8M0: tl.constexpr,
                              HAS_CUM: tl.constexpr, HAS_WAIT: tl.constexpr, TB: tl.constexpr, QB: tl.constexpr,
                              BLOCK: tl.constexpr, G_POW2: tl.constexpr, HAS_TIMER: tl.constexpr,
                              K_POW2: tl.constexpr, ROLES: tl.constexpr = 3):
    """The dispatch: ``n_send`` programs do the send kernel's work (``n_gb`` per token), the rest the
    receive kernel's (``L x R x S``). ``ROLES``: 3, both in one launch (no hook): roles go by a ticket
    taken at the start, sends first, so a program only gets a receive role (which waits on other GPUs)
    once every send role is held by a program already running: no send can be starved of an SM by
    waiting receives, whatever number of programs is resident. 1: only the send roles (``n_send`` is
    the grid), 2: only the receive roles (``n_send`` is 0): the hook's two launches, each compiled
    without the other's code (registers: a send program needs a quarter of a receive program's), under
    one kernel name."""
    n_all = tl.num_programs(0)
    if ROLES == 3:
        role = tl.atomic_add(role_ptr, 1)
        if role == n_all - 1:
            tl.atomic_xchg(role_ptr, 0)  # every program has its role: ready for the next launch
    else:
        role = tl.program_id(0)
    if (ROLES & 1) and (role < n_send):
        _ll_send(role // n_gb, role % n_gb, n_send, x_ptr, topk_ptr, T, H, G, K, me, R, L, E, M, ptr_table,
                 area_off, src_bytes, msg_bytes, sig_off, send_ticket_ptr, err_ptr, mask_ptr, USE_FP8,
                 ROUND_SCALE, GC, R_POW2, SHRINK)
    elif ROLES & 2:
        q = role - n_send
        _ll_recv(q // (R * S), (q // S) % R, q % S, S, n_all - n_send, ptr_table, area_off, src_bytes, msg_bytes,
                 sig_off, slot_off, me, R, L, M, H, G, K, out_x, out_s, out_src, out_range, out_count, cum_ptr,
                 wait_ptr, level_ptr, recv_ticket_ptr, err_ptr, timeout_ns, mask_ptr, SHRINK, USE_FP8, UE8M0,
                 HAS_CUM, HAS_WAIT, TB, QB, BLOCK, G_POW2, HAS_TIMER, K_POW2)


@triton.jit
def _ll_recv(l, r, s, S, n_programs, ptr_table, area_off, src_bytes, msg_bytes, sig_off, slot_off, me, R, L, M, H,
             G, K, out_x, out_s, out_src, out_range, out_count, cum_ptr, wait_ptr, level_ptr, ticket_ptr, err_ptr,
             timeout_ns, mask_ptr, SHRINK: tl.constexpr, USE_FP8: tl.constexpr, UE8M0: tl.constexpr,
             HAS_CUM: tl.constexpr, HAS_WAIT: tl.constexpr, TB: tl.constexpr, QB: tl.constexpr,
             BLOCK: tl.constexpr, G_POW2: tl.constexpr, HAS_TIMER: tl.constexpr, K_POW2: tl.constexpr,
             SIG_STRIDE: tl.constexpr = 4):
    """The receive kernel's work for its program ``(l, r, s)`` of ``n_programs`` (``S`` per block).
    ``SIG_STRIDE``: bytes between signal words (4: int32 flags; 8: NVSHMEM's uint64 signals, whose low word is
    polled). The programs count themselves by a relaxed GPU-scope ticket (the last only stores the next
    expected level, which the next kernel on this stream reads: one H200, 128 tokens, the receive 12.9 -> 12.1
    us against an acquire-release system-scope ticket)."""
    RM = R * M
    level = tl.load(level_ptr)
    t0 = now_ns(HAS_WAIT & HAS_TIMER)
    wait_ge(peer_ptr(ptr_table, me, sig_off + (SIG_D * R + r) * SIG_STRIDE, tl.int32), level + 1, err_ptr, 6, r,
            timeout_ns, HAS_TIMER, mask_ptr, SHRINK)
    if HAS_WAIT:
        if s == 0:
            tl.atomic_add(wait_ptr + r, (now_ns(HAS_WAIT & HAS_TIMER) - t0).to(tl.int64))
    kk = tl.arange(0, K_POW2)
    cols = tl.arange(0, BLOCK)
    gg = tl.arange(0, G_POW2)
    e = me * L + l
    # rows of the sources before r
    begin = tl.zeros((), dtype=tl.int32)
    for r2 in range(0, r):
        wait_ge(peer_ptr(ptr_table, me, sig_off + (SIG_D * R + r2) * SIG_STRIDE, tl.int32), level + 1, err_ptr, 6, r2,
                timeout_ns, HAS_TIMER, mask_ptr, SHRINK)
        src2 = peer_ptr(ptr_table, me, area_off + r2 * src_bytes, tl.int32)
        t_r2 = _header_tokens(src2, M, err_ptr, r2, _alive(mask_ptr, r2, SHRINK))
        for tb in range(0, t_r2, TB):
            tt = tb + tl.arange(0, TB)
            hit, kpos = _hits(src2, msg_bytes, tt, tt < t_r2, kk, e, K)
            begin += tl.sum(hit.to(tl.int32), 0)
    row_words = H // 2
    if USE_FP8:
        row_words = H // 4
    src = peer_ptr(ptr_table, me, area_off + r * src_bytes, tl.int32)
    t_r = _header_tokens(src, M, err_ptr, r, _alive(mask_ptr, r, SHRINK))
    running = tl.zeros((), dtype=tl.int32)
    for tb in range(0, t_r, TB):
        tt = tb + tl.arange(0, TB)
        hit, kpos = _hits(src, msg_bytes, tt, tt < t_r, kk, e, K)
        tt64 = tt.to(tl.int64)
        h = hit.to(tl.int32)
        rel = tl.cumsum(h, 0) - h
        row = begin + running + rel
        if s == 0:
            tl.store(out_src + (l * RM + row).to(tl.int64), tt, mask=hit)
            slot = peer_ptr(ptr_table, me, slot_off + r * M * MAX_TOPK * 4, tl.int32)
            tl.store(slot + tt64 * MAX_TOPK + kpos, (l * RM + row), mask=hit)
        nh = tl.sum(h, 0)
        qq0 = tl.arange(0, QB)
        for q0 in range(s * QB, nh, S * QB):
            qq = q0 + qq0
            qv = qq < nh
            sel = hit[None, :] & (rel[None, :] == qq[:, None])
            tok = tl.sum(tl.where(sel, tt[None, :], 0), 1).to(tl.int64)
            rowq = begin + running + qq
            dstq = (l * RM + rowq).to(tl.int64)
            payq = src + (HEADER // 4) + tok * (msg_bytes // 4) + MAX_TOPK
            for c0 in range(0, row_words, BLOCK):
                cc = c0 + cols
                cm = qv[:, None] & (cc[None, :] < row_words)
                v = tl.load(payq[:, None] + cc[None, :], mask=cm)
                tl.store(out_x + dstq[:, None] * row_words + cc[None, :], v, mask=cm)
            if USE_FP8:
                sp = (payq + H // 4).to(tl.pointer_type(tl.float32))
                gm = qv[:, None] & (gg[None, :] < G)
                sc = tl.load(sp[:, None] + gg[None, :], mask=gm, other=1.0)
                if UE8M0:
                    G4 = (G + 3) // 4
                    ex = (sc.to(tl.int32, bitcast=True) >> 23) & 0xFF
                    ex = tl.where(gg[None, :] < G, ex, 0)
                    ex3 = tl.reshape(ex, (QB, G_POW2 // 4, 4))
                    sh = tl.arange(0, 4) * 8
                    packed = tl.sum(ex3 << sh[None, None, :], 2)
                    g4 = tl.arange(0, G_POW2 // 4)
                    tl.store(out_s + (l * G4 + g4[None, :]).to(tl.int64) * RM + rowq[:, None], packed,
                             mask=qv[:, None] & (g4[None, :] < G4))
                else:
                    tl.store(out_s + (l * G + gg[None, :]).to(tl.int64) * RM + rowq[:, None], sc, mask=gm)
        running += nh
    if s == 0:
        tl.store(out_range + l * R + r, (begin.to(tl.int64) << 32) | running.to(tl.int64))
        if r == R - 1:
            tl.store(out_count + l, begin + running)
            if HAS_CUM:
                tl.store(cum_ptr + l, tl.load(cum_ptr + l) + begin + running)
    if ticket_last_n(ticket_ptr, n_programs, LOCAL=True):
        tl.store(level_ptr, level + 1)


@triton.jit
def _ll_weights(pid, P, topk_ptr, w_ptr, T, K, me, R, M, ptr_table, w_off, sig_off, ticket_ptr, mask_ptr,
                SHRINK: tl.constexpr):
    """The weights kernel's work for program ``pid`` of ``P``."""
    kk = tl.arange(0, MAX_TOPK)
    km = kk < K
    for t in range(pid, T, P):
        t64 = _i64(t)
        ids = tl.load(topk_ptr + t64 * K + kk, mask=km, other=-1).to(tl.int32)
        w = tl.load(w_ptr + t64 * K + kk, mask=km, other=0.0)
        for j in range(0, R):
            if _alive(mask_ptr, j, SHRINK) != 0:
                dst = peer_ptr(ptr_table, j, w_off + (me * M + t64) * MAX_TOPK * 8, tl.int32)
                tl.store(dst + kk, ids)
                tl.store(dst.to(tl.pointer_type(tl.float32)) + MAX_TOPK + kk, w)
    if ticket_last_n(ticket_ptr, P):
        for j in range(0, R):
            if _alive(mask_ptr, j, SHRINK) != 0:
                signal(peer_ptr(ptr_table, j, sig_off + (SIG_W * R + me) * 4, tl.int32), 1)


@triton.jit
def _ll_reduce(idx, cs, n_programs, y_ptr, H, K, me, R, L, M, ptr_table, d_area_off, src_bytes, w_off, slot_off,
               c_off, sig_off, CW, wlevel_ptr, ticket_ptr, err_ptr, timeout_ns, mask_ptr, K_POW2: tl.constexpr,
               BLOCK: tl.constexpr, HAS_TIMER: tl.constexpr, SHRINK: tl.constexpr):
    """The reduce kernel's work for its program ``(idx, cs)`` of ``n_programs``."""
    kk = tl.arange(0, MAX_TOPK)
    level = tl.load(wlevel_ptr)
    r = idx // M
    t = idx % M
    t_r = _header_tokens(peer_ptr(ptr_table, me, d_area_off + r * src_bytes, tl.int32), M, err_ptr, r,
                         _alive(mask_ptr, r, SHRINK))
    if t < t_r:
        wait_ge(peer_ptr(ptr_table, me, sig_off + (SIG_W * R + r) * 4, tl.int32), level + 1, err_ptr, 7, r,
                timeout_ns, HAS_TIMER, mask_ptr, SHRINK)
        lo = me * L
        wrow = peer_ptr(ptr_table, me, w_off + (_i64(r) * M + t) * MAX_TOPK * 8, tl.int32)
        ids = tl.load(wrow + kk)
        w = tl.load(wrow.to(tl.pointer_type(tl.float32)) + MAX_TOPK + kk)
        here = (kk < K) & (ids >= lo) & (ids < lo + L)
        if tl.sum(here.to(tl.int32), 0) > 0:
            slots = tl.load(peer_ptr(ptr_table, me, slot_off + (_i64(r) * M + t) * MAX_TOPK * 4, tl.int32) + kk,
                            mask=here, other=0)
            out = peer_ptr(ptr_table, r, c_off + (me * M + _i64(t)) * H * 4, tl.float32)
            k2 = tl.arange(0, K_POW2)
            h2 = tl.sum(tl.where(kk[None, :] == k2[:, None], here[None, :].to(tl.int32), 0), 1) > 0
            s2 = tl.sum(tl.where(kk[None, :] == k2[:, None], slots[None, :], 0), 1).to(tl.int64)
            w2 = tl.sum(tl.where(kk[None, :] == k2[:, None], w[None, :], 0.0), 1)
            cols = tl.arange(0, BLOCK)
            for c0 in range(cs * CW, tl.minimum(H, (cs + 1) * CW), BLOCK):
                cc = c0 + cols
                cm = cc < H
                tile = tl.load(y_ptr + s2[:, None] * H + cc[None, :], mask=h2[:, None] & cm[None, :], other=0.0)
                acc = tl.sum(tile.to(tl.float32) * w2[:, None], 0)
                tl.store(out + cc, acc, mask=cm)
    if ticket_last_n(ticket_ptr, n_programs):
        tl.store(wlevel_ptr, level + 1)
        for j in range(0, R):
            if _alive(mask_ptr, j, SHRINK) != 0:
                signal(peer_ptr(ptr_table, j, sig_off + (SIG_C * R + me) * 4, tl.int32), 1)


@triton.jit(do_not_specialize=['T'])
def _ll_combine_recv_kernel(topk_ptr, T, H, K, me, R, L, M, ptr_table, c_off, sig_off, out_ptr, wait_ptr,
                            clevel_ptr, ticket_ptr, err_ptr, timeout_ns, mask_ptr,
                            K_POW2: tl.constexpr, R_POW2: tl.constexpr, BLOCK: tl.constexpr,
                            HAS_WAIT: tl.constexpr, HAS_TIMER: tl.constexpr, SHRINK: tl.constexpr,
                            SIG_STRIDE: tl.constexpr = 4):
    """Program ``(t, c)``: ``out[t, cB:(c+1)B] = Σ_j partial_j[t]`` over the ranks ``j`` holding one of
    token ``t``'s experts, in rank order, float32, rounded once to bf16."""
    _ll_combine_recv(tl.program_id(0), tl.program_id(1), tl.num_programs(0) * tl.num_programs(1), topk_ptr, T, H,
                     K, me, R, L, M, ptr_table, c_off, sig_off, out_ptr, wait_ptr, clevel_ptr, ticket_ptr, err_ptr,
                     timeout_ns, mask_ptr, K_POW2, R_POW2, BLOCK, HAS_WAIT, HAS_TIMER, SHRINK, SIG_STRIDE)


@triton.jit
def _ll_combine_recv(t, cb, n_programs, topk_ptr, T, H, K, me, R, L, M, ptr_table, c_off, sig_off, out_ptr, wait_ptr,
                     clevel_ptr, ticket_ptr, err_ptr, timeout_ns, mask_ptr, K_POW2: tl.constexpr,
                     R_POW2: tl.constexpr, BLOCK: tl.constexpr, HAS_WAIT: tl.constexpr, HAS_TIMER: tl.constexpr,
                     SHRINK: tl.constexpr, SIG_STRIDE: tl.constexpr = 4):
    """The combine receive kernel's work for its program ``(t, cb)`` of ``n_programs`` (``SIG_STRIDE`` and the
    relaxed GPU-scope ticket as in ``_ll_recv``: 8.7 -> 8.0 us at 128 tokens on one H200)."""
    level = tl.load(clevel_ptr)
    kk = tl.arange(0, K_POW2)
    rr = tl.arange(0, R_POW2)
    t64 = _i64(t)
    ids = tl.load(topk_ptr + t64 * K + kk, mask=(kk < K) & (t < T), other=-1)
    owner = tl.where(ids >= 0, ids // L, -1)
    has = tl.sum(tl.where(owner[:, None] == rr[None, :], 1, 0), 0)
    first = (t == 0) & (cb == 0)
    cc = cb * BLOCK + tl.arange(0, BLOCK)
    cm = cc < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, R):
        hj = tl.sum(tl.where(rr == j, has, 0), 0)
        if (hj > 0) | (HAS_WAIT & first):
            t0 = now_ns(HAS_WAIT & HAS_TIMER)
            wait_ge(peer_ptr(ptr_table, me, sig_off + (SIG_C * R + j) * SIG_STRIDE, tl.int32), level + 1, err_ptr, 7, j,
                    timeout_ns, HAS_TIMER, mask_ptr, SHRINK)
            if HAS_WAIT:
                if first:
                    tl.atomic_add(wait_ptr + j, (now_ns(HAS_WAIT & HAS_TIMER) - t0).to(tl.int64))
            if (hj * _alive(mask_ptr, j, SHRINK)) > 0:
                part = peer_ptr(ptr_table, me, c_off + (_i64(j) * M + t64) * H * 4, tl.float32)
                acc += tl.load(part + cc, mask=cm, other=0.0)
    if t < T:
        tl.store(out_ptr + t64 * H + cc, acc.to(tl.bfloat16), mask=cm)
    if ticket_last_n(ticket_ptr, n_programs, LOCAL=True):
        tl.store(clevel_ptr, level + 1)


@triton.jit(do_not_specialize=['T', 'n_w'])
@symbol("_ZN6epcomm2ll7combineEv")  # epcomm::ll::combine()
def _ll_combine_kernel(topk_ptr, w_ptr, T, K, me, R, M, ptr_table, w_off, sig_off, wticket_ptr, mask_ptr,
                             y_ptr, H, L, d_area_off, src_bytes, slot_off, c_off, CW, wlevel_ptr, rticket_ptr,
                             err_ptr, timeout_ns, out_ptr, wait_ptr, clevel_ptr, cticket_ptr, role_ptr,
                             n_w, n_cs, n_red, n_cb, K_POW2: tl.constexpr, R_POW2: tl.constexpr,
                             BLOCK: tl.constexpr, RBLOCK: tl.constexpr, HAS_WAIT: tl.constexpr,
                             HAS_TIMER: tl.constexpr, SHRINK: tl.constexpr, DO_RECV: tl.constexpr,
                             RECV_ONLY: tl.constexpr = False):
    """The combine: ``n_w`` programs do the weights kernel's work, the next ``n_red`` the reduce
    kernel's (``n_cs`` channel splits per source token), and with ``DO_RECV`` (no hook) the rest the
    receive kernel's (``n_cb`` channel blocks per token). Roles go by a ticket taken at the start, in
    that order: a program gets a role that waits on other GPUs only once every role before it is held
    by a running program (see ``_ll_dispatch_kernel``). ``RECV_ONLY`` (the hook's second launch,
    ``n_w = n_red = 0``): every program a receiver, by its id, compiled without the other roles."""
    n_all = tl.num_programs(0)
    if RECV_ONLY:
        role = tl.program_id(0)
    else:
        role = tl.atomic_add(role_ptr, 1)
        if role == n_all - 1:
            tl.atomic_xchg(role_ptr, 0)
    if RECV_ONLY:
        _ll_combine_recv(role // n_cb, role % n_cb, n_all, topk_ptr, T, H, K, me, R, L, M, ptr_table, c_off, sig_off,
                         out_ptr, wait_ptr, clevel_ptr, cticket_ptr, err_ptr, timeout_ns, mask_ptr, K_POW2, R_POW2,
                         BLOCK, HAS_WAIT, HAS_TIMER, SHRINK)
    elif role < n_w:
        _ll_weights(role, n_w, topk_ptr, w_ptr, T, K, me, R, M, ptr_table, w_off, sig_off, wticket_ptr, mask_ptr,
                    SHRINK)
    elif role < n_w + n_red:
        q = role - n_w
        _ll_reduce(q // n_cs, q % n_cs, n_red, y_ptr, H, K, me, R, L, M, ptr_table, d_area_off, src_bytes, w_off,
                   slot_off, c_off, sig_off, CW, wlevel_ptr, rticket_ptr, err_ptr, timeout_ns, mask_ptr, K_POW2,
                   RBLOCK, HAS_TIMER, SHRINK)
    else:
        if DO_RECV:
            q = role - n_w - n_red
            _ll_combine_recv(q // n_cb, q % n_cb, n_all - n_w - n_red, topk_ptr, T, H, K, me, R, L, M, ptr_table,
                             c_off, sig_off, out_ptr, wait_ptr, clevel_ptr, cticket_ptr, err_ptr, timeout_ns,
                             mask_ptr, K_POW2, R_POW2, BLOCK, HAS_WAIT, HAS_TIMER, SHRINK)


@triton.jit
def _i64(v):
    return v + tl.zeros((), dtype=tl.int64)

"""High-throughput kernels of the internode backend (Triton + NVSHMEM), hierarchical as DeepEP's: a
token crosses the network at most once per destination node, to the rank with the sender's local
index there (its *relay*), which forwards it over NVLink to the ranks of its node that hold its
experts (this module: the layout exchange and the dispatch; the combine, which reduces inside the node
first and sends one partial sum per token and node back: ``internode_ht_combine.py``).

Letters: ``T`` tokens of a rank, ``TM`` the most tokens any rank has (every area's rows), ``R`` ranks,
``N`` ranks per node, ``P = R/N`` nodes, rank ``s = a*N + i`` (node ``a``, local index ``i``).
Rows are int32 words: ``_hd_send`` packs a message from the inputs, ``_hd_gather`` unpacks it into the outputs.

0. ``_hn_prep`` (the layout from ``is_token_in_rank``, staged) and ``_hn_notify`` (the exchange): their
   docstrings.

Dispatch (``W`` words per payload row, messages of ``W + R`` words: the row, then for every rank the
row's position in that rank's block from this source, or -1):
1. ``_hd_send`` at source ``s``, blocks of ``RB`` tokens a program: stage their messages in its own
   buffer; put them to relay ``(b, i)``'s RDMA area, slot ``a``, rows ``npos[t, b]`` (their positions
   among the tokens for node ``b``) for every node ``b`` they go to, one put per run of at most ``CH``
   consecutive tokens (a store when ``b == a``: the relay is ``s``); signal each relay (``D_RDMA[a]``).
2. ``_hd_forward`` at relay ``(b, i)``: for source node ``a``, row ``q``: store the row into the NVL
   area of each rank ``(b, j)`` that wants it, slot ``s``, at its position; signal them (``D_FWD[i]``).
   Not launched in nodes of one rank: the gather reads the node slots (``DIRECT``).
3. ``_hd_gather`` at receiver: after every relay of its node signalled, rows in (source rank, token)
   order into the outputs (``recv_x``, scales, local top-k ids and weights, token index: what the
   reference backend returns), padding past the rows that arrived.

Grids are fixed by the host's shapes (a captured call's cannot follow the counts): programs loop over
the rows their device-side counts give.

Combine: ``internode_ht_combine.py`` (its kernels use this module's helpers and signal words).

Signals (uint64 words, only increased by one per call), per parity at ``sig_off``: ``D_RDMA[P]`` (word
``a``), ``D_FWD[N]`` (``P + i``), ``C_REL[N]`` (``P + N + j``), ``C_FIN[P]`` (``P + 2N + b``); every
waiting kernel keeps the level it expects next in local memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvshmem as nv
from .common import peer_ptr, record_error, signal, ticket_last_n, wait_ge


@triton.jit
def _copy_words(dst, src, n, BLOCK: tl.constexpr):
    cc = tl.arange(0, BLOCK)
    for c0 in range(0, n, BLOCK):
        m = (c0 + cc) < n
        tl.store(dst + c0 + cc, tl.load(src + c0 + cc, mask=m), mask=m)


@triton.jit
def _sig(ptr_table, rank, sig_off, idx):
    return peer_ptr(ptr_table, rank, sig_off + idx * 8, tl.int64)


@triton.jit
def _wait(ptr_table, me, sig_off, idx, target, err_ptr, phase, peer, timeout_ns, HAS_TIMER: tl.constexpr):
    """Wait for this rank's uint64 signal ``idx`` (low word) to reach ``target``."""
    wait_ge(peer_ptr(ptr_table, me, sig_off + idx * 8, tl.int32), target, err_ptr, phase, peer, timeout_ns,
            HAS_TIMER)


@triton.jit(do_not_specialize=['T', 'per_chan'])
def _hn_prep_kernel(is_in_ptr, T, R, N, C, per_chan, ntpr_ptr, ntpe_ptr, L, stage_ptr, S, rel_ptr, npos_ptr, cpm_ptr,
                    BLOCK: tl.constexpr, R_POW2: tl.constexpr):
    """The layout of a dispatch from ``is_token_in_rank`` (``is_in [T, R]``, one byte a flag), for every rank
    ``j`` (programs loop over them): ``rel[:, j]`` (each token's row among those for ``j``, -1 where not), ``cpm[j]``
    (the channel prefix: channel ``c`` holds tokens ``[c*per_chan, (c+1)*per_chan)``; past the tokens,
    the total), and for ``j = b*N`` node ``b``'s ``npos[:, b]`` (the same among the tokens for any rank
    of ``b``); the exchange rows into ``stage [R, S]``: in every row the count for ``j``, its
    ``num_tokens_per_rank[j]`` and node ``b``'s count; in row ``j`` the token count, ``cpm[j]`` and the
    expert counts of ``j``. Example: ``is_in[:, j] = [1, 0, 1]`` -> ``rel[:, j] = [0, -1, 1]``, count 2."""
    P = R // N
    dd = tl.arange(0, R_POW2)
    dm = dd < R
    c0 = 2 * R + 1 + P
    for j in range(tl.program_id(0), R, tl.num_programs(0)):  # (programs loop over the ranks)
        row = stage_ptr + j * S
        running = tl.zeros((), tl.int32)
        for b0 in range(0, T, BLOCK):
            offs = b0 + tl.arange(0, BLOCK)
            m = offs < T
            f = tl.load(is_in_ptr + offs.to(tl.int64) * R + j, mask=m, other=0).to(tl.int32)
            cs = tl.cumsum(f, 0)
            tl.store(rel_ptr + offs.to(tl.int64) * R + j, tl.where(f != 0, running + cs - f, -1), mask=m)
            ends = m & (((offs + 1) % per_chan == 0) | (offs == T - 1))
            ch = offs // per_chan
            tl.store(cpm_ptr + j * C + ch, running + cs, mask=ends)
            tl.store(row + c0 + ch, running + cs, mask=ends)
            running += tl.sum(f, 0)
        for q0 in range(0, C, BLOCK):
            cc = q0 + tl.arange(0, BLOCK)
            past = (cc < C) & (cc * per_chan >= T)
            tl.store(cpm_ptr + j * C + cc, tl.zeros_like(cc) + running, mask=past)
            tl.store(row + c0 + cc, tl.zeros_like(cc) + running, mask=past)
        tl.store(stage_ptr + dd * S + j, tl.zeros_like(dd) + running, mask=dm)
        tl.store(stage_ptr + dd * S + R + j, tl.zeros_like(dd) + tl.load(ntpr_ptr + j), mask=dm)
        tl.store(row + 2 * R, T)
        for l0 in range(0, L, BLOCK):
            ll = l0 + tl.arange(0, BLOCK)
            tl.store(row + c0 + C + ll, tl.load(ntpe_ptr + j * L + ll, mask=ll < L, other=0), mask=ll < L)
        if j % N == 0:
            b = j // N
            run2 = tl.zeros((), tl.int32)
            for b0 in range(0, T, BLOCK):
                offs = b0 + tl.arange(0, BLOCK)
                m = offs < T
                g = tl.zeros((BLOCK,), tl.int32)
                for k in range(N):
                    g = g | tl.load(is_in_ptr + offs.to(tl.int64) * R + b * N + k, mask=m, other=0).to(tl.int32)
                cs = tl.cumsum(g, 0)
                tl.store(npos_ptr + offs.to(tl.int64) * P + b, tl.where(g != 0, run2 + cs - g, -1), mask=m)
                run2 += tl.sum(g, 0)
            tl.store(stage_ptr + dd * S + 2 * R + 1 + b, tl.zeros_like(dd) + run2, mask=dm)


@triton.jit
def _hn_notify_kernel(me, R, S, SU, ptr_table, stage_off, recv_off, recv_stride, nsig_off, out_ptr, level_ptr,
                      ticket_ptr, err_ptr, timeout_ns, BLOCK: tl.constexpr, CHECK: tl.constexpr,
                      HAS_TIMER: tl.constexpr, SIM: tl.constexpr):
    """The layout exchange. For every rank ``d`` (programs loop over them): this rank's row for rank ``d``
    (``S`` words, the first ``SU`` used, staged at ``stage_off`` by ``_hn_prep``) to ``d``'s receive area,
    slot ``me``, with ``d``'s signal word ``me`` (one NVSHMEM put-with-signal; a store and a release where
    ``d`` is this
    rank); then it waits for rank ``d``'s row here and copies it to ``out[d]`` (a private tensor: what
    the later kernels and the host read). With ``CHECK`` (no host synchronisation follows:
    ``num_worst_tokens``), rank ``d``'s ``num_tokens_per_rank`` (words ``R..2R``) is checked against
    its counts (words ``0..R``): error 11 names it.

    The receive area alternates between two parities by the device's count of exchanges (``level``),
    so a replayed CUDA graph alternates too: a rank writes parity ``q`` of call ``c + 2`` only after
    every rank has put its row of call ``c + 1``, which each does after it used its rows of call ``c``.
    Signals are counters (one word per source), compared with the count."""
    GP = tl.num_programs(0)
    level = tl.load(level_ptr)
    area = recv_off + (level % 2) * recv_stride
    for d in range(tl.program_id(0), R, GP):
        d64 = d + tl.zeros((), tl.int64)  # (a loop index: a Python int under the interpreter)
        src = peer_ptr(ptr_table, me, stage_off + d64 * S * 4, tl.int32)
        dst_off = area + me * S * 4
        if d64 == me:
            _copy_words(peer_ptr(ptr_table, me, dst_off, tl.int32), src, SU, BLOCK)
            signal(_sig(ptr_table, me, nsig_off, me), 1)
        else:
            nv.put_signal(ptr_table, me, d64.to(tl.int32), dst_off, src, SU * 4, nsig_off + me * 8, SIM)
    nv.quiet(SIM)
    for d in range(tl.program_id(0), R, GP):
        d64 = d + tl.zeros((), tl.int64)
        _wait(ptr_table, me, nsig_off, d64, level + 1, err_ptr, 1, d64.to(tl.int32), timeout_ns, HAS_TIMER)
        row = peer_ptr(ptr_table, me, area + d64 * S * 4, tl.int32)
        _copy_words(out_ptr + d64 * S, row, SU, BLOCK)
        if CHECK:
            cc = tl.arange(0, BLOCK)
            for c0 in range(0, R, BLOCK):
                m = (c0 + cc) < R
                cnt = tl.load(row + c0 + cc, mask=m, other=0)
                said = tl.load(row + R + c0 + cc, mask=m, other=0)
                if tl.sum((cnt != said).to(tl.int32), 0) > 0:
                    j = tl.min(tl.where(cnt != said, c0 + cc, 1 << 30), 0)
                    record_error(err_ptr, 11, d64.to(tl.int32), tl.load(row + R + j), tl.load(row + j))
    if ticket_last_n(ticket_ptr, GP):
        tl.store(level_ptr, level + 1)


@triton.jit
def _copy_rows(dst, src, ld_ok, st_ok, n, BLOCK: tl.constexpr):
    """Rows of ``n`` int32 words, ``dst[r] <- src[r]`` (``[RB]`` row pointers) where ``st_ok``, zeros where
    not ``ld_ok``: a tile of ``RB x BLOCK`` words a step, so that many loads are in flight at once (a
    row a step, 4 KB, left a program latency-bound at ~4 GB/s)."""
    cc = tl.arange(0, BLOCK)
    for c0 in range(0, n, BLOCK):
        cm = (c0 + cc)[None, :] < n
        v = tl.load(src[:, None] + c0 + cc[None, :], mask=ld_ok[:, None] & cm, other=0)
        tl.store(dst[:, None] + c0 + cc[None, :], v, mask=st_ok[:, None] & cm)


@triton.jit
def _col(tile, idx, j):
    """Column ``j`` of an integer ``[RB, M]`` tile (``idx`` = ``arange(M)``), in registers."""
    return tl.sum(tl.where(idx[None, :] == j, tile, 0), 1)


@triton.jit(do_not_specialize=['T'])
def _hd_send_kernel(x_ptr, s_ptr, id_ptr, w_ptr, rel_ptr, npos_ptr, T, XW, G, K, NSRC, R, CH, me, N, P, ptr_table,
                    stage_off, rdma_off, slot_words, sig_off, ticket_ptr, BLOCK: tl.constexpr, RB: tl.constexpr,
                    S_POW2: tl.constexpr, SIM: tl.constexpr):
    """Program ``p``: blocks of ``RB`` tokens ``t0 = p*RB, (p + programs)*RB, ...``; a block's messages staged
    here as tiles, then to the relay of every node they go to: one put per run of consecutive tokens that
    go there (their rows there are consecutive too), a run cut where a token index is a multiple of
    ``CH`` and at the block's end, so at most ``CH`` rows a put (DeepEP's
    ``num_max_rdma_chunked_send_tokens``); this node's own relay (this rank) by a tile copy.
    A message (``W + R`` words, all int32 views): ``x[t]`` (``XW``), its scales (``G``), top-k ids
    (``2K``: int64), weights (``K``), ``t`` itself where ``NSRC`` (1; 0 in a cached dispatch), then its
    ``R`` positions ``rel[t]``."""
    GP = tl.num_programs(0)
    a = me // N
    i = me % N
    W = XW + G + 3 * K + NSRC
    MW = W + R
    uu = tl.arange(0, RB)
    stage = peer_ptr(ptr_table, me, stage_off, tl.int32)
    for t0 in range(tl.program_id(0) * RB, T, GP * RB):
        tt = t0 + uu.to(tl.int64)
        ok = tt < T
        row = stage + tt * MW
        _copy_rows(row, x_ptr + tt * XW, ok, ok, XW, BLOCK)
        _copy_rows(row + XW, s_ptr + tt * G, ok, ok, G, S_POW2)
        _copy_rows(row + XW + G, id_ptr + tt * (2 * K), ok, ok, 2 * K, S_POW2)
        _copy_rows(row + XW + G + 2 * K, w_ptr + tt * K, ok, ok, K, S_POW2)
        if NSRC > 0:
            tl.store(row + XW + G + 3 * K, tt.to(tl.int32), mask=ok)
        _copy_rows(row + W, rel_ptr + tt * R, ok, ok, R, S_POW2)
        tl.debug_barrier()
        n = tl.minimum(T - t0, RB)
        for b in range(P):
            qs = tl.load(npos_ptr + tt * P + b, mask=ok, other=-1)
            if b == a:  # this rank is its own node's relay
                mine = peer_ptr(ptr_table, me, rdma_off, tl.int32) + (a * slot_words + qs.to(tl.int64) * MW)
                _copy_rows(mine, row, ok & (qs >= 0), ok & (qs >= 0), MW, BLOCK)
            else:
                prev = tl.load(npos_ptr + (tt - 1) * P + b, mask=ok & (uu > 0), other=-1)
                cut = (tt % CH) == 0
                start = (qs >= 0) & ((prev < 0) | cut)
                brk = (qs < 0) | cut
                for u in range(0, n):
                    if tl.sum((start & (uu == u)).to(tl.int32), 0) > 0:
                        q = tl.sum(tl.where(uu == u, qs, 0), 0)
                        end = tl.min(tl.where((uu > u) & brk, uu, n), 0)
                        u64 = t0 + u + tl.zeros((), tl.int64)  # (loop indices: Python ints under the interpreter)
                        off = rdma_off + (a * slot_words + q.to(tl.int64) * MW) * 4
                        nv.put(ptr_table, me, b * N + i, off, stage + u64 * MW, (end - u) * MW * 4, SIM)
    nv.quiet(SIM)
    if ticket_last_n(ticket_ptr, GP):
        for b in range(P):
            relay = b * N + i
            if b == a:
                signal(_sig(ptr_table, me, sig_off, a), 1)
            else:
                nv.put_signal(ptr_table, me, relay, stage_off, peer_ptr(ptr_table, me, stage_off, tl.uint8), 0,
                              sig_off + a * 8, SIM)
        nv.quiet(SIM)


@triton.jit
def _hd_forward_kernel(cnt_ptr, cnt_stride, W, MW, me, N, P, R, ptr_table, rdma_off, slot_words, nvl_off,
                       nvl_slot_words, sig_off, level_ptr, ticket_ptr, err_ptr, timeout_ns, BLOCK: tl.constexpr,
                       RB: tl.constexpr, N_POW2: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Relay program ``g`` of ``G``: for every source node ``a``, blocks of ``RB`` rows ``q0 = g*RB, (g + G)*RB,
    ...`` below ``cnt[a * cnt_stride]`` (the messages node ``a`` sent here), each tile read once and stored
    to the ranks of this node that want its rows."""
    g = tl.program_id(0)
    G = tl.num_programs(0)
    b = me // N
    i = me % N
    level = tl.load(level_ptr)
    uu = tl.arange(0, RB)
    nn = tl.arange(0, N_POW2)
    cc = tl.arange(0, BLOCK)
    rdma = peer_ptr(ptr_table, me, rdma_off, tl.int32)
    for a in range(P):
        cnt = tl.load(cnt_ptr + a * cnt_stride)
        if g * RB < cnt:
            _wait(ptr_table, me, sig_off, a, level + 1, err_ptr, 3, a * N + i, timeout_ns, HAS_TIMER)
        s64 = a * N + i + tl.zeros((), tl.int64)  # (a loop index: a Python int under the interpreter)
        for q0 in range(g * RB, cnt, G * RB):
            qq = q0 + uu.to(tl.int64)
            ok = qq < cnt
            msg = rdma + (a * slot_words + qq * MW)
            pos = tl.load(msg[:, None] + W + b * N + nn[None, :], mask=ok[:, None] & (nn[None, :] < N), other=-1)
            for c0 in range(0, W, BLOCK):
                cm = (c0 + cc)[None, :] < W
                v = tl.load(msg[:, None] + c0 + cc[None, :], mask=ok[:, None] & cm)
                for j in range(N):
                    pj = _col(pos, nn, j)
                    dst = peer_ptr(ptr_table, b * N + j, nvl_off, tl.int32) + (s64 * nvl_slot_words +
                                                                                pj.to(tl.int64) * W)
                    tl.store(dst[:, None] + c0 + cc[None, :], v, mask=(pj >= 0)[:, None] & cm)
    if ticket_last_n(ticket_ptr, G):
        tl.store(level_ptr, level + 1)
        for j in range(N):
            signal(_sig(ptr_table, b * N + j, sig_off, P + i), 1)


@triton.jit
def _source_of(col, rr, qq):
    """``(s, first row of s)`` for received rows ``qq`` (``[RB]``): ``col`` is the inclusive prefix over
    source ranks of the rows this rank receives (``rank_prefix_matrix[:, me]``, padded with a large value)."""
    s = tl.sum((col[None, :] <= qq[:, None]).to(tl.int32), 1)
    return s, tl.max(tl.where(rr[None, :] < s[:, None], col[None, :], 0), 1)


@triton.jit
def _hd_gather_kernel(col_ptr, col_stride, rows, rx_ptr, rs_ptr, rid_ptr, rw_ptr, rsrc_ptr, XW, G, K, NSRC, lo, LX,
                      me, N, P, R, nvl_word_off, nvl_slot_words, row_words, ptr_table, sig_off, level_ptr, ticket_ptr,
                      err_ptr, timeout_ns, BLOCK: tl.constexpr, RB: tl.constexpr, R_POW2: tl.constexpr,
                      K_POW2: tl.constexpr, G_POW2: tl.constexpr, DIRECT: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Program ``g``: after every relay of this node forwarded, blocks of ``RB`` rows ``q < rows``: row
    ``q - first(s)`` of source ``s``'s NVL slot (``_source_of``) into the outputs (int32 views): ``rx[q]``
    (``XW`` words), ``rs[q]`` (``G``), where ``K``: ``rid[q]`` (int64) the top-k ids made local (``id - lo``
    for ids in ``[lo, lo + LX)``, else -1) and ``rw[q]`` the weights (0 where the id is not local), where
    ``NSRC``: ``rsrc[q]`` the source's token index. Past the rows that arrived (the padding of
    ``num_worst_tokens``): zeros, -1 for the ids and the token index, as the reference pads them.
    Slots at word ``nvl_word_off``, ``nvl_slot_words`` apart, rows ``row_words`` apart. ``DIRECT`` (one
    rank a node, nothing forwarded): they are the node slots, whose rows for this rank are in the same
    order (a node's tokens are this rank's), and it waits for every node's send (``D_RDMA``) instead of
    its node's relays (``D_FWD``)."""
    g = tl.program_id(0)
    GP = tl.num_programs(0)
    b = me // N
    level = tl.load(level_ptr)
    if DIRECT:
        for a in range(P):
            _wait(ptr_table, me, sig_off, a, level + 1, err_ptr, 3, a, timeout_ns, HAS_TIMER)
    else:
        for i2 in range(N):
            _wait(ptr_table, me, sig_off, P + i2, level + 1, err_ptr, 3, b * N + i2, timeout_ns, HAS_TIMER)
    rr = tl.arange(0, R_POW2)
    col = tl.load(col_ptr + rr * col_stride, mask=rr < R, other=2147483647)
    n = tl.load(col_ptr + (R - 1) * col_stride)
    uu = tl.arange(0, RB)
    kk = tl.arange(0, K_POW2)
    km = kk[None, :] < K
    nvl = peer_ptr(ptr_table, me, nvl_word_off * 4, tl.int32)
    for q0 in range(g * RB, rows, GP * RB):
        qq = q0 + uu.to(tl.int64)
        inb = qq < rows
        got = qq < n
        s, first = _source_of(col, rr, qq)
        src = nvl + (s.to(tl.int64) * nvl_slot_words + (qq - first) * row_words)
        _copy_rows(rx_ptr + qq * XW, src, got, inb, XW, BLOCK)
        _copy_rows(rs_ptr + qq * G, src + XW, got, inb, G, G_POW2)
        if K > 0:
            m2 = got[:, None] & km
            ids = src[:, None] + XW + G + 2 * kk[None, :]  # int64 as two int32 words (rows need not be 8-aligned)
            e = (tl.load(ids + 1, mask=m2, other=0).to(tl.int64) << 32) | \
                (tl.load(ids, mask=m2, other=0).to(tl.int64) & 0xFFFFFFFF)
            here = m2 & (e >= lo) & (e < lo + LX)
            tl.store(rid_ptr + qq[:, None] * K + kk[None, :], tl.where(here, e - lo, -1), mask=inb[:, None] & km)
            wt = tl.load(src[:, None] + XW + G + 2 * K + kk[None, :], mask=m2, other=0).to(tl.float32, bitcast=True)
            tl.store(rw_ptr + qq[:, None] * K + kk[None, :], tl.where(here, wt, 0.0), mask=inb[:, None] & km)
        if NSRC > 0:
            tok = tl.load(src + XW + G + 3 * K, mask=got, other=-1)
            tl.store(rsrc_ptr + qq, tl.where(got, tok, -1), mask=inb)
    if ticket_last_n(ticket_ptr, GP):
        tl.store(level_ptr, level + 1)

"""High-throughput kernels of the internode backend (Triton + NVSHMEM), hierarchical as DeepEP's: a
token crosses the network at most once per destination node, to the rank with the sender's local
index there (its *relay*), which forwards it over NVLink to the ranks of its node that hold its
experts; combine reduces inside the node first (at the relay), then sends one partial sum per token
and node back.

Letters: ``T`` tokens of a rank, ``TM`` the most tokens any rank has (every area's rows), ``R`` ranks,
``N`` ranks per node, ``P = R/N`` nodes, rank ``s = a*N + i`` (node ``a``, local index ``i``).
Rows are int32 words: ``_hd_send`` packs a message from the inputs, ``_hd_gather`` unpacks it into the outputs.

0. ``_hn_prep`` (the layout from ``is_token_in_rank``, staged) and ``_hn_notify`` (the exchange): their
   docstrings.

Dispatch (``W`` words per payload row, messages of ``W + R`` words: the row, then for every rank the
row's position in that rank's block from this source, or -1):
1. ``_hd_send`` at source ``s``, a chunk of ``CH`` tokens a program: stage their messages in its own
   buffer; put them to relay ``(b, i)``'s RDMA area, slot ``a``, rows ``npos[t, b]`` (their positions
   among the tokens for node ``b``) for every node ``b`` they go to, one put per run of consecutive
   tokens (a store when ``b == a``: the relay is ``s``); signal each relay (``D_RDMA[a]``).
2. ``_hd_forward`` at relay ``(b, i)``: for source node ``a``, row ``q``: store the row into the NVL
   area of each rank ``(b, j)`` that wants it, slot ``s``, at its position; signal them (``D_FWD[i]``).
3. ``_hd_gather`` at receiver: after every relay of its node signalled, rows in (source rank, token)
   order into the outputs (``recv_x``, scales, local top-k ids and weights, token index: what the
   reference backend returns), padding past the rows that arrived.

Grids are fixed by the host's shapes (a captured call's cannot follow the counts): programs loop over
the rows their device-side counts give.

Combine (``CW = H/2 + K + 1`` words: bf16 row, float32 weights, a marker = the device's count of
combines + 1, which ``_hc_final`` advances):
4. ``_hc_send`` at receiver ``(b, j)``: row ``q`` of ``x`` and the weights (source ``s = (a, i)``,
   token ``t``) into relay
   ``(b, i)``'s relay area, slot ``(a, j)``, row ``t``, with the marker; signal the node's relays.
5. ``_hc_relay`` at ``(b, i)``: for ``(a, t)``: Σ over ``j`` of the marked rows in float32 (and the
   weights), staged with the marker; a chunk of ``CH`` consecutive tokens put at once to
   ``s = (a, i)``'s final area, slot ``b``, rows ``t...``; signal.
6. ``_hc_final`` at ``s``: Σ over nodes of the marked partial sums, in node order, float32, then the
   biases, rounded once to BF16.

A combine's parity (its areas, signal words and levels: ``par_bytes`` and ``sig_par`` from parity 0's)
is the device's count of combines modulo 2, so a CUDA graph of combines alone alternates too: a rank
writes parity ``q`` of combine ``c + 2`` only after its ``_hc_final`` of ``c + 1``, which waits on relays
that waited on every rank's ``_hc_send`` of ``c + 1``, each issued after that rank read parity ``q`` of
combine ``c``.

Signals (uint64 words, only increased by one per call), per parity at ``sig_off``: ``D_RDMA[P]`` (word
``a``), ``D_FWD[N]`` (``P + i``), ``C_REL[N]`` (``P + N + j``), ``C_FIN[P]`` (``P + 2N + b``); every waiting kernel keeps the level it expects next in local memory.
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


@triton.jit(do_not_specialize=['T'])
def _hd_send_kernel(x_ptr, s_ptr, id_ptr, w_ptr, rel_ptr, npos_ptr, T, XW, G, K, NSRC, R, CH, me, N, P, ptr_table,
                    stage_off, rdma_off, slot_words, sig_off, ticket_ptr, BLOCK: tl.constexpr, CH_POW2: tl.constexpr,
                    SIM: tl.constexpr):
    """Program ``p``: chunks ``c = p, p + programs, ...``; chunk ``c``'s messages ``t = c*CH ...`` (up to
    ``CH`` tokens) staged here, then to the relay of every node they go to: one put per run of
    consecutive tokens that go there (their rows there are consecutive too), so at most ``CH`` rows a
    put (DeepEP's ``num_max_rdma_chunked_send_tokens``).
    A message (``W + R`` words, all int32 views): ``x[t]`` (``XW``), its scales (``G``), top-k ids
    (``2K``: int64), weights (``K``), ``t`` itself where ``NSRC`` (1; 0 in a cached dispatch), then its
    ``R`` positions ``rel[t]``."""
    GP = tl.num_programs(0)
    a = me // N
    i = me % N
    W = XW + G + 3 * K + NSRC
    MW = W + R
    uu = tl.arange(0, CH_POW2)
    for c in range(tl.program_id(0), (T + CH - 1) // CH, GP):
        t0 = (c + tl.zeros((), tl.int64)) * CH  # (a loop index: a Python int under the interpreter)
        n = tl.minimum(T - t0, CH)
        stage = peer_ptr(ptr_table, me, stage_off + t0 * MW * 4, tl.int32)
        for u in range(0, n):
            t64 = t0 + u
            row = stage + (t64 - t0) * MW
            _copy_words(row, x_ptr + t64 * XW, XW, BLOCK)
            _copy_words(row + XW, s_ptr + t64 * G, G, BLOCK)
            _copy_words(row + XW + G, id_ptr + t64 * 2 * K, 2 * K, BLOCK)
            _copy_words(row + XW + G + 2 * K, w_ptr + t64 * K, K, BLOCK)
            if NSRC > 0:
                tl.store(row + XW + G + 3 * K, t64.to(tl.int32))
            _copy_words(row + W, rel_ptr + t64 * R, R, BLOCK)
        tl.debug_barrier()
        for b in range(P):
            qs = tl.load(npos_ptr + (t0 + uu) * P + b, mask=uu < n, other=-1)
            relay = b * N + i
            for u in range(0, n):
                q = tl.load(npos_ptr + (t0 + u) * P + b)
                u_ = u + tl.zeros((), tl.int64)  # (a loop index: a Python int under the interpreter)
                prev = tl.load(npos_ptr + (t0 + u_ - 1) * P + b, mask=u_ > 0, other=-1)
                if (q >= 0) & (prev < 0):  # a run of tokens for node b starts at u: it ends at the next gap
                    end = tl.min(tl.where((uu > u_) & (qs < 0), uu.to(tl.int64), n), 0)
                    src = stage + u_ * MW
                    off = rdma_off + (a * slot_words + q.to(tl.int64) * MW) * 4
                    if b == a:  # this rank is its own node's relay
                        _copy_words(peer_ptr(ptr_table, me, off, tl.int32), src, (end - u_) * MW, BLOCK)
                    else:
                        nv.put(ptr_table, me, relay, off, src, (end - u_) * MW * 4, SIM)
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
                       HAS_TIMER: tl.constexpr):
    """Relay program ``g`` of ``G``: for every source node ``a``, rows ``q = g, g + G, ...`` below
    ``cnt[a * cnt_stride]`` (the messages node ``a`` sent here) to the ranks of this node that want them."""
    g = tl.program_id(0)
    G = tl.num_programs(0)
    b = me // N
    i = me % N
    level = tl.load(level_ptr)
    for a in range(P):
        cnt = tl.load(cnt_ptr + a * cnt_stride)
        if g < cnt:
            _wait(ptr_table, me, sig_off, a, level + 1, err_ptr, 3, a * N + i, timeout_ns, HAS_TIMER)
        s = a * N + i
        for q in range(g, cnt, G):
            q64 = q + tl.zeros((), tl.int64)  # (a loop index: a Python int under the interpreter)
            msg = peer_ptr(ptr_table, me, rdma_off + (a * slot_words + q64 * MW) * 4, tl.int32)
            for j in range(N):
                pos = tl.load(msg + W + b * N + j)
                if pos >= 0:
                    dst = peer_ptr(ptr_table, b * N + j,
                                   nvl_off + (s * nvl_slot_words + pos.to(tl.int64) * W) * 4, tl.int32)
                    _copy_words(dst, msg, W, BLOCK)
    if ticket_last_n(ticket_ptr, G):
        tl.store(level_ptr, level + 1)
        for j in range(N):
            signal(_sig(ptr_table, b * N + j, sig_off, P + i), 1)


@triton.jit
def _source_of(col, rr, q):
    """``(s, first row of s)`` for received row ``q``: ``col`` is the inclusive prefix over source ranks of
    the rows this rank receives (``rank_prefix_matrix[:, me]``, padded with a large value)."""
    s = tl.sum((col <= q).to(tl.int32), 0)
    return s, tl.max(tl.where(rr < s, col, 0), 0)


@triton.jit
def _hd_gather_kernel(col_ptr, col_stride, rows, rx_ptr, rs_ptr, rid_ptr, rw_ptr, rsrc_ptr, XW, G, K, NSRC, lo, LX,
                      me, N, P, R, nvl_word_off, nvl_slot_words, ptr_table, sig_off, level_ptr, ticket_ptr, err_ptr,
                      timeout_ns, BLOCK: tl.constexpr, R_POW2: tl.constexpr, K_POW2: tl.constexpr,
                      HAS_TIMER: tl.constexpr):
    """Program ``g``: after every relay of this node forwarded, rows ``q = g, g + G, ... < rows``: row
    ``q - first(s)`` of source ``s``'s NVL slot (``_source_of``) into the outputs (int32 views): ``rx[q]``
    (``XW`` words), ``rs[q]`` (``G``), where ``K``: ``rid[q]`` (int64) the top-k ids made local (``id - lo``
    for ids in ``[lo, lo + LX)``, else -1) and ``rw[q]`` the weights (0 where the id is not local), where
    ``NSRC``: ``rsrc[q]`` the source's token index. Past the rows that arrived (the padding of
    ``num_worst_tokens``): zeros, -1 for the ids and the token index, as the reference pads them."""
    g = tl.program_id(0)
    GP = tl.num_programs(0)
    b = me // N
    W = XW + G + 3 * K + NSRC
    level = tl.load(level_ptr)
    for i2 in range(N):
        _wait(ptr_table, me, sig_off, P + i2, level + 1, err_ptr, 3, b * N + i2, timeout_ns, HAS_TIMER)
    rr = tl.arange(0, R_POW2)
    col = tl.load(col_ptr + rr * col_stride, mask=rr < R, other=2147483647)
    n = tl.load(col_ptr + (R - 1) * col_stride)
    cc = tl.arange(0, BLOCK)
    kk = tl.arange(0, K_POW2)
    km = kk < K
    for q in range(g, rows, GP):
        q64 = q + tl.zeros((), tl.int64)  # (a loop index: a Python int under the interpreter)
        if q < n:
            s, first = _source_of(col, rr, q)
            src = peer_ptr(ptr_table, me, (nvl_word_off + s * nvl_slot_words + (q64 - first) * W) * 4, tl.int32)
            _copy_words(rx_ptr + q64 * XW, src, XW, BLOCK)
            _copy_words(rs_ptr + q64 * G, src + XW, G, BLOCK)
            if K > 0:
                ids = src + XW + G + 2 * kk  # int64 as two int32 words (a row need not be 8-byte aligned)
                e = (tl.load(ids + 1, mask=km, other=0).to(tl.int64) << 32) | \
                    (tl.load(ids, mask=km, other=0).to(tl.int64) & 0xFFFFFFFF)
                here = (e >= lo) & (e < lo + LX)
                tl.store(rid_ptr + q64 * K + kk, tl.where(here, e - lo, -1), mask=km)
                wt = tl.load(src + XW + G + 2 * K + kk, mask=km, other=0).to(tl.float32, bitcast=True)
                tl.store(rw_ptr + q64 * K + kk, tl.where(here, wt, 0.0), mask=km)
            if NSRC > 0:
                tl.store(rsrc_ptr + q64, tl.load(src + XW + G + 3 * K))
        else:
            for c0 in range(0, XW, BLOCK):
                tl.store(rx_ptr + q64 * XW + c0 + cc, tl.zeros((BLOCK,), tl.int32), mask=(c0 + cc) < XW)
            for c0 in range(0, G, BLOCK):
                tl.store(rs_ptr + q64 * G + c0 + cc, tl.zeros((BLOCK,), tl.int32), mask=(c0 + cc) < G)
            if K > 0:
                tl.store(rid_ptr + q64 * K + kk, tl.full((K_POW2,), -1, tl.int64), mask=km)
                tl.store(rw_ptr + q64 * K + kk, tl.zeros((K_POW2,), tl.float32), mask=km)
            if NSRC > 0:
                tl.store(rsrc_ptr + q64, -1)
    if ticket_last_n(ticket_ptr, GP):
        tl.store(level_ptr, level + 1)


@triton.jit(do_not_specialize=['rows'])
def _hc_send_kernel(x_ptr, w_ptr, HW, K, col_ptr, col_stride, src_tok_ptr, rows, CW, cid_ptr, me, N, P, R, ptr_table,
                    rel_off, rel_slot_words, sig_off, par_bytes, sig_par, ticket_ptr, BLOCK: tl.constexpr,
                    R_POW2: tl.constexpr):
    """Program ``g``: received rows ``q = g, g + G, ...`` that arrived, each ``x[q]`` (``HW`` words of BF16
    pairs), ``w[q]`` (``K`` float32 words) and the marker (``CW = HW + K + 1`` words), to their source's
    relay here; the source from ``col`` (``_source_of``), the token from ``src_tok``."""
    g = tl.program_id(0)
    G = tl.num_programs(0)
    b = me // N
    j = me % N
    call_id = tl.load(cid_ptr) + 1  # this combine's marker: the device's count of combines, + 1
    par = ((call_id - 1) % 2).to(tl.int64)  # (offsets past 2 GiB)
    rel_off += par * par_bytes
    sig_off += par * sig_par
    rr = tl.arange(0, R_POW2)
    col = tl.load(col_ptr + rr * col_stride, mask=rr < R, other=2147483647)
    n = tl.minimum(tl.load(col_ptr + (R - 1) * col_stride), rows)
    for q in range(g, n, G):
        s, _ = _source_of(col, rr, q)
        t = tl.load(src_tok_ptr + q).to(tl.int64)
        a = s // N
        i = s % N
        dst = peer_ptr(ptr_table, b * N + i, rel_off + ((a * N + j) * rel_slot_words + t * CW) * 4, tl.int32)
        q64 = q + tl.zeros((), tl.int64)  # (a loop index: a Python int under the interpreter)
        _copy_words(dst, x_ptr + q64 * HW, HW, BLOCK)
        _copy_words(dst + HW, w_ptr + q64 * K, K, BLOCK)
        tl.store(dst + CW - 1, call_id)
    if ticket_last_n(ticket_ptr, G):
        for i2 in range(N):
            signal(_sig(ptr_table, b * N + i2, sig_off, P + N + j), 1)


@triton.jit
def _hc_relay_kernel(tok_ptr, tok_stride, H, K, CW, FW, CH, cid_ptr, me, N, P, ptr_table, rel_off, rel_slot_words,
                     stage_off, fin_off, fin_slot_words, sig_off, par_bytes, sig_par, level_ptr, ticket_ptr, err_ptr,
                     timeout_ns, BLOCK: tl.constexpr, K_POW2: tl.constexpr, HAS_TIMER: tl.constexpr,
                     SIM: tl.constexpr):
    """Program ``g`` of ``G``, for every source node ``a``: chunks ``c = g, g + G, ...`` of ``CH`` tokens of
    ``(a, i)`` (``tok[(a * N + i) * tok_stride]`` of them): for each token, Σ over this node's ranks of their rows
    for it, in float32, with the weights, staged; then the chunk's staged rows in one put (stored where
    ``a`` is this node) to ``(a, i)``'s final area, slot ``b`` (DeepEP's
    ``num_max_rdma_chunked_send_tokens`` of the combine). A token no row came for keeps its stale staged
    row, whose old marker ``_hc_final`` skips."""
    g = tl.program_id(0)
    G = tl.num_programs(0)
    b = me // N
    i = me % N
    call_id = tl.load(cid_ptr) + 1
    par = ((call_id - 1) % 2).to(tl.int64)  # (offsets past 2 GiB)
    rel_off += par * par_bytes
    stage_off += par * par_bytes
    fin_off += par * par_bytes
    sig_off += par * sig_par
    level_ptr += par
    level = tl.load(level_ptr)
    for j2 in range(N):
        _wait(ptr_table, me, sig_off, P + N + j2, level + 1, err_ptr, 5, b * N + j2, timeout_ns, HAS_TIMER)
    HW = H // 2
    for a in range(P):
        cnt = tl.load(tok_ptr + (a * N + i) * tok_stride)
        for c in range(g, (cnt + CH - 1) // CH, G):
            t0 = (c + tl.zeros((), tl.int64)) * CH  # (a loop index: a Python int under the interpreter)
            n = tl.minimum(cnt - t0, CH)
            for u in range(0, n):
                t64 = t0 + u
                stage = peer_ptr(ptr_table, me, stage_off + (a * fin_slot_words + t64 * FW) * 4, tl.float32)
                present = tl.zeros((), tl.int32)
                for j in range(N):
                    row = peer_ptr(ptr_table, me, rel_off + ((a * N + j) * rel_slot_words + t64 * CW) * 4, tl.int32)
                    present += (tl.load(row + CW - 1) == call_id).to(tl.int32)
                if present > 0:
                    cc = tl.arange(0, BLOCK)
                    for c0 in range(0, H, BLOCK):
                        cm = (c0 + cc) < H
                        acc = tl.zeros((BLOCK,), tl.float32)
                        for j in range(N):
                            row = peer_ptr(ptr_table, me, rel_off + ((a * N + j) * rel_slot_words + t64 * CW) * 4,
                                           tl.int32)
                            if tl.load(row + CW - 1) == call_id:
                                v = tl.load(row.to(tl.pointer_type(tl.bfloat16)) + c0 + cc, mask=cm, other=0.0)
                                acc += v.to(tl.float32)
                        tl.store(stage + c0 + cc, acc, mask=cm)
                    kk = tl.arange(0, K_POW2)
                    km = kk < K
                    wacc = tl.zeros((K_POW2,), tl.float32)
                    for j in range(N):
                        row = peer_ptr(ptr_table, me, rel_off + ((a * N + j) * rel_slot_words + t64 * CW) * 4,
                                       tl.int32)
                        if tl.load(row + CW - 1) == call_id:
                            wacc += tl.load(row.to(tl.pointer_type(tl.float32)) + HW + kk, mask=km, other=0.0)
                    tl.store(stage + H + kk, wacc, mask=km)
                    tl.store(stage.to(tl.pointer_type(tl.int32)) + FW - 1, call_id)
            tl.debug_barrier()
            first = peer_ptr(ptr_table, me, stage_off + (a * fin_slot_words + t0 * FW) * 4, tl.int32)
            off = fin_off + (b * fin_slot_words + t0 * FW) * 4
            if a == b:  # the source is this rank
                _copy_words(peer_ptr(ptr_table, me, off, tl.int32), first, n * FW, BLOCK)
            else:
                nv.put(ptr_table, me, a * N + i, off, first, n * FW * 4, SIM)
    nv.quiet(SIM)
    if ticket_last_n(ticket_ptr, G):
        tl.store(level_ptr, level + 1)
        for a2 in range(P):
            if a2 == b:
                signal(_sig(ptr_table, me, sig_off, P + 2 * N + b), 1)
            else:
                nv.put_signal(ptr_table, me, a2 * N + i, stage_off, peer_ptr(ptr_table, me, stage_off, tl.uint8), 0,
                              sig_off + (P + 2 * N + b) * 8, SIM)
        nv.quiet(SIM)


@triton.jit(do_not_specialize=['T'])
def _hc_final_kernel(out_ptr, wout_ptr, b0_ptr, b1_ptr, T, H, K, FW, cid_ptr, me, N, P, ptr_table, fin_off,
                     fin_slot_words, sig_off, par_bytes, sig_par, level_ptr, ticket_ptr, err_ptr, timeout_ns,
                     BLOCK: tl.constexpr, K_POW2: tl.constexpr, HAS_W: tl.constexpr, NB: tl.constexpr,
                     HAS_TIMER: tl.constexpr):
    """Program ``g`` of ``G``, tokens ``t = g, g + G, ...``: ``out[t] = Σ_b partial_b[t]`` over the nodes
    whose partial carries this call's marker, in node order, float32, plus the ``NB`` (0-2) BF16 biases
    in order, rounded once to BF16
    (and the weights, float32)."""
    g = tl.program_id(0)
    G = tl.num_programs(0)
    call_id = tl.load(cid_ptr) + 1
    par = ((call_id - 1) % 2).to(tl.int64)  # (offsets past 2 GiB)
    fin_off += par * par_bytes
    sig_off += par * sig_par
    level_ptr += par
    level = tl.load(level_ptr)
    i = me % N
    for b in range(P):
        _wait(ptr_table, me, sig_off, P + 2 * N + b, level + 1, err_ptr, 5, b * N + i, timeout_ns, HAS_TIMER)
    for t in range(g, T, G):
        t64 = t + tl.zeros((), tl.int64)  # (a loop index: a Python int under the interpreter)
        cc = tl.arange(0, BLOCK)
        for c0 in range(0, H, BLOCK):
            cm = (c0 + cc) < H
            acc = tl.zeros((BLOCK,), tl.float32)
            for b in range(P):
                part = peer_ptr(ptr_table, me, fin_off + (b * fin_slot_words + t64 * FW) * 4, tl.float32)
                if tl.load(part.to(tl.pointer_type(tl.int32)) + FW - 1) == call_id:
                    acc += tl.load(part + c0 + cc, mask=cm, other=0.0)
            if NB > 0:
                acc += tl.load(b0_ptr + t64 * H + c0 + cc, mask=cm, other=0.0).to(tl.float32)
            if NB > 1:
                acc += tl.load(b1_ptr + t64 * H + c0 + cc, mask=cm, other=0.0).to(tl.float32)
            tl.store(out_ptr + t64 * H + c0 + cc, acc.to(tl.bfloat16), mask=cm)
        if HAS_W:
            kk = tl.arange(0, K_POW2)
            km = kk < K
            wacc = tl.zeros((K_POW2,), tl.float32)
            for b in range(P):
                part = peer_ptr(ptr_table, me, fin_off + (b * fin_slot_words + t64 * FW) * 4, tl.float32)
                if tl.load(part.to(tl.pointer_type(tl.int32)) + FW - 1) == call_id:
                    wacc += tl.load(part + H + kk, mask=km, other=0.0)
            tl.store(wout_ptr + t64 * K + kk, wacc, mask=km)
    if ticket_last_n(ticket_ptr, G):
        tl.store(level_ptr, level + 1)
        tl.store(cid_ptr, call_id)  # (the last kernel of the combine on this rank counts it)

"""High-throughput combine kernel of the internode backend (Triton + NVSHMEM): the reverse of the
dispatch in ``internode_ht.py`` (its letters, channels, counters and free words), reducing inside the
node first, in one launch of ``Config.num_sms`` programs in three roles (as the dispatch's: programs
``[lo, lo + n)`` each, in this order, never waiting on a later program of the launch).

Rows: ``CW = pad4(H/2 + K)`` words (a BF16 row of ``x``, then its ``K`` float32 weights); a partial sum ``FW =
pad4(H + K)`` float32 words, or in nodes of one rank the row itself (``FW = CW``: a sum of one row, exact).
Strides are padded to 16 bytes (``internode_ht_rows``).

1. **senders** (nodes of more than one rank) at ``(b, j)``, unit ``(s, c)`` for sources ``s = (a, i)``
   whose relay ``(b, i)`` is another rank: this rank's rows of ``x`` from channel ``c`` of ``s`` (rows
   ``[rcp[s][c], rcp[s][c+1])``, as the dispatch's receiver took them), with their weights, into
   ``(b, i)``'s relay area, slot ``(a, j)``, at the same row of ``s``'s block; its counter
   ``C_CS[a][j][c]`` grows by them after each tile (a release atomic).
2. **relays** at ``(b, i)``, unit ``(a, c)``: channel ``c`` of source ``s = (a, i)``, node row by node row
   (``ncp``; for ``a = b`` this rank's own tokens): Σ over the node's ranks ``j``, in rank order, float32,
   of their rows for it (row ``tbl[slot a][q][j]`` of relay slot ``(a, j)``, kept by the dispatch's
   forwarder; for ``j = i`` this rank's own ``x``; for ``a = b`` the rows ``rel[t, j]``), once
   ``C_CS[a][j][c]`` counts them. For another node the partials are staged and put to ``s``'s final area,
   slot of ``b``, in puts of at most ``CH`` rows (Config's RDMA chunk of the combine, from the channel's
   first row), then a ``fence`` and one ``signal_add`` of the rows to ``C_FN[b][c]`` at ``s``; for this
   node they go to this rank's own final slot, counted in its ``C_FN[b][c]`` by a release atomic. A source
   whose buffer NVSHMEM maps here (``P2P``) gets the partials stored straight into its final slot, each
   tile counted by a release atomic (no staging, no put). In
   nodes of one rank the rows of ``x`` are the partials (staged as they are, BF16), and a rank's own
   rows stay where they are (the final reads ``x``).
3. **finals** at ``(a, i)``, channel ``c`` of its tokens: ``out[t] = Σ_b partial_b[npos[t, b]]`` over the
   nodes ``b`` it went to, in node order, float32, once ``C_FN[b][c]`` counts them, then the ``NB``
   (0-2) BF16 biases in order, rounded once to BF16 (and the weights, float32).

In nodes of one rank the launch's programs take both relay and final roles instead, half a channel at a time
where it can (``PAIR``: ``backends/internode_ht.InternodeHighThroughput.combine``, ``internode_ht_pair``; its
halves are counted in ``C_FN[b][c]`` and the channels in ``C_FN[b][C + c]``).

Free words: a sender waits for ``F_CS[i]`` (relay ``i`` read the call before last of this parity), a
relay for ``F_FN[a]`` (source node ``a``'s final read its slots); the last program raises them and counts
the combine. A combine's parity is the device's count of combines modulo 2, so a CUDA graph of combines
alone alternates too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvshmem as nv
from .common import ticket_last_n
from .internode_ht_pair import _hc_pair
from .internode_ht_prep import _wait
from .internode_ht_rows import (
    _base_add,
    _biased_store,
    _copy_rows,
    _free,
    _mapped,
    _node_unit,
    _publish_direct,
    _put_chunks,
    pad4,
)


@triton.jit
def _hc_send(g, GC, x_ptr, w_ptr, rows, HW, K, me, N, P, R, C, rpm_ptr, rcp_ptr, ptr_table, area, TM, ctr_off, ctr32,
             CM, C_CS, F_CS, cc, err_ptr, timeout_ns, BLOCK: tl.constexpr, RB: tl.constexpr, K_POW2: tl.constexpr,
             HAS_TIMER: tl.constexpr):
    """Sender ``g`` of ``GC`` at ``(b, j)`` (module docstring, 1)."""
    b = me // N
    j = me % N
    CW = pad4(HW + K)
    for i2 in range(N):  # the node's relays freed their relay areas of this parity (the call before last)
        if i2 != j:
            if tl.atomic_add(ctr32 + 2 * (F_CS + i2), 0, sem="acquire", scope="sys") - (cc - 1) < 0:
                _wait(ptr_table, me, ctr_off, F_CS + i2, cc - 1, err_ptr, 4, b * N + i2, timeout_ns, HAS_TIMER)
    uu = tl.arange(0, RB)
    for u in range(g, P * (N - 1) * C, GC):
        a, i, c, _, first, q_lo, q_hi = _node_unit(u, C, N, j, R, rpm_ptr, rcp_ptr)
        relay = b * N + i
        slot = a * (N - 1) + j - (j > i).to(tl.int32)
        peer8 = tl.load(ptr_table + relay).to(tl.pointer_type(tl.uint8))
        dst = (peer8 + area).to(tl.pointer_type(tl.int32)) + slot.to(tl.int64) * TM * CW
        ctr = (peer8 + ctr_off).to(tl.pointer_type(tl.int64)) + C_CS + (a * N + j) * CM + c
        for q0 in range(q_lo, q_hi, RB):
            qq = q0 + uu.to(tl.int64)
            ok = qq < q_hi
            have = ok & (first + qq < rows)  # (rows past x's: more arrived than num_worst_tokens, error 9)
            row = tl.multiple_of(dst + qq * CW, 16)
            _copy_rows(row, x_ptr + (first + qq) * HW, have, ok, HW, BLOCK)
            if K > 0:
                _copy_rows(row + HW, w_ptr + (first + qq) * K, have, ok, K, K_POW2)
            tl.debug_barrier()  # (the tile stored by every thread before the count that publishes it)
            tl.atomic_add(ctr, (tl.minimum(q0 + RB, q_hi) - q0).to(tl.int64), sem="release", scope="sys")


@triton.jit
def _partial(acc_rows, relp, ok, i, N, own_rows, own_w, own_ok, rel, a, TM, CW, H, K, RB: tl.constexpr,
             BLOCK: tl.constexpr, K_POW2: tl.constexpr):
    """Σ over ranks ``j`` in order of their rows for a tile of tokens, float32, into ``acc_rows`` (``[RB]``
    float32 row pointers, ``H`` then ``K`` words): rank ``j``'s row is ``relp[:, j]`` (``[RB]`` pointers to
    each token's rows at the node's ranks, -1: none) of relay slot ``(a, j)`` in ``rel``, this rank's
    (``j = i``) is ``own_rows`` (BF16 ``x``) and ``own_w`` (its float32 weights), row pointers, read where
    ``own_ok``."""
    cc = tl.arange(0, BLOCK)
    kk = tl.arange(0, K_POW2)
    km = kk[None, :] < K
    HW = H // 2
    for c0 in range(0, H, BLOCK):
        cm = (c0 + cc)[None, :] < H
        acc = tl.full((RB, BLOCK), 0.0, tl.float32)
        for j in range(N):
            rj = tl.load(relp + j, mask=ok, other=-1).to(tl.int64)
            mj = (ok & (rj >= 0))[:, None] & cm
            if j == i:
                row = own_rows
                mj = mj & own_ok[:, None]
            else:
                slot = a * (N - 1) + j - (j > i).to(tl.int32)
                row = tl.multiple_of((rel + (slot.to(tl.int64) * TM + rj) * CW).to(tl.pointer_type(tl.bfloat16)),
                                     16)
            acc += tl.load(row[:, None] + c0 + cc[None, :], mask=mj, other=0.0).to(tl.float32)
        tl.store(acc_rows[:, None] + c0 + cc[None, :], acc, mask=ok[:, None] & cm)
    if K > 0:
        wacc = tl.full((RB, K_POW2), 0.0, tl.float32)
        for j in range(N):
            rj = tl.load(relp + j, mask=ok, other=-1).to(tl.int64)
            mj = (ok & (rj >= 0))[:, None] & km
            if j == i:
                row = own_w
                mj = mj & own_ok[:, None]
            else:
                slot = a * (N - 1) + j - (j > i).to(tl.int32)
                row = (rel + (slot.to(tl.int64) * TM + rj) * CW + HW).to(tl.pointer_type(tl.float32))
            wacc += tl.load(row[:, None] + kk[None, :], mask=mj, other=0.0)
        tl.store(acc_rows[:, None] + H + kk[None, :], wacc, mask=ok[:, None] & km)


@triton.jit
def _node_rows(relp, ok, i, N, a, c, CM, C_CS, base_ptr, ctr32, ptr_table, me, ctr_off, b, err_ptr, timeout_ns,
               HAS_TIMER: tl.constexpr):
    """Wait until every other rank ``j`` of node ``b`` has sent its rows of a tile (``relp``: ``[RB]``
    pointers to each token's rows at the node's ranks, -1: none): its ``C_CS[a][j][c]`` counts all its
    rows of this channel so far; the base, this call's target, grows by the tile's as it goes."""
    for j in range(N):
        if j != i:
            k = C_CS + (a * N + j) * CM + c
            target = _base_add(base_ptr + k, tl.sum(((tl.load(relp + j, mask=ok, other=-1) >= 0) & ok).to(tl.int32),
                                                    0))
            if tl.atomic_add(ctr32 + 2 * k, 0, sem="acquire", scope="sys") - target < 0:
                _wait(ptr_table, me, ctr_off, k, target, err_ptr, 5, b * N + j, timeout_ns, HAS_TIMER)
    tl.debug_barrier()


@triton.jit
def _hc_relay(g, GR, x_ptr, xw_ptr, w_ptr, rows, H, K, rel_ptr, npos_ptr, T, pc, me, N, P, R, C, CH, rpm_ptr, ncp_ptr,
              tbl_ptr, ptr_table, area, stage_rel, fin_rel, TM, ctr_off, ctr32, CM, C_CS, C_FN, F_FN, cc, base_ptr, P2P,
              err_ptr, timeout_ns, BLOCK: tl.constexpr, RB: tl.constexpr, K_POW2: tl.constexpr,
              HAS_TIMER: tl.constexpr, SIM: tl.constexpr):
    """Relay ``g`` of ``GR`` at ``(b, i)`` (module docstring, 2). ``x_ptr`` BF16 ``[rows, H]`` (``xw_ptr`` the
    same as int32 words), ``w_ptr`` its weights (float32 as int32 words). Partials for a source NVSHMEM
    maps go straight into its final slot, counted by a release atomic after each tile (``P2P``)."""
    b = me // N
    i = me % N
    HW = H // 2
    CW = pad4(HW + K)
    FW = tl.where(N > 1, pad4(H + K), CW)
    for a2 in range(P):  # the other nodes' finals freed their slots of this parity (the call before last)
        if a2 != b:
            if tl.atomic_add(ctr32 + 2 * (F_FN + a2), 0, sem="acquire", scope="sys") - (cc - 1) < 0:
                _wait(ptr_table, me, ctr_off, F_FN + a2, cc - 1, err_ptr, 4, a2 * N + i, timeout_ns, HAS_TIMER)
    uu = tl.arange(0, RB)
    me8 = tl.load(ptr_table + me).to(tl.pointer_type(tl.uint8))
    rel = (me8 + area).to(tl.pointer_type(tl.int32))
    stage = (me8 + area + stage_rel).to(tl.pointer_type(tl.int32))
    fin = (me8 + area + fin_rel).to(tl.pointer_type(tl.int32))
    for u in range(g, P * C, GR):
        a = u // C
        c = u % C
        s = a * N + i
        first = tl.load(rpm_ptr + (s - 1) * R, mask=s > 0, other=0)  # source s's first row here
        if a == b:  # this rank's own tokens; in nodes of one rank nothing to do (the final reads x)
            if N > 1:
                t_lo = c * pc
                t_hi = tl.minimum(t_lo + pc, T)
                for t0 in range(t_lo, t_hi, RB):
                    tt = t0 + uu.to(tl.int64)
                    q = tl.load(npos_ptr + tt * P + b, mask=tt < t_hi, other=-1).to(tl.int64)
                    ok = q >= 0
                    relp = rel_ptr + tt * R + b * N
                    _node_rows(relp, ok, i, N, a, c, CM, C_CS, base_ptr, ctr32, ptr_table, me, ctr_off, b, err_ptr,
                               timeout_ns, HAS_TIMER)
                    mine = first + tl.load(relp + i, mask=ok, other=-1)
                    acc = tl.multiple_of((fin + ((P - 1) * TM + q) * FW).to(tl.pointer_type(tl.float32)), 16)
                    _partial(acc, relp, ok, i, N, x_ptr + mine * H, (w_ptr + mine * K).to(tl.pointer_type(tl.float32)),
                             mine < rows, rel, a, TM, CW, H, K, RB, BLOCK, K_POW2)
                    tl.debug_barrier()  # (this rank's final reads the partials after the count)
                    tl.atomic_add(ctr32.to(tl.pointer_type(tl.int64)) + C_FN + b * CM + c,
                                  tl.sum(ok.to(tl.int64), 0), sem="release", scope="sys")
        else:
            q_lo = tl.load(ncp_ptr + s * C + c - 1, mask=c > 0, other=0)
            q_hi = tl.load(ncp_ptr + s * C + c)
            src = stage + ((a - b - 1 + P) % P).to(tl.int64) * TM * FW
            dst = area + fin_rel + ((b - a - 1 + P) % P).to(tl.int64) * TM * FW * 4  # (at s)
            s8, direct = _mapped(ptr_table, s, P2P)
            if direct:  # the partials go straight into s's final slot
                src = (s8 + dst).to(tl.pointer_type(tl.int32))
            for q0 in range(q_lo, q_hi, RB):
                qq = q0 + uu.to(tl.int64)
                ok = qq < q_hi
                prow = tl.multiple_of(src + qq * FW, 16)
                if N > 1:
                    relp = tbl_ptr + (((a - b - 1 + P) % P) * TM + qq) * N
                    _node_rows(relp, ok, i, N, a, c, CM, C_CS, base_ptr, ctr32, ptr_table, me, ctr_off, b, err_ptr,
                               timeout_ns, HAS_TIMER)
                    mine = first + tl.load(relp + i, mask=ok, other=-1)
                    _partial(tl.multiple_of(prow.to(tl.pointer_type(tl.float32)), 16), relp, ok, i, N, x_ptr + mine * H,
                             (w_ptr + mine * K).to(tl.pointer_type(tl.float32)), mine < rows, rel, a, TM, CW, H, K, RB,
                             BLOCK, K_POW2)
                else:  # the row itself (x and its weights), staged for the put
                    have = ok & (first + qq < rows)
                    _copy_rows(prow, xw_ptr + (first + qq) * HW, have, ok, HW, BLOCK)
                    if K > 0:
                        _copy_rows(prow + HW, w_ptr + (first + qq) * K, have, ok, K, K_POW2)
                tl.debug_barrier()  # (the tile written by every thread before the puts read it or the count)
                before = (q0 - q_lo).to(tl.int64)
                after = (tl.minimum(q0 + RB, q_hi) - q_lo).to(tl.int64)
                p0 = before // CH * CH  # the earlier tiles put their whole chunks
                upto = tl.where(q0 + RB >= q_hi, after, after // CH * CH)  # (the rest at the channel's end)
                if direct:  # (the chunks' rows are at s already)
                    _publish_direct(s8, ctr_off, C_FN + b * CM + c, upto - p0)
                elif upto > p0:
                    _put_chunks(ptr_table, me, s, dst + q_lo * FW * 4, src + q_lo * FW, p0, upto, CH, FW,
                                ctr_off + (C_FN + b * CM + c) * 8, SIM)
    nv.quiet(SIM)


@triton.jit
def _hc_final(g, GF, x_ptr, w_ptr, rows, out_ptr, wout_ptr, b0_ptr, b1_ptr, H, K, rel_ptr, npos_ptr, T, pc, me, N, P, R,
              C, rpm_ptr, ptr_table, fin, TM, ctr_off, ctr32, CM, C_FN, base_ptr, err_ptr, timeout_ns,
              BLOCK: tl.constexpr, RB: tl.constexpr, K_POW2: tl.constexpr, HAS_W: tl.constexpr, NB: tl.constexpr,
              HAS_TIMER: tl.constexpr):
    """Final ``g`` of ``GF`` at ``(a, i)`` (module docstring, 3). ``x_ptr`` BF16 ``[rows, H]``, ``w_ptr`` its
    weights (float32 as int32 words), ``out [T, H]`` BF16, ``wout [T, K]``, the biases ``[T, H]`` BF16."""
    a = me // N
    i = me % N
    HW = H // 2
    FW = tl.where(N > 1, pad4(H + K), pad4(HW + K))
    WO = tl.where(N > 1, H, HW)  # where a partial's weights start
    uu = tl.arange(0, RB)
    cl = tl.arange(0, BLOCK)
    kk = tl.arange(0, K_POW2)
    km = kk[None, :] < K
    first = tl.load(rpm_ptr + (me - 1) * R, mask=me > 0, other=0)  # this rank's own rows in x
    for c in range(g, C, GF):
        t_lo = c * pc
        t_hi = tl.minimum(t_lo + pc, T)
        for t0 in range(t_lo, t_hi, RB):
            tt = t0 + uu.to(tl.int64)
            ok = tt < t_hi
            npos = npos_ptr + tt * P
            for b in range(P):  # each node's partials of this tile: C_FN[b][c] counts them (base: so far)
                if (b != a) | (N > 1):
                    k = C_FN + b * CM + c
                    target = _base_add(base_ptr + k, tl.sum((tl.load(npos + b, mask=ok, other=-1) >= 0).to(tl.int32),
                                                            0))
                    if tl.atomic_add(ctr32 + 2 * k, 0, sem="acquire", scope="sys") - target < 0:
                        _wait(ptr_table, me, ctr_off, k, target, err_ptr, 5, b * N + i, timeout_ns, HAS_TIMER)
            tl.debug_barrier()
            for c0 in range(0, H, BLOCK):
                cm = (c0 + cl)[None, :] < H
                acc = tl.full((RB, BLOCK), 0.0, tl.float32)
                for b in range(P):
                    q = tl.load(npos + b, mask=ok, other=-1).to(tl.int64)
                    m = (q >= 0)[:, None] & cm
                    if (b == a) & (N == 1):  # this rank's own rows: x itself (q = rel[t, me])
                        v = tl.load(x_ptr + (first + q)[:, None] * H + c0 + cl[None, :],
                                    mask=m & (first + q < rows)[:, None], other=0.0)
                        acc += v.to(tl.float32)
                    else:
                        slot = tl.where(b == a, P - 1, (b - a - 1 + P) % P)
                        part = fin + (slot.to(tl.int64) * TM + q) * FW
                        if N > 1:
                            pf = tl.multiple_of(part.to(tl.pointer_type(tl.float32)), 16)
                            acc += tl.load(pf[:, None] + c0 + cl[None, :], mask=m, other=0.0)
                        else:
                            pb = tl.multiple_of(part.to(tl.pointer_type(tl.bfloat16)), 16)
                            acc += tl.load(pb[:, None] + c0 + cl[None, :], mask=m, other=0.0).to(tl.float32)
                _biased_store(acc, tt[:, None] * H + c0 + cl[None, :], ok[:, None] & cm, out_ptr, b0_ptr, b1_ptr, NB)
            if HAS_W:
                wacc = tl.full((RB, K_POW2), 0.0, tl.float32)
                for b in range(P):
                    q = tl.load(npos + b, mask=ok, other=-1).to(tl.int64)
                    m = (q >= 0)[:, None] & km
                    if (b == a) & (N == 1):
                        wrow = (w_ptr + (first + q) * K).to(tl.pointer_type(tl.float32))
                        m = m & (first + q < rows)[:, None]
                    else:
                        slot = tl.where(b == a, P - 1, (b - a - 1 + P) % P)
                        wrow = (fin + (slot.to(tl.int64) * TM + q) * FW + WO).to(tl.pointer_type(tl.float32))
                    wacc += tl.load(wrow[:, None] + kk[None, :], mask=m, other=0.0)
                tl.store(wout_ptr + tt[:, None] * K + kk[None, :], wacc, mask=ok[:, None] & km)


@triton.jit(do_not_specialize=['T', 'pc', 'rows', 's_lo', 's_n', 'r_lo', 'r_n', 'f_lo', 'f_n', 'P2P', 'PAIR'])  # (TUNE)
def _hc_kernel(x_ptr, xw_ptr, w_ptr, rows, H, K, rel_ptr, npos_ptr, nco_ptr, T, pc, C, rpm_ptr, rcp_ptr, ncp_ptr,
               tbl_ptr, out_ptr, wout_ptr, b0_ptr, b1_ptr, me, N, P, R, CH, ptr_table, area_off, par_bytes, stage_rel,
               fin_rel, TM, ctr_off, CM, base_ptr, cnt_ptr, ticket_ptr, err_ptr, timeout_ns, s_lo, s_n, r_lo, r_n, f_lo,
               f_n, P2P, PAIR, BLOCK: tl.constexpr, FBLOCK: tl.constexpr, RB: tl.constexpr, K_POW2: tl.constexpr,
               P_POW2: tl.constexpr, HAS_W: tl.constexpr, NB: tl.constexpr, STAGES: tl.constexpr,
               HAS_TIMER: tl.constexpr, SIM: tl.constexpr):
    """One combine (module docstring): program ``p`` is sender ``p - s_lo`` (of ``s_n``), then relay ``p -
    r_lo`` (of ``r_n``), then final ``p - f_lo`` (of ``f_n``), where it is in their ranges; with ``PAIR`` (nodes
    of one rank, ``2C <= CM``) every program is both, a unit at a time (``internode_ht_pair``: ``nco [P, C]``
    this rank's channel prefix for each node, ``FBLOCK`` columns a step ``STAGES`` deep, ``P_POW2`` nodes
    unrolled). ``x [rows, H]`` BF16 (``xw`` the same as int32 words), ``w [rows, K]`` float32 weights as int32
    words (``K = 0``: none); the handle's layout as the dispatch's (``internode_ht._internode_dispatch_impl_kernel``),
    ``tbl [P-1, TM, N]`` the forwarder's positions. Areas at ``area_off + parity * par_bytes`` (the device's
    count of combines, ``cnt[0]``): relay slots at 0, staging at ``stage_rel``, final slots at ``fin_rel``, ``TM``
    rows each, of ``pad4`` strides. ``P2P``: relays store to the finals NVSHMEM maps (``internode_ht_rows``)."""
    pid = tl.program_id(0)
    cc = tl.load(cnt_ptr)
    area = area_off + (cc % 2).to(tl.int64) * par_bytes  # (offsets past 2 GiB)
    me8 = tl.load(ptr_table + me).to(tl.pointer_type(tl.uint8))
    ctr32 = (me8 + ctr_off).to(tl.pointer_type(tl.int32))  # (a counter's low word: 2 * its index)
    HW = H // 2  # (H is even: x is viewed as int32 words)
    C_CS = (P + R) * CM
    C_FN = C_CS + R * CM
    F_CS = (2 * P + 2 * R) * CM + P + N
    F_FN = F_CS + N
    if PAIR != 0:
        _hc_pair(pid, tl.num_programs(0), x_ptr, xw_ptr, w_ptr, rows, H, K, npos_ptr, nco_ptr, T, pc, me, P, R, C, CH,
                 rpm_ptr, ncp_ptr, out_ptr, wout_ptr, b0_ptr, b1_ptr, ptr_table, area, stage_rel, fin_rel, TM, ctr_off,
                 ctr32, CM, C_FN, F_FN, cc, base_ptr, P2P, err_ptr, timeout_ns, BLOCK, FBLOCK, RB, K_POW2, P_POW2,
                 HAS_W, NB, STAGES, HAS_TIMER, SIM)
    if (PAIR == 0) & (pid >= s_lo) & (pid < s_lo + s_n):
        _hc_send(pid - s_lo, s_n, xw_ptr, w_ptr, rows, HW, K, me, N, P, R, C, rpm_ptr, rcp_ptr, ptr_table, area, TM,
                 ctr_off, ctr32, CM, C_CS, F_CS, cc, err_ptr, timeout_ns, BLOCK, RB, K_POW2, HAS_TIMER)
    if (PAIR == 0) & (pid >= r_lo) & (pid < r_lo + r_n):
        _hc_relay(pid - r_lo, r_n, x_ptr, xw_ptr, w_ptr, rows, H, K, rel_ptr, npos_ptr, T, pc, me, N, P, R, C, CH,
                  rpm_ptr, ncp_ptr, tbl_ptr, ptr_table, area, stage_rel, fin_rel, TM, ctr_off, ctr32, CM, C_CS, C_FN,
                  F_FN, cc, base_ptr, P2P, err_ptr, timeout_ns, BLOCK, RB, K_POW2, HAS_TIMER, SIM)
    if (PAIR == 0) & (pid >= f_lo) & (pid < f_lo + f_n):
        _hc_final(pid - f_lo, f_n, x_ptr, w_ptr, rows, out_ptr, wout_ptr, b0_ptr, b1_ptr, H, K, rel_ptr, npos_ptr, T,
                  pc, me, N, P, R, C, rpm_ptr, ptr_table, (me8 + area + fin_rel).to(tl.pointer_type(tl.int32)), TM,
                  ctr_off, ctr32, CM, C_FN, base_ptr, err_ptr, timeout_ns, BLOCK, RB, K_POW2, HAS_W, NB, HAS_TIMER)
    if ticket_last_n(ticket_ptr, tl.num_programs(0)):  # every program has read its slots: free them
        _free(ptr_table, me, N, P, ctr_off, F_CS, F_FN, cnt_ptr, cc, SIM)  # (relay of its node; final)

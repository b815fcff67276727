"""High-throughput kernels of the internode backend (Triton + NVSHMEM), hierarchical as DeepEP's: a
token crosses the network at most once per destination node, to the rank with the sender's local
index there (its *relay*), which forwards it over NVLink to the ranks of its node that hold its
experts (this module: the layout exchange and the dispatch; the combine, which reduces inside the node
first and sends one partial sum per token and node back: ``internode_ht_combine.py``).

Letters: ``T`` tokens of a rank, ``TM`` the rows of every slot (the most tokens any rank has), ``R``
ranks, ``N`` ranks per node, ``P = R/N`` nodes, rank ``s = a*N + i`` (node ``a``, local index ``i``),
``C`` channels, ``CM`` the most channels (the counters' stride).

0. ``_hn_prep`` (the layout from ``is_token_in_rank``, staged) and ``_hn_notify`` (the exchange): their
   docstrings.

**Channels.** A rank's tokens are split into ``C`` channels of ``pc = ceil(T/C)`` consecutive tokens (the
handle's channels). The rows a channel gives a node, a rank, or a relay's partial sums are consecutive,
and the exchange tells every consumer where each channel's rows start and end: the relay the source's
channel prefix for its node (``ncp``), a receiver its channel prefix for that rank (the handle's
``recv_channel_prefix_matrix``). So each channel flows by itself, in order, and a consumer waits only
for the rows it is about to read.

**Counters.** A producer adds the rows it has published to a uint64 counter per (source, channel) at the
consumer; counters only grow. The consumer keeps, in private memory, the total it has consumed from each
counter over past calls (its *base*): a tile of rows ``[lo, q1)`` of a channel starting at ``lo`` is
there once the counter reaches ``base + q1 - lo``; at the channel's end the base grows by the channel's
rows. A producer's rows of a call all land before its next call's (every program ends with ``quiet``,
stores complete with their kernel), so a counter past the target never counts a later call's rows
before this call's.

Dispatch: one launch, ``Config.num_sms`` programs in three roles (programs ``[lo, lo + n)`` each, in this
order; with fewer programs than roles the last takes the rest, after its own: a program never waits on
a later program of its launch, the Triton interpreter's order):
1. **senders** (nodes of other nodes to send to): channel ``c`` of this rank ``(a, i)``: each token's
   message (``x | scales | top-k ids | weights | token index``, ``W`` int32 words, then its position at
   each rank of the node, ``NR`` words) staged once per node ``b`` it goes to, at that node's row
   ``npos[t, b]`` (stage slot of ``b``); after each block of ``RB`` tokens, the rows staged for ``b`` so
   far go to relay ``(b, i)`` in puts of at most ``CH`` rows (Config's RDMA chunk, counted from the
   channel's first row; a chunk not full yet waits for the next block, or the channel's end), then a
   ``fence``, then one ``signal_add`` of the rows to counter ``D_RD[a][c]`` there. A relay whose buffer
   NVSHMEM maps here (``P2P``: ``internode_ht_rows``) gets the message rows written straight into its
   RDMA slot instead, and after each block their count by a release atomic: no staging, no put.
2. **forwarders**, unit ``(a, c)`` (source ``s = (a, i)``, channel ``c``; this node's units first, its
   own tokens waiting on nothing): for ``a`` this node, this rank's own tokens straight from the inputs; else
   the rows of slot ``a`` as ``D_RD[a][c]`` says they arrived. Each row is stored to the NVL slot of ``s`` at
   every other rank ``j`` of the node that wants it (row ``rel[t, j]``), whose counter ``D_NV[s][c]`` then
   grows by its rows (a release atomic after each tile); rows for this rank go straight into the outputs
   (unpacked as the receivers do). Also the padding past the rows that arrive (``num_worst_tokens``).
3. **receivers** (nodes of more than one rank), unit ``(s, c)`` for sources whose relay is another rank
   of this node: the rows of NVL slot ``s`` as ``D_NV[s][c]`` says, unpacked into the outputs:
   ``recv_x``, scales, the top-k ids made local and their weights, the token index (what the reference
   backend returns), at the source's row block (``rank_prefix_matrix``).

In nodes of one rank there are no receivers, and nothing is stored to a peer: the forwarder is the
receiver. Passes over the payload: a token read once per node from the inputs; rows for another node
staged, put, then unpacked at its relay (or forwarded, then unpacked), or with ``P2P`` stored into the
relay's slot, then unpacked; a rank's own rows for its node go from its inputs to the outputs, with no
staging. Rows start 16-byte aligned (strides ``pad4``): ``internode_ht_rows``.

**Slots free.** Areas alternate between two parities by the device's count of dispatches (a CUDA graph
alternates too). Before its first write of a call a producer waits until each consumer has finished the
call before last (the one that used this parity): counters ``F_RD[b]`` (relay ``b`` read its RDMA slots)
at the senders, ``F_NV[j]`` (receiver ``j`` read its NVL slots) at the forwarders; the last program of
the launch raises them at the producers and counts the call.

Grids are fixed by ``num_sms`` (a captured call's cannot follow the counts): programs loop over units
and rows from device-side counts. Every wait has the deadline and names the peer and the phase
(``common.PHASES``: 2 for the slots, 3 for data).

Counter words (uint64, one region, at ``ctr_off``): ``D_RD[P][CM]``, ``D_NV[R][CM]``, the combine's
``C_CS[P][N][CM]`` and ``C_FN[P][CM]``, then ``F_RD[P]``, ``F_NV[N]``, ``F_CS[N]``, ``F_FN[P]``
(:func:`ctr_words`); the private bases are int32 at the same indices.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvshmem as nv
from .common import ticket_last_n

# the layout exchange's kernels live in internode_ht_prep.py (re-exported here), the row movers in internode_ht_rows.py
from .internode_ht_prep import _hn_notify_kernel, _hn_prep_kernel, _wait  # noqa: F401
from .internode_ht_rows import (
    _copy_rows,
    _fan,
    _fan_row,
    _free,
    _mapped,
    _msg_rows,
    _node_unit,
    _nvl_publish,
    _nvl_rows,
    _publish_direct,
    _put_chunks,
    _unpack,
    pad4,
)


def ctr_words(r: int, n: int, cm: int) -> tuple[int, ...]:
    """Word indices of the counter region (module docstring): ``(D_NV, C_CS, C_FN, F_RD, F_NV, F_CS, F_FN,
    total)``; ``D_RD`` is at 0. Example: ``r = 4, n = 2, cm = 128`` -> ``(256, 768, 1280, 1536, 1538, 1540,
    1542, 1544)``."""
    p = r // n
    d_nv = p * cm
    c_cs = d_nv + r * cm
    c_fn = c_cs + r * cm
    f_rd = c_fn + p * cm
    return d_nv, c_cs, c_fn, f_rd, f_rd + p, f_rd + p + n, f_rd + p + 2 * n, f_rd + 2 * p + 2 * n


@triton.jit
def _stage(src, ok, n, col, npos, a, i, N, P, ptr_table, stage, rdma_off, slot_words, MW, P2P, BLK: tl.constexpr):
    """``n`` words of rows ``src`` (``[RB]`` int32 pointers, read once where ``ok``) to column ``col`` of their
    message for every other node ``b`` (row ``npos[:, b]``; ``npos``: ``[RB]`` pointers to the rows of
    ``npos``, -1: not sent there): in the relay's slot or this rank's stage (``_msg_rows``)."""
    cc = tl.arange(0, BLK)
    for c0 in range(0, n, BLK):
        cm = (c0 + cc)[None, :] < n
        v = tl.load(src[:, None] + c0 + cc[None, :], mask=ok[:, None] & cm)
        for b in range(P):
            if b != a:
                q = tl.load(npos + b, mask=ok, other=-1).to(tl.int64)
                row, _ = _msg_rows(q, b, a, i, N, P, ptr_table, stage, rdma_off, slot_words, MW, P2P)
                tl.store(row[:, None] + col + c0 + cc[None, :], v, mask=(q >= 0)[:, None] & cm)


@triton.jit
def _await(seen, target, ptr_table, me, ctr_off, ctr32, idx, err_ptr, peer, timeout_ns, HAS_TIMER: tl.constexpr):
    """Until this rank's counter word ``idx`` reaches ``target`` (phase 3, naming ``peer``), then a barrier;
    returns what it last read of it. ``seen``: its value at an earlier read (an acquire, by this program):
    rows it counted are here already, so a tile within it reads no counter (one acquire atomic at system
    scope a tile cost a round trip to memory each; a producer ahead publishes many tiles at once)."""
    if seen - target < 0:  # (wrapped, as the counters)
        seen = tl.atomic_add(ctr32 + 2 * idx, 0, sem="acquire", scope="sys")
        if seen - target < 0:
            _wait(ptr_table, me, ctr_off, idx, target, err_ptr, 3, peer, timeout_ns, HAS_TIMER)
            seen = target
    tl.debug_barrier()
    return seen


@triton.jit
def _hd_send(g, GS, x_ptr, s_ptr, id_ptr, w_ptr, rel_ptr, npos_ptr, nco_ptr, T, pc, C, XW, G, K, NSRC, NR, me, N, P,
             R, CH, CHD, ptr_table, stage, rdma_off, slot_words, MW, ctr_off, ctr32, CM, F_RD, dc, P2P, err_ptr,
             timeout_ns, BLOCK: tl.constexpr, RB: tl.constexpr, N_POW2: tl.constexpr, S_POW2: tl.constexpr,
             HAS_TIMER: tl.constexpr, SIM: tl.constexpr):
    """Sender ``g`` of ``GS``: channels ``g, g + GS, ...`` of this rank ``(a, i)`` to the relays ``(b, i)`` of
    the other nodes (module docstring, 1). ``nco [P, C]``: this rank's channel prefix for each node (the
    rows a channel gives it: ``[nco[b][c-1], nco[b][c])``). A relay NVSHMEM maps gets its rows by stores
    and their count by a release atomic, a whole number of ``CHD`` rows at a time (``CH``, as the puts
    would send them, or more: ``TUNE["d_p2p_rows"]``, fewer counts and the fences before them; the rest at
    the channel's end) (``P2P``: ``internode_ht_rows``)."""
    a = me // N
    i = me % N
    W = XW + G + 3 * K + NSRC
    for b in range(P):  # the relays' RDMA slots of this parity are free once they read the call before last
        if b != a:
            if tl.atomic_add(ctr32 + 2 * (F_RD + b), 0, sem="acquire", scope="sys") - (dc - 1) < 0:
                _wait(ptr_table, me, ctr_off, F_RD + b, dc - 1, err_ptr, 2, b * N + i, timeout_ns, HAS_TIMER)
    uu = tl.arange(0, RB)
    for c in range(g, C, GS):
        t_lo = c * pc
        t_hi = tl.minimum(t_lo + pc, T)
        for t0 in range(t_lo, t_hi, RB):
            tt = t0 + uu.to(tl.int64)
            ok = tt < t_hi
            npos = npos_ptr + tt * P
            away = ok & (tl.load(npos + (a + 1) % P, mask=ok, other=-1) >= 0)  # sent to another node
            for b in range(2, P):
                away = away | (ok & (tl.load(npos + (a + b) % P, mask=ok, other=-1) >= 0))
            _stage(x_ptr + tt * XW, away, XW, 0, npos, a, i, N, P, ptr_table, stage, rdma_off, slot_words, MW, P2P,
                   BLOCK)
            if G > 0:
                _stage(s_ptr + tt * G, away, G, XW, npos, a, i, N, P, ptr_table, stage, rdma_off, slot_words, MW, P2P,
                       S_POW2)
            if K > 0:
                _stage(id_ptr + tt * (2 * K), away, 2 * K, XW + G, npos, a, i, N, P, ptr_table, stage, rdma_off,
                       slot_words, MW, P2P, S_POW2)
                _stage(w_ptr + tt * K, away, K, XW + G + 2 * K, npos, a, i, N, P, ptr_table, stage, rdma_off,
                       slot_words, MW, P2P, S_POW2)
            for b in range(P):
                if b != a:
                    q = tl.load(npos + b, mask=ok, other=-1).to(tl.int64)
                    row, _ = _msg_rows(q, b, a, i, N, P, ptr_table, stage, rdma_off, slot_words, MW, P2P)
                    if NSRC > 0:
                        tl.store(row + W - 1, tt.to(tl.int32), mask=q >= 0)
                    if NR > 0:  # the token's rows at the ranks of b (-1: none)
                        _copy_rows(row + W, rel_ptr + tt * R + b * N, q >= 0, q >= 0, NR, N_POW2)
            tl.debug_barrier()  # (the block's rows written by every thread before the puts read them or the count)
            last = t0 + RB >= t_hi
            for b in range(P):
                if b != a:
                    q = tl.load(npos + b, mask=ok, other=-1).to(tl.int64)
                    relay = b * N + i
                    f_b = tl.load(nco_ptr + b * C + c - 1, mask=c > 0, other=0).to(tl.int64)
                    total = tl.load(nco_ptr + b * C + c).to(tl.int64) - f_b
                    q_max = tl.max(q, 0)
                    # rows written before this block (all of them where it has none), and after it
                    before = tl.where(q_max >= 0, tl.min(tl.where(q >= 0, q, 1 << 40), 0) - f_b, total)
                    after = tl.where(q_max >= 0, q_max + 1 - f_b, before)
                    base, direct = _mapped(ptr_table, relay, P2P)
                    chb = tl.where(direct, CHD, CH)  # (rows a count covers)
                    p0 = before // chb * chb  # what the earlier blocks sent: their whole chunks
                    upto = tl.where(last, total, after // chb * chb)  # whole chunks; the rest at the channel's end
                    if upto > p0:
                        if direct:  # the chunks' rows are in the relay's slot already: count them there
                            _publish_direct(base, ctr_off, a * CM + c, upto - p0)
                        else:
                            src = stage + ((b - a - 1 + P) % P) * slot_words + f_b * MW
                            dst = rdma_off + (((a - b - 1 + P) % P) * slot_words + f_b * MW) * 4
                            _put_chunks(ptr_table, me, relay, dst, src, p0, upto, CH, MW,
                                        ctr_off + (a * CM + c) * 8, SIM)
    nv.quiet(SIM)


@triton.jit
def _hd_forward(g, GF, x_ptr, s_ptr, id_ptr, w_ptr, rel_ptr, T, pc, C, XW, G, K, NSRC, NR, me, N, P, R,
                rpm_ptr, ncp_ptr, rx_ptr, rs_ptr, rid_ptr, rw_ptr, rsrc_ptr, rows, lo, LX, ptr_table, rdma,
                slot_words, MW, nvl_off, TM, ctr_off, ctr32, CM, D_NV, F_NV, dc, base_ptr, tbl_ptr, SAVE,
                OWN_SPLIT, err_ptr, timeout_ns, BLOCK: tl.constexpr, RB: tl.constexpr, N_POW2: tl.constexpr, K_POW2: tl.constexpr,
                G_POW2: tl.constexpr, S_POW2: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Forwarder ``g`` of ``GF`` at relay ``(b, i)``: units ``(a, c)`` (module docstring, 2), then the padding
    rows ``[n, rows)``. With ``SAVE`` each forwarded row's positions at the node's ranks are kept for the
    combine: ``tbl[slot a][row][j]``. The units of this rank's own node come first (its own tokens: no wait),
    then the other nodes' in turn; with ``OWN_SPLIT`` (nodes of one rank) there are no units of its own node
    (``_hd_own``)."""
    b = me // N
    i = me % N
    W = XW + G + 3 * K + NSRC
    WP = pad4(W)  # an NVL row
    for j in range(N):  # the node's receivers freed their NVL slots of this parity (the call before last)
        if j != i:
            if tl.atomic_add(ctr32 + 2 * (F_NV + j), 0, sem="acquire", scope="sys") - (dc - 1) < 0:
                _wait(ptr_table, me, ctr_off, F_NV + j, dc - 1, err_ptr, 2, b * N + j, timeout_ns, HAS_TIMER)
    uu = tl.arange(0, RB)
    for u in range(g, (P - OWN_SPLIT) * C, GF):  # (OWN_SPLIT: no unit of this node, _hd_own moves its rows)
        a = (u // C + OWN_SPLIT + b) % P
        c = u % C
        s = a * N + i
        first = tl.load(rpm_ptr + (s - 1) * R, mask=s > 0, other=0)  # source s's first row here
        nidx = D_NV + s * CM + c  # the receivers' count of this unit's rows
        if a == b:  # this rank's own tokens (it is their relay in its node): from the inputs
            t_lo = c * pc
            t_hi = tl.minimum(t_lo + pc, T)
            for t0 in range(t_lo, t_hi, RB):
                tt = t0 + uu.to(tl.int64)
                ok = tt < t_hi
                relp = rel_ptr + tt * R + b * N
                if N > 1:
                    peer = tt < 0  # (rows a peer wants: read once)
                    for j in range(N):
                        if j != i:
                            peer = peer | (tl.load(relp + j, mask=ok, other=-1) >= 0)
                    _fan(x_ptr + tt * XW, peer, XW, 0, relp, ptr_table, nvl_off, b, i, N, a, TM, WP, BLOCK)
                    if G > 0:
                        _fan(s_ptr + tt * G, peer, G, XW, relp, ptr_table, nvl_off, b, i, N, a, TM, WP, S_POW2)
                    if K > 0:
                        _fan(id_ptr + tt * (2 * K), peer, 2 * K, XW + G, relp, ptr_table, nvl_off, b, i, N, a, TM, WP,
                             S_POW2)
                        _fan(w_ptr + tt * K, peer, K, XW + G + 2 * K, relp, ptr_table, nvl_off, b, i, N, a, TM, WP,
                             S_POW2)
                    if NSRC > 0:  # the token index, the message's last word
                        for j in range(N):
                            if j != i:
                                dst, want = _nvl_rows(relp, j, i, a, b, N, ok, ptr_table, nvl_off, TM, WP)
                                tl.store(dst + W - 1, tt.to(tl.int32), mask=want)
                ri = tl.load(relp + i, mask=ok, other=-1).to(tl.int64)
                _unpack(first + ri, ri >= 0, ri >= 0, x_ptr + tt * XW, s_ptr + tt * G, id_ptr + tt * (2 * K),
                        w_ptr + tt * K, tt.to(tl.int32), rx_ptr, rs_ptr, rid_ptr, rw_ptr, rsrc_ptr, rows, XW, G, K,
                        NSRC, lo, LX, BLOCK, K_POW2, G_POW2)
                if N > 1:
                    _nvl_publish(relp, ok, ptr_table, ctr_off, b, i, N, nidx)
        else:  # rows of slot a, as they arrive
            ridx = a * CM + c  # D_RD[a][c]
            base = tl.load(base_ptr + ridx)
            q_lo = tl.load(ncp_ptr + s * C + c - 1, mask=c > 0, other=0)
            q_hi = tl.load(ncp_ptr + s * C + c)
            slot = rdma + ((a - b - 1 + P) % P) * slot_words
            seen = base  # the counter as last read (at least what earlier calls consumed)
            for q0 in range(q_lo, q_hi, RB):
                qq = q0 + uu.to(tl.int64)
                ok = qq < q_hi
                target = base + tl.minimum(q0 + RB, q_hi) - q_lo
                seen = _await(seen, target, ptr_table, me, ctr_off, ctr32, ridx, err_ptr, s, timeout_ns, HAS_TIMER)
                msg = tl.multiple_of(slot + qq * MW, 16)
                if N > 1:
                    relp = msg + W
                    peer = qq < 0
                    for j in range(N):
                        if j != i:
                            peer = peer | (tl.load(relp + j, mask=ok, other=-1) >= 0)
                    _fan_row(msg, peer, XW, W, relp, ptr_table, nvl_off, b, i, N, a, TM, WP, BLOCK, S_POW2)
                    if SAVE:
                        rs_ = (a - b - 1 + P) % P
                        _copy_rows(tbl_ptr + (rs_ * TM + qq) * N, relp, ok, ok, N, N_POW2)
                    ri = tl.load(relp + i, mask=ok, other=-1).to(tl.int64)
                else:  # one rank a node: the node's row is the rank's
                    ri = tl.where(ok, qq, -1)
                mine = ri >= 0
                tok = tl.load(msg + W - 1, mask=mine & (NSRC > 0), other=-1)
                _unpack(first + ri, mine, mine, msg, msg + XW, msg + XW + G, msg + XW + G + 2 * K, tok, rx_ptr,
                        rs_ptr, rid_ptr, rw_ptr, rsrc_ptr, rows, XW, G, K, NSRC, lo, LX, BLOCK, K_POW2, G_POW2)
                if N > 1:
                    _nvl_publish(msg + W, ok, ptr_table, ctr_off, b, i, N, nidx)
            tl.store(base_ptr + ridx, base + q_hi - q_lo)
    n = tl.load(rpm_ptr + (R - 1) * R)  # every row that arrives here; past it, the padding
    for q0 in range(n + g * RB, rows, GF * RB):
        qq = q0 + uu.to(tl.int64)
        none = qq < 0
        nowhere = rx_ptr + qq * 0  # (row pointers never read)
        _unpack(qq, none, qq < rows, nowhere, nowhere, nowhere, nowhere, none.to(tl.int32), rx_ptr, rs_ptr, rid_ptr,
                rw_ptr, rsrc_ptr, rows, XW, G, K, NSRC, lo, LX, BLOCK, K_POW2, G_POW2)


@triton.jit
def _hd_own(g, NG, x_ptr, s_ptr, id_ptr, w_ptr, rel_ptr, T, XW, G, K, NSRC, me, R, rpm_ptr, rx_ptr, rs_ptr, rid_ptr,
            rw_ptr, rsrc_ptr, rows, lo, LX, BLOCK: tl.constexpr, RB: tl.constexpr, K_POW2: tl.constexpr,
            G_POW2: tl.constexpr):
    """Nodes of one rank with ``OWN_SPLIT``: this rank's own rows from the inputs into the outputs, tile ``k`` of
    ``RB`` tokens by program ``k mod NG`` of the whole launch, after its role's work. Nothing waits on these
    rows (no peer in the node, no counter), so they need no channel order; spread over every program they
    even out the roles (a forwarder's unit of its own tokens was as long as a sender's or a relayed unit: 36
    such units on 24 programs at DSv3, two on the busiest, where the same rows over 24 make 1.5)."""
    first = tl.load(rpm_ptr + (me - 1) * R, mask=me > 0, other=0)  # this rank's first row of its own block
    uu = tl.arange(0, RB)
    for t0 in range(g * RB, T, NG * RB):
        tt = t0 + uu.to(tl.int64)
        ri = tl.load(rel_ptr + tt * R + me, mask=tt < T, other=-1).to(tl.int64)
        _unpack(first + ri, ri >= 0, ri >= 0, x_ptr + tt * XW, s_ptr + tt * G, id_ptr + tt * (2 * K), w_ptr + tt * K,
                tt.to(tl.int32), rx_ptr, rs_ptr, rid_ptr, rw_ptr, rsrc_ptr, rows, XW, G, K, NSRC, lo, LX, BLOCK,
                K_POW2, G_POW2)


@triton.jit
def _hd_receive(g, GV, XW, G, K, NSRC, me, N, P, R, C, rpm_ptr, rcp_ptr, rx_ptr, rs_ptr, rid_ptr, rw_ptr, rsrc_ptr,
                rows, lo, LX, nvl, TM, ptr_table, ctr_off, ctr32, CM, D_NV, base_ptr, err_ptr, timeout_ns,
                BLOCK: tl.constexpr, RB: tl.constexpr, K_POW2: tl.constexpr, G_POW2: tl.constexpr,
                HAS_TIMER: tl.constexpr):
    """Receiver ``g`` of ``GV`` at ``(b, j)``: units ``(s, c)`` whose relay ``(b, i)`` is another rank (module
    docstring, 3): rows ``[rcp[s][c], rcp[s][c+1])`` of source ``s``'s block, from NVL slot ``k``."""
    b = me // N
    j = me % N
    W = XW + G + 3 * K + NSRC
    WP = pad4(W)
    uu = tl.arange(0, RB)
    for u in range(g, P * (N - 1) * C, GV):
        a, i, c, k, first, q_lo, q_hi = _node_unit(u, C, N, j, R, rpm_ptr, rcp_ptr)
        s = a * N + i
        nidx = D_NV + s * CM + c
        base = tl.load(base_ptr + nidx)
        slot = nvl + k.to(tl.int64) * TM * WP
        seen = base
        for q0 in range(q_lo, q_hi, RB):
            qq = q0 + uu.to(tl.int64)
            ok = qq < q_hi
            target = base + tl.minimum(q0 + RB, q_hi) - q_lo
            seen = _await(seen, target, ptr_table, me, ctr_off, ctr32, nidx, err_ptr, b * N + i, timeout_ns, HAS_TIMER)
            row = tl.multiple_of(slot + qq * WP, 16)
            tok = tl.load(row + W - 1, mask=ok & (NSRC > 0), other=-1)
            _unpack(first + qq, ok, ok, row, row + XW, row + XW + G, row + XW + G + 2 * K, tok, rx_ptr, rs_ptr,
                    rid_ptr, rw_ptr, rsrc_ptr, rows, XW, G, K, NSRC, lo, LX, BLOCK, K_POW2, G_POW2)
        tl.store(base_ptr + nidx, base + q_hi - q_lo)


@triton.jit(do_not_specialize=['T', 'pc', 'rows', 's_lo', 's_n', 'f_lo', 'f_n', 'v_lo', 'v_n', 'P2P',
                              'OWN_SPLIT', 'CHD'])  # (a TUNE variant, nodes of one rank or more: one binary)
def _internode_dispatch_impl_kernel(x_ptr, s_ptr, id_ptr, w_ptr, rel_ptr, npos_ptr, nco_ptr, T, pc, C, XW, G, K, NSRC, rpm_ptr, rcp_ptr,
               ncp_ptr, rx_ptr, rs_ptr, rid_ptr, rw_ptr, rsrc_ptr, rows, lo, LX, me, N, P, R, CH, CHD, ptr_table, area_off,
               par_bytes, rdma_rel, nvl_rel, TM, ctr_off, CM, tbl_ptr, SAVE, base_ptr, cnt_ptr, ticket_ptr, err_ptr,
               timeout_ns, s_lo, s_n, f_lo, f_n, v_lo, v_n, P2P, OWN_SPLIT, BLOCK: tl.constexpr,
               RB: tl.constexpr,
               N_POW2: tl.constexpr, K_POW2: tl.constexpr, G_POW2: tl.constexpr, S_POW2: tl.constexpr,
               HAS_TIMER: tl.constexpr, SIM: tl.constexpr):
    """One dispatch (module docstring): program ``p`` is sender ``p - s_lo`` if ``s_lo <= p < s_lo + s_n``,
    then forwarder ``p - f_lo`` (of ``f_n``), then receiver ``p - v_lo`` (of ``v_n``). Inputs as int32 views:
    ``x [T, XW]``, scales ``[T, G]``, top-k ids ``[T, 2K]`` (int64), weights ``[T, K]``, ``NSRC`` (1: carry
    the token index; 0 in a cached dispatch); ``rel [T, R]``, ``npos [T, P]`` this rank's layout, tokens in
    channels of ``pc``, ``nco [P, C]`` their channel prefix for each node; ``rpm`` column ``me`` of the rank
    prefix matrix (stride ``R``), ``rcp [R, C]`` the handle's receive channel prefix, ``ncp [R, C]`` each
    source's channel prefix for this node. Outputs ``rows`` rows. Areas at ``area_off + parity * par_bytes``
    (the device's count of dispatches, ``cnt[0]``): staging at 0, RDMA slots at ``rdma_rel``, NVL slots at
    ``nvl_rel``, ``TM`` rows each, of ``pad4`` strides. ``P2P``: senders store to the relays NVSHMEM maps
    (``internode_ht_rows``), counting ``CHD`` rows at a time (``CH``: Config's RDMA chunk, the puts' most
    rows); ``OWN_SPLIT`` (nodes of one rank): every program moves a share of this rank's own rows after its
    role's work (``_hd_own``)."""
    pid = tl.program_id(0)
    dc = tl.load(cnt_ptr)
    area = area_off + (dc % 2).to(tl.int64) * par_bytes  # (offsets past 2 GiB)
    me8 = tl.load(ptr_table + me).to(tl.pointer_type(tl.uint8))
    ctr32 = (me8 + ctr_off).to(tl.pointer_type(tl.int32))  # (a counter's low word: 2 * its index)
    W = XW + G + 3 * K + NSRC
    NR = tl.where(N > 1, N, 0)  # a message's positions at the destination node's ranks
    MW = pad4(W + NR)  # a message's stride (16-byte aligned rows)
    slot_words = (TM + tl.full((), 0, tl.int64)) * MW
    D_NV = P * CM
    F_RD = (2 * P + 2 * R) * CM
    F_NV = F_RD + P
    if (pid >= s_lo) & (pid < s_lo + s_n):
        _hd_send(pid - s_lo, s_n, x_ptr, s_ptr, id_ptr, w_ptr, rel_ptr, npos_ptr, nco_ptr, T, pc, C, XW, G, K, NSRC,
                 NR, me, N, P, R, CH, CHD, ptr_table, (me8 + area).to(tl.pointer_type(tl.int32)), area + rdma_rel,
                 slot_words, MW, ctr_off, ctr32, CM, F_RD, dc, P2P, err_ptr, timeout_ns, BLOCK, RB, N_POW2, S_POW2,
                 HAS_TIMER, SIM)
    if (pid >= f_lo) & (pid < f_lo + f_n):
        _hd_forward(pid - f_lo, f_n, x_ptr, s_ptr, id_ptr, w_ptr, rel_ptr, T, pc, C, XW, G, K, NSRC, NR, me, N, P, R,
                    rpm_ptr, ncp_ptr, rx_ptr, rs_ptr, rid_ptr, rw_ptr, rsrc_ptr, rows, lo, LX, ptr_table,
                    (me8 + area + rdma_rel).to(tl.pointer_type(tl.int32)), slot_words, MW, area + nvl_rel, TM,
                    ctr_off, ctr32, CM, D_NV, F_NV, dc, base_ptr, tbl_ptr, SAVE, OWN_SPLIT, err_ptr,
                    timeout_ns, BLOCK, RB, N_POW2, K_POW2, G_POW2, S_POW2, HAS_TIMER)
    if (pid >= v_lo) & (pid < v_lo + v_n):
        _hd_receive(pid - v_lo, v_n, XW, G, K, NSRC, me, N, P, R, C, rpm_ptr, rcp_ptr, rx_ptr, rs_ptr, rid_ptr,
                    rw_ptr, rsrc_ptr, rows, lo, LX, (me8 + area + nvl_rel).to(tl.pointer_type(tl.int32)), TM,
                    ptr_table, ctr_off, ctr32, CM, D_NV, base_ptr, err_ptr, timeout_ns, BLOCK, RB, K_POW2, G_POW2,
                    HAS_TIMER)
    if OWN_SPLIT != 0:
        _hd_own(pid, tl.num_programs(0), x_ptr, s_ptr, id_ptr, w_ptr, rel_ptr, T, XW, G, K, NSRC, me, R, rpm_ptr, rx_ptr,
                rs_ptr, rid_ptr, rw_ptr, rsrc_ptr, rows, lo, LX, BLOCK, RB, K_POW2, G_POW2)
    if ticket_last_n(ticket_ptr, tl.num_programs(0)):  # every program has read its slots: free them
        _free(ptr_table, me, N, P, ctr_off, F_NV, F_RD, cnt_ptr, dc, SIM)

"""High-throughput kernels of the internode backend (Triton + NVSHMEM), hierarchical as DeepEP's: a
token crosses the network at most once per destination node, to the rank with the sender's local
index there (its *relay*), which forwards it over NVLink to the ranks of its node that hold its
experts; combine reduces inside the node first (at the relay), then sends one partial sum per token
and node back.

Letters: ``T`` tokens of a rank, ``TM`` the most tokens any rank has (every area's rows), ``R`` ranks,
``N`` ranks per node, ``P = R/N`` nodes, rank ``s = a*N + i`` (node ``a``, local index ``i``).
Rows are opaque int32 words (the payload is packed on the host, ``backends/internode_ht.py``).

Dispatch (``W`` words per payload row, messages of ``W + R`` words: the row, then for every rank the
row's position in that rank's block from this source, or -1):
1. ``_hd_send`` at source ``s``: stage message ``t`` in its own buffer; put it to relay ``(b, i)``'s
   RDMA area, slot ``a``, row ``npos[t, b]`` (its position among the tokens for node ``b``) for every
   node ``b`` it goes to (a store when ``b == a``: the relay is ``s``); signal each relay (``D_RDMA[a]``).
2. ``_hd_forward`` at relay ``(b, i)``: for source node ``a``, row ``q``: store the row into the NVL
   area of each rank ``(b, j)`` that wants it, slot ``s``, at its position; signal them (``D_FWD[i]``).
3. ``_hd_gather`` at receiver: after every relay of its node signalled, rows in (source rank, token)
   order into one ``[n, W]`` tensor (the host unpacks it as the reference backend does).

Combine (``CW = H/2 + K + 1`` words: bf16 row, float32 weights, a marker = the combine's call id):
4. ``_hc_send`` at receiver ``(b, j)``: row ``q`` (source ``s = (a, i)``, token ``t``) into relay
   ``(b, i)``'s relay area, slot ``(a, j)``, row ``t``, with the marker; signal the node's relays.
5. ``_hc_relay`` at ``(b, i)``: for ``(a, t)``: Σ over ``j`` of the marked rows in float32 (and the
   weights); staged and put to ``s = (a, i)``'s final area, slot ``b``, row ``t`` with the marker; signal.
6. ``_hc_final`` at ``s``: Σ over nodes of the marked partial sums, in node order, float32.

Signals (uint64 words, only increased by one per call), per parity at ``sig_off``: ``D_RDMA[P]`` (word
``a``), ``D_FWD[N]`` (``P + i``), ``C_REL[N]`` (``P + N + j``), ``C_FIN[P]`` (``P + 2N + b``); every waiting kernel keeps the level it expects next in local memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvshmem as nv
from .common import peer_ptr, signal, ticket_last_n, wait_ge


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


@triton.jit(do_not_specialize=['T'])
def _hd_send_kernel(msg_ptr, npos_ptr, T, MW, me, N, P, ptr_table, stage_off, rdma_off, slot_words, sig_off,
                    ticket_ptr, BLOCK: tl.constexpr, SIM: tl.constexpr):
    """Program ``t``: message ``t`` (``MW`` words) staged here, then to the relay of every node it goes to."""
    t = tl.program_id(0)
    a = me // N
    i = me % N
    if t < T:
        t64 = t.to(tl.int64)
        stage = peer_ptr(ptr_table, me, stage_off + t64 * MW * 4, tl.int32)
        _copy_words(stage, msg_ptr + t64 * MW, MW, BLOCK)
        tl.debug_barrier()
        for b in range(P):
            q = tl.load(npos_ptr + t64 * P + b)
            if q >= 0:
                relay = b * N + i
                off = rdma_off + (a * slot_words + q.to(tl.int64) * MW) * 4
                if b == a:  # this rank is its own node's relay
                    _copy_words(peer_ptr(ptr_table, me, off, tl.int32), stage, MW, BLOCK)
                else:
                    nv.put(ptr_table, me, relay, off, stage, MW * 4, SIM)
    nv.quiet(SIM)
    if ticket_last_n(ticket_ptr, tl.num_programs(0)):
        for b in range(P):
            relay = b * N + i
            if b == a:
                signal(_sig(ptr_table, me, sig_off, a), 1)
            else:
                nv.put_signal(ptr_table, me, relay, stage_off, peer_ptr(ptr_table, me, stage_off, tl.uint8), 0,
                              sig_off + a * 8, SIM)
        nv.quiet(SIM)


@triton.jit
def _hd_forward_kernel(cnt_ptr, W, MW, me, N, P, R, ptr_table, rdma_off, slot_words, nvl_off, nvl_slot_words,
                       sig_off, level_ptr, ticket_ptr, err_ptr, timeout_ns, BLOCK: tl.constexpr,
                       HAS_TIMER: tl.constexpr):
    """Relay program ``(a, q)``: row ``q`` from source node ``a`` to the ranks of this node that want it."""
    a = tl.program_id(0)
    q = tl.program_id(1)
    b = me // N
    i = me % N
    level = tl.load(level_ptr)
    if q < tl.load(cnt_ptr + a):
        _wait(ptr_table, me, sig_off, a, level + 1, err_ptr, 3, a * N + i, timeout_ns, HAS_TIMER)
        msg = peer_ptr(ptr_table, me, rdma_off + (a * slot_words + q.to(tl.int64) * MW) * 4, tl.int32)
        s = a * N + i
        for j in range(N):
            pos = tl.load(msg + W + b * N + j)
            if pos >= 0:
                dst = peer_ptr(ptr_table, b * N + j, nvl_off + (s * nvl_slot_words + pos.to(tl.int64) * W) * 4,
                               tl.int32)
                _copy_words(dst, msg, W, BLOCK)
    if ticket_last_n(ticket_ptr, tl.num_programs(0) * tl.num_programs(1)):
        tl.store(level_ptr, level + 1)
        for j in range(N):
            signal(_sig(ptr_table, b * N + j, sig_off, P + i), 1)


@triton.jit
def _hd_gather_kernel(off_ptr, n, out_ptr, W, me, N, P, ptr_table, sig_off, level_ptr, ticket_ptr, err_ptr,
                      timeout_ns, BLOCK: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Program ``q``: after every relay of this node forwarded, ``out[q] = NVL area word offset off[q]``."""
    q = tl.program_id(0)
    b = me // N
    level = tl.load(level_ptr)
    for i2 in range(N):
        _wait(ptr_table, me, sig_off, P + i2, level + 1, err_ptr, 3, b * N + i2, timeout_ns, HAS_TIMER)
    if q < n:
        src = peer_ptr(ptr_table, me, tl.load(off_ptr + q) * 4, tl.int32)
        _copy_words(out_ptr + q.to(tl.int64) * W, src, W, BLOCK)
    if ticket_last_n(ticket_ptr, tl.num_programs(0)):
        tl.store(level_ptr, level + 1)


@triton.jit(do_not_specialize=['n', 'call_id'])
def _hc_send_kernel(rows_ptr, src_rank_ptr, src_tok_ptr, n, CW, call_id, me, N, P, ptr_table, rel_off,
                    rel_slot_words, sig_off, ticket_ptr, BLOCK: tl.constexpr):
    """Program ``q``: received row ``q`` (``CW - 1`` words) and the marker to its source's relay here."""
    q = tl.program_id(0)
    b = me // N
    j = me % N
    if q < n:
        s = tl.load(src_rank_ptr + q)
        t = tl.load(src_tok_ptr + q).to(tl.int64)
        a = s // N
        i = s % N
        dst = peer_ptr(ptr_table, b * N + i, rel_off + ((a * N + j) * rel_slot_words + t * CW) * 4, tl.int32)
        _copy_words(dst, rows_ptr + q.to(tl.int64) * (CW - 1), CW - 1, BLOCK)
        tl.store(dst + CW - 1, call_id)
    if ticket_last_n(ticket_ptr, tl.num_programs(0)):
        for i2 in range(N):
            signal(_sig(ptr_table, b * N + i2, sig_off, P + N + j), 1)


@triton.jit(do_not_specialize=['call_id'])
def _hc_relay_kernel(tok_ptr, H, K, CW, FW, call_id, me, N, P, ptr_table, rel_off, rel_slot_words, stage_off,
                     fin_off, fin_slot_words, sig_off, level_ptr, ticket_ptr, err_ptr, timeout_ns,
                     BLOCK: tl.constexpr, K_POW2: tl.constexpr, HAS_TIMER: tl.constexpr, SIM: tl.constexpr):
    """Program ``(a, t)``: Σ over this node's ranks of their rows for token ``t`` of ``(a, i)``, in float32,
    with the weights; put (stored where ``a`` is this node) to ``(a, i)``'s final area, slot ``b``."""
    a = tl.program_id(0)
    t = tl.program_id(1)
    b = me // N
    i = me % N
    level = tl.load(level_ptr)
    for j2 in range(N):
        _wait(ptr_table, me, sig_off, P + N + j2, level + 1, err_ptr, 5, b * N + j2, timeout_ns, HAS_TIMER)
    t64 = t.to(tl.int64)
    if t < tl.load(tok_ptr + a * N + i):
        HW = H // 2
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
                row = peer_ptr(ptr_table, me, rel_off + ((a * N + j) * rel_slot_words + t64 * CW) * 4, tl.int32)
                if tl.load(row + CW - 1) == call_id:
                    wacc += tl.load(row.to(tl.pointer_type(tl.float32)) + HW + kk, mask=km, other=0.0)
            tl.store(stage + H + kk, wacc, mask=km)
            tl.store(stage.to(tl.pointer_type(tl.int32)) + FW - 1, call_id)
            tl.debug_barrier()
            off = fin_off + (b * fin_slot_words + t64 * FW) * 4
            if a == b:  # the source is this rank
                _copy_words(peer_ptr(ptr_table, me, off, tl.int32), stage.to(tl.pointer_type(tl.int32)), FW,
                            BLOCK)
            else:
                nv.put(ptr_table, me, a * N + i, off, stage, FW * 4, SIM)
    nv.quiet(SIM)
    if ticket_last_n(ticket_ptr, tl.num_programs(0) * tl.num_programs(1)):
        tl.store(level_ptr, level + 1)
        for a2 in range(P):
            if a2 == b:
                signal(_sig(ptr_table, me, sig_off, P + 2 * N + b), 1)
            else:
                nv.put_signal(ptr_table, me, a2 * N + i, stage_off, peer_ptr(ptr_table, me, stage_off, tl.uint8), 0,
                              sig_off + (P + 2 * N + b) * 8, SIM)
        nv.quiet(SIM)


@triton.jit(do_not_specialize=['T', 'call_id'])
def _hc_final_kernel(out_ptr, wout_ptr, T, H, K, FW, call_id, me, N, P, ptr_table, fin_off, fin_slot_words,
                     sig_off, level_ptr, ticket_ptr, err_ptr, timeout_ns, BLOCK: tl.constexpr,
                     K_POW2: tl.constexpr, HAS_W: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Program ``t``: ``out[t] = Σ_b partial_b[t]`` over the nodes whose partial carries this call's
    marker, in node order, float32 (and the weights)."""
    t = tl.program_id(0)
    level = tl.load(level_ptr)
    i = me % N
    for b in range(P):
        _wait(ptr_table, me, sig_off, P + 2 * N + b, level + 1, err_ptr, 5, b * N + i, timeout_ns, HAS_TIMER)
    if t < T:
        t64 = t.to(tl.int64)
        cc = tl.arange(0, BLOCK)
        for c0 in range(0, H, BLOCK):
            cm = (c0 + cc) < H
            acc = tl.zeros((BLOCK,), tl.float32)
            for b in range(P):
                part = peer_ptr(ptr_table, me, fin_off + (b * fin_slot_words + t64 * FW) * 4, tl.float32)
                if tl.load(part.to(tl.pointer_type(tl.int32)) + FW - 1) == call_id:
                    acc += tl.load(part + c0 + cc, mask=cm, other=0.0)
            tl.store(out_ptr + t64 * H + c0 + cc, acc, mask=cm)
        if HAS_W:
            kk = tl.arange(0, K_POW2)
            km = kk < K
            wacc = tl.zeros((K_POW2,), tl.float32)
            for b in range(P):
                part = peer_ptr(ptr_table, me, fin_off + (b * fin_slot_words + t64 * FW) * 4, tl.float32)
                if tl.load(part.to(tl.pointer_type(tl.int32)) + FW - 1) == call_id:
                    wacc += tl.load(part + H + kk, mask=km, other=0.0)
            tl.store(wout_ptr + t64 * K + kk, wacc, mask=km)
    if ticket_last_n(ticket_ptr, tl.num_programs(0)):
        tl.store(level_ptr, level + 1)

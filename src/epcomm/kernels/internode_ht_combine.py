"""High-throughput combine kernels of the internode backend (Triton + NVSHMEM): the reverse of the
dispatch in ``internode_ht.py`` (its letters, areas and signal words), reducing inside the node first.

Combine (``CW = H/2 + K + 1`` words: bf16 row, float32 weights, a marker = the device's count of
combines + 1, which ``_hc_final`` advances):
4. ``_hc_send`` at receiver ``(b, j)``: row ``q`` of ``x`` and the weights (source ``s = (a, i)``,
   token ``t``) into relay
   ``(b, i)``'s relay area, slot ``(a, j)``, row ``t``, with the marker; signal the node's relays.
5. ``_hc_relay`` at ``(b, i)``: for ``(a, t)``: Σ over ``j`` of the marked rows in float32 (and the
   weights), staged with the marker; put to ``s = (a, i)``'s final area, slot ``b``, rows ``t...``,
   in pieces of at most ``CH`` consecutive tokens; signal.
   In nodes of one rank the relay rows go as they are, BF16 (``DIRECT``; the final kernel's ``PBF16``).
6. ``_hc_final`` at ``s``: Σ over nodes of the marked partial sums, in node order, float32, then the
   biases, rounded once to BF16.

A combine's parity (its areas, signal words and levels: ``par_bytes`` and ``sig_par`` from parity 0's)
is the device's count of combines modulo 2, so a CUDA graph of combines alone alternates too: a rank
writes parity ``q`` of combine ``c + 2`` only after its ``_hc_final`` of ``c + 1``, which waits on relays
that waited on every rank's ``_hc_send`` of ``c + 1``, each issued after that rank read parity ``q`` of
combine ``c``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvshmem as nv
from .common import peer_ptr, signal, ticket_last_n
from .internode_ht import _col, _copy_rows, _sig, _source_of, _wait


@triton.jit(do_not_specialize=['rows'])
def _hc_send_kernel(x_ptr, w_ptr, HW, K, col_ptr, col_stride, src_tok_ptr, rows, CW, cid_ptr, me, N, P, R, ptr_table,
                    rel_off, rel_slot_words, sig_off, par_bytes, sig_par, ticket_ptr, BLOCK: tl.constexpr,
                    RB: tl.constexpr, R_POW2: tl.constexpr, K_POW2: tl.constexpr):
    """Program ``g``: blocks of ``RB`` received rows ``q`` that arrived, each ``x[q]`` (``HW`` words of BF16
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
    uu = tl.arange(0, RB)
    for q0 in range(g * RB, n, G * RB):
        qq = q0 + uu.to(tl.int64)
        ok = qq < n
        s, _ = _source_of(col, rr, qq)
        t = tl.load(src_tok_ptr + qq, mask=ok, other=0).to(tl.int64)
        a = s // N
        i = s % N  # (rows past n: a rank of this node all the same, never written)
        dst = peer_ptr(ptr_table, b * N + i, rel_off + ((a * N + j).to(tl.int64) * rel_slot_words + t * CW) * 4,
                       tl.int32)
        _copy_rows(dst, x_ptr + qq * HW, ok, ok, HW, BLOCK)
        _copy_rows(dst + HW, w_ptr + qq * K, ok, ok, K, K_POW2)
        tl.store(dst + CW - 1, tl.zeros((RB,), tl.int32) + call_id, mask=ok)
    if ticket_last_n(ticket_ptr, G):
        for i2 in range(N):
            signal(_sig(ptr_table, b * N + i2, sig_off, P + N + j), 1)


@triton.jit
def _relay_sum(rel, stg, a64, tt, ok, call_id, H, K, CW, FW, N, rel_slot_words, fin_slot_words, RB: tl.constexpr,
               BLOCK: tl.constexpr, N_POW2: tl.constexpr, K_POW2: tl.constexpr):
    """For tokens ``tt`` of source node ``a``: Σ over this node's ranks ``j`` of their marked rows (relay
    slot ``(a, j)``), float32 in rank order, and of their weights, staged (with the marker) in rows
    ``tt`` of stage slot ``a``, which it returns (``[RB]`` int32 row pointers)."""
    nn = tl.arange(0, N_POW2)
    cc = tl.arange(0, BLOCK)
    kk = tl.arange(0, K_POW2)
    km = kk[None, :] < K
    roff = (a64 * N + nn[None, :]) * rel_slot_words + tt[:, None] * CW  # [RB, N]: (a, j)'s row for tt
    mk = (tl.load(rel + roff + CW - 1, mask=ok[:, None] & (nn[None, :] < N), other=0) == call_id).to(tl.int32)
    present = tl.max(mk, 1) > 0
    stage = stg + (a64 * fin_slot_words + tt * FW)
    stage_f = stage.to(tl.pointer_type(tl.float32))
    for c0 in range(0, H, BLOCK):
        cm = (c0 + cc)[None, :] < H
        acc = tl.zeros((RB, BLOCK), tl.float32)
        for j in range(N):
            row = (rel + _col(roff, nn, j)).to(tl.pointer_type(tl.bfloat16))
            v = tl.load(row[:, None] + c0 + cc[None, :], mask=(_col(mk, nn, j) > 0)[:, None] & cm, other=0.0)
            acc += v.to(tl.float32)
        tl.store(stage_f[:, None] + c0 + cc[None, :], acc, mask=present[:, None] & cm)
    wacc = tl.zeros((RB, K_POW2), tl.float32)
    for j in range(N):
        row = (rel + _col(roff, nn, j)).to(tl.pointer_type(tl.float32))
        wacc += tl.load(row[:, None] + H // 2 + kk[None, :], mask=(_col(mk, nn, j) > 0)[:, None] & km, other=0.0)
    tl.store(stage_f[:, None] + H + kk[None, :], wacc, mask=present[:, None] & km)
    tl.store(stage + FW - 1, tl.zeros((RB,), tl.int32) + call_id, mask=present)
    return stage


@triton.jit
def _hc_relay_kernel(tok_ptr, tok_stride, H, K, CW, FW, CH, cid_ptr, me, N, P, ptr_table, rel_off, rel_slot_words,
                     stage_off, fin_off, fin_slot_words, sig_off, par_bytes, sig_par, level_ptr, ticket_ptr, err_ptr,
                     timeout_ns, BLOCK: tl.constexpr, RB: tl.constexpr, N_POW2: tl.constexpr, K_POW2: tl.constexpr,
                     DIRECT: tl.constexpr, HAS_TIMER: tl.constexpr, SIM: tl.constexpr):
    """Program ``g`` of ``G``, for every source node ``a``: blocks of ``RB`` tokens of ``(a, i)``
    (``tok[(a * N + i) * tok_stride]`` of them): for each token, Σ over this node's ranks of their marked
    rows for it, in float32 in rank order, with the weights, staged as a tile; then the block's staged rows
    to ``(a, i)``'s final area, slot ``b``, one put per piece of at most ``CH`` tokens (cut at multiples of
    ``CH``: DeepEP's ``num_max_rdma_chunked_send_tokens`` of the combine), a tile copy where ``a`` is this
    node. A token no row came for keeps its stale staged row, whose old marker ``_hc_final`` skips.
    ``DIRECT`` (one rank a node, ``FW == CW``): a relay row (BF16 ``x``, weights, marker) already is the
    partial sum, so the rows go as they are, BF16, without staging (exact: a sum of one row)."""
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
    uu = tl.arange(0, RB)
    rel = peer_ptr(ptr_table, me, rel_off, tl.int32)
    stg = peer_ptr(ptr_table, me, stage_off, tl.int32)
    sw = fin_slot_words
    if DIRECT:  # the rows go from slot (a, 0) of the relay area (its rows are FW = CW words)
        stg = rel
        sw = rel_slot_words
    for a in range(P):
        cnt = tl.load(tok_ptr + (a * N + i) * tok_stride)
        a64 = a + tl.zeros((), tl.int64)  # (a loop index: a Python int under the interpreter)
        for t0 in range(g * RB, cnt, G * RB):
            tt = t0 + uu.to(tl.int64)
            ok = tt < cnt
            if DIRECT:
                stage = stg + (a64 * sw + tt * FW)
            else:
                stage = _relay_sum(rel, stg, a64, tt, ok, call_id, H, K, CW, FW, N, rel_slot_words, fin_slot_words,
                                   RB, BLOCK, N_POW2, K_POW2)
            tl.debug_barrier()
            if a == b:  # the source is this rank
                mine = peer_ptr(ptr_table, me, fin_off, tl.int32) + (b * fin_slot_words + tt * FW)
                _copy_rows(mine, stage, ok, ok, FW, BLOCK)
            else:
                end = tl.minimum(t0 + RB, cnt)
                p0 = t0 + tl.zeros((), tl.int64)
                while p0 < end:
                    p1 = tl.minimum((p0 // CH + 1) * CH, end)
                    nv.put(ptr_table, me, a * N + i, fin_off + (b * fin_slot_words + p0 * FW) * 4,
                           stg + (a64 * sw + p0 * FW), (p1 - p0) * FW * 4, SIM)
                    p0 = p1
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
                     BLOCK: tl.constexpr, RB: tl.constexpr, P_POW2: tl.constexpr, K_POW2: tl.constexpr,
                     HAS_W: tl.constexpr, NB: tl.constexpr, PBF16: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Program ``g`` of ``G``, blocks of ``RB`` tokens: ``out[t] = Σ_b partial_b[t]`` over the nodes whose
    partial carries this call's marker, in node order, float32, plus the ``NB`` (0-2) BF16 biases in
    order, rounded once to BF16 (and the weights, float32). Partials are float32 (``H`` words, then the
    weights), or BF16 where ``PBF16`` (``H/2`` words: the relay's ``DIRECT`` rows)."""
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
    uu = tl.arange(0, RB)
    pp = tl.arange(0, P_POW2)
    cc = tl.arange(0, BLOCK)
    kk = tl.arange(0, K_POW2)
    km = kk[None, :] < K
    fin = peer_ptr(ptr_table, me, fin_off, tl.int32)
    for t0 in range(g * RB, T, G * RB):
        tt = t0 + uu.to(tl.int64)
        ok = tt < T
        poff = pp[None, :].to(tl.int64) * fin_slot_words + tt[:, None] * FW  # [RB, P]: node b's partial for tt
        mk = (tl.load(fin + poff + FW - 1, mask=ok[:, None] & (pp[None, :] < P), other=0) == call_id).to(tl.int32)
        for c0 in range(0, H, BLOCK):
            cm = (c0 + cc)[None, :] < H
            acc = tl.zeros((RB, BLOCK), tl.float32)
            for b in range(P):
                part = fin + _col(poff, pp, b)
                pm = (_col(mk, pp, b) > 0)[:, None] & cm
                if PBF16:
                    v = tl.load(part.to(tl.pointer_type(tl.bfloat16))[:, None] + c0 + cc[None, :], mask=pm, other=0.0)
                    acc += v.to(tl.float32)
                else:
                    acc += tl.load(part.to(tl.pointer_type(tl.float32))[:, None] + c0 + cc[None, :], mask=pm,
                                   other=0.0)
            o = tt[:, None] * H + c0 + cc[None, :]
            if NB > 0:
                acc += tl.load(b0_ptr + o, mask=ok[:, None] & cm, other=0.0).to(tl.float32)
            if NB > 1:
                acc += tl.load(b1_ptr + o, mask=ok[:, None] & cm, other=0.0).to(tl.float32)
            tl.store(out_ptr + o, acc.to(tl.bfloat16), mask=ok[:, None] & cm)
        if HAS_W:
            wacc = tl.zeros((RB, K_POW2), tl.float32)
            for b in range(P):
                part = (fin + _col(poff, pp, b) + (H // 2 if PBF16 else H)).to(tl.pointer_type(tl.float32))
                wacc += tl.load(part[:, None] + kk[None, :], mask=(_col(mk, pp, b) > 0)[:, None] & km, other=0.0)
            tl.store(wout_ptr + tt[:, None] * K + kk[None, :], wacc, mask=ok[:, None] & km)
    if ticket_last_n(ticket_ptr, G):
        tl.store(level_ptr, level + 1)
        tl.store(cid_ptr, call_id)  # (the last kernel of the combine on this rank counts it)

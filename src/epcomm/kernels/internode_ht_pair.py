"""The high-throughput combine in nodes of one rank as the nvlink backend's (``internode_ht_combine.py`` has
the letters, the areas and the counters; where ``backends/internode_ht`` pairs a combine): every program first
copies its share of the rows going back to the other nodes, then reduces its share of this rank's tokens, as
the nvlink combine's programs push and then reduce, instead of one half of the programs copying while the
other half reduces (the reductions, which read two rows and write one where a copy reads one and writes one,
were then the launch's time: 12 finals each reducing a whole channel).

**Units.** Channel ``c``'s tokens are cut in two halves, unit ``u = 2c + h`` (``h`` 0 or 1), taken by program
``u mod S`` of the launch's ``S`` (even: ``Config`` asks for it), units in order, each as **relay** then
**final**:

1. relay at ``b`` (this rank), for every other node ``a`` (source ``s = a``): rows ``[q_lo, q_m)`` (``h = 0``) or
   ``[q_m, q_hi)`` (``h = 1``) of ``s``'s channel ``c`` here (``ncp``: ``[q_lo, q_hi)``; ``q_m = q_lo +
   ceil((q_hi - q_lo) / 2)``), each the BF16 row of ``x`` and its weights (a sum of one row, exact), into
   ``s``'s final slot of ``b``: by stores where NVSHMEM maps ``s`` (``P2P``), else staged and put in puts of at
   most ``CH`` rows (Config's RDMA chunk, from the channel's first row). Then one count of the half's rows:
   ``C_FN[b][C + c]`` (the channel's rows) at ``s``, and for ``h = 0`` also ``C_FN[b][c]`` (its half's);
   a release atomic after the stores, or a ``fence`` and ``signal_add`` after the puts.
2. final at ``a`` (this rank): its tokens of channel ``c`` (``[c*pc, c*pc + pc)``) before ``t_m`` (``h = 0``) or
   from it (``h = 1``), where ``t_m`` is the first token whose row at some other node ``b`` lies in the second
   half of the channel's rows there (``nco``: the same ``q_lo, q_m, q_hi`` as the relay computes); so unit ``(c,
   0)`` reads only rows its peer's unit ``(c, 0)`` sent, and waits for ``C_FN[b][c]``, while ``(c, 1)`` waits for
   the whole channel, ``C_FN[b][C + c]``. ``out[t] = Σ_b row_b`` in node order (this rank's own row read from
   ``x``), float32, then the biases, rounded once: the split-role finals' sum, the same bits.

Unit ``u``'s final waits on the peers' unit ``u`` (program ``u mod S`` there too) and, for ``h = 1``, on their
unit ``u - 1`` (program ``u mod S - 1``: ``S`` is even, ``u`` odd), each of which relays before it reduces: no
program waits on a later program of a launch (the Triton interpreter runs them one after another; the peers'
programs of one index run alongside). Each counter word is counted and consumed by one unit a call, and the
split-role combine uses only words ``C_FN[b][c < C]`` with their own consumers, so every word's private base
(the total its consumer has taken) stays equal to what its producers added whatever mode each call runs
(``2C <= CM`` and at most 16 nodes, unrolled in the reduction: the backend checks).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvshmem as nv
from .internode_ht_prep import _wait
from .internode_ht_rows import _base_add, _biased_store, _copy_rows, _mapped, _publish_direct, _put_rows, pad4


@triton.jit
def _halves(pre_ptr, C, c, h):
    """``(q_lo, q_m, lo, hi)``: the channel's first row and its second half's, and unit ``h``'s rows ``[lo, hi)``,
    from a channel prefix row (``pre [C]``: rows of channels ``0..c`` together)."""
    q_lo = tl.load(pre_ptr + c - 1, mask=c > 0, other=0)
    q_hi = tl.load(pre_ptr + c)
    q_m = q_lo + (q_hi - q_lo + 1) // 2
    return q_lo, q_m, tl.where(h == 0, q_lo, q_m), tl.where(h == 0, q_m, q_hi)


@triton.jit
def _pair_relay(c, h, xw_ptr, w_ptr, rows, HW, K, me, P, R, C, CH, rpm_ptr, ncp_ptr, ptr_table, stage, area,
                fin_rel, TM, FW, ctr_off, C_FN, CM, P2P, BLOCK: tl.constexpr, RB: tl.constexpr, K_POW2: tl.constexpr,
                SIM: tl.constexpr):
    """Unit ``(c, h)``'s relay at ``b = me`` (module docstring, 1). ``xw`` BF16 ``x`` as int32 words ``[rows,
    HW]``, ``w`` its weights; ``stage`` this rank's staging (int32 pointer), ``area`` the parity's byte offset."""
    b = me
    uu = tl.arange(0, RB)
    for a in range(P):
        if a != b:
            first = tl.load(rpm_ptr + (a - 1) * R, mask=a > 0, other=0)  # source a's first row here
            q_lo, _, lo, hi = _halves(ncp_ptr + a * C, C, c, h)
            dst = area + fin_rel + ((b - a - 1 + P) % P).to(tl.int64) * TM * FW * 4 + q_lo * FW * 4  # (at a)
            s8, direct = _mapped(ptr_table, a, P2P)
            if direct:  # straight into a's final slot
                src = (s8 + dst).to(tl.pointer_type(tl.int32))
            else:
                src = stage + ((a - b - 1 + P) % P).to(tl.int64) * TM * FW + q_lo * FW
            for q0 in range(lo, hi, RB):
                qq = q0 + uu.to(tl.int64)
                ok = qq < hi
                have = ok & (first + qq < rows)  # (rows past x's: more arrived than num_worst_tokens, error 9)
                prow = tl.multiple_of(src + (qq - q_lo) * FW, 16)
                _copy_rows(prow, xw_ptr + (first + qq) * HW, have, ok, HW, BLOCK)
                if K > 0:
                    _copy_rows(prow + HW, w_ptr + (first + qq) * K, have, ok, K, K_POW2)
                if not direct:
                    tl.debug_barrier()  # (the tile staged by every thread before the puts read it)
                    _put_rows(ptr_table, me, a, dst, src, q0 - q_lo, tl.minimum(q0 + RB, hi) - q_lo, CH, FW, SIM)
            whole = C_FN + b * CM + C + c  # the channel's rows; half 0 also counts its own
            if direct:
                _publish_direct(s8, ctr_off, whole, hi - lo)
                if h == 0:
                    _publish_direct(s8, ctr_off, C_FN + b * CM + c, hi - lo)
            elif hi > lo:
                nv.fence(SIM)  # (the half's puts land before its counts)
                nv.signal_add(ptr_table, me, a, ctr_off + whole * 8, hi - lo, SIM)
                if h == 0:
                    nv.signal_add(ptr_table, me, a, ctr_off + (C_FN + b * CM + c) * 8, hi - lo, SIM)


@triton.jit
def _pair_final(c, h, x_ptr, w_ptr, rows, out_ptr, wout_ptr, b0_ptr, b1_ptr, H, K, npos_ptr, nco_ptr, T, pc, me, P, R,
                C, rpm_ptr, ptr_table, fin, TM, FW, ctr_off, ctr32, C_FN, CM, base_ptr, err_ptr, timeout_ns,
                FBLOCK: tl.constexpr, RB: tl.constexpr, K_POW2: tl.constexpr, P_POW2: tl.constexpr,
                HAS_W: tl.constexpr, NB: tl.constexpr, STAGES: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Unit ``(c, h)``'s final at ``a = me`` (module docstring, 2). ``x`` BF16 ``[rows, H]``, ``w`` its weights
    (float32 as int32 words), ``out [T, H]`` BF16, ``wout [T, K]``, the biases ``[T, H]`` BF16; ``fin`` this
    rank's final slots (int32 pointer), ``FW`` words a row (``HW`` of ``x``, then ``K`` weights). The reduction
    reads every node's row of a tile of ``RB`` tokens and ``FBLOCK`` columns a step, its loads ``STAGES`` deep
    (Triton's software pipeline, as the nvlink reduce's)."""
    a = me
    HW = H // 2
    t_lo = c * pc
    t_hi = tl.minimum(t_lo + pc, T)
    t_m = t_hi  # the first token of the second half
    scan = tl.arange(0, 256)
    for b in range(P):
        if b != a:
            q_lo, q_m, _, hi = _halves(nco_ptr + b * C, C, c, h)
            for t0 in range(t_lo, t_hi, 256):
                tt = t0 + scan
                q = tl.load(npos_ptr + tt.to(tl.int64) * P + b, mask=tt < t_hi, other=-1)
                t_m = tl.minimum(t_m, tl.min(tl.where(q >= q_m, tt, t_hi), 0))
            # rows [q_lo, hi) from b (half 0's, or the channel's): counted in C_FN[b][c], or C_FN[b][C + c]
            k = C_FN + b * CM + c + h * C
            target = _base_add(base_ptr + k, hi - q_lo)
            if tl.atomic_add(ctr32 + 2 * k, 0, sem="acquire", scope="sys") - target < 0:
                _wait(ptr_table, me, ctr_off, k, target, err_ptr, 5, b, timeout_ns, HAS_TIMER)
    tl.debug_barrier()
    f_lo = tl.where(h == 0, t_lo, t_m)
    f_hi = tl.where(h == 0, t_m, t_hi)
    first = tl.load(rpm_ptr + (me - 1) * R, mask=me > 0, other=0)  # this rank's own rows in x
    uu = tl.arange(0, RB)
    pp = tl.arange(0, P_POW2)
    cl = tl.arange(0, FBLOCK)
    kk = tl.arange(0, K_POW2)
    km = kk[None, :] < K
    for t0 in range(f_lo, f_hi, RB):
        tt = t0 + uu.to(tl.int64)
        ok = tt < f_hi
        qs = tl.load(npos_ptr + tt[:, None] * P + pp[None, :], mask=ok[:, None] & (pp[None, :] < P), other=-1)
        for h0 in tl.range(0, H, FBLOCK, num_stages=STAGES):
            cc = h0 + cl
            cm = cc[None, :] < H
            acc = tl.full((RB, FBLOCK), 0.0, tl.float32)
            for n in tl.static_range(P_POW2):  # (unrolled: straight-line loads the pipeliner can prefetch)
                q = tl.sum(tl.where(pp[None, :] == n, qs, 0), 1).to(tl.int64)
                part = fin + (((n - a - 1 + P) % P).to(tl.int64) * TM + q) * FW  # node n's row in its final slot
                row = tl.where(n == a, x_ptr + (first + q) * H,
                               tl.multiple_of(part.to(tl.pointer_type(tl.bfloat16)), 16))
                m = (q >= 0) & (n < P) & ((n != a) | (first + q < rows))
                acc += tl.load(row[:, None] + cc[None, :], mask=m[:, None] & cm, other=0.0).to(tl.float32)
            _biased_store(acc, tt[:, None] * H + cc[None, :], ok[:, None] & cm, out_ptr, b0_ptr, b1_ptr, NB)
        if HAS_W:
            wacc = tl.full((RB, K_POW2), 0.0, tl.float32)
            for n2 in range(P):
                q = tl.sum(tl.where(pp[None, :] == n2, qs, 0), 1).to(tl.int64)
                part = fin + (((n2 - a - 1 + P) % P).to(tl.int64) * TM + q) * FW + HW
                wrow = tl.where(n2 == a, w_ptr + (first + q) * K, part).to(tl.pointer_type(tl.float32))
                m = (q >= 0)[:, None] & km & ((n2 != a) | (first + q < rows))[:, None]
                wacc += tl.load(wrow[:, None] + kk[None, :], mask=m, other=0.0)
            tl.store(wout_ptr + tt[:, None] * K + kk[None, :], wacc, mask=ok[:, None] & km)


@triton.jit
def _hc_pair(g, S, x_ptr, xw_ptr, w_ptr, rows, H, K, npos_ptr, nco_ptr, T, pc, me, P, R, C, CH, rpm_ptr, ncp_ptr,
             out_ptr, wout_ptr, b0_ptr, b1_ptr, ptr_table, area, stage_rel, fin_rel, TM, ctr_off, ctr32, CM, C_FN,
             F_FN, cc, base_ptr, P2P, err_ptr, timeout_ns, BLOCK: tl.constexpr, FBLOCK: tl.constexpr,
             RB: tl.constexpr, K_POW2: tl.constexpr, P_POW2: tl.constexpr, HAS_W: tl.constexpr, NB: tl.constexpr,
             STAGES: tl.constexpr, HAS_TIMER: tl.constexpr, SIM: tl.constexpr):
    """Program ``g`` of ``S`` of a combine in nodes of one rank (module docstring): units ``g, g + S, ...``, each
    relay then final; then ``quiet`` (its puts delivered before the launch's last program frees the slots)."""
    HW = H // 2
    FW = pad4(HW + K)
    for a2 in range(P):  # the other nodes' finals freed their slots of this parity (the call before last)
        if a2 != me:
            if tl.atomic_add(ctr32 + 2 * (F_FN + a2), 0, sem="acquire", scope="sys") - (cc - 1) < 0:
                _wait(ptr_table, me, ctr_off, F_FN + a2, cc - 1, err_ptr, 4, a2, timeout_ns, HAS_TIMER)
    me8 = tl.load(ptr_table + me).to(tl.pointer_type(tl.uint8))
    stage = (me8 + area + stage_rel).to(tl.pointer_type(tl.int32))
    fin = (me8 + area + fin_rel).to(tl.pointer_type(tl.int32))
    for u in range(g, 2 * C, S):
        c = u // 2
        h = u % 2
        _pair_relay(c, h, xw_ptr, w_ptr, rows, HW, K, me, P, R, C, CH, rpm_ptr, ncp_ptr, ptr_table, stage, area,
                    fin_rel, TM, FW, ctr_off, C_FN, CM, P2P, BLOCK, RB, K_POW2, SIM)
        _pair_final(c, h, x_ptr, w_ptr, rows, out_ptr, wout_ptr, b0_ptr, b1_ptr, H, K, npos_ptr, nco_ptr, T, pc, me,
                    P, R, C, rpm_ptr, ptr_table, fin, TM, FW, ctr_off, ctr32, C_FN, CM, base_ptr, err_ptr, timeout_ns,
                    FBLOCK, RB, K_POW2, P_POW2, HAS_W, NB, STAGES, HAS_TIMER)
    nv.quiet(SIM)

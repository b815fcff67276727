"""Device helpers shared by the high-throughput kernels (``ht_notify``, ``ht_transfer``, ``ht_receive``):
the flag slots, waits on and signals to every peer's flag, tile copies, the push of one tile of rows.

Flag slots (int32 index = slot * R + peer) in every rank's flag area: ``NOTIFY`` counts exchanged,
``DDATA`` / ``CDATA`` dispatch / combine rows delivered (in ``NC`` chunks), ``DCONSUMED`` / ``CCONSUMED``
a receiver has consumed its staging slot (the sender may overwrite it).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import peer_ptr, signal, wait_ge

NOTIFY = tl.constexpr(0)
DDATA = tl.constexpr(1)
DCONSUMED = tl.constexpr(2)
CDATA = tl.constexpr(3)
CCONSUMED = tl.constexpr(4)


@triton.jit
def _wait_peers(ptr_table, flags_off, slot, R, me, target, err_ptr, phase, timeout_ns,
                HAS_TIMER: tl.constexpr):
    """Wait until every peer's counter in flag ``slot`` (in this rank's flag area) reaches ``target``."""
    for j in range(0, R):
        if j != me:
            wait_ge(peer_ptr(ptr_table, me, flags_off + (slot * R + j) * 4, tl.int32), target, err_ptr,
                    phase, j,
                    timeout_ns, HAS_TIMER)


@triton.jit
def _signal_peers(ptr_table, flags_off, slot, R, me, value):
    """Add ``value`` (release) to this rank's counter in flag ``slot`` of every peer."""
    for j in range(0, R):
        if j != me:
            signal(peer_ptr(ptr_table, j, flags_off + (slot * R + me) * 4, tl.int32), value)


@triton.jit
def _i64(v):
    """Widen a loop index (a tensor when compiled, a Python int under the interpreter) to int64."""
    return v + tl.zeros((), dtype=tl.int64)


@triton.jit
def _copy_tile(dst, dst_rows, src, src_rows, row_ok, row_elems, BLOCK: tl.constexpr):
    """Rows ``src_rows`` of ``src`` to rows ``dst_rows`` of ``dst`` (int64 row indices, ``row_elems``
    words each) where ``row_ok``: a whole tile of rows per step, so many loads are in flight at once."""
    cols = tl.arange(0, BLOCK)
    d = dst_rows[:, None] * row_elems
    s = src_rows[:, None] * row_elems
    for h0 in range(0, row_elems, BLOCK):
        cc = h0 + cols
        m = row_ok[:, None] & (cc[None, :] < row_elems)
        tl.store(dst + d + cc[None, :], tl.load(src + s + cc[None, :], mask=m), mask=m)


@triton.jit
def _copy_small(dst, src, rows, row_ok, n_cols, N_POW2: tl.constexpr):
    """Rows ``rows`` (int64) of a ``[*, n_cols]`` array (scales, top-k ids or weights) to the same rows
    of ``dst`` where ``row_ok``."""
    cc = tl.arange(0, N_POW2)
    m = row_ok[:, None] & (cc[None, :] < n_cols)
    off = rows[:, None] * n_cols + cc[None, :]
    tl.store(dst + off, tl.load(src + off, mask=m), mask=m)


@triton.jit
def _push_tile(t0, x_ptr, row_elems, T, R, me, is_in_ptr, ptr_table, stage_off, stage_src_bytes, xs_ptr, G,
               topk_ptr, w_ptr, K, s_off, k_off, w_off, RB: tl.constexpr, BLOCK: tl.constexpr,
               ELEM: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, G_POW2: tl.constexpr,
               K_POW2: tl.constexpr):
    """Rows ``t0 .. t0 + RB`` of ``x`` (and their scales, ids, weights) to the same rows of my slot in
    every peer that gets them (``is_in[t, j]``)."""
    tt = (t0 + tl.arange(0, RB)).to(tl.int64)
    inb = tt < T
    for j in range(0, R):
        if j != me:
            f = tl.load(is_in_ptr + tt * R + j, mask=inb, other=0) != 0
            if tl.max(f.to(tl.int32), 0) > 0:
                dst = peer_ptr(ptr_table, j, stage_off + me * stage_src_bytes, ELEM)
                _copy_tile(dst, tt, x_ptr, tt, f, row_elems, BLOCK)
                if HAS_SCALES:
                    _copy_small(peer_ptr(ptr_table, j, s_off + me * stage_src_bytes, tl.float32), xs_ptr, tt,
                                f, G, G_POW2)
                if HAS_TOPK:
                    _copy_small(peer_ptr(ptr_table, j, k_off + me * stage_src_bytes, tl.int64), topk_ptr, tt,
                                f, K, K_POW2)
                    _copy_small(peer_ptr(ptr_table, j, w_off + me * stage_src_bytes, tl.float32), w_ptr, tt,
                                f, K, K_POW2)


@triton.jit
def _wait_sources(need, known, rr, ptr_table, flags_off, slot, R, me, base, err_ptr, phase, timeout_ns,
                  NC: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Wait until source ``j``'s data counter reaches ``base * NC + need[j]`` for every ``j`` whose
    need exceeds what this program already saw (``known``); returns the updated ``known``."""
    for j in range(0, R):
        if j != me:
            nj = tl.sum(tl.where(rr == j, need, 0), 0)
            kj = tl.sum(tl.where(rr == j, known, 0), 0)
            if nj > kj:
                flag = peer_ptr(ptr_table, me, flags_off + (slot * R + j) * 4, tl.int32)
                wait_ge(flag, base * NC + nj, err_ptr, phase, j, timeout_ns, HAS_TIMER)
                known = tl.where(rr == j, nj, known)
    return known

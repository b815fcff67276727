"""High-throughput kernels, transfer phase: the bulk movers between ranks.

- ``ce_wait`` / ``ce_signal``: one-program kernels around the copy-engine bulk copies (wait for the
  receivers to free their staging slots; raise the data flags after the copies).
- ``ce_flag_value``: a one-program kernel of five arguments, the host probe's yardstick of a launch's cost
  (``bench/profile.host_primitives``; no backend launches it).
- ``_combine_push_rows``: the SM mover of combine, each owner's block of rows into its staging slot
  (``ht_receive._combine_kernel`` runs it before its reduce; the dispatch's SM push is the gather kernel's,
  ``ht_common``'s tiles).

Letters: ``T`` tokens, ``K`` top-k, ``R`` ranks, ``G`` scale groups, ``P`` programs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import peer_ptr
from .ht_common import CCONSUMED, _copy_tile, _signal_peers, _wait_peers


@triton.jit
def _ce_wait_kernel(ptr_table, flags_off, slot, R, me, ctr_ptr, err_ptr, phase, timeout_ns,
                    HAS_TIMER: tl.constexpr):
    """Before the copy engine overwrites peers' staging: wait until every peer consumed the last one."""
    _wait_peers(ptr_table, flags_off, slot, R, me, tl.load(ctr_ptr), err_ptr, phase, timeout_ns, HAS_TIMER)


@triton.jit(do_not_specialize=['inc', 'bump'])
def _ce_signal_kernel(ptr_table, flags_off, slot, R, me, ctr_ptr, inc, bump):
    """After copy-engine chunks finished (stream order): raise the data flag on every peer by ``inc``
    (the number of ``NC``-chunks just copied); ``bump`` = 1 after the last advances this rank's send
    counter."""
    _signal_peers(ptr_table, flags_off, slot, R, me, inc)
    if bump != 0:
        tl.store(ctr_ptr, tl.load(ctr_ptr) + 1)


@triton.jit(do_not_specialize=['done', 'bump'])
def _ce_flag_value_kernel(ctr_ptr, out_ptr, done, bump, NC: tl.constexpr):
    """``sends so far * NC + done`` into ``out`` (``ctr``: the sends so far; ``bump`` = 1 advances it). No
    backend launches it since the copy-engine flag raised by copies of this value was removed (it was never
    measured against the flag kernel); the host probe times its launches (``bench/profile``)."""
    n = tl.load(ctr_ptr)
    tl.store(out_ptr, n * NC + done)
    if bump != 0:
        tl.store(ctr_ptr, n + 1)


@triton.jit
def _combine_push_rows(pid, P, x_ptr, w_ptr, row_elems, K, R, me, rpm_ptr, ptr_table, flags_off, stage_off,
                       stage_src_bytes, stage_w_off, stage_w_src_bytes, ctr_ptr, err_ptr, timeout_ns, x_rows,
                       HAS_W: tl.constexpr, RB: tl.constexpr, BLOCK: tl.constexpr, K_POW2: tl.constexpr,
                       HAS_TIMER: tl.constexpr):
    """Program ``pid`` of ``P``'s share of the combine's push (``_combine_push_kernel``): after every owner
    freed my slot (its ``n``-th consume, ``n`` = my send counter, returned), rows ``[rpm[i-1, me], rpm[i,
    me])`` of x (``row_elems`` int32 words each, and their weights) to rows ``0..`` of my slot on owner
    ``i``, ``RB`` rows per step."""
    n = tl.load(ctr_ptr)
    _wait_peers(ptr_table, flags_off, CCONSUMED, R, me, n, err_ptr, 4, timeout_ns, HAS_TIMER)
    kk = tl.arange(0, K_POW2)
    for i in range(0, R):
        if i != me:
            end = tl.minimum(tl.load(rpm_ptr + i * R + me), x_rows)
            start = tl.zeros((), dtype=tl.int32)
            if i > 0:
                start = tl.minimum(tl.load(rpm_ptr + (i - 1) * R + me), x_rows)
            dst = peer_ptr(ptr_table, i, stage_off + me * stage_src_bytes, tl.int32)
            dst_w = peer_ptr(ptr_table, i, stage_w_off + me * stage_w_src_bytes, tl.float32)
            for r0 in range(pid * RB, end - start, P * RB):
                rr = (r0 + tl.arange(0, RB)).to(tl.int64)
                ok = rr < end - start
                src = start + rr
                _copy_tile(dst, rr, x_ptr, src, ok, row_elems, BLOCK)
                if HAS_W:
                    km = ok[:, None] & (kk[None, :] < K)
                    tl.store(dst_w + rr[:, None] * K + kk[None, :],
                             tl.load(w_ptr + src[:, None] * K + kk[None, :], mask=km), mask=km)
    return n

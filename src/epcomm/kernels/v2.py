"""Kernels of ``ElasticBuffer``'s combine transport on the nvlink backend (``backends/nvlink_v2.py``): every
rank stores its rows straight into their owners' symmetric buffers, then waits until every peer's rows have
landed in its own. Flags follow ``common.py``'s protocol (counters that only grow, release/acquire at system
scope), so nothing is reset between calls and a CUDA graph replays them.

Flags in each rank's buffer (int32): ``free[R]`` (peer ``r`` has finished reading its area: it may be
written), ``data[R]`` (programs of peer ``r`` whose rows have landed here). ``epoch`` (local, int32[2]): the
calls so far and their programs. Call ``e = epoch[0] + 1``: program 0 announces ``free`` to every peer;
every program waits for ``free[q] >= e`` of every peer, stores its rows (row ``i`` into rank ``dst[i] // S``, slot ``dst[i] % S``
of block ``me``), then adds 1 to ``data[me]`` of every peer; ``_combine_arrive_kernel`` waits for
``data[q]`` to reach the programs of every call so far (``P`` programs a rank in a call, the same on
every rank) and stores the count.

Example (R = 2, S = 4, P = 1, first call): rank 0 sends a row with ``dst = 6`` -> rank 1, slot 2 of
block 0; each rank's ``data`` becomes ``[1, 1]``, ``epoch`` 1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import peer_ptr, signal, wait_ge


@triton.jit
def _combine_impl_kernel(rows, dst, n, W: tl.constexpr, slots, ptr_table, area_off, flags_off, flags,
                         epoch_ptr, me, R, err_ptr, timeout_ns, HAS_TIMER: tl.constexpr, BLOCK: tl.constexpr):
    """``rows int32[n, W]`` (W words a row), ``dst int64[n]`` (-1: nowhere) -> the owners' areas."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    e = tl.load(epoch_ptr) + 1
    if pid == 0:
        for q in range(R):
            signal(peer_ptr(ptr_table, q, flags_off + me * 4, tl.int32), 1)  # free[me] on every peer
    for q in range(R):
        wait_ge(flags + q, e, err_ptr, 4, q, timeout_ns, HAS_TIMER)
    offs = tl.arange(0, BLOCK)
    for i in range(pid, n, nprog):
        d = tl.load(dst + i)
        if d >= 0:
            owner = d // slots
            at = area_off + ((me * slots + d % slots) * W) * 4
            base = peer_ptr(ptr_table, owner, at, tl.int32)
            for c in range(0, W, BLOCK):
                m = (c + offs) < W
                tl.store(base + c + offs, tl.load(rows + i * W + c + offs, mask=m), mask=m)
    for q in range(R):
        signal(peer_ptr(ptr_table, q, flags_off + (R + me) * 4, tl.int32), 1)  # data[me] on every peer


@triton.jit
def _combine_arrive_kernel(flags, epoch_ptr, R, P, err_ptr, timeout_ns, HAS_TIMER: tl.constexpr):
    """Wait until every peer's ``P`` programs have stored their rows here, then count the call:
    ``epoch = [calls, programs of every call so far]``, so calls with different ``num_sms`` (``P``) count
    right (``P * calls`` did not: a sweep of 4 then 8 SMs waited for arrivals that never come)."""
    e = tl.load(epoch_ptr) + 1
    target = tl.load(epoch_ptr + 1) + P
    for q in range(R):
        wait_ge(flags + R + q, target, err_ptr, 5, q, timeout_ns, HAS_TIMER)
    tl.store(epoch_ptr, e)
    tl.store(epoch_ptr + 1, target)


@triton.jit
def _dispatch_copy_epilogue_impl_kernel(src, source, out, X, K, ROW: tl.constexpr, ZERO: tl.constexpr,
                                        BLOCK: tl.constexpr):
    """The expanded layout's copy: expanded row ``e`` of ``out uint8[X, ROW]`` takes contiguous row
    ``source[e] // K`` of ``src uint8[N, ROW]``; a padding row (``source[e] < 0``) is zeroed with ``ZERO``,
    else left as it is (DeepEP leaves it uninitialised), so a worst-case layout costs only its real rows.

    Example: ``K = 2``, ``source = [0, -1, 3]`` -> rows ``[src[0], (zero or untouched), src[1]]``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    for e in range(pid, X, nprog):
        s = tl.load(source + e)
        dst = out + (e + tl.zeros((), tl.int64)) * ROW  # int64: X * ROW may pass 2**31
        if s >= 0:
            row = src + (s // K) * ROW
            for c in range(0, ROW, BLOCK):
                m = (c + offs) < ROW
                tl.store(dst + c + offs, tl.load(row + c + offs, mask=m), mask=m)
        elif ZERO:
            for c in range(0, ROW, BLOCK):
                m = (c + offs) < ROW
                tl.store(dst + c + offs, tl.zeros([BLOCK], dtype=tl.uint8), mask=m)


@triton.jit
def _combine_reduce_epilogue_impl_kernel(got, use, owner, b0, b1, out, M, K, ROW_ELEMS, H, NB: tl.constexpr,
                                         OUT_F32: tl.constexpr, BLOCK: tl.constexpr):
    """The combine's reduction at the owner, in DeepEP's fixed order: for token ``t`` (program 0) and a block
    of the hidden dim (program 1), ``acc = b0 + b1`` (``NB`` biases; float32, or zeros), then for lanes
    ``j = 0 .. K-1`` ``acc += got[owner[t, j] * M + t]`` where ``use[t, j]``, else ``+= 0``; one BF16
    rounding (``OUT_F32``: the float32 sum itself, for the interpreter, whose BF16 cast truncates).
    ``got bf16[R*M, ROW_ELEMS]``: the rows each rank sent back (their first ``H`` elements)."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if NB >= 1:
        acc = tl.load(b0 + t * H + offs, mask=m, other=0.0).to(tl.float32)
    if NB == 2:
        acc = acc + tl.load(b1 + t * H + offs, mask=m, other=0.0).to(tl.float32)
    for j in range(K):
        u = tl.load(use + t * K + j)
        r = tl.load(owner + t * K + j)
        row = (r * M + t) * ROW_ELEMS
        v = tl.load(got + row + offs, mask=m & (u != 0), other=0.0).to(tl.float32)
        acc = acc + v
    if OUT_F32:
        tl.store(out + t * H + offs, acc, mask=m)
    else:
        tl.store(out + t * H + offs, acc.to(tl.bfloat16), mask=m)

"""Kernels of ``ElasticBuffer``'s combine (DeepEP V2's API), launched by ``backends/elastic_kernels.py`` wherever
the backend runs kernels (each has a torch twin in ``elastic_layout.py``, the same bytes; the dispatch's are
in ``v2_dispatch.py``):

- ``_combine_pack_kernel`` (the rows sent back, where the transport cannot read them in place: an
  expanded combine's local sums, other backends), ``_combine_reduce_epilogue_impl_kernel`` (the reduction
  at the owner);
- the combine transport on the nvlink backend (``backends/nvlink_v2.py``), below.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``LE = E/R``, ``M`` max tokens a
rank, ``N`` contiguous rows, ``X`` expanded rows.

The transport: every rank stores its rows straight into their owners' symmetric buffers, then waits until
every peer's rows have landed in its own. Flags follow ``common.py``'s protocol (counters that only grow, release/acquire at system
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

from .common import INTERPRETED, peer_ptr, signal, wait_ge


@triton.jit(do_not_specialize=["n", "slots", "area_off", "flags_off", "me", "R", "timeout_ns"])
def _combine_impl_kernel(rows, wts, dst, n, slots, ptr_table, area_off, flags_off, flags, epoch_ptr, me, R, err_ptr,
                         timeout_ns, W: tl.constexpr, XW: tl.constexpr, XS: tl.constexpr, KW: tl.constexpr,
                         KS: tl.constexpr, HAS_TIMER: tl.constexpr, RB: tl.constexpr,
                         BLOCK: tl.constexpr, ALIGNED: tl.constexpr, SKIP_SELF: tl.constexpr = False):
    """Row ``i`` (``dst int64[n]``, -1: nowhere) -> its owner's area, ``W`` int32 words a row there, made of
    two parts read in place: words ``0 .. XW-1`` from ``rows`` (rows ``XS`` words apart), then with
    ``KW > 0`` words ``XW .. XW+KW-1`` from ``wts`` (rows ``KS`` words apart). Words after ``XW + KW`` (padding) are not written. So a contiguous combine's ``x bf16[N, H]``
    and ``topk_weights f32[N, K]`` land as the row ``x | weights`` without a pass that builds it first;
    rows already packed are ``XW = XS = W, KW = 0``. A tile of ``RB`` rows x ``BLOCK`` words a step
    (program ``p`` takes rows ``p*RB ..``, then ``P*RB`` on), so that each program keeps ``4 * RB * BLOCK``
    bytes in flight: one row of ``BLOCK`` words a step left a program waiting on one load's latency after
    another. ``ALIGNED``: every destination row starts 16 bytes aligned (the launcher checked the bases,
    ``area_off`` and ``4W``), so the stores are 16-byte vectors (the weights' too where ``XW`` and ``KS``
    are multiples of 4: the column tiles run over both parts, each word loaded from the one it lies in).
    ``SKIP_SELF``: rows this rank owns stay where they are (block ``me`` of its own area is not written):
    the reduction reads them in place (``_combine_reduce_epilogue_impl_kernel``'s ``SELF``)."""
    rows = rows.to(tl.pointer_type(tl.int32), bitcast=True)
    wts = wts.to(tl.pointer_type(tl.int32), bitcast=True)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    e = tl.load(epoch_ptr) + 1
    if pid == 0:
        for q in range(R):
            signal(peer_ptr(ptr_table, q, flags_off + me * 4, tl.int32), 1)  # free[me] on every peer
    for q in range(R):
        wait_ge(flags + q, e, err_ptr, 4, q, timeout_ns, HAS_TIMER)
    rr = tl.arange(0, RB)
    cols = tl.arange(0, BLOCK)
    for i0 in range(pid * RB, n, nprog * RB):
        i = (i0 + rr).to(tl.int64)
        d = tl.load(dst + i, mask=i < n, other=-1)
        use = d >= 0
        if SKIP_SELF:
            use = use & (d // slots != me)
        owner = tl.where(use, d // slots, 0)
        # the byte address of each row's slot in its owner's area
        addr = tl.load(ptr_table + owner, mask=use, other=0) + area_off + (me * slots + d % slots) * (W * 4)
        base = addr.to(tl.pointer_type(tl.int32))
        if ALIGNED:
            base = tl.multiple_of(base, 16)
        src = (rows + i * XS)[:, None]
        wsrc = (wts + i * KS - XW)[:, None]  # word c >= XW of the row: wsrc + c
        # a tile with no row to move (padding, or rows this rank owns under SKIP_SELF) takes no column steps:
        # with every row skipped the kernel still took 94 us of a DSv3 combine at world 1 (4096 rows, 24
        # programs; profile of 928ee47), its masked column steps run whether or not a row moves
        if tl.sum(use.to(tl.int32), 0) > 0:
            for c in range(0, XW + KW, BLOCK):
                cc = (c + cols)[None, :]
                m = use[:, None] & (cc < XW + KW)
                at = src + cc
                if KW > 0:  # one load a word from either source: a tile straddling XW stays one 16-byte vector path
                    at = tl.where(cc < XW, at, wsrc + cc)
                tl.store(base[:, None] + cc, tl.load(at, mask=m), mask=m)
    for q in range(R):
        signal(peer_ptr(ptr_table, q, flags_off + (R + me) * 4, tl.int32), 1)  # data[me] on every peer


@triton.jit(do_not_specialize=["R", "P", "timeout_ns"])
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



# ----------------------------------------------------------------------------- combine: the epilogues


@triton.jit
def _bf16(acc):
    """float32 -> BF16, rounded to nearest even. Under the interpreter (whose cast truncates) by integer
    arithmetic, as torch rounds (NaN -> 0x7FC0); compiled, the hardware's conversion."""
    if INTERPRETED:
        bits = acc.to(tl.uint32, bitcast=True)
        r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
        r = tl.where(acc != acc, 0x7FC0, r).to(tl.uint16)
        return r.to(tl.bfloat16, bitcast=True)
    else:
        return acc.to(tl.bfloat16)


@triton.jit(do_not_specialize=["lane"])
def _combine_pack_kernel(x, meta, w, rows, dst, lane, K: tl.constexpr, KP: tl.constexpr, H: tl.constexpr,
                         W: tl.constexpr, HAS_W: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """The rows a combine sends back (``rows``: ``W`` bytes each), for contiguous row ``n`` (program 0) and
    a block of the hidden dim (program 1); rows whose ``meta[n, 0]`` (the source token) is ``-1`` are
    padding and left alone. ``meta int32[N, K+2]``: columns 2.. the expanded row of each lane.

    - ``MODE`` 0: row ``n`` of ``x bf16[N, H]`` as it is; ``HAS_W``: ``w f32[N, K]``'s row from byte ``2H``.
    - ``MODE`` 1: the local lanes' rows of ``x bf16[X, H]`` summed in lane order in float32 from zero, one
      BF16 rounding (``elastic_layout.local_reduce``); ``HAS_W``: each lane's weight ``w f32[X]`` at its
      expanded row (``0`` elsewhere) from byte ``2H``.
    - ``MODE`` 2: lane ``lane``'s expanded row of ``x bf16[X, H]`` as it is, and ``dst int64[N]`` = the source
      token where that lane is local, else ``-1`` (one transport a lane).

    Example (``K = 2``, ``MODE`` 1): ``meta[n] = [5, 1, 0, 2]`` -> ``x[0] + x[2]`` rounded once, weights
    ``[w[0], w[2]]``."""
    n = tl.program_id(0)
    hb = tl.program_id(1)
    offs = hb * BLOCK + tl.arange(0, BLOCK)
    m = offs < H
    mrow = meta + n * (K + 2)
    g = tl.load(mrow)
    base = rows + n.to(tl.int64) * W
    out = base.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    wout = (base + 2 * H).to(tl.pointer_type(tl.float32), bitcast=True)
    lanes = tl.arange(0, KP)
    if MODE == 2:
        s = tl.load(mrow + 2 + lane)
        use = (s >= 0) & (g >= 0)
        if hb == 0:
            tl.store(dst + n, tl.where(use, g.to(tl.int64), -1))
        if use:
            tl.store(out + offs, tl.load(x + s.to(tl.int64) * H + offs, mask=m), mask=m)
    elif g >= 0:
        if MODE == 0:
            tl.store(out + offs, tl.load(x + n.to(tl.int64) * H + offs, mask=m), mask=m)
            if HAS_W:
                if hb == 0:
                    tl.store(wout + lanes, tl.load(w + n * K + lanes, mask=lanes < K), mask=lanes < K)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            ss = tl.load(mrow + 2 + lanes, mask=lanes < K, other=-1)
            for j in tl.static_range(K):  # unrolled: the K loads are issued together, added in lane order
                sj = tl.sum(tl.where(lanes == j, ss, 0), 0)
                acc += tl.load(x + sj.to(tl.int64) * H + offs, mask=m & (sj >= 0), other=0.0).to(tl.float32)
            tl.store(out + offs, _bf16(acc), mask=m)
            if HAS_W:
                if hb == 0:
                    tl.store(wout + lanes, tl.load(w + ss, mask=ss >= 0, other=0.0), mask=lanes < K)


@triton.jit(do_not_specialize=["M", "J0", "J1", "me", "R"])
def _combine_reduce_epilogue_impl_kernel(got, topk, b0, b1, acc_io, out, out_w, M, J0, J1, x_self, w_self,
                                         send_head, me, R, K: tl.constexpr,
                                         KP: tl.constexpr, LE: tl.constexpr, ROW: tl.constexpr, H: tl.constexpr,
                                         W_OFF: tl.constexpr, NB: tl.constexpr, MASTER: tl.constexpr,
                                         HAS_W: tl.constexpr, ACC_IN: tl.constexpr, ACC_OUT: tl.constexpr,
                                         BLOCK: tl.constexpr, SELF: tl.constexpr = False, XS: tl.constexpr = 0,
                                         WS: tl.constexpr = 0):
    """The combine's reduction at the owner, in DeepEP's fixed order, for token ``t`` (program 0) and a
    block of the hidden dim (program 1): ``acc = b0 + b1`` (``NB`` biases; float32, or zeros; ``ACC_IN``:
    the float32 ``acc_io`` of a previous call instead), then for lanes ``j = J0 .. J1-1``
    ``acc += got[owner_j * M + t]`` where lane ``j`` is used, else ``+= 0``; one BF16 rounding into
    ``out`` (``ACC_OUT``: ``acc_io`` keeps the float32 sum for the next call). ``got``: the rows each rank
    sent back, ``ROW`` bytes each, BF16 from byte 0. Lane ``j`` (``topk int64[T, K]``) is owned by
    ``topk[t, j] // LE``; it is used where its id is not ``-1`` and, with ``MASTER``, no later lane has the
    same owner (each rank's partial added once, at its highest lane: ``elastic_layout.master_lanes``).
    ``HAS_W``: ``out_w f32[T, K]`` = the float32 each lane's owner sent at element ``W_OFF`` + lane of its
    row (0 for ``-1`` lanes). ``SELF``: the partial this rank (``me`` of ``R``) holds of its own token is
    read in place, not from ``got`` (the transport left it there: ``SKIP_SELF``): row
    ``send_head[t, me]`` of ``x_self bf16`` (rows ``XS`` elements apart) and with ``HAS_W`` of ``w_self f32``
    (``WS`` apart): the same values, added at the same place of the same order."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < H
    rows = got.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    if ACC_IN:
        acc = tl.load(acc_io + t * H + offs, mask=m, other=0.0)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        if NB >= 1:
            acc = tl.load(b0 + t * H + offs, mask=m, other=0.0).to(tl.float32)
        if NB == 2:
            acc = acc + tl.load(b1 + t * H + offs, mask=m, other=0.0).to(tl.float32)
    srow = tl.full((), -1, tl.int64)
    if SELF:
        srow = tl.load(send_head + t.to(tl.int64) * R + me).to(tl.int64)  # -1 where no lane is mine
    tk = topk + t * K
    # unrolled: the loads are issued together; lanes outside J0..J1-1 add nothing. A lane's id and owner
    # are scalars (loads of one cached line): picking them out of a [KP] vector took two block-wide
    # reductions a lane, which with one 1024-column block a program cost more than the rows' bytes
    for j in tl.static_range(K):
        idj = tl.load(tk + j)
        oj = tl.where(idj >= 0, idj // LE, -1)
        inr = (j >= J0) & (j < J1)
        use = (idj >= 0) & inr
        if MASTER:  # a later lane of the same owner: this one is not its master
            for j2 in tl.static_range(j + 1, K):
                i2 = tl.load(tk + j2)
                use = use & ((i2 < 0) | (i2 // LE != oj))
        row = (oj.to(tl.int64) * M + t) * (ROW // 2)
        if SELF:  # (a select, not a sum of the two loads: -0.0 stays -0.0)
            mine = oj == me
            v = tl.load(rows + row + offs, mask=m & use & ~mine, other=0.0).to(tl.float32)
            vs = tl.load(x_self + srow * XS + offs, mask=m & use & mine, other=0.0).to(tl.float32)
            v = tl.where(mine, vs, v)
        else:
            v = tl.load(rows + row + offs, mask=m & use, other=0.0).to(tl.float32)
        acc = tl.where(inr, acc + v, acc)
    if ACC_OUT:
        tl.store(acc_io + t * H + offs, acc, mask=m)
    else:
        tl.store(out + t * H + offs, _bf16(acc), mask=m)
    if HAS_W:
        if tl.program_id(1) == 0:
            lanes = tl.arange(0, KP)
            ids = tl.load(topk + t * K + lanes, mask=lanes < K, other=-1)
            own = tl.where(ids >= 0, ids // LE, -1)
            wrows = got.to(tl.pointer_type(tl.float32), bitcast=True)
            wm = (ids >= 0) & (lanes < K)
            if SELF:
                wv = tl.load(wrows + (tl.where(own >= 0, own, 0).to(tl.int64) * M + t) * (ROW // 4) + W_OFF + lanes,
                             mask=wm & (own != me), other=0.0)
                ws = tl.load(w_self + srow * WS + lanes, mask=wm & (own == me), other=0.0)
                wv = tl.where(own == me, ws, wv)
            else:
                wv = tl.load(wrows + (tl.where(own >= 0, own, 0).to(tl.int64) * M + t) * (ROW // 4) + W_OFF + lanes,
                             mask=wm, other=0.0)
            tl.store(out_w + t * K + lanes, wv, mask=lanes < K)

"""Kernels of ``ElasticBuffer`` (DeepEP V2's API), launched by ``backends/elastic_kernels.py`` wherever the
backend runs kernels (each has a torch twin in ``elastic_layout.py``, the same bytes):

- dispatch: ``_recv_meta_kernel`` (the handle's metadata, counts and prefix sums; launched as
  ``_dispatch_copy_epilogue_impl_meta_kernel`` by a contiguous dispatch, its one launch after the
  transfer), ``_expert_layout_kernel`` (the expanded layout), ``_dispatch_copy_epilogue_impl_kernel`` (the
  expanded rows),
  ``_dispatch_copy_epilogue_impl_cached_kernel`` (a cached contiguous dispatch's ids and weights); each
  dispatch launches one kernel named ``dispatch_copy_epilogue_impl`` (docs/v2.md, "Kernel names");
- combine: ``_combine_pack_kernel`` (the rows sent back, where the transport cannot read them in place: an
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



# ----------------------------------------------------------------------------- dispatch: layout and metadata


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


@triton.jit(do_not_specialize=["N", "T", "M", "A"])
def _recv_meta_kernel(rpm, me, recv_src, recv_local, N, local, local_out, meta, gid, counts, psum, psum_rank,
                      cum, topk, topk_copy, send_head, T, dst_slot, M, A, part, ticket, R: tl.constexpr,
                      K: tl.constexpr, LE: tl.constexpr, LEP: tl.constexpr, HB: tl.constexpr,
                      KP: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr, COPY: tl.constexpr,
                      EXPAND: tl.constexpr, HAS_CUM: tl.constexpr, COPY_TOPK: tl.constexpr):
    """Per received row (programs ``0 .. P-1``, ``P = max(1, ceil(N/BN))``, ``BN`` rows each) and per sent
    token (the programs after, ``BN`` tokens each), what ``elastic_layout.recv_meta`` computes in torch:

    - ``rpm int32[R, R]`` (``rank_prefix_matrix``): column ``me`` -> ``psum_rank int32[R]``; a row's source
      rank is the number of entries ``<=`` its index; rows from the last entry on are padding.
    - ``gid int64[N]`` = ``src_rank * M + recv_src[row]`` (``-1``: padding), ``local int64[N, K]`` (and
      ``local_out`` with ``COPY``) = ``recv_local`` with padding rows ``-1``.
    - ``meta int32[N, K+2]``: ``[gid, src_rank * K + highest local lane or -1, -1 ...]``; with ``EXPAND``
      the local lanes' columns are left to ``_expert_layout_kernel``.
    - the counts: each row program adds the histogram of its local ids (``HB >= LE`` bins) into ``part
      int32[LE]`` and takes a ticket (``ticket int32[1]``); the last of the ``P`` takes the sums (putting
      ``part`` and the ticket back to 0 for the next launch or a graph's replay) and writes ``counts
      int32[LE]``, ``psum int32[LE]`` with alignment ``A`` (inclusive sums of the aligned counts;
      ``EXPAND``: aligned start + count) and adds the counts to ``cum`` (``HAS_CUM``). So no output is
      zeroed first and no second launch sums them. ``part`` and ``ticket`` start at 0 (allocated zeroed
      once); launches that share them run in order, as a buffer's calls do.
    - ``dst_slot int32[T, K]`` = ``d * M + send_head[t, d]`` with ``d = topk[t, j] // LE``, ``-1`` for
      ``-1`` lanes; ``COPY_TOPK``: ``topk_copy int64[T, K]`` = ``topk`` (the handle's copy).

    Example (``R = 2, M = 4, K = 2``, rank 1, ``rpm[:, 1] = [1, 3]``, ``N = 4``, ``recv_src = [2, 0, 3, *]``,
    ``recv_local = [[0, -1], [1, 0], [-1, 1], *]``, ``A = 2``): gid ``[2, 4, 7, -1]``, meta column 1
    ``[0, 3, 3, -1]``, counts ``[2, 2]``, psum ``[2, 4]``."""
    pid = tl.program_id(0)
    nbn = tl.maximum((N + BN - 1) // BN, 1)  # program 0 handles rows (psum_rank, the counts) even when N = 0
    lanes = tl.arange(0, KP)
    lm = lanes < K
    if pid < nbn:
        rows = pid * BN + tl.arange(0, BN)
        rm = rows < N
        at = rows[:, None] * K + lanes[None, :]
        m2 = rm[:, None] & lm[None, :]
        # every load at once (padding rows are read too, and masked below: no load waits for the rank prefix)
        sidx = tl.load(recv_src + rows, mask=rm, other=0)
        raw = tl.load(recv_local + at, mask=m2, other=-1)
        total = tl.load(rpm + (R - 1) * R + me)
        src = tl.zeros([BN], dtype=tl.int32)
        for r0 in range(0, R, RB):
            rs = r0 + tl.arange(0, RB)
            p = tl.load(rpm + rs * R + me, mask=rs < R, other=2147483647)
            src += tl.sum((rows[:, None] >= p[None, :]).to(tl.int32), 1)
            if pid == 0:
                tl.store(psum_rank + rs, p, mask=rs < R)
        valid = rows < total
        loc = tl.where(valid[:, None], raw, -1)
        here = loc >= 0
        # the counts first: the ticket's release then waits for these adds only, not for the rows' stores
        hist = tl.histogram(tl.reshape(tl.where(here, loc, 0).to(tl.int32), [BN * KP]), HB,
                            mask=tl.reshape(here, [BN * KP]))
        hb = tl.arange(0, HB)
        tl.atomic_add(part + hb, hist, mask=hb < LE, sem="relaxed", scope="gpu")
        tl.debug_barrier()
        if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == nbn - 1:  # the last row program
            tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")
            es = tl.arange(0, LEP)
            em = es < LE
            zero = tl.zeros([LEP], dtype=tl.int32)
            c = tl.atomic_xchg(part + es, zero, mask=em, sem="relaxed", scope="gpu")
            c = tl.where(em, c, 0)
            al = (c + A - 1) // A * A
            incl = tl.cumsum(al, 0)
            tl.store(counts + es, c, mask=em)
            if EXPAND:
                tl.store(psum + es, incl - al + c, mask=em)
            else:
                tl.store(psum + es, incl, mask=em)
            if HAS_CUM:
                tl.store(cum + es, tl.load(cum + es, mask=em, other=0) + c, mask=em)
        g = tl.where(valid, src.to(tl.int64) * M + sidx, -1)
        tl.store(gid + rows, g, mask=rm)
        tl.store(local + at, loc, mask=m2)
        if COPY:
            tl.store(local_out + at, loc, mask=m2)
        master = tl.max(tl.where(here, lanes[None, :], -1), 1)
        mrow = meta + rows * (K + 2)
        tl.store(mrow, g.to(tl.int32), mask=rm)
        tl.store(mrow + 1, tl.where(valid & (master >= 0), src * K + master, -1), mask=rm)
        if EXPAND:
            m2 = m2 & ~here
        tl.store(mrow[:, None] + 2 + lanes[None, :], tl.full([BN, KP], -1, tl.int32), mask=m2)
    else:
        t = (pid - nbn) * BN + tl.arange(0, BN)
        tm = t[:, None] < T
        at = t[:, None] * K + lanes[None, :]
        ids = tl.load(topk + at, mask=tm & lm[None, :], other=-1)
        d = tl.where(ids >= 0, ids // LE, 0)
        ok = (ids >= 0) & (d < R)
        there = tl.load(send_head + t[:, None] * R + d, mask=ok & tm, other=0)
        tl.store(dst_slot + at, tl.where(ok, d * M + there, -1).to(tl.int32), mask=tm & lm[None, :])
        if COPY_TOPK:
            tl.store(topk_copy + at, ids, mask=tm & lm[None, :])


@triton.jit(do_not_specialize=["N", "T", "M", "A"])
def _dispatch_copy_epilogue_impl_meta_kernel(rpm, me, recv_src, recv_local, N, local, local_out, meta, gid,
                                             counts, psum, psum_rank, cum, topk, topk_copy, send_head, T,
                                             dst_slot, M, A, part, ticket, R: tl.constexpr, K: tl.constexpr,
                                             LE: tl.constexpr, LEP: tl.constexpr, HB: tl.constexpr,
                                             KP: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr,
                                             COPY: tl.constexpr, EXPAND: tl.constexpr, HAS_CUM: tl.constexpr,
                                             COPY_TOPK: tl.constexpr):
    """A contiguous dispatch's copy epilogue (``dispatch_copy_epilogue_impl`` in DeepEP's names, so that its
    profiler-based timing finds one): ``_recv_meta_kernel`` with ``COPY``, launched under this name. The
    transfer (``_dispatch_impl_kernel``) already wrote the rows, scales and weights into the outputs; what
    is left to finish them is this kernel's: the received top-k ids copied into ``recv_topk_idx`` (padding
    rows ``-1``) and the handle's metadata, counts and prefix sums: the dispatch's only launch after the
    transfer. An expanded dispatch launches ``_recv_meta_kernel``: its epilogue is the expanded copy,
    ``_dispatch_copy_epilogue_impl_kernel``."""
    _recv_meta_kernel(rpm, me, recv_src, recv_local, N, local, local_out, meta, gid, counts, psum, psum_rank,
                      cum, topk, topk_copy, send_head, T, dst_slot, M, A, part, ticket, R, K, LE, LEP, HB, KP,
                      BN, RB, COPY, EXPAND, HAS_CUM, COPY_TOPK)


@triton.jit(do_not_specialize=["me", "A", "X"])
def _expert_layout_kernel(counts, local, rpm, me, A, meta, source, X, R: tl.constexpr, K: tl.constexpr,
                          LE: tl.constexpr, LEP: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr):
    """The expanded layout, from the real counts ``counts int32[LE]`` (``_recv_meta_kernel``'s) and alignment
    ``A``: program ``e`` lays out expert ``e``: its rows in row order from its aligned start (``meta[row, 2 +
    lane]``, and ``source int64[X]`` = ``row * K + lane``), its padding and a share of the tail ``source``
    rows set to ``-1``. Only the real rows (``rpm[R-1, me]``) of ``local int64[N, K]`` are read.

    Example (``LE = 2, A = 2``): ``local = [[0, 1], [-1, 1]]``, counts ``[1, 2]`` -> meta lanes
    ``[[0, 2], [-1, 3]]``, source ``[0, -1, 1, 3]``."""
    es = tl.arange(0, LEP)
    em = es < LE
    c = tl.load(counts + es, mask=em, other=0)
    al = (c + A - 1) // A * A
    start = tl.cumsum(al, 0) - al
    pid = tl.program_id(0)
    s_e = tl.sum(tl.where(es == pid, start, 0), 0)
    pad_lo = s_e + tl.sum(tl.where(es == pid, c, 0), 0)
    pad_hi = s_e + tl.sum(tl.where(es == pid, al, 0), 0)
    lanes = tl.arange(0, KP)
    lm = lanes < K
    total = tl.load(rpm + (R - 1) * R + me)
    run = s_e
    for b in range(0, total, BN):
        rows = b + tl.arange(0, BN)
        at = rows[:, None] * K + lanes[None, :]
        loc = tl.load(local + at, mask=(rows[:, None] < total) & lm[None, :], other=-1)
        hit = loc == pid
        has = tl.sum(hit.to(tl.int32), 1)
        pos = run + tl.cumsum(has, 0) - has
        pos2 = tl.broadcast_to(pos[:, None], [BN, KP])
        tl.store(meta + rows[:, None] * (K + 2) + 2 + lanes[None, :], pos2, mask=hit)
        tl.store(source + pos2, at.to(tl.int64), mask=hit)
        run += tl.sum(has, 0)
    offs = tl.arange(0, BN)
    for p0 in range(pad_lo, pad_hi, BN):
        tl.store(source + p0 + offs, tl.full([BN], -1, tl.int64), mask=p0 + offs < pad_hi)
    end = tl.sum(al, 0)
    for p0 in range(end + pid * BN, X, LE * BN):
        tl.store(source + p0 + offs, tl.full([BN], -1, tl.int64), mask=p0 + offs < X)


@triton.jit(do_not_specialize=["X", "sf_rs", "sf_cs"])
def _dispatch_copy_epilogue_impl_kernel(src, source, out, X, sf_src, sf_out, sf_rs, sf_cs, w_src, w_out,
                                        K: tl.constexpr, ROW: tl.constexpr, SRC_STRIDE: tl.constexpr,
                                        SFB: tl.constexpr, SFBP: tl.constexpr, SF_OFF: tl.constexpr,
                                        SF_STRIDE: tl.constexpr, W_OFF: tl.constexpr, W_STRIDE: tl.constexpr,
                                        HAS_SF: tl.constexpr, HAS_W: tl.constexpr, ZERO: tl.constexpr,
                                        RB: tl.constexpr, BLOCK: tl.constexpr):
    """The expanded layout's copy: expanded row ``e`` takes contiguous row ``r = source[e] // K`` (lane
    ``source[e] % K``): ``ROW`` bytes of ``src`` (rows ``SRC_STRIDE`` bytes apart) into ``out uint8[X, ROW]``;
    with ``HAS_SF`` the ``SFB`` bytes of scale packs from byte ``SF_OFF`` of ``sf_src``'s rows (``SF_STRIDE``
    bytes apart) into ``sf_out`` (4-byte element ``(e, c)`` at ``e * sf_rs + c * sf_cs``); with ``HAS_W``
    the lane's 4-byte weight from byte ``W_OFF`` of ``w_src``'s rows (``W_STRIDE`` bytes apart) into
    ``w_out[e]``. Sources are bytes, so packed
    rows (x, packs and weights side by side) are read in place. A padding row (``source[e] < 0``) is
    zeroed with ``ZERO``, else left as it is (DeepEP leaves it uninitialised), so a worst-case layout
    costs only its real rows. A program moves a tile of ``RB`` rows x ``BLOCK`` bytes a step (rows
    ``p*RB ..``, then ``P*RB`` on): one row a step kept one load in flight.

    Example: ``K = 2``, ``source = [0, -1, 3]`` -> rows ``[src[0], (zero or untouched), src[1]]``, weights
    ``[w[0, 0], (0 or untouched), w[1, 1]]``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    rr = tl.arange(0, RB)
    sb = tl.arange(0, SFBP)
    sm = sb < SFB
    wb = tl.arange(0, 4)
    src8 = src.to(tl.pointer_type(tl.uint8), bitcast=True)
    out8 = out.to(tl.pointer_type(tl.uint8), bitcast=True)
    sf_src8 = sf_src.to(tl.pointer_type(tl.uint8), bitcast=True)
    sf_out8 = sf_out.to(tl.pointer_type(tl.uint8), bitcast=True)
    w_src8 = w_src.to(tl.pointer_type(tl.uint8), bitcast=True)
    w_out8 = w_out.to(tl.pointer_type(tl.uint8), bitcast=True)
    for e0 in range(pid * RB, X, nprog * RB):
        e = (e0 + rr).to(tl.int64)  # int64: X * ROW may pass 2**31
        inb = e < X
        s = tl.load(source + e, mask=inb, other=-1)
        real = s >= 0
        put = real
        if ZERO:  # the padding rows too
            put = inb
        r = tl.where(real, s // K, 0)
        dst = out8 + e * ROW
        row = src8 + r * SRC_STRIDE
        for c in range(0, ROW, BLOCK):
            cc = (c + offs)[None, :]
            v = tl.load(row[:, None] + cc, mask=real[:, None] & (cc < ROW), other=0)
            tl.store(dst[:, None] + cc, v, mask=put[:, None] & (cc < ROW))
        if HAS_SF:
            sf_dst = sf_out8 + (e[:, None] * sf_rs + (sb[None, :] // 4) * sf_cs) * 4 + sb[None, :] % 4
            v = tl.load(sf_src8 + SF_OFF + r[:, None] * SF_STRIDE + sb[None, :], mask=real[:, None] & sm[None, :],
                        other=0)
            tl.store(sf_dst, v, mask=put[:, None] & sm[None, :])
        if HAS_W:
            v = tl.load(w_src8 + W_OFF + r[:, None] * W_STRIDE + (tl.where(real, s, 0) % K)[:, None] * 4 + wb[None, :],
                        mask=real[:, None], other=0)
            tl.store(w_out8 + e[:, None] * 4 + wb[None, :], v, mask=put[:, None])


@triton.jit(do_not_specialize=["N"])
def _dispatch_copy_epilogue_impl_cached_kernel(local, out_k, N, w_src, w_out, K: tl.constexpr, KP: tl.constexpr,
                                               W_OFF: tl.constexpr, W_STRIDE: tl.constexpr, HAS_W: tl.constexpr,
                                               BN: tl.constexpr):
    """A cached contiguous dispatch's copy epilogue (the transfer wrote the rows): ``BN`` rows a program,
    ``out_k int64[N, K]`` = the handle's local expert ids ``local int64[N, K]`` (the call's
    ``recv_topk_idx``); with ``HAS_W`` ``w_out f32[N, K]`` = the received weights (the 4 bytes of lane
    ``j`` at byte ``W_OFF + 4j`` of row ``n`` of ``w_src``, rows ``W_STRIDE`` bytes apart: read in place in
    the packed rows) where lane ``j`` is local (``local >= 0``), else 0, as a fresh dispatch gives them.

    Example (``K = 2``): ``local = [[0, -1]]``, received weights ``[[0.5, 0.7]]`` -> ``[[0, -1]]``,
    ``[[0.5, 0.0]]``."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    r64 = rows.to(tl.int64)[:, None]
    lanes = tl.arange(0, KP)[None, :]
    m = (rows[:, None] < N) & (lanes < K)
    tl.store(out_k + r64 * K + lanes, tl.load(local + r64 * K + lanes, mask=m), mask=m)
    if HAS_W:  # byte by byte: the packed weights need not be 4-byte aligned
        cols = tl.arange(0, 4 * KP)[None, :]
        here = tl.load(local + r64 * K + cols // 4, mask=(rows[:, None] < N) & (cols < 4 * K), other=-1) >= 0
        w8 = w_src.to(tl.pointer_type(tl.uint8), bitcast=True)
        v = tl.load(w8 + W_OFF + r64 * W_STRIDE + cols, mask=here, other=0)
        wo8 = w_out.to(tl.pointer_type(tl.uint8), bitcast=True)
        tl.store(wo8 + r64 * (4 * K) + cols, v, mask=(rows[:, None] < N) & (cols < 4 * K))


# ----------------------------------------------------------------------------- combine: the epilogues


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

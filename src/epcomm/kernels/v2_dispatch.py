"""Kernels of ``ElasticBuffer``'s dispatch steps (DeepEP V2's API) after the backend's transfer, launched by
``backends/elastic_kernels.py`` wherever the backend runs kernels (each has a torch twin in
``elastic_layout.py``, the same bytes): ``_recv_meta_kernel`` (the handle's metadata, counts and prefix sums;
launched as ``_dispatch_copy_epilogue_impl_meta_kernel`` by a contiguous dispatch, its one launch after the
transfer), ``_expert_layout_kernel`` (the expanded layout), ``_dispatch_copy_epilogue_impl_kernel`` (the
expanded rows), ``_dispatch_copy_epilogue_impl_cached_kernel`` (a cached contiguous dispatch's ids and
weights). Each dispatch launches one kernel named ``dispatch_copy_epilogue_impl`` (docs/v2.md, "Kernel
names"). The combine's kernels are in ``v2.py``.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``LE = E/R``, ``M`` max tokens a
rank, ``N`` contiguous rows, ``X`` expanded rows.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["me", "N", "T", "M", "A"])
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


@triton.jit(do_not_specialize=["me", "N", "T", "M", "A"])
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


@triton.jit(do_not_specialize=["X", "sf_rs", "sf_cs", "N"])
def _dispatch_copy_epilogue_impl_kernel(src, source, out, X, sf_src, sf_out, sf_rs, sf_cs, w_src, w_out, slots, N,
                                        K: tl.constexpr, KP: tl.constexpr, ROW: tl.constexpr,
                                        SRC_STRIDE: tl.constexpr, SFB: tl.constexpr, SFBP: tl.constexpr,
                                        SF_OFF: tl.constexpr, SF_STRIDE: tl.constexpr, W_OFF: tl.constexpr,
                                        W_STRIDE: tl.constexpr, HAS_SF: tl.constexpr, HAS_W: tl.constexpr,
                                        ZERO: tl.constexpr, RB: tl.constexpr, BLOCK: tl.constexpr,
                                        BY_ROW: tl.constexpr, SLOT_STRIDE: tl.constexpr):
    """The expanded layout's copy: expanded row ``e`` takes contiguous row ``r = source[e] // K`` (lane
    ``source[e] % K``): ``ROW`` bytes of ``src`` (rows ``SRC_STRIDE`` bytes apart) into ``out uint8[X, ROW]``;
    with ``HAS_SF`` the ``SFB`` bytes of scale packs from byte ``SF_OFF`` of ``sf_src``'s rows (``SF_STRIDE``
    bytes apart) into ``sf_out`` (4-byte element ``(e, c)`` at ``e * sf_rs + c * sf_cs``); with ``HAS_W``
    the lane's 4-byte weight from byte ``W_OFF`` of ``w_src``'s rows (``W_STRIDE`` bytes apart) into
    ``w_out[e]``. Sources are bytes, so packed rows (x, packs and weights side by side) are read in place.
    A padding row (``source[e] < 0``) is zeroed with ``ZERO``, else left as it is (DeepEP leaves it
    uninitialised), so a worst-case layout costs only its real rows. A program moves a tile of ``RB`` rows
    x ``BLOCK`` bytes a step (rows ``p*RB ..``, then ``P*RB`` on): one row a step kept one load in flight.

    ``BY_ROW``: the same bytes, by contiguous row: a program reads a tile of the ``N`` rows once and stores
    it to each local lane's expanded row (``slots int32[N, K]``, rows ``SLOT_STRIDE`` apart, ``-1``: no
    row), where by expanded row each contiguous row is read once per local lane (DSv3 at world 1: 8 reads
    of 14 KB, far apart, for one write each); then with ``ZERO`` the padding rows by ``source``.

    Example: ``K = 2``, ``source = [0, -1, 3]`` (``slots = [[0, -1], [-1, 2]]``) -> rows ``[src[0], (zero
    or untouched), src[1]]``, weights ``[w[0, 0], (0 or untouched), w[1, 1]]``."""
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
    if BY_ROW:
        lanes = tl.arange(0, KP)
        for n0 in range(pid * RB, N, nprog * RB):
            r = (n0 + rr).to(tl.int64)
            inr = r < N
            srow = slots + r * SLOT_STRIDE
            has = tl.max(tl.load(srow[:, None] + lanes[None, :], mask=inr[:, None] & (lanes < K)[None, :],
                                 other=-1), 1) >= 0  # rows with a local lane (not padding)
            if tl.sum(has.to(tl.int32), 0) > 0:  # a tile of padding rows takes no step
                row = src8 + r * SRC_STRIDE
                for c in range(0, ROW, BLOCK):
                    cc = (c + offs)[None, :]
                    v = tl.load(row[:, None] + cc, mask=has[:, None] & (cc < ROW), other=0)
                    for j in tl.static_range(K):  # the tile into each lane's expanded rows
                        e = tl.load(srow + j, mask=inr, other=-1).to(tl.int64)
                        tl.store(out8 + e[:, None] * ROW + cc, v, mask=(e >= 0)[:, None] & (cc < ROW))
                if HAS_SF:
                    v = tl.load(sf_src8 + SF_OFF + r[:, None] * SF_STRIDE + sb[None, :], mask=has[:, None] & sm[None, :],
                                other=0)
                    for j in tl.static_range(K):
                        e = tl.load(srow + j, mask=inr, other=-1).to(tl.int64)
                        tl.store(sf_out8 + (e[:, None] * sf_rs + (sb[None, :] // 4) * sf_cs) * 4 + sb[None, :] % 4, v,
                                 mask=(e >= 0)[:, None] & sm[None, :])
                if HAS_W:
                    for j in tl.static_range(K):
                        e = tl.load(srow + j, mask=inr, other=-1).to(tl.int64)
                        v = tl.load(w_src8 + W_OFF + r[:, None] * W_STRIDE + j * 4 + wb[None, :], mask=(e >= 0)[:, None],
                                    other=0)
                        tl.store(w_out8 + e[:, None] * 4 + wb[None, :], v, mask=(e >= 0)[:, None])
    if ZERO or not BY_ROW:  # by expanded row: every row, or (BY_ROW) the padding rows only
        for e0 in range(pid * RB, X, nprog * RB):
            e = (e0 + rr).to(tl.int64)  # int64: X * ROW may pass 2**31
            inb = e < X
            s = tl.load(source + e, mask=inb, other=-1)
            real = s >= 0
            put = real
            if ZERO:  # the padding rows too
                put = inb
            if BY_ROW:  # the real rows are in place: zeros into the others, nothing read
                put = inb & ~real
                real = tl.zeros([RB], dtype=tl.int1)
            if tl.sum(put.to(tl.int32), 0) > 0:  # a tile with no row to write takes no step
                r = tl.where(real, s // K, 0)
                dst = out8 + e * ROW
                row = src8 + r * SRC_STRIDE
                for c in range(0, ROW, BLOCK):
                    cc = (c + offs)[None, :]
                    v = tl.load(row[:, None] + cc, mask=real[:, None] & (cc < ROW), other=0)
                    tl.store(dst[:, None] + cc, v, mask=put[:, None] & (cc < ROW))
                if HAS_SF:
                    sf_dst = sf_out8 + (e[:, None] * sf_rs + (sb[None, :] // 4) * sf_cs) * 4 + sb[None, :] % 4
                    v = tl.load(sf_src8 + SF_OFF + r[:, None] * SF_STRIDE + sb[None, :],
                                mask=real[:, None] & sm[None, :], other=0)
                    tl.store(sf_dst, v, mask=put[:, None] & sm[None, :])
                if HAS_W:
                    lane = (tl.where(real, s, 0) % K)[:, None] * 4
                    v = tl.load(w_src8 + W_OFF + r[:, None] * W_STRIDE + lane + wb[None, :], mask=real[:, None],
                                other=0)
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

"""Row movers of the internode high-throughput kernels (``internode_ht.py``, ``internode_ht_combine.py``,
whose letters these use): tile copies, a message's unpacking into the outputs, the forward of rows to the
node's ranks and its counts, where a sender writes a message (staging or the relay's own slot), the chunked
puts, and the end of a launch (the free words).

**Rows start 16-byte aligned.** Every row of an area (a message, an NVL row, a combine row, a partial sum)
starts at a multiple of 16 bytes: row strides are padded to multiples of 4 words (``pad4``; the host,
``backends/internode_ht.py``, lays the areas out with the same strides), area offsets are multiples of 128
bytes, and the symmetric buffers' bases multiples of 16 (the backend checks them). The compiler cannot know
it of a pointer built from an address loaded from ``ptr_table`` (4-byte aligned to it), so the kernels say
so with ``tl.multiple_of(rows, 16)`` where they compute a tile's row pointers (in the function that
computes them: a hint on a function's argument does not reach the caller's value). The copies of a row's
``x`` part (``XW`` words, a multiple of 4 for any hidden size of a multiple of 8) then move 16-byte vectors
where they moved 4-byte words, and NVSHMEM's put, whose block copy takes 16-byte steps only where both ends
are 16-byte aligned, no longer moves 4 or 8 bytes a thread a step for three rows in four (DSv3's BF16
message was 3609 words).

**Direct rows** (``P2P``, ``backends/internode_ht.TUNE["p2p"]``): where NVSHMEM maps a relay's buffer into
this process (``ptr_table[relay] != 0``: the relay sits on a GPU this one reaches by loads and stores, as
virtual nodes of one host do, or an NVLink domain across hosts), a sender writes its messages straight into
the relay's RDMA slot with stores and publishes them by a release atomic on the relay's counter, as the
forwarders publish inside a node: no staging and no put, so a row is written once instead of twice and
copied by tiles instead of by NVSHMEM's block copy (one 16-byte word a thread a loop step: bound by the
latency of each step). DeepEP's low-latency kernels do the same for peers NVSHMEM maps. Peers it does not
map (across an RDMA network) get staging and puts.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvshmem as nv
from .common import signal
from .internode_ht_prep import _sig


@triton.jit
def pad4(n):
    """``n`` words rounded up to a multiple of 4 (16 bytes): a row stride."""
    return (n + 3) // 4 * 4


@triton.jit
def _copy_rows(dst, src, ld_ok, st_ok, n, BLOCK: tl.constexpr):
    """Rows of ``n`` int32 words, ``dst[r] <- src[r]`` (``[RB]`` row pointers) where ``st_ok``, zeros where
    not ``ld_ok``: a tile of ``RB x BLOCK`` words a step, so that many loads are in flight at once (a
    row a step, 4 KB, left a program latency-bound at ~4 GB/s)."""
    cc = tl.arange(0, BLOCK)
    for c0 in range(0, n, BLOCK):
        cm = (c0 + cc)[None, :] < n
        v = tl.load(src[:, None] + c0 + cc[None, :], mask=ld_ok[:, None] & cm, other=0)
        tl.store(dst[:, None] + c0 + cc[None, :], v, mask=st_ok[:, None] & cm)


@triton.jit
def _free(ptr_table, me, N, P, ctr_off, F_NODE, F_NET, cnt_ptr, count, SIM: tl.constexpr):
    """The end of a launch (its last program): this rank ``(b, i)`` has read every slot its producers wrote
    this call, so it raises its word in theirs, ``F_NODE[i]`` at the other ranks of its node (a release
    atomic) and ``F_NET[b]`` at rank ``i`` of every other node (NVSHMEM), then counts the call."""
    b = me // N
    i = me % N
    for j in range(N):
        if j != i:
            signal(_sig(ptr_table, b * N + j, ctr_off, F_NODE + i), 1)
    for a in range(P):
        if a != b:
            nv.signal_add(ptr_table, me, a * N + i, ctr_off + (F_NET + b) * 8, 1, SIM)
    nv.quiet(SIM)
    tl.store(cnt_ptr, count + 1)


@triton.jit
def _mapped(ptr_table, pe, P2P):
    """``(base, direct)``: ``pe``'s symmetric buffer as this process maps it (``uint8*``), and whether rows
    for it go there by stores (``P2P`` on and NVSHMEM maps it; module docstring)."""
    pb = tl.load(ptr_table + pe)
    return pb.to(tl.pointer_type(tl.uint8)), (P2P != 0) & (pb != 0)


@triton.jit
def _msg_rows(q, b, a, i, N, P, ptr_table, stage, rdma_off, slot_words, MW, P2P):
    """``[RB]`` int32 pointers to rows ``q`` of this rank's (node ``a``) messages for node ``b``: in relay
    ``(b, i)``'s own RDMA slot (slot ``(a - b - 1) mod P`` at ``rdma_off``) where rows go there directly,
    else in stage slot ``(b - a - 1) mod P``; and whether direct."""
    base, direct = _mapped(ptr_table, b * N + i, P2P)
    if direct:
        rows = (base + rdma_off).to(tl.pointer_type(tl.int32)) + ((a - b - 1 + P) % P) * slot_words
    else:
        rows = stage + ((b - a - 1 + P) % P) * slot_words
    return tl.multiple_of(rows + q * MW, 16), direct


@triton.jit
def _publish_direct(base, ctr_off, idx, n):
    """``n`` rows (a scalar) stored straight into a peer's slot (``base``: its buffer, ``uint8*``) are counted
    in its counter word ``idx`` (release, after every thread's stores)."""
    tl.debug_barrier()
    if n > 0:
        tl.atomic_add((base + ctr_off).to(tl.pointer_type(tl.int64)) + idx, n.to(tl.int64), sem="release",
                      scope="sys")


@triton.jit
def _put_rows(ptr_table, me, pe, dst, src, p0, upto, CH, RW, SIM: tl.constexpr):
    """Rows ``[p0, upto)`` of a channel (``RW`` words each; chunks end at multiples of ``CH`` rows from the
    channel's first row) from ``src`` (this rank's int32 pointer to the channel's first row) to byte offset
    ``dst`` (the channel's first row) at ``pe``, in puts of at most a chunk (no fence, no count)."""
    while p0 < upto:
        p1 = tl.minimum((p0 // CH + 1) * CH, upto)
        nv.put(ptr_table, me, pe, dst + p0 * RW * 4, src + p0 * RW, (p1 - p0) * RW * 4, SIM)
        p0 = p1


@triton.jit
def _put_chunks(ptr_table, me, pe, dst, src, p0, upto, CH, RW, sig_off, SIM: tl.constexpr):
    """:func:`_put_rows`, then a ``fence`` (the rows land before the count that publishes them) and one
    ``signal_add`` of their number to ``sig_off`` at ``pe``."""
    _put_rows(ptr_table, me, pe, dst, src, p0, upto, CH, RW, SIM)
    nv.fence(SIM)
    nv.signal_add(ptr_table, me, pe, sig_off, upto - p0, SIM)


@triton.jit
def _biased_store(acc, o, om, out_ptr, b0_ptr, b1_ptr, NB: tl.constexpr):
    """A final's sums ``acc`` (float32) plus the ``NB`` (0-2) BF16 biases in order, rounded once to BF16, into
    ``out`` at offsets ``o`` where ``om``."""
    if NB > 0:
        acc += tl.load(b0_ptr + o, mask=om, other=0.0).to(tl.float32)
    if NB > 1:
        acc += tl.load(b1_ptr + o, mask=om, other=0.0).to(tl.float32)
    tl.store(out_ptr + o, acc.to(tl.bfloat16), mask=om)


@triton.jit
def _base_add(ptr, n):
    """This call's target of a counter whose private base is ``*ptr``: the base grows by ``n`` (a tile's rows),
    and the new base is the target, the same in every thread. One atomic (one thread does it; Triton
    broadcasts its result): a plain load of the base by every thread and a store by one (Triton stores a
    scalar from thread 0 only) let a warp that loaded after thread 0's store see the next base, wait for
    a target too high, and part from the other warps around the wait's barriers (the final of a combine
    with weights hung so on an H100)."""
    return tl.atomic_add(ptr, n, sem="relaxed", scope="cta") + n


@triton.jit
def _unpack(orow, got, inb, xs, ss, ids, ws, tok, rx_ptr, rs_ptr, rid_ptr, rw_ptr, rsrc_ptr, rows, XW, G, K, NSRC, lo,
            LX, BLOCK: tl.constexpr, K_POW2: tl.constexpr, G_POW2: tl.constexpr):
    """Output rows ``orow`` (``[RB]``) from a message's fields at ``xs, ss, ids, ws`` (``[RB]`` int32 row
    pointers) where ``got``, padding where ``inb`` but not ``got`` (zeros, -1 for the ids and the token
    index, as the reference pads): ``rx`` the ``XW`` words of ``x``, ``rs`` the ``G`` scales, where ``K``:
    ``rid`` (int64) the top-k ids made local (``id - lo`` for ids in ``[lo, lo + LX)``, else -1) and ``rw``
    their weights (0 where not local), where ``NSRC``: ``rsrc`` the token index ``tok``. Never past the
    outputs' ``rows`` (more rows than ``num_worst_tokens`` arriving: error 9, from the handle kernel)."""
    inb = inb & (orow < rows)
    got = got & inb
    _copy_rows(rx_ptr + orow * XW, xs, got, inb, XW, BLOCK)
    if G > 0:
        _copy_rows(rs_ptr + orow * G, ss, got, inb, G, G_POW2)
    if K > 0:
        kk = tl.arange(0, K_POW2)
        km = kk[None, :] < K
        m2 = got[:, None] & km
        idw = ids[:, None] + 2 * kk[None, :]  # int64 as two int32 words (rows need not be 8-aligned)
        e = (tl.load(idw + 1, mask=m2, other=0).to(tl.int64) << 32) | \
            (tl.load(idw, mask=m2, other=0).to(tl.int64) & 0xFFFFFFFF)
        here = m2 & (e >= lo) & (e < lo + LX)
        tl.store(rid_ptr + orow[:, None] * K + kk[None, :], tl.where(here, e - lo, -1), mask=inb[:, None] & km)
        wt = tl.load(ws[:, None] + kk[None, :], mask=m2, other=0).to(tl.float32, bitcast=True)
        tl.store(rw_ptr + orow[:, None] * K + kk[None, :], tl.where(here, wt, 0.0), mask=inb[:, None] & km)
    if NSRC > 0:
        tl.store(rsrc_ptr + orow, tl.where(got, tok, -1), mask=inb)


@triton.jit
def _nvl_rows(relp, j, i, a, b, N, ok, ptr_table, nvl_off, TM, WP):
    """``([RB] int32 pointers, wanted)``: the rows of source ``(a, i)``'s NVL slot at rank ``j`` of node ``b``
    that each row of a tile goes to (``relp``: ``[RB]`` pointers to each row's positions at the node's ranks,
    -1: not wanted there); the slot is the source's index among those whose relay is not ``j``."""
    pj = tl.load(relp + j, mask=ok, other=-1).to(tl.int64)
    slot = a * (N - 1) + i - (i > j).to(tl.int32)
    base = (tl.load(ptr_table + b * N + j).to(tl.pointer_type(tl.uint8)) + nvl_off).to(
        tl.pointer_type(tl.int32))
    return tl.multiple_of(base + (slot.to(tl.int64) * TM + pj) * WP, 16), pj >= 0


@triton.jit
def _fan(src, ok, n, col, relp, ptr_table, nvl_off, b, i, N, a, TM, WP, BLK: tl.constexpr):
    """``n`` words of rows ``src`` (``[RB]`` int32 pointers, read where ``ok``) to column ``col`` of source
    ``(a, i)``'s NVL slot at every other rank ``j`` of node ``b`` that wants them (:func:`_nvl_rows`)."""
    cc = tl.arange(0, BLK)
    for c0 in range(0, n, BLK):
        cm = (c0 + cc)[None, :] < n
        v = tl.load(src[:, None] + c0 + cc[None, :], mask=ok[:, None] & cm)
        for j in range(N):
            if j != i:
                dst, want = _nvl_rows(relp, j, i, a, b, N, ok, ptr_table, nvl_off, TM, WP)
                tl.store(dst[:, None] + col + c0 + cc[None, :], v, mask=want[:, None] & cm)


@triton.jit
def _fan_row(src, ok, XW, W, relp, ptr_table, nvl_off, b, i, N, a, TM, WP, BLOCK: tl.constexpr,
             S_POW2: tl.constexpr):
    """A message's first ``W`` words (``x``, then the rest) forwarded by :func:`_fan`: ``x`` in tiles of
    ``BLOCK`` words (16-byte vectors where ``XW`` is a multiple of 4), the short rest in ``S_POW2``."""
    _fan(src, ok, XW, 0, relp, ptr_table, nvl_off, b, i, N, a, TM, WP, BLOCK)
    _fan(src + XW, ok, W - XW, XW, relp, ptr_table, nvl_off, b, i, N, a, TM, WP, S_POW2)


@triton.jit
def _nvl_publish(relp, ok, ptr_table, ctr_off, b, i, N, idx):
    """After a tile of forwarded rows (``relp``: ``[RB]`` pointers to each row's positions at the node's
    ranks): each other rank ``j`` of node ``b`` that got rows gets them counted in its word ``idx``
    (release, after the tile's stores)."""
    tl.debug_barrier()
    for j in range(N):
        if j != i:
            pj = tl.sum(((tl.load(relp + j, mask=ok, other=-1) >= 0) & ok).to(tl.int64), 0)
            if pj > 0:
                ctr = (tl.load(ptr_table + b * N + j).to(tl.pointer_type(tl.uint8)) + ctr_off).to(
                    tl.pointer_type(tl.int64))
                tl.atomic_add(ctr + idx, pj, sem="release", scope="sys")


@triton.jit
def _node_unit(u, C, N, j, R, rpm_ptr, rcp_ptr):
    """Unit ``u`` of the ``P * (N-1) * C`` (source, channel) pairs of rank ``(b, j)`` whose relay is another rank
    of its node: ``(a, i, c, k, first, q_lo, q_hi)``: source ``(a, i)``, channel ``c``, the source's slot
    ``k`` among those, the source's first row here (``rpm`` column ``me``, stride ``R``), and the channel's
    rows ``[q_lo, q_hi)`` of its block (``rcp``: the handle's receive channel prefix ``[R, C]``)."""
    c = u % C
    k = u // C
    i = k % (N - 1)
    a = k // (N - 1)
    i = i + (i >= j).to(tl.int32)
    s = a * N + i
    first = tl.load(rpm_ptr + (s - 1) * R, mask=s > 0, other=0)
    q_lo = tl.load(rcp_ptr + s * C + c) - first
    q_hi = tl.load(rcp_ptr + s * C + c + 1, mask=c + 1 < C, other=tl.load(rpm_ptr + s * R)) - first
    return a, i, c, k, first, q_lo, q_hi

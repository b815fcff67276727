"""High-throughput kernel of ``Buffer.get_dispatch_layout`` on the GPU backends: the routing counts of
``layout.dispatch_layout`` in one launch (it is ~20 torch ops, a dozen of them kernels).

Letters: ``T`` tokens, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``.

The grid is (token chunks) x (groups), flattened: program ``pid`` takes chunk ``pid // NG`` (``S`` tokens,
the last one shorter) and group ``pid % NG``. Groups ``0 .. NR-1`` take ``RB`` ranks each: they write
``is_token_in_rank[chunk, ranks]`` directly and count the chunk's tokens per rank; groups ``NR ..`` take
``EB`` experts each and count the chunk's entries per expert (``tl.histogram``). Each program stores its
counts into row ``chunk`` of a scratch ``part int32[CP2, R + E]`` (columns: ranks, then experts), then takes
a ticket of its group (``tickets int32[NG]``, ``common.ticket_last_n``); the last of a group's chunks
sums the group's columns over the chunks (integers: the same bits in any order) into
``num_tokens_per_rank`` / ``num_tokens_per_expert`` and puts the ticket back to 0, ready for the next
launch or a graph's replay. So one launch, no zeroed output and no host sync; the scratch
(``scratch_words``) is allocated zeroed once and kept: launches that share it must run in order, as a
Buffer's calls do (``streams.py``). An id outside ``[0, E)`` counts nowhere (the dispatch reports it), as
in ``layout.dispatch_layout``.

The host picks the chunking per call (``chunking``): chunks of ``S`` tokens, a multiple of ``TBE`` (the
expert programs' tile; ``TBR``, the rank programs', divides it), at most ``CP2`` of them and at least one
(``T = 0``: one empty chunk writes the zero counts). At ``T = 4096``, ``K = 8`` that is 32 chunks of one
128-token tile; up to ``TBE`` tokens, one chunk.

Example (R = 2, E = 4, so L = 2; T = 3, K = 2): ``topk_idx = [[0, 3], [1, -1], [-1, -1]]`` gives
``is_token_in_rank = [[1, 1], [1, 0], [0, 0]]``, ``num_tokens_per_rank = [2, 1]``,
``num_tokens_per_expert = [1, 1, 0, 1]``.

``layout_tiles`` is the same layout inside the exchange kernel (``ht_notify._dispatch_notify_kernel`` with
``FUSED_LAYOUT``, ``ElasticBuffer``'s dispatch not captured into a CUDA graph: ``HTDispatch.fuses_layout``):
its first ``Q`` programs take token tiles, every rank and expert of a tile at once, and the last of them
releases the counts to the kernel's rank programs (``fused_words`` of scratch, an epoch flag; no separate
launch).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import ticket_last_n


def chunking(t: int, tbe: int, cp2: int) -> tuple[int, int]:
    """``(chunks, S)`` of a launch over ``t`` tokens: ``S`` tokens a chunk, a multiple of ``tbe``, at most
    ``cp2`` chunks and at least one. Example: ``chunking(4096, 128, 32) == (32, 128)``,
    ``chunking(5000, 128, 32) == (20, 256)``, ``chunking(0, 128, 32) == (1, 128)``."""
    s = tbe * max(1, -(-t // (tbe * cp2)))
    return max(1, -(-t // s)), s


def scratch_words(ng: int, cp2: int, r_: int, e: int) -> int:
    """int32 words of the kernel's scratch: the partial counts ``[cp2, r_ + e]``, then ``ng`` tickets (the
    tickets must start at 0: allocate it zeroed)."""
    return cp2 * (r_ + e) + ng


@triton.jit
def _publish(cnt, cols, n, chunk, nch, W, part_ptr, col0, ticket_ptr, out_ptr, B: tl.constexpr,
             CP2: tl.constexpr):
    """Store this program's counts ``cnt`` (``int32[B]`` for the group's columns ``cols``, valid below ``n``)
    into ``part[chunk, col0 + cols]``; the group's last chunk sums the column over the ``nch`` chunks into
    ``out[cols]``."""
    tl.store(part_ptr + chunk * W + col0 + cols, cnt, mask=cols < n)
    # each program's stores released before its ticket, at GPU scope: only the next kernels on this GPU
    # read the sums (the notify kernel publishes them to peers with its own system-scope release)
    if ticket_last_n(ticket_ptr, nch, GPU=True):
        cc = tl.arange(0, CP2)
        m = (cc[:, None] < nch) & (cols[None, :] < n)
        parts = tl.load(part_ptr + cc[:, None] * W + col0 + cols[None, :], mask=m, other=0)
        tl.store(out_ptr + cols, tl.sum(parts, 0), mask=cols < n)


@triton.jit
def _expert_counts(ids, mk, e0, E, EB: tl.constexpr, N: tl.constexpr):
    """``int32[EB]``: how many of the ids ``ids`` (``[rows, K]``, valid where ``mk``; ``N = rows * K``) are each of
    the experts ``e0 .. e0 + EB - 1`` (ids at or past ``E`` count nowhere)."""
    rel = (ids - e0).to(tl.int32)
    mine = mk & (rel >= 0) & (rel < EB) & (ids < E)
    return tl.histogram(tl.reshape(tl.where(mine, rel, 0), [N]), EB, mask=tl.reshape(mine, [N]))


@triton.jit(do_not_specialize=['T', 'S'],
            do_not_specialize_on_alignment=['topk_ptr', 'per_rank_ptr', 'per_expert_ptr', 'in_rank_ptr'])
def _layout_kernel(topk_ptr, T, S, K, E, L, R, per_rank_ptr, per_expert_ptr, in_rank_ptr, part_ptr,
                   ticket_ptr, NR, NG, K_POW2: tl.constexpr, RB: tl.constexpr, EB: tl.constexpr,
                   TBR: tl.constexpr, TBE: tl.constexpr, CP2: tl.constexpr):
    """``topk int64[T, K]`` -> ``per_rank int32[R]``, ``per_expert int32[E]``, ``in_rank int8[T, R]`` (the
    bytes of a bool tensor), on ``chunks * NG`` programs (``chunking``); ``part`` and ``ticket`` the
    scratch (``scratch_words``): ``NR`` rank groups of ``RB`` ranks, then expert groups of ``EB``."""
    pid = tl.program_id(0)
    chunk = pid // NG
    grp = pid % NG
    nch = tl.num_programs(0) // NG
    t_lo = chunk * S
    t_hi = tl.minimum(t_lo + S, T)
    W = R + E
    kk = tl.arange(0, K_POW2)
    if grp < NR:
        rr = grp * RB + tl.arange(0, RB)
        rcnt = tl.zeros((RB,), dtype=tl.int32)
        for t0 in range(t_lo, t_hi, TBR):
            tt = (t0 + tl.arange(0, TBR)).to(tl.int64)
            mk = (tt[:, None] < t_hi) & (kk[None, :] < K)
            ids = tl.load(topk_ptr + tt[:, None] * K + kk[None, :], mask=mk, other=-1)
            rank = tl.where(mk & (ids >= 0) & (ids < E), ids // L, -1)
            inr = tl.max((rank[:, :, None] == rr[None, None, :]).to(tl.int32), 1)  # [TBR, RB]
            tl.store(in_rank_ptr + tt[:, None] * R + rr[None, :], inr.to(tl.int8),
                     mask=(tt[:, None] < t_hi) & (rr[None, :] < R))
            rcnt += tl.sum(inr, 0)
        _publish(rcnt, rr, R, chunk, nch, W, part_ptr, 0, ticket_ptr + grp, per_rank_ptr, RB, CP2)
    else:
        e0 = (grp - NR) * EB
        ecnt = tl.zeros((EB,), dtype=tl.int32)
        for t0 in range(t_lo, t_hi, TBE):
            tt = (t0 + tl.arange(0, TBE)).to(tl.int64)
            mk = (tt[:, None] < t_hi) & (kk[None, :] < K)
            ids = tl.load(topk_ptr + tt[:, None] * K + kk[None, :], mask=mk, other=-1)
            ecnt += _expert_counts(ids, mk, e0, E, EB, TBE * K_POW2)
        _publish(ecnt, e0 + tl.arange(0, EB), E, chunk, nch, W, part_ptr, R, ticket_ptr + grp, per_expert_ptr,
                 EB, CP2)


def fused_words(cp2: int, r_: int, e: int) -> int:
    """int32 words of ``layout_tiles``' scratch (no zeroing needed): the partial counts ``[cp2, r_ + e + 2]``
    (ranks, experts, then a bad-id flag and the bad id), then one row of the same width whose first two words
    hold the call's bad id (flag, value), then ``num_tokens_per_rank [r_]`` and ``num_tokens_per_expert [e]``.
    Example: ``fused_words(32, 1, 256) == 33 * 259 + 257``."""
    return (cp2 + 1) * (r_ + e + 2) + r_ + e


@triton.jit
def bad_id(ids, mk, E):
    """``(found, id)`` for the expert ids ``ids`` (int64 ``[rows, K]``, valid where ``mk``) outside ``[-1, E)``:
    the lowest such id where one is below -1, else the highest (what error 10 reports, as int32)."""
    bad = mk & ((ids < -1) | (ids >= E))
    lo = tl.min(tl.min(tl.where(bad, ids, 1 << 40), 1), 0)
    hi = tl.max(tl.max(tl.where(bad, ids, -(1 << 40)), 1), 0)
    return tl.sum(tl.sum(bad.to(tl.int32), 1), 0) > 0, tl.where(lo < -1, lo, hi).to(tl.int32)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def layout_tiles(q, Q, topk_ptr, T, K, E, L, R, in_rank_ptr, per_rank_ptr, per_expert_ptr, part_ptr, lay_ptr,
                 nctr_ptr, TB: tl.constexpr, K_POW2: tl.constexpr, R_POW2: tl.constexpr, EB: tl.constexpr,
                 CP2: tl.constexpr, CHECK: tl.constexpr):
    """Tile program ``q`` of ``Q`` (at most ``CP2``) of the exchange kernel's fused layout (``R <= 64``): for its
    tiles of ``TB`` rows of ``topk int64[T, K]`` (``q, q + Q, ...``) the rows of ``in_rank int8[T, R]``, and its counts
    per rank and per expert (``tl.histogram`` over blocks of ``EB`` experts: one block up to ``EB``) into row
    ``q`` of ``part int32[CP2, R + E + 2]``, with (``CHECK``) whether its ids hold one outside ``[-1, E)`` and
    which (``bad_id``, its first such tile's; ids outside ``[0, E)`` count nowhere, as in
    ``layout.dispatch_layout``). Then a GPU-scope ticket (``lay[0]``, back to 0 after the last): the last sums
    the columns into ``per_rank int32[R]`` / ``per_expert int32[E]`` (integers: the same bits in any order),
    puts the bad id of the lowest ``q`` that found one into row ``CP2`` (flag, id), and releases
    ``lay[1] = nctr[0] + 1``: the epoch the rank programs wait for. They advance ``nctr`` only after it, so
    ``nctr[0]`` is this call's count in every program; the flag then holds the previous fused call's epoch,
    below this one's, in eager calls and graph replays alike (no host reset: ``lay`` and ``nctr`` start at 0
    together with the backend)."""
    W2 = R + E + 2
    kk = tl.arange(0, K_POW2)
    rr = tl.arange(0, R_POW2)
    rcnt = tl.zeros((R_POW2,), dtype=tl.int32)
    found = tl.zeros((), dtype=tl.int32)
    val = tl.zeros((), dtype=tl.int32)
    for e0 in range(0, E, EB):
        ecnt = tl.zeros((EB,), dtype=tl.int32)
        for t0 in range(q * TB, T, Q * TB):
            tt = (t0 + tl.arange(0, TB)).to(tl.int64)
            mk = (tt[:, None] < T) & (kk[None, :] < K)
            ids = tl.load(topk_ptr + tt[:, None] * K + kk[None, :], mask=mk, other=-1)
            ecnt += _expert_counts(ids, mk, e0, E, EB, TB * K_POW2)
            if e0 == 0:  # the rows and the rank counts once (the first expert block)
                # a row's ranks as bits (R <= 64): [TB, K] and [TB, R] values, not [TB, K, R] (8 ranks spilled)
                bits = tl.reduce(tl.where(mk & (ids >= 0) & (ids < E), 1 << (ids // L), 0), 1, _or)
                inr = ((bits[:, None] >> rr[None, :].to(tl.int64)) & 1).to(tl.int32)  # [TB, R_POW2]
                tl.store(in_rank_ptr + tt[:, None] * R + rr[None, :], inr.to(tl.int8),
                         mask=(tt[:, None] < T) & (rr[None, :] < R))
                rcnt += tl.sum(inr, 0)
                if CHECK:
                    f, v = bad_id(ids, mk, E)
                    val = tl.where(f & (found == 0), v, val)
                    found = tl.where(f, 1, found)
        ee = e0 + tl.arange(0, EB)
        tl.store(part_ptr + q * W2 + R + ee, ecnt, mask=ee < E)
    tl.store(part_ptr + q * W2 + rr, rcnt, mask=rr < R)
    tl.store(part_ptr + q * W2 + R + E, found)
    tl.store(part_ptr + q * W2 + R + E + 1, val)
    # stores released before the ticket at GPU scope: only this kernel's rank programs read the sums (they
    # publish them to peers with their own system-scope release)
    if ticket_last_n(lay_ptr, Q, GPU=True):
        cc = tl.arange(0, CP2)
        mr = (cc[:, None] < Q) & (rr[None, :] < R)
        tl.store(per_rank_ptr + rr, tl.sum(tl.load(part_ptr + cc[:, None] * W2 + rr[None, :], mask=mr, other=0), 0),
                 mask=rr < R)
        for e0 in range(0, E, EB):
            ee = e0 + tl.arange(0, EB)
            mx = (cc[:, None] < Q) & (ee[None, :] < E)
            tl.store(per_expert_ptr + ee,
                     tl.sum(tl.load(part_ptr + cc[:, None] * W2 + R + ee[None, :], mask=mx, other=0), 0), mask=ee < E)
        flags = tl.load(part_ptr + cc * W2 + R + E, mask=cc < Q, other=0)
        first = tl.min(tl.where(flags != 0, cc, CP2), 0)
        tl.store(part_ptr + CP2 * W2, (first < CP2).to(tl.int32))
        tl.store(part_ptr + CP2 * W2 + 1, tl.sum(tl.where(cc == first, tl.load(part_ptr + cc * W2 + R + E + 1,
                                                                              mask=cc < Q, other=0), 0), 0))
        n0 = tl.load(nctr_ptr)
        tl.debug_barrier()
        tl.atomic_xchg(lay_ptr + 1, n0 + 1, sem="release", scope="gpu")

"""High-throughput kernels, layout phase: ``notify`` (counts and send lists exchanged through the peers'
meta areas), ``handle`` (the dispatch handle's tensors from the notify outputs) and ``dispatch_notify``,
both in one launch (the eager dispatch's).

Letters: ``T`` tokens, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``, ``C`` channels.

Example (R = 2, me = 0, T = 3, is_token_in_rank[:, 1] = [1, 0, 1]): notify program 1 writes the
send list [0, 2] into rank 1's buffer and send_head_rel[:, 1] = [0, -1, 1].
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import fence_sys, peer_ptr, record_error, signal, ticket_last_n, wait_ge
from .ht_common import NOTIFY
from .ht_layout import _or, bad_id, layout_tiles


@triton.jit
def _notify_send(j, is_in_ptr, T, R, me, ntpr_ptr, ntpe_ptr, L, C, per_chan, ptr_table, meta_off, list_off, flags_off,
                 parity, meta_parity_bytes, meta_src_bytes, list_parity_bytes, list_src_bytes, send_head_rel_ptr,
                 cpm_ptr, BLOCK: tl.constexpr, R_POW2: tl.constexpr, STORE_REL: tl.constexpr):
    """Rank ``j``'s part of the exchange: my counts, the per-expert counts of its experts, my channel prefix
    for it and my send list into its meta area, then its notify flag raised. With ``STORE_REL`` each
    token's position in the list (``-1``: not sent to ``j``) goes to ``send_head_rel[:, j]``."""
    meta = peer_ptr(ptr_table, j, meta_off + parity * meta_parity_bytes + me * meta_src_bytes, tl.int32)
    lst = peer_ptr(ptr_table, j, list_off + parity * list_parity_bytes + me * list_src_bytes, tl.int32)
    rr = tl.arange(0, R_POW2)
    tl.store(meta + rr, tl.load(ntpr_ptr + rr, mask=rr < R, other=0), mask=rr < R)
    for l0 in range(0, L, BLOCK):
        ll = l0 + tl.arange(0, BLOCK)
        tl.store(meta + R + ll, tl.load(ntpe_ptr + j * L + ll, mask=ll < L, other=0), mask=ll < L)
    # One pass over the tokens (channel c holds tokens [c*per_chan, (c+1)*per_chan)): the list of
    # tokens for rank j, each token's position in it, and each channel's inclusive count, stored
    # by the channel's last token; channels past the end hold the total. (A loop per channel made
    # C x ceil(T / (C * BLOCK)) dependent steps: 28 us at 4096 tokens on one H200, now 11 us.)
    running = tl.zeros((), dtype=tl.int32)
    for b in range(0, T, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        m = offs < T
        f = tl.load(is_in_ptr + offs.to(tl.int64) * R + j, mask=m, other=0).to(tl.int32)
        cs = tl.cumsum(f, 0)
        pos = running + cs - f
        tl.store(lst + pos, offs, mask=m & (f != 0))
        if STORE_REL:
            tl.store(send_head_rel_ptr + offs.to(tl.int64) * R + j, tl.where(f != 0, pos, -1), mask=m)
        ends = m & (((offs + 1) % per_chan == 0) | (offs == T - 1))
        ch = offs // per_chan
        tl.store(meta + R + L + ch, running + cs, mask=ends)
        tl.store(cpm_ptr + j * C + ch, running + cs, mask=ends)
        running += tl.sum(f, 0)
    for c0 in range(0, C, BLOCK):
        cc = c0 + tl.arange(0, BLOCK)
        past = (cc < C) & (cc * per_chan >= T)
        tl.store(meta + R + L + cc, tl.zeros_like(cc) + running, mask=past)
        tl.store(cpm_ptr + j * C + cc, tl.zeros_like(cc) + running, mask=past)
    tl.store(meta + R + L + C, T)
    signal(peer_ptr(ptr_table, j, flags_off + (NOTIFY * R + me) * 4, tl.int32), 1)


@triton.jit
def _notify_recv(j, n, R, me, L, C, ptr_table, meta_off, list_off, flags_off, parity, meta_parity_bytes,
                 meta_src_bytes, list_parity_bytes, list_src_bytes, nctr_ptr, counts_ptr, per_expert_ptr,
                 chan_ptr, tok_ptr, src_lists_ptr, src_lists_stride, err_ptr, timeout_ns,
                 BLOCK: tl.constexpr, R_POW2: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Wait for rank ``j``'s part (its ``n + 1``-th), then copy its counts (row ``j`` of ``counts[R][R]``),
    the per-expert counts of my experts (``per_expert[j]``), its channel prefix for me (``chan[j]``), its
    token count and its send list into local arrays; advance ``nctr[j]``."""
    flag = peer_ptr(ptr_table, me, flags_off + (NOTIFY * R + j) * 4, tl.int32)
    wait_ge(flag, n + 1, err_ptr, 1, j, timeout_ns, HAS_TIMER)
    meta_in = peer_ptr(ptr_table, me, meta_off + parity * meta_parity_bytes + j * meta_src_bytes, tl.int32)
    lst_in = peer_ptr(ptr_table, me, list_off + parity * list_parity_bytes + j * list_src_bytes, tl.int32)
    rr = tl.arange(0, R_POW2)
    row = tl.load(meta_in + rr, mask=rr < R, other=0)
    tl.store(counts_ptr + j * R + rr, row, mask=rr < R)
    for l0 in range(0, L, BLOCK):
        ll = l0 + tl.arange(0, BLOCK)
        pe = tl.load(meta_in + R + ll, mask=ll < L, other=0)
        tl.store(per_expert_ptr + j * L + ll, pe, mask=ll < L)
    for c0 in range(0, C, BLOCK):
        cc = c0 + tl.arange(0, BLOCK)
        tl.store(chan_ptr + j * C + cc, tl.load(meta_in + R + L + cc, mask=cc < C, other=0), mask=cc < C)
    tl.store(tok_ptr + j, tl.load(meta_in + R + L + C))
    cnt = tl.load(meta_in + me)
    for b in range(0, cnt, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        m = offs < cnt
        tl.store(src_lists_ptr + j * src_lists_stride + offs, tl.load(lst_in + offs, mask=m, other=0), mask=m)
    tl.store(nctr_ptr + j, n + 1)


@triton.jit(do_not_specialize=['T', 'per_chan'])
def _notify_kernel(is_in_ptr, T, R, me, ntpr_ptr, ntpe_ptr, L, C, per_chan,
                   ptr_table, flags_off, meta_off, meta_parity_bytes, meta_src_bytes,
                   list_off, list_parity_bytes, list_src_bytes,
                   nctr_ptr, send_head_rel_ptr, cpm_ptr,
                   counts_ptr, per_expert_ptr, chan_ptr, tok_ptr, src_lists_ptr, src_lists_stride,
                   err_ptr, timeout_ns,
                   BLOCK: tl.constexpr, R_POW2: tl.constexpr, DO_SEND: tl.constexpr, DO_RECV: tl.constexpr,
                   HAS_TIMER: tl.constexpr):
    """Program ``j`` exchanges with rank ``j`` (``_notify_send``, then ``_notify_recv``); the handle's
    tensors come after, from ``_handle_kernel``."""
    j = tl.program_id(0)
    n = tl.load(nctr_ptr + j)
    parity = n & 1  # (n % 2 is -1 for odd n once the counter has wrapped)
    if DO_SEND:
        _notify_send(j, is_in_ptr, T, R, me, ntpr_ptr, ntpe_ptr, L, C, per_chan, ptr_table, meta_off, list_off,
                     flags_off, parity, meta_parity_bytes, meta_src_bytes, list_parity_bytes, list_src_bytes,
                     send_head_rel_ptr, cpm_ptr, BLOCK, R_POW2, True)
    if DO_RECV:
        _notify_recv(j, n, R, me, L, C, ptr_table, meta_off, list_off, flags_off, parity, meta_parity_bytes,
                     meta_src_bytes, list_parity_bytes, list_src_bytes, nctr_ptr, counts_ptr, per_expert_ptr,
                     chan_ptr, tok_ptr, src_lists_ptr, src_lists_stride, err_ptr, timeout_ns, BLOCK,
                     R_POW2, HAS_TIMER)


@triton.jit
def _handle_prefix(pid, cnt_ptr, CS, chan_ptr, CHS, C, R, me, rpm_ptr, rcp_ptr, err_ptr, num_worst,
                   CHECK_WORST: tl.constexpr, R_POW2: tl.constexpr, C_POW2: tl.constexpr):
    """``rpm = cumsum(counts, 0)`` (``counts[i][j]`` at ``cnt_ptr + i * CS + j``) and, by program 0, the
    handle's ``rank_prefix_matrix`` and ``recv_channel_prefix_matrix`` (from ``chan[i][c]`` at
    ``chan_ptr + i * CHS + c``) and the ``num_worst`` check (error 9). Returns ``rpm``."""
    ri = tl.arange(0, R_POW2)
    m2 = (ri[:, None] < R) & (ri[None, :] < R)
    cnt = tl.load(cnt_ptr + ri[:, None] * CS + ri[None, :], mask=m2, other=0)
    rpm = tl.cumsum(cnt, 0)
    if pid == 0:
        tl.store(rpm_ptr + ri[:, None] * R + ri[None, :], rpm, mask=m2)
        col_incl = tl.sum(tl.where(ri[None, :] == me, rpm, 0), 1)  # rpm[:, me]
        col_cnt = tl.sum(tl.where(ri[None, :] == me, cnt, 0), 1)
        cc = tl.arange(0, C_POW2)
        mc = (ri[:, None] < R) & (cc[None, :] < C)
        prev = tl.load(chan_ptr + ri[:, None] * CHS + cc[None, :] - 1, mask=mc & (cc[None, :] > 0), other=0)
        tl.store(rcp_ptr + ri[:, None] * C + cc[None, :], (col_incl - col_cnt)[:, None] + prev, mask=mc)
        if CHECK_WORST:
            n = tl.max(tl.where(ri < R, col_incl, 0), 0)  # rpm[R-1][me]: every row arriving here
            if n > num_worst:
                record_error(err_ptr, 9, -1, n, num_worst)
    return rpm


@triton.jit
def _check_topk_tile(tt, topk_ptr, T, K, E, err_ptr, is_in_ptr, R, L, K_POW2: tl.constexpr):
    """Rows ``tt`` (int64) of ``topk[T, K]``: error 10 if an expert id is outside ``[-1, E)``; else error 12
    ``[12, -1, token, rank]`` if ``is_in int8[T, R]`` (the dispatch's ``is_token_in_rank``) is not the layout of
    the ids (the ranks of a row's ids in ``[0, E)``, ``L`` experts a rank): a layout made from other ids (the
    lowest such token, its lowest rank that differs). Compared as bits, ``RB`` ranks at a time: ``[rows, K]`` and
    ``[rows, RB]`` values per block, no ``[rows, K, R]`` (what ``ht_layout.layout_tiles`` does for the rows it
    writes).

    Example (R = 2, E = 4, so L = 2): ids ``[0, 3]`` need the row ``[1, 1]``; ``[1, 0]`` records
    ``[12, -1, t, 1]``."""
    RB: tl.constexpr = 16
    kk = tl.arange(0, K_POW2)
    mk = (tt[:, None] < T) & (kk[None, :] < K)
    ids = tl.load(topk_ptr + tt[:, None] * K + kk[None, :], mask=mk, other=-1).to(tl.int64)
    found, v = bad_id(ids, mk, E)
    if found:
        record_error(err_ptr, 10, -1, v, E)
    else:
        rank = tl.where(mk & (ids >= 0) & (ids < E), ids // L, -1).to(tl.int32)
        rr = tl.arange(0, RB)
        for r0 in range(0, R, RB):
            rel = rank - r0
            inb = (rel >= 0) & (rel < RB)
            want = tl.reduce(tl.where(inb, 1 << tl.where(inb, rel, 0), 0), 1, _or)  # [rows]: the ids' ranks
            mr = (tt[:, None] < T) & (r0 + rr[None, :] < R)
            got = tl.load(is_in_ptr + tt[:, None] * R + r0 + rr[None, :], mask=mr, other=0)
            have = tl.sum(tl.where(got != 0, 1 << rr[None, :], 0), 1)  # [rows]: the layout's ranks
            diff = want ^ have
            if tl.max(diff, 0) != 0:  # (bits below 1 << 16: never negative)
                tok = tl.min(tl.where(diff != 0, tt, T), 0)
                d = tl.sum(tl.where(tt == tok, diff, 0), 0)
                first = tl.min(tl.where(((d >> rr) & 1) != 0, rr, RB), 0)
                record_error(err_ptr, 12, -1, tok.to(tl.int32), r0 + first)


@triton.jit(do_not_specialize=['T', 'num_worst'])
def _handle_kernel(counts_ptr, CS, chan_ptr, CHS, C, rel_ptr, T, R, me, rpm_ptr, rcp_ptr, send_head_ptr, err_ptr,
                   num_worst, topk_ptr, K, E, is_in_ptr, L, CHECK_WORST: tl.constexpr, R_POW2: tl.constexpr,
                   C_POW2: tl.constexpr, TB: tl.constexpr, CHECK_TOPK: tl.constexpr = False,
                   K_POW2: tl.constexpr = 1):
    """The dispatch handle's tensors from the notify outputs, in one launch (they were ~17 torch ops):

    - ``rpm = cumsum(counts, 0)`` (``counts[i][j]``: tokens rank ``i`` sends to rank ``j``; row stride
      ``CS``, as ``chan``'s is ``CHS``: the internode backend reads both out of its layout exchange);
    - ``recv_channel_prefix[i][c] = rpm[i-1][me] + chan[i][c-1]`` (``chan``: source ``i``'s inclusive
      channel prefix for this rank; 0 for ``i = 0`` / ``c = 0``), as ``layout.recv_channel_prefix_matrix``;
    - ``send_head[t][j] = rel[t][j] + rpm[me-1][j]`` where ``rel >= 0`` (else ``rel``), rows split over
      the programs;
    - with ``CHECK_WORST``: more rows arriving than ``num_worst`` records error 9 (program 0);
    - with ``CHECK_TOPK``: an expert id in ``topk[T, K]`` outside ``[-1, E)`` records error 10, an ``is_in
      int8[T, R]`` (``is_token_in_rank``) that is not the layout of the ids (``L`` experts a rank) error 12
      (``_check_topk_tile``; raised at the call's host synchronisation, else at the next call).
    """
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    ri = tl.arange(0, R_POW2)
    rpm = _handle_prefix(pid, counts_ptr, CS, chan_ptr, CHS, C, R, me, rpm_ptr, rcp_ptr, err_ptr, num_worst,
                         CHECK_WORST, R_POW2, C_POW2)
    offs = tl.sum(tl.where(ri[:, None] == me - 1, rpm, 0), 0)  # rpm[me-1][:] (zeros for me = 0)
    for t0 in range(pid * TB, T, P * TB):
        tt = (t0 + tl.arange(0, TB)).to(tl.int64)
        m = (tt[:, None] < T) & (ri[None, :] < R)
        rel = tl.load(rel_ptr + tt[:, None] * R + ri[None, :], mask=m, other=-1)
        tl.store(send_head_ptr + tt[:, None] * R + ri[None, :], tl.where(rel >= 0, rel + offs[None, :], rel),
                 mask=m)
        if CHECK_TOPK:
            _check_topk_tile(tt, topk_ptr, T, K, E, err_ptr, is_in_ptr, R, L, K_POW2)


@triton.jit(do_not_specialize=['T', 'per_chan', 'num_worst', 'RP'],
            do_not_specialize_on_alignment=['is_in_ptr', 'ntpr_ptr', 'ntpe_ptr', 'cpm_ptr', 'rpm_ptr', 'rcp_ptr',
                                            'send_head_ptr', 'topk_ptr'])
def _dispatch_notify_kernel(is_in_ptr, T, R, me, ntpr_ptr, ntpe_ptr, L, C, per_chan,
                            ptr_table, flags_off, meta_off, meta_parity_bytes, meta_src_bytes,
                            list_off, list_parity_bytes, list_src_bytes,
                            nctr_ptr, cpm_ptr, counts_ptr, per_expert_ptr, chan_ptr, tok_ptr, src_lists_ptr,
                            src_lists_stride, err_ptr, timeout_ns,
                            rpm_ptr, rcp_ptr, send_head_ptr, num_worst, topk_ptr, K, E, host_addr_ptr, RP,
                            part_ptr, lay_ptr, done_ptr,
                            BLOCK: tl.constexpr, R_POW2: tl.constexpr, C_POW2: tl.constexpr,
                            K_POW2: tl.constexpr, TB: tl.constexpr, CHECK_WORST: tl.constexpr,
                            CHECK_TOPK: tl.constexpr, HOST_COUNTS: tl.constexpr, HAS_TIMER: tl.constexpr,
                            FUSED_LAYOUT: tl.constexpr, EB: tl.constexpr, CP2: tl.constexpr):
    """The eager dispatch's layout exchange and its handle in one launch (``_notify_kernel`` then
    ``_handle_kernel``, without the ``send_head_rel`` scratch between them).

    The first ``RP`` programs take the ranks ``j = pid, pid + RP, ...`` (``RP = R`` on a GPU; one program
    under the interpreter, which runs programs one after another): first every send (``_notify_send``),
    then every receive (``_notify_recv``),
    then each waits until every rank's part is in this rank's meta area (``_notify_exchange``) and reads
    ``counts`` and the
    channel prefixes from there: ``rank_prefix_matrix``, ``recv_channel_prefix_matrix`` and the
    ``num_worst`` check by program 0 (``_handle_prefix``); ``send_head[:, j]`` for its ranks (the send list
    positions again, plus ``rpm[me-1][j]``). The expert-id check (``CHECK_TOPK``: ids in range, and the layout
    ``is_token_in_rank`` that of the ids, ``_check_topk_tile``) is done by the programs after those (tiles of
    ``TB`` rows, ``q, q + P - RP, ...`` for program ``RP + q``), which wait for nothing: the launcher adds them
    (``notify_grid``); with none, by every program. (Checked by the rank programs alone, a rank's program walked
    ``T / TB`` tiles one after another: at world 1 the kernel took ~45 us of a DSv3 dispatch on an H100.)

    With ``FUSED_LAYOUT`` (``ElasticBuffer``'s eager dispatch: ``HTDispatch.fuses_layout``) the kernel also makes its
    inputs ``is_token_in_rank`` (``is_in``, written), ``num_tokens_per_rank`` / ``num_tokens_per_expert`` (``ntpr``,
    ``ntpe``: scratch) from ``topk``, so the layout needs no launch of its own: the tile programs come first,
    ``P - RP`` of them (``ht_layout.layout_tiles``: tiles of ``TB`` rows, the expert-id check included, scratch
    ``part``, ticket and epoch flag ``lay[0:2]``), the rank programs last (the Triton interpreter runs programs in
    order, and on a GPU the waiting programs are the last dispatched). Each rank program waits for the epoch
    ``nctr + 1`` on ``lay[1]`` before it reads them; rank program 0 records error 10 (the id the tile programs
    found) once its own waits for every peer's part are over (a recorded error ends every later wait at once).

    With ``HOST_COUNTS`` (a synchronised dispatch: its host reads the counts) every program, once what it writes
    for the host is written (a rank program: its exchange and waits; a tile program: its tiles), takes a ticket
    on ``done_ptr``; the last sets the host's done word (:func:`_host_done`), which the host polls: it goes on
    while the rank programs still make the handle's prefixes and ``send_head``.

    Example (R = 2, me = 1, T = 3, is_token_in_rank = [[1, 1], [0, 1], [1, 0]], rank 0 sends 2 tokens to
    rank 0 and 4 to rank 1): ``send_head = [[2, 4], [-1, 5], [3, -1]]``.
    """
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    rk = pid
    if FUSED_LAYOUT:
        rk = pid - (P - RP)
    if (rk >= 0) & (rk < RP):
        if FUSED_LAYOUT:
            wait_ge(lay_ptr + 1, tl.load(nctr_ptr + rk) + 1, err_ptr, 1, me, timeout_ns, HAS_TIMER)
        n0 = _notify_exchange(rk, RP, is_in_ptr, T, R, me, ntpr_ptr, ntpe_ptr, L, C, per_chan, ptr_table, flags_off,
                              meta_off, meta_parity_bytes, meta_src_bytes, list_off, list_parity_bytes, list_src_bytes,
                              nctr_ptr, cpm_ptr, counts_ptr, per_expert_ptr, chan_ptr, tok_ptr, src_lists_ptr,
                              src_lists_stride, err_ptr, timeout_ns, BLOCK, R_POW2, HAS_TIMER)
        if FUSED_LAYOUT and CHECK_TOPK:  # noqa: SIM102 (constexprs, then a value)
            if rk == 0:
                bad = part_ptr + CP2 * (R + E + 2)  # (flag, id) from the last tile program
                if tl.load(bad) != 0:
                    record_error(err_ptr, 10, -1, tl.load(bad + 1), E)
        if HOST_COUNTS:  # (with check tiles and no program of their own, after this program's tiles: below)
            if FUSED_LAYOUT or not CHECK_TOPK:  # noqa: SIM114 (constexprs, then a value)
                _host_done(done_ptr, P, host_addr_ptr, counts_ptr, per_expert_ptr, R, me, L, BLOCK, R_POW2)
            elif P > RP:
                _host_done(done_ptr, P, host_addr_ptr, counts_ptr, per_expert_ptr, R, me, L, BLOCK, R_POW2)
        _notify_handle(rk, RP, n0, is_in_ptr, T, R, me, L, C, ptr_table, meta_off, meta_parity_bytes,
                       meta_src_bytes, err_ptr, rpm_ptr, rcp_ptr, send_head_ptr, num_worst, BLOCK, R_POW2, C_POW2,
                       CHECK_WORST)
    elif FUSED_LAYOUT:
        layout_tiles(pid, P - RP, topk_ptr, T, K, E, L, R, is_in_ptr, ntpr_ptr, ntpe_ptr, part_ptr, lay_ptr,
                     nctr_ptr, TB, K_POW2, R_POW2, EB, CP2, CHECK_TOPK)
        if HOST_COUNTS:
            _host_done(done_ptr, P, host_addr_ptr, counts_ptr, per_expert_ptr, R, me, L, BLOCK, R_POW2)
    if CHECK_TOPK and not FUSED_LAYOUT:  # by the programs after the rank programs where there are any, else all
        q = pid - RP
        Q = P - RP
        if Q == 0:
            q = pid
            Q = P
        if q >= 0:
            for t0 in range(q * TB, T, Q * TB):
                _check_topk_tile((t0 + tl.arange(0, TB)).to(tl.int64), topk_ptr, T, K, E, err_ptr, is_in_ptr, R, L,
                                 K_POW2)
            if HOST_COUNTS:
                _host_done(done_ptr, P, host_addr_ptr, counts_ptr, per_expert_ptr, R, me, L, BLOCK, R_POW2)


@triton.jit
def _host_done(done_ptr, P, host_addr_ptr, counts_ptr, per_expert_ptr, R, me, L, BLOCK: tl.constexpr,
               R_POW2: tl.constexpr):
    """This program's part of what the host reads is written (the exchange's counts, an error's host mirror): the
    last of the ``P`` programs to get here writes the host's words, the address ``host_addr_ptr[0]``:
    ``[rank_prefix_matrix[:, me] (R)][received rows per local expert (L)]`` (from ``counts[R][R]`` and
    ``per_expert[R][L]``, which every rank program wrote before its ticket), then sets the done word (address
    ``host_addr_ptr[1]``) to 1. The host cleared it before the launch and polls it, so a synchronised dispatch's host
    resumes once the counts and the checks are in, not at the kernel's end (the handle's prefixes and ``send_head``
    come after, in the rank programs), and reads its sums as they are.

    Example (R = 2, me = 1, counts = [[3, 1], [2, 4]], per_expert = [[1, 0], [3, 1]]): ``[1, 5, 4, 1]``."""
    if ticket_last_n(done_ptr, P):  # (acquire-release, system scope: every program's writes come before)
        host = tl.load(host_addr_ptr).to(tl.pointer_type(tl.int32))
        rr = tl.arange(0, R_POW2)
        col = tl.load(counts_ptr + rr * R + me, mask=rr < R, other=0)
        tl.store(host + rr, tl.cumsum(col, 0), mask=rr < R)
        for l0 in range(0, L, BLOCK):
            ll = l0 + tl.arange(0, BLOCK)
            m = (rr[:, None] < R) & (ll[None, :] < L)
            pe = tl.load(per_expert_ptr + rr[:, None] * L + ll[None, :], mask=m, other=0)
            tl.store(host + R + ll, tl.sum(pe, 0), mask=ll < L)
        tl.debug_barrier()
        fence_sys()  # (the words before the done word, for the host that polls it)
        tl.store(tl.load(host_addr_ptr + 1).to(tl.pointer_type(tl.int32)), 1)


@triton.jit
def _notify_exchange(pid, P, is_in_ptr, T, R, me, ntpr_ptr, ntpe_ptr, L, C, per_chan, ptr_table, flags_off, meta_off,
                     meta_parity_bytes, meta_src_bytes, list_off, list_parity_bytes, list_src_bytes, nctr_ptr, cpm_ptr,
                     counts_ptr, per_expert_ptr, chan_ptr, tok_ptr, src_lists_ptr, src_lists_stride, err_ptr,
                     timeout_ns, BLOCK: tl.constexpr, R_POW2: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Rank program ``pid`` of ``P``'s share of ``_dispatch_notify_kernel``'s exchange with ranks ``pid, pid + P,
    ...`` (their sends, then their receives), then the wait for every rank's part. Returns the notify counter
    at the call's start (``n0``)."""
    n0 = tl.load(nctr_ptr + pid)  # every rank's counter is the same at the start of a call
    for j in range(pid, R, P):
        n = tl.load(nctr_ptr + j)
        _notify_send(j, is_in_ptr, T, R, me, ntpr_ptr, ntpe_ptr, L, C, per_chan, ptr_table, meta_off, list_off,
                     flags_off, n & 1, meta_parity_bytes, meta_src_bytes, list_parity_bytes, list_src_bytes,
                     cpm_ptr, cpm_ptr, BLOCK, R_POW2, False)
    for j in range(pid, R, P):
        n = tl.load(nctr_ptr + j)
        _notify_recv(j, n, R, me, L, C, ptr_table, meta_off, list_off, flags_off, n & 1, meta_parity_bytes,
                     meta_src_bytes, list_parity_bytes, list_src_bytes, nctr_ptr, counts_ptr, per_expert_ptr,
                     chan_ptr, tok_ptr, src_lists_ptr, src_lists_stride, err_ptr, timeout_ns,
                     BLOCK, R_POW2, HAS_TIMER)
    for i in range(0, R):
        wait_ge(peer_ptr(ptr_table, me, flags_off + (NOTIFY * R + i) * 4, tl.int32), n0 + 1, err_ptr, 1, i,
                timeout_ns, HAS_TIMER)
    return n0


@triton.jit
def _notify_handle(pid, P, n0, is_in_ptr, T, R, me, L, C, ptr_table, meta_off, meta_parity_bytes,
                   meta_src_bytes, err_ptr, rpm_ptr, rcp_ptr, send_head_ptr, num_worst, BLOCK: tl.constexpr,
                   R_POW2: tl.constexpr, C_POW2: tl.constexpr, CHECK_WORST: tl.constexpr):
    """Rank program ``pid`` of ``P``, after :func:`_notify_exchange`: the handle's prefixes (program 0) and
    ``send_head[:, j]`` for ranks ``j = pid, pid + P, ...``."""
    meta = peer_ptr(ptr_table, me, meta_off + (n0 & 1) * meta_parity_bytes, tl.int32)
    ms = meta_src_bytes // 4
    rpm = _handle_prefix(pid, meta, ms, meta + R + L, ms, C, R, me, rpm_ptr, rcp_ptr, err_ptr, num_worst,
                         CHECK_WORST, R_POW2, C_POW2)
    ri = tl.arange(0, R_POW2)
    offs = tl.sum(tl.where(ri[:, None] == me - 1, rpm, 0), 0)  # rpm[me-1][:] (zeros for me = 0)
    for j in range(pid, R, P):
        off = tl.sum(tl.where(ri == j, offs, 0), 0)
        running = tl.zeros((), dtype=tl.int32)
        for b in range(0, T, BLOCK):
            tt = b + tl.arange(0, BLOCK)
            m = tt < T
            f = tl.load(is_in_ptr + tt.to(tl.int64) * R + j, mask=m, other=0).to(tl.int32)
            pos = running + tl.cumsum(f, 0) - f
            tl.store(send_head_ptr + tt.to(tl.int64) * R + j, tl.where(f != 0, pos + off, -1), mask=m)
            running += tl.sum(f, 0)

"""High-throughput intranode kernels (Triton) over symmetric memory.

Letters: ``T`` tokens, ``H`` hidden (elements of the row dtype), ``K`` top-k, ``E`` experts, ``R``
ranks, ``L = E/R``, ``C`` channels, ``N`` received rows, ``P`` programs.

Pieces (see backends/nvlink.py for the orchestration and the buffer layout):
- ``notify``: program ``j`` compacts the tokens for rank ``j`` (send list, channel prefix, relative
  send_head) and writes counts + list into rank ``j``'s buffer, raises a flag, then waits for rank
  ``j``'s counts and copies them into local arrays.
- ``ce_wait`` / ``ce_signal``: one-program kernels around the copy-engine bulk copies (wait for
  the receivers to free their staging slots; raise the data flags after the copies).
- ``push``: the SM alternative to the copy engine: rows of a source (with their scales, ids and
  weights) pushed into peers' slots; a kernel of its own for cached dispatches and with
  ``TUNE["fused_push"]`` off.
- ``gather``: receiver side of dispatch: rows from local x or the staging slots into ``recv_x``
  in (source rank, token) order, top-k ids rewritten to local experts. With ``PUSH`` (the SM
  transfer of a non-cached dispatch) it also does the push: push and own block first, then the
  peers' rows.
- ``reduce``: owner side of combine: float32 sum, rank by rank, of the rows every rank returned.

Example (R = 2, me = 0, T = 3, is_token_in_rank[:, 1] = [1, 0, 1]): notify program 1 writes the
send list [0, 2] into rank 1's buffer and send_head_rel[:, 1] = [0, -1, 1].
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import peer_ptr, record_error, signal, ticket_last, wait_ge

# Flag slots (int32 index = slot * R + peer) in every rank's flag area.
NOTIFY = tl.constexpr(0)
DDATA = tl.constexpr(1)
DCONSUMED = tl.constexpr(2)
CDATA = tl.constexpr(3)
CCONSUMED = tl.constexpr(4)


@triton.jit(do_not_specialize=['T', 'per_chan'])
def _notify_kernel(is_in_ptr, T, R, me, ntpr_ptr, ntpe_ptr, L, C, per_chan,
                   ptr_table, flags_off, meta_off, meta_parity_bytes, meta_src_bytes,
                   list_off, list_parity_bytes, list_src_bytes,
                   nctr_ptr, send_head_rel_ptr, cpm_ptr,
                   counts_ptr, per_expert_ptr, chan_ptr, tok_ptr, src_lists_ptr, src_lists_stride,
                   err_ptr, timeout_ns,
                   BLOCK: tl.constexpr, R_POW2: tl.constexpr, DO_SEND: tl.constexpr, DO_RECV: tl.constexpr,
                   HAS_TIMER: tl.constexpr):
    j = tl.program_id(0)
    n = tl.load(nctr_ptr + j)
    parity = n & 1  # (n % 2 is -1 for odd n once the counter has wrapped)
    if DO_SEND:
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
    if DO_RECV:
        flag = peer_ptr(ptr_table, me, flags_off + (NOTIFY * R + j) * 4, tl.int32)
        wait_ge(flag, n + 1, err_ptr, 1, j, timeout_ns, HAS_TIMER)
        meta_in = peer_ptr(ptr_table, me, meta_off + parity * meta_parity_bytes + j * meta_src_bytes, tl.int32)
        lst_in = peer_ptr(ptr_table, me, list_off + parity * list_parity_bytes + j * list_src_bytes, tl.int32)
        rr = tl.arange(0, R_POW2)
        tl.store(counts_ptr + j * R + rr, tl.load(meta_in + rr, mask=rr < R, other=0), mask=rr < R)
        for l0 in range(0, L, BLOCK):
            ll = l0 + tl.arange(0, BLOCK)
            tl.store(per_expert_ptr + j * L + ll, tl.load(meta_in + R + ll, mask=ll < L, other=0), mask=ll < L)
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


@triton.jit(do_not_specialize=['T', 'num_worst'])
def _handle_kernel(counts_ptr, chan_ptr, C, rel_ptr, T, R, me, rpm_ptr, rcp_ptr, send_head_ptr, err_ptr,
                   num_worst, topk_ptr, K, E, CHECK_WORST: tl.constexpr, R_POW2: tl.constexpr,
                   C_POW2: tl.constexpr, TB: tl.constexpr, CHECK_TOPK: tl.constexpr = False,
                   K_POW2: tl.constexpr = 1):
    """The dispatch handle's tensors from the notify outputs, in one launch (they were ~17 torch ops):

    - ``rpm = cumsum(counts, 0)`` (``counts[i][j]``: tokens rank ``i`` sends to rank ``j``);
    - ``recv_channel_prefix[i][c] = rpm[i-1][me] + chan[i][c-1]`` (``chan``: source ``i``'s inclusive
      channel prefix for this rank; 0 for ``i = 0`` / ``c = 0``), as ``layout.recv_channel_prefix_matrix``;
    - ``send_head[t][j] = rel[t][j] + rpm[me-1][j]`` where ``rel >= 0`` (else ``rel``), rows split over
      the programs;
    - with ``CHECK_WORST``: more rows arriving than ``num_worst`` records error 9 (program 0);
    - with ``CHECK_TOPK``: an expert id in ``topk[T, K]`` outside ``[-1, E)`` records error 10 (the
      calls without a host synchronisation find bad ids here; the others at their synchronisation).
    """
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    ri = tl.arange(0, R_POW2)
    m2 = (ri[:, None] < R) & (ri[None, :] < R)
    cnt = tl.load(counts_ptr + ri[:, None] * R + ri[None, :], mask=m2, other=0)
    rpm = tl.cumsum(cnt, 0)
    if pid == 0:
        tl.store(rpm_ptr + ri[:, None] * R + ri[None, :], rpm, mask=m2)
        col_incl = tl.sum(tl.where(ri[None, :] == me, rpm, 0), 1)  # rpm[:, me]
        col_cnt = tl.sum(tl.where(ri[None, :] == me, cnt, 0), 1)
        cc = tl.arange(0, C_POW2)
        mc = (ri[:, None] < R) & (cc[None, :] < C)
        prev = tl.load(chan_ptr + ri[:, None] * C + cc[None, :] - 1, mask=mc & (cc[None, :] > 0), other=0)
        tl.store(rcp_ptr + ri[:, None] * C + cc[None, :], (col_incl - col_cnt)[:, None] + prev, mask=mc)
        if CHECK_WORST:
            n = tl.max(tl.where(ri < R, col_incl, 0), 0)  # rpm[R-1][me]: every row arriving here
            if n > num_worst:
                record_error(err_ptr, 9, -1, n, num_worst)
    offs = tl.sum(tl.where(ri[:, None] == me - 1, rpm, 0), 0)  # rpm[me-1][:] (zeros for me = 0)
    for t0 in range(pid * TB, T, P * TB):
        tt = (t0 + tl.arange(0, TB)).to(tl.int64)
        m = (tt[:, None] < T) & (ri[None, :] < R)
        rel = tl.load(rel_ptr + tt[:, None] * R + ri[None, :], mask=m, other=-1)
        tl.store(send_head_ptr + tt[:, None] * R + ri[None, :], tl.where(rel >= 0, rel + offs[None, :], rel), mask=m)
        if CHECK_TOPK:
            kk = tl.arange(0, K_POW2)
            mk = (tt[:, None] < T) & (kk[None, :] < K)
            ids = tl.load(topk_ptr + tt[:, None] * K + kk[None, :], mask=mk, other=-1).to(tl.int64)
            bad = mk & ((ids < -1) | (ids >= E))
            if tl.sum(tl.sum(bad.to(tl.int32), 1), 0) > 0:
                lo = tl.min(tl.min(tl.where(bad, ids, 1 << 40), 1), 0)
                hi = tl.max(tl.max(tl.where(bad, ids, -(1 << 40)), 1), 0)
                record_error(err_ptr, 10, -1, tl.where(lo < -1, lo, hi).to(tl.int32), E)


@triton.jit
def _wait_peers(ptr_table, flags_off, slot, R, me, target, err_ptr, phase, timeout_ns, HAS_TIMER: tl.constexpr):
    """Wait until every peer's counter in flag ``slot`` (in this rank's flag area) reaches ``target``."""
    for j in range(0, R):
        if j != me:
            wait_ge(peer_ptr(ptr_table, me, flags_off + (slot * R + j) * 4, tl.int32), target, err_ptr, phase, j,
                    timeout_ns, HAS_TIMER)


@triton.jit
def _signal_peers(ptr_table, flags_off, slot, R, me, value):
    """Add ``value`` (release) to this rank's counter in flag ``slot`` of every peer."""
    for j in range(0, R):
        if j != me:
            signal(peer_ptr(ptr_table, j, flags_off + (slot * R + me) * 4, tl.int32), value)


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
    """The copy-engine flag variant (``TUNE["ce_flag"] = "copy"``): the value a data flag must reach
    after ``done`` of this call's ``NC`` chunks (``sends so far * NC + done``) into ``out``, for a
    4-byte copy-engine copy to every peer's flag, behind the data copies on the same stream;
    ``bump`` = 1 after the last advances the send counter."""
    n = tl.load(ctr_ptr)
    tl.store(out_ptr, n * NC + done)
    if bump != 0:
        tl.store(ctr_ptr, n + 1)


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


@triton.jit(do_not_specialize=['T'])
def _push_kernel(x_ptr, row_elems, T, R, me, is_in_ptr, ptr_table, flags_off, slot, consumed_slot,
                 stage_off, stage_src_bytes, ctr_ptr, ticket_ptr, err_ptr, phase, timeout_ns,
                 xs_ptr, G, topk_ptr, w_ptr, K, s_off, k_off, w_off,
                 NC: tl.constexpr, RB: tl.constexpr, BLOCK: tl.constexpr, HAS_TIMER: tl.constexpr,
                 ELEM: tl.constexpr, HAS_SCALES: tl.constexpr = False, HAS_TOPK: tl.constexpr = False,
                 G_POW2: tl.constexpr = 1, K_POW2: tl.constexpr = 1):
    """SM bulk mover: row ``t`` of ``x`` (``row_elems`` int8/int16/int32 words) to row ``t`` of my slot
    in every peer ``j`` with ``is_in[t, j]``, ``RB`` rows per step, with the row's scales (``G``
    float32, staging array at ``s_off``), top-k ids (``K`` int64, ``k_off``) and weights (``K``
    float32, ``w_off``); the last program raises the peers' data flags (every program's stores are
    released, system scope, before its ticket)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n = tl.load(ctr_ptr)
    _wait_peers(ptr_table, flags_off, consumed_slot, R, me, n, err_ptr, phase, timeout_ns, HAS_TIMER)
    for t0 in range(pid * RB, T, P * RB):
        _push_tile(t0, x_ptr, row_elems, T, R, me, is_in_ptr, ptr_table, stage_off, stage_src_bytes, xs_ptr, G,
                   topk_ptr, w_ptr, K, s_off, k_off, w_off, RB, BLOCK, ELEM, HAS_SCALES, HAS_TOPK, G_POW2, K_POW2)
    if ticket_last(ticket_ptr):
        _signal_peers(ptr_table, flags_off, slot, R, me, NC)
        tl.store(ctr_ptr, n + 1)


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


@triton.jit
def _tile_src(v0, v_hi, total, start_me, rr, R, incl, excl, src_lists_ptr, src_lists_stride, out_src,
              RB: tl.constexpr, CACHED: tl.constexpr):
    """Source token of each row of the gather tile at rotated position ``v0`` (0 past the end): from
    the handle (``out_src``) when cached, else from source ``i``'s send list."""
    vv = v0 + tl.arange(0, RB)
    real = vv < tl.minimum(total, v_hi)
    nn = tl.where(real, (vv + start_me) % tl.maximum(total, 1), vv)
    if CACHED:
        s = tl.load(out_src + nn, mask=real, other=0)
    else:
        i = tl.sum(tl.where((rr[None, :] < R) & (incl[None, :] <= nn[:, None]), 1, 0), 1)
        start = tl.sum(tl.where(rr[None, :] == i[:, None], excl[None, :], 0), 1)
        s = tl.load(src_lists_ptr + i * src_lists_stride + (nn - start), mask=real, other=0)
    return s


@triton.jit
def _gather_rows(v_lo, v_hi, pid, P, known, x_ptr, xs_ptr, topk_ptr, w_ptr, row_elems, G, K, me, R, lo_expert, L,
                 src_lists_ptr, src_lists_stride, n_rows, total, start_me, rr, incl, excl, chunk_rows,
                 stage_ptr, stage_src_elems, stage_s_ptr, stage_s_src, stage_k_ptr, stage_k_src,
                 stage_w_ptr, stage_w_src,
                 out_x, out_s, out_s_stride_row, out_s_stride_col, out_k, out_w, out_src,
                 ptr_table, flags_off, base, err_ptr, timeout_ns,
                 CACHED: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, NC: tl.constexpr,
                 RB: tl.constexpr, BLOCK: tl.constexpr, K_POW2: tl.constexpr, G_POW2: tl.constexpr,
                 HAS_TIMER: tl.constexpr, STAGES: tl.constexpr, ONE_LOAD: tl.constexpr,
                 PREFETCH: tl.constexpr = False):
    """Output rows at rotated positions ``v_lo <= v < v_hi`` (``v = 0`` is this rank's own block),
    tiles of ``RB`` rows, tile ``u`` by program ``u % P``; returns the updated ``known`` levels.
    ``PREFETCH``: each tile's source-token load is issued one tile ahead, so it overlaps the row copy
    before it instead of preceding its own."""
    kk = tl.arange(0, K_POW2)
    gg = tl.arange(0, G_POW2)
    cols = tl.arange(0, BLOCK)
    if PREFETCH:
        s_next = _tile_src(v_lo + pid * RB, v_hi, total, start_me, rr, R, incl, excl, src_lists_ptr,
                           src_lists_stride, out_src, RB, CACHED)
    for v0 in range(v_lo + pid * RB, v_hi, P * RB):
        vv = v0 + tl.arange(0, RB)
        inb = vv < v_hi
        real = vv < tl.minimum(total, v_hi)
        nn = tl.where(real, (vv + start_me) % tl.maximum(total, 1), vv)
        nn64 = nn.to(tl.int64)
        i = tl.sum(tl.where((rr[None, :] < R) & (incl[None, :] <= nn[:, None]), 1, 0), 1)
        if PREFETCH:  # this tile's source rows were loaded one step ahead; load the next tile's now
            s = s_next
            s_next = _tile_src(v0 + P * RB, v_hi, total, start_me, rr, R, incl, excl, src_lists_ptr,
                               src_lists_stride, out_src, RB, CACHED)
        else:
            s = _tile_src(v0, v_hi, total, start_me, rr, R, incl, excl, src_lists_ptr, src_lists_stride, out_src,
                          RB, CACHED)
        if not CACHED:
            tl.store(out_src + nn, tl.where(real, s, -1), mask=inb)
        if not CACHED:
            ch = tl.sum(tl.where(rr[None, :] == i[:, None], chunk_rows[None, :], 1), 1)
            lvl = tl.where(real & (i != me), s // ch + 1, 0)
            need = tl.max(tl.where(rr[None, :] == i[:, None], lvl[:, None], 0), 0)
            known = _wait_sources(need, known, rr, ptr_table, flags_off, DDATA, R, me, base, err_ptr, 3,
                                  timeout_ns, NC, HAS_TIMER)
        s64 = s.to(tl.int64)
        mine = real & (i == me)
        peer = real & (i != me)
        lrow = s64 * row_elems
        srow = i.to(tl.int64) * stage_src_elems + s64 * row_elems
        orow = nn64 * row_elems
        if ONE_LOAD:  # one load per element through a per-row pointer (local x or staging)
            row_src = tl.where(mine, x_ptr + lrow, stage_ptr + srow)
            for h0 in tl.range(0, row_elems, BLOCK, num_stages=STAGES):
                cc = h0 + cols
                cm = real[:, None] & (cc[None, :] < row_elems)
                v = tl.load(row_src[:, None] + cc[None, :], mask=cm)
                tl.store(out_x + orow[:, None] + cc[None, :], v, mask=cm)
        else:  # two masked loads (x or staging), then a select
            for h0 in tl.range(0, row_elems, BLOCK, num_stages=STAGES):
                cc = h0 + cols
                cm = cc[None, :] < row_elems
                a = tl.load(x_ptr + lrow[:, None] + cc[None, :], mask=mine[:, None] & cm)
                b = tl.load(stage_ptr + srow[:, None] + cc[None, :], mask=peer[:, None] & cm)
                tl.store(out_x + orow[:, None] + cc[None, :], tl.where(mine[:, None], a, b),
                         mask=real[:, None] & cm)
        if HAS_SCALES:
            gm = gg[None, :] < G
            sa = tl.load(xs_ptr + s64[:, None] * G + gg[None, :], mask=mine[:, None] & gm)
            sb = tl.load(stage_s_ptr + i.to(tl.int64)[:, None] * stage_s_src + s64[:, None] * G + gg[None, :],
                         mask=peer[:, None] & gm)
            tl.store(out_s + nn64[:, None] * out_s_stride_row + gg[None, :] * out_s_stride_col,
                     tl.where(mine[:, None], sa, sb), mask=real[:, None] & gm)
        if HAS_TOPK:
            km = kk[None, :] < K
            ka = tl.load(topk_ptr + s64[:, None] * K + kk[None, :], mask=mine[:, None] & km, other=-1)
            kb = tl.load(stage_k_ptr + i.to(tl.int64)[:, None] * stage_k_src + s64[:, None] * K + kk[None, :],
                         mask=peer[:, None] & km, other=-1)
            wa = tl.load(w_ptr + s64[:, None] * K + kk[None, :], mask=mine[:, None] & km, other=0.0)
            wb = tl.load(stage_w_ptr + i.to(tl.int64)[:, None] * stage_w_src + s64[:, None] * K + kk[None, :],
                         mask=peer[:, None] & km, other=0.0)
            kv = tl.where(mine[:, None], ka, kb)
            wv = tl.where(mine[:, None], wa, wb)
            here = real[:, None] & (kv >= lo_expert) & (kv < lo_expert + L)
            tl.store(out_k + nn64[:, None] * K + kk[None, :], tl.where(here, kv - lo_expert, -1),
                     mask=inb[:, None] & km)
            tl.store(out_w + nn64[:, None] * K + kk[None, :], tl.where(here, wv, 0.0), mask=inb[:, None] & km)
    return known


@triton.jit(do_not_specialize=['n_rows', 'T_send'])
def _gather_kernel(x_ptr, xs_ptr, topk_ptr, w_ptr, row_elems, G, K,
                   counts_ptr, counts_stride, me, R, lo_expert, L, tok_ptr,
                   src_lists_ptr, src_lists_stride, n_rows,
                   stage_ptr, stage_src_elems, stage_s_ptr, stage_s_src, stage_k_ptr, stage_k_src,
                   stage_w_ptr, stage_w_src,
                   out_x, out_s, out_s_stride_row, out_s_stride_col, out_k, out_w, out_src,
                   ptr_table, flags_off, ctr_ptr, ticket_ptr, err_ptr, timeout_ns,
                   is_in_ptr, T_send, push_off, push_slot_bytes, push_s_off, push_k_off, push_w_off,
                   send_ctr_ptr, push_ticket_ptr,
                   CACHED: tl.constexpr, IS_PREFIX: tl.constexpr, HAS_SCALES: tl.constexpr,
                   HAS_TOPK: tl.constexpr, NC: tl.constexpr, RB: tl.constexpr, BLOCK: tl.constexpr,
                   R_POW2: tl.constexpr, K_POW2: tl.constexpr, G_POW2: tl.constexpr, HAS_TIMER: tl.constexpr,
                   STAGES: tl.constexpr = 3, ONE_LOAD: tl.constexpr = False, PUSH: tl.constexpr = False,
                   PUSH_RB: tl.constexpr = 8, PUSH_BLOCK: tl.constexpr = 512, ELEM: tl.constexpr = tl.int32,
                   PUSH_TOPK: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    """Dispatch receive: row ``n`` of the outputs = token ``s`` of source rank ``i`` (rank-major order).

    Tiles of ``RB`` rows; rows are visited rotated so this rank's own block (no wait) comes first,
    then the peers' blocks in token order, waiting chunk by chunk (``NC`` copy-engine chunks per
    source; chunk of token ``s`` = ``s // ceil(T_i / NC)``; cached mode waits for all chunks).

    ``PUSH`` (the SM transfer, non-cached): this kernel also sends. Its programs first push this
    rank's rows into the peers' staging (``_push_kernel``'s work: ``T_send`` rows, ``is_in``, scales
    and, with ``PUSH_TOPK``, ids and weights) interleaved with copying the own block (local
    reads, so NVLink and HBM work at once); the last program to finish that raises the peers' data
    flags; then every program copies the peers' rows as they are flagged. Every program of the grid
    must be resident (grid <= SMs), as for the waits elsewhere.
    """
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    base = tl.load(ctr_ptr)
    rr = tl.arange(0, R_POW2)
    col = tl.load(counts_ptr + rr * counts_stride + me, mask=rr < R, other=0)
    if IS_PREFIX:
        incl = col
        excl = tl.load(counts_ptr + (rr - 1) * counts_stride + me, mask=(rr < R) & (rr > 0), other=0)
    else:
        incl = tl.cumsum(col, 0)
        excl = incl - col
    # rows this call may write: every row arriving, or fewer when num_worst_tokens is too small (the
    # handle kernel records that error; the rows beyond the output are dropped, never written past it)
    total = tl.minimum(tl.max(tl.where(rr < R, incl, 0), 0), n_rows)
    start_me = tl.sum(tl.where(rr == me, excl, 0), 0)
    known = tl.zeros((R_POW2,), dtype=tl.int32)
    if CACHED:
        known = _wait_sources(tl.full((R_POW2,), NC, tl.int32), known, rr, ptr_table, flags_off, DDATA, R, me,
                              base, err_ptr, 3, timeout_ns, NC, HAS_TIMER)
        chunk_rows = tl.full((R_POW2,), 1, tl.int32)
    else:
        toks = tl.load(tok_ptr + rr, mask=rr < R, other=0)
        chunk_rows = tl.maximum((toks + NC - 1) // NC, 1)
    v_lo = 0
    if PUSH:
        n_send = tl.load(send_ctr_ptr)
        _wait_peers(ptr_table, flags_off, DCONSUMED, R, me, n_send, err_ptr, 2, timeout_ns, HAS_TIMER)
        own = tl.minimum(tl.sum(tl.where(rr == me, col, 0), 0), total)
        n_push = (T_send + PUSH_RB - 1) // PUSH_RB
        n_own = (own + RB - 1) // RB
        for u in range(pid, tl.maximum(n_push, n_own), P):
            if u < n_push:
                _push_tile(u * PUSH_RB, x_ptr, row_elems, T_send, R, me, is_in_ptr, ptr_table, push_off,
                           push_slot_bytes, xs_ptr, G, topk_ptr, w_ptr, K, push_s_off, push_k_off, push_w_off,
                           PUSH_RB, PUSH_BLOCK, ELEM, HAS_SCALES, PUSH_TOPK, G_POW2, K_POW2)
            if u < n_own:
                known = _gather_rows(u * RB, tl.minimum(u * RB + RB, own), 0, 1, known, x_ptr, xs_ptr, topk_ptr,
                                     w_ptr, row_elems, G, K, me, R, lo_expert, L, src_lists_ptr, src_lists_stride,
                                     n_rows, total, start_me, rr, incl, excl, chunk_rows, stage_ptr,
                                     stage_src_elems, stage_s_ptr, stage_s_src, stage_k_ptr, stage_k_src,
                                     stage_w_ptr, stage_w_src, out_x, out_s, out_s_stride_row, out_s_stride_col,
                                     out_k, out_w, out_src, ptr_table, flags_off, base, err_ptr, timeout_ns,
                                     CACHED, HAS_SCALES, HAS_TOPK, NC, RB, BLOCK, K_POW2, G_POW2, HAS_TIMER,
                                     STAGES, ONE_LOAD, PREFETCH)
        if ticket_last(push_ticket_ptr):
            _signal_peers(ptr_table, flags_off, DDATA, R, me, NC)
            tl.store(send_ctr_ptr, n_send + 1)
        v_lo = own
    known = _gather_rows(v_lo, n_rows, pid, P, known, x_ptr, xs_ptr, topk_ptr, w_ptr, row_elems, G, K, me, R,
                         lo_expert, L, src_lists_ptr, src_lists_stride, n_rows, total, start_me, rr, incl, excl,
                         chunk_rows, stage_ptr, stage_src_elems, stage_s_ptr, stage_s_src, stage_k_ptr,
                         stage_k_src, stage_w_ptr, stage_w_src, out_x, out_s, out_s_stride_row, out_s_stride_col,
                         out_k, out_w, out_src, ptr_table, flags_off, base, err_ptr, timeout_ns,
                         CACHED, HAS_SCALES, HAS_TOPK, NC, RB, BLOCK, K_POW2, G_POW2, HAS_TIMER, STAGES, ONE_LOAD,
                         PREFETCH)
    if ticket_last(ticket_ptr):
        _signal_peers(ptr_table, flags_off, DCONSUMED, R, me, 1)
        tl.store(ctr_ptr, base + 1)


@triton.jit(do_not_specialize=['T', 'x_rows'])
def _reduce_kernel(x_ptr, H, T, R, me, send_head_ptr, rpm_ptr, w_ptr, K, x_rows,
                   stage_ptr, stage_src_elems, stage_w_ptr, stage_w_src,
                   bias0_ptr, bias1_ptr, out_ptr, out_w_ptr,
                   ptr_table, flags_off, ctr_ptr, ticket_ptr, err_ptr, timeout_ns,
                   HAS_W: tl.constexpr, NUM_BIAS: tl.constexpr, NC: tl.constexpr, TB: tl.constexpr,
                   BLOCK: tl.constexpr, R_POW2: tl.constexpr, K_POW2: tl.constexpr, HAS_TIMER: tl.constexpr,
                   STAGES: tl.constexpr = 3):
    """Combine receive: ``out[t] = Σ_j row_j(t)`` (float32, ranks in order) ``+ bias``, as bf16.

    ``row_j(t)`` is row ``send_head[t, j]`` of rank ``j``'s x: local x for ``j == me``, else row
    ``send_head[t, j] - rpm[me-1, j]`` of staging slot ``j`` (rank ``j`` copied my block there in
    ``NC`` chunks of ``ceil(count / NC)`` rows; this program waits chunk by chunk). Local rows at or
    past ``x_rows`` are not read (after a num_worst_tokens overflow, recorded as an error).
    """
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    base_ctr = tl.load(ctr_ptr)
    rr = tl.arange(0, R_POW2)
    mine_row = tl.load(rpm_ptr + me * R + rr, mask=rr < R, other=0)
    if me > 0:
        base = tl.load(rpm_ptr + (me - 1) * R + rr, mask=rr < R, other=0)
    else:
        base = tl.zeros((R_POW2,), dtype=tl.int32)
    chunk_rows = tl.maximum((mine_row - base + NC - 1) // NC, 1)
    known = tl.zeros((R_POW2,), dtype=tl.int32)
    kk = tl.arange(0, K_POW2)
    cols = tl.arange(0, BLOCK)
    for t0 in range(pid * TB, T, P * TB):
        tt = t0 + tl.arange(0, TB)
        tm = tt < T
        tt64 = tt.to(tl.int64)
        heads = tl.load(send_head_ptr + tt64[:, None] * R + rr[None, :], mask=tm[:, None] & (rr[None, :] < R),
                        other=-1)
        rel = heads - base[None, :]
        lvl = tl.where((heads >= 0) & (rr[None, :] != me), rel // chunk_rows[None, :] + 1, 0)
        need = tl.max(lvl, 0)
        known = _wait_sources(need, known, rr, ptr_table, flags_off, CDATA, R, me, base_ctr, err_ptr, 5,
                              timeout_ns, NC, HAS_TIMER)
        for h0 in tl.range(0, H, BLOCK, num_stages=STAGES):
            cc = h0 + cols
            cm = cc[None, :] < H
            acc = tl.zeros((TB, BLOCK), dtype=tl.float32)
            for j in tl.static_range(R_POW2):  # unrolled: straight-line loads the pipeliner can prefetch
                row = tl.sum(tl.where(rr[None, :] == j, heads, 0), 1)
                ok = tm & (row >= 0) & (j < R)
                relj = row - tl.sum(tl.where(rr == j, base, 0), 0)
                a = tl.load(x_ptr + row.to(tl.int64)[:, None] * H + cc[None, :],
                            mask=(ok & (me == j) & (row < x_rows))[:, None] & cm, other=0.0)
                b = tl.load(stage_ptr + j * stage_src_elems + relj.to(tl.int64)[:, None] * H + cc[None, :],
                            mask=(ok & (me != j))[:, None] & cm, other=0.0)
                acc += a.to(tl.float32) + b.to(tl.float32)  # one of a, b is 0: the same sum, rank by rank
            if NUM_BIAS >= 1:
                acc += tl.load(bias0_ptr + tt64[:, None] * H + cc[None, :], mask=tm[:, None] & cm,
                               other=0.0).to(tl.float32)
            if NUM_BIAS >= 2:
                acc += tl.load(bias1_ptr + tt64[:, None] * H + cc[None, :], mask=tm[:, None] & cm,
                               other=0.0).to(tl.float32)
            tl.store(out_ptr + tt64[:, None] * H + cc[None, :], acc.to(tl.bfloat16), mask=tm[:, None] & cm)
        if HAS_W:
            km = kk[None, :] < K
            accw = tl.zeros((TB, K_POW2), dtype=tl.float32)
            for j in range(0, R):
                row = tl.sum(tl.where(rr[None, :] == j, heads, 0), 1)
                ok = tm & (row >= 0)
                if j == me:
                    wv = tl.load(w_ptr + row.to(tl.int64)[:, None] * K + kk[None, :],
                                 mask=(ok & (row < x_rows))[:, None] & km, other=0.0)
                else:
                    relj = row - tl.sum(tl.where(rr == j, base, 0), 0)
                    wv = tl.load(stage_w_ptr + _i64(j) * stage_w_src + relj.to(tl.int64)[:, None] * K + kk[None, :],
                                 mask=ok[:, None] & km, other=0.0)
                accw += wv
            tl.store(out_w_ptr + tt64[:, None] * K + kk[None, :], accw, mask=tm[:, None] & km)
    # every chunk of every peer must have arrived before the slot is handed back
    known = _wait_sources(tl.full((R_POW2,), NC, tl.int32), known, rr, ptr_table, flags_off, CDATA, R, me, base_ctr,
                          err_ptr, 5, timeout_ns, NC, HAS_TIMER)
    if ticket_last(ticket_ptr):
        _signal_peers(ptr_table, flags_off, CCONSUMED, R, me, 1)
        tl.store(ctr_ptr, base_ctr + 1)


@triton.jit(do_not_specialize=['x_rows'])
def _combine_push_kernel(x_ptr, w_ptr, row_elems, K, R, me, rpm_ptr, ptr_table, flags_off,
                         stage_off, stage_src_bytes, stage_w_off, stage_w_src_bytes,
                         ctr_ptr, ticket_ptr, err_ptr, timeout_ns, x_rows,
                         HAS_W: tl.constexpr, NC: tl.constexpr, RB: tl.constexpr, BLOCK: tl.constexpr,
                         K_POW2: tl.constexpr, HAS_TIMER: tl.constexpr):
    """SM mover for combine: rows ``[rpm[i-1, me], rpm[i, me])`` of x go to row 0.. of my slot on
    owner ``i``, ``RB`` rows per step; the last program raises the owners' data flags. Rows at or past
    ``x_rows`` (x's length) are not read: after a num_worst_tokens overflow, recorded as an error,
    ``rpm`` counts more rows than x has."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
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
                    tl.store(dst_w + rr[:, None] * K + kk[None, :], tl.load(w_ptr + src[:, None] * K + kk[None, :],
                                                                              mask=km), mask=km)
    if ticket_last(ticket_ptr):
        _signal_peers(ptr_table, flags_off, CDATA, R, me, NC)
        tl.store(ctr_ptr, n + 1)

"""The internode high-throughput layout exchange's kernels (split from ``internode_ht.py``, whose docstring
describes the channels, counters and roles): ``_hn_prep_kernel`` computes a call's layout from
``is_token_in_rank`` in one launch and stages this rank's row for every peer; ``_hn_notify_kernel`` puts
those rows (NVSHMEM puts with signals to the other nodes, stores inside the node) and gathers every rank's
row. Also the signal-word helpers both modules use (``_sig``, ``_wait``, ``_copy_words``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvshmem as nv
from .common import peer_ptr, record_error, signal, ticket_last_n


@triton.jit
def _copy_words(dst, src, n, BLOCK: tl.constexpr):
    cc = tl.arange(0, BLOCK)
    for c0 in range(0, n, BLOCK):
        m = (c0 + cc) < n
        tl.store(dst + c0 + cc, tl.load(src + c0 + cc, mask=m), mask=m)


@triton.jit
def _sig(ptr_table, rank, sig_off, idx):
    """The uint64 word ``idx`` at ``sig_off`` of ``rank``'s buffer, as an int64 pointer."""
    return peer_ptr(ptr_table, rank, sig_off + idx * 8, tl.int64)


@triton.jit
def _wait(ptr_table, me, sig_off, idx, target, err_ptr, phase, peer, timeout_ns, HAS_TIMER: tl.constexpr):
    """Wait for this rank's uint64 word ``idx`` at ``sig_off`` (low 32 bits) to reach ``target``, with the
    deadline (``nvshmem.wait_signal``: in the simulation, this process's puts in flight land first)."""
    nv.wait_signal(ptr_table, me, sig_off + idx * 8, target, err_ptr, phase, peer, timeout_ns, HAS_TIMER)


@triton.jit(do_not_specialize=['T', 'per_chan'])
def _hn_prep_kernel(is_in_ptr, T, R, N, C, per_chan, ntpr_ptr, ntpe_ptr, L, stage_ptr, S, rel_ptr, npos_ptr, cpm_ptr,
                    BLOCK: tl.constexpr, R_POW2: tl.constexpr):
    """The layout of a dispatch from ``is_token_in_rank`` (``is_in [T, R]``, one byte a flag), for every rank
    ``j`` (programs loop over them): ``rel[:, j]`` (each token's row among those for ``j``, -1 where not), ``cpm[j]``
    (the channel prefix: channel ``c`` holds tokens ``[c*per_chan, (c+1)*per_chan)``; past the tokens,
    the total), and for ``j = b*N`` node ``b``'s ``npos[:, b]`` (the same among the tokens for any rank
    of ``b``); the exchange rows into ``stage [R, S]``: in every row the count for ``j``, its
    ``num_tokens_per_rank[j]`` and node ``b``'s count; in row ``j`` the token count, ``cpm[j]``, the
    expert counts of ``j`` and the channel prefix of ``j``'s node (as ``cpm``, over the tokens for any of its
    ranks). Example: ``is_in[:, j] = [1, 0, 1]`` -> ``rel[:, j] = [0, -1, 1]``, count 2."""
    P = R // N
    dd = tl.arange(0, R_POW2)
    dm = dd < R
    c0 = 2 * R + 1 + P
    c1 = c0 + C + L
    for j in range(tl.program_id(0), R, tl.num_programs(0)):  # (programs loop over the ranks)
        row = stage_ptr + j * S
        running = tl.zeros((), tl.int32)
        for b0 in range(0, T, BLOCK):
            offs = b0 + tl.arange(0, BLOCK)
            m = offs < T
            f = tl.load(is_in_ptr + offs.to(tl.int64) * R + j, mask=m, other=0).to(tl.int32)
            cs = tl.cumsum(f, 0)
            tl.store(rel_ptr + offs.to(tl.int64) * R + j, tl.where(f != 0, running + cs - f, -1), mask=m)
            ends = m & (((offs + 1) % per_chan == 0) | (offs == T - 1))
            ch = offs // per_chan
            tl.store(cpm_ptr + j * C + ch, running + cs, mask=ends)
            tl.store(row + c0 + ch, running + cs, mask=ends)
            running += tl.sum(f, 0)
        for q0 in range(0, C, BLOCK):
            cc = q0 + tl.arange(0, BLOCK)
            past = (cc < C) & (cc * per_chan >= T)
            tl.store(cpm_ptr + j * C + cc, tl.zeros_like(cc) + running, mask=past)
            tl.store(row + c0 + cc, tl.zeros_like(cc) + running, mask=past)
        tl.store(stage_ptr + dd * S + j, tl.zeros_like(dd) + running, mask=dm)
        tl.store(stage_ptr + dd * S + R + j, tl.zeros_like(dd) + tl.load(ntpr_ptr + j), mask=dm)
        tl.store(row + 2 * R, T)
        for l0 in range(0, L, BLOCK):
            ll = l0 + tl.arange(0, BLOCK)
            tl.store(row + c0 + C + ll, tl.load(ntpe_ptr + j * L + ll, mask=ll < L, other=0), mask=ll < L)
        if j % N == 0:
            b = j // N
            run2 = tl.zeros((), tl.int32)
            for b0 in range(0, T, BLOCK):
                offs = b0 + tl.arange(0, BLOCK)
                m = offs < T
                g = tl.zeros((BLOCK,), tl.int32)
                for k in range(N):
                    g = g | tl.load(is_in_ptr + offs.to(tl.int64) * R + b * N + k, mask=m, other=0).to(tl.int32)
                cs = tl.cumsum(g, 0)
                tl.store(npos_ptr + offs.to(tl.int64) * P + b, tl.where(g != 0, run2 + cs - g, -1), mask=m)
                ends = m & (((offs + 1) % per_chan == 0) | (offs == T - 1))
                for k in range(N):
                    tl.store(stage_ptr + (b * N + k) * S + c1 + offs // per_chan, run2 + cs, mask=ends)
                run2 += tl.sum(g, 0)
            for q0 in range(0, C, BLOCK):
                cc = q0 + tl.arange(0, BLOCK)
                past = (cc < C) & (cc * per_chan >= T)
                for k in range(N):
                    tl.store(stage_ptr + (b * N + k) * S + c1 + cc, tl.zeros_like(cc) + run2, mask=past)
            tl.store(stage_ptr + dd * S + 2 * R + 1 + b, tl.zeros_like(dd) + run2, mask=dm)


@triton.jit
def _hn_notify_kernel(me, R, S, SU, ptr_table, stage_off, recv_off, recv_stride, nsig_off, out_ptr, level_ptr,
                      ticket_ptr, err_ptr, timeout_ns, BLOCK: tl.constexpr, CHECK: tl.constexpr,
                      HAS_TIMER: tl.constexpr, SIM: tl.constexpr):
    """The layout exchange. For every rank ``d`` (programs loop over them): this rank's row for rank ``d``
    (``S`` words, the first ``SU`` used, staged at ``stage_off`` by ``_hn_prep``) to ``d``'s receive area,
    slot ``me``, with ``d``'s signal word ``me`` (one NVSHMEM put-with-signal; a store and a release where
    ``d`` is this
    rank); then it waits for rank ``d``'s row here and copies it to ``out[d]`` (a private tensor: what
    the later kernels and the host read). With ``CHECK`` (no host synchronisation follows:
    ``num_worst_tokens``), rank ``d``'s ``num_tokens_per_rank`` (words ``R..2R``) is checked against
    its counts (words ``0..R``): error 11 names it.

    The receive area alternates between two parities by the device's count of exchanges (``level``),
    so a replayed CUDA graph alternates too: a rank writes parity ``q`` of call ``c + 2`` only after
    every rank has put its row of call ``c + 1``, which each does after it used its rows of call ``c``.
    Signals are counters (one word per source), compared with the count."""
    GP = tl.num_programs(0)
    level = tl.load(level_ptr)
    area = recv_off + (level % 2) * recv_stride
    for d in range(tl.program_id(0), R, GP):
        d64 = d + tl.zeros((), tl.int64)  # (a loop index: a Python int under the interpreter)
        src = peer_ptr(ptr_table, me, stage_off + d64 * S * 4, tl.int32)
        dst_off = area + me * S * 4
        if d64 == me:
            _copy_words(peer_ptr(ptr_table, me, dst_off, tl.int32), src, SU, BLOCK)
            signal(_sig(ptr_table, me, nsig_off, me), 1)
        else:
            nv.put_signal(ptr_table, me, d64.to(tl.int32), dst_off, src, SU * 4, nsig_off + me * 8, SIM)
    nv.quiet(SIM)
    for d in range(tl.program_id(0), R, GP):
        d64 = d + tl.zeros((), tl.int64)
        _wait(ptr_table, me, nsig_off, d64, level + 1, err_ptr, 1, d64.to(tl.int32), timeout_ns, HAS_TIMER)
        row = peer_ptr(ptr_table, me, area + d64 * S * 4, tl.int32)
        _copy_words(out_ptr + d64 * S, row, SU, BLOCK)
        if CHECK:
            cc = tl.arange(0, BLOCK)
            for c0 in range(0, R, BLOCK):
                m = (c0 + cc) < R
                cnt = tl.load(row + c0 + cc, mask=m, other=0)
                said = tl.load(row + R + c0 + cc, mask=m, other=0)
                if tl.sum((cnt != said).to(tl.int32), 0) > 0:
                    j = tl.min(tl.where(cnt != said, c0 + cc, 1 << 30), 0)
                    record_error(err_ptr, 11, d64.to(tl.int32), tl.load(row + R + j), tl.load(row + j))
    if ticket_last_n(ticket_ptr, GP):
        tl.store(level_ptr, level + 1)

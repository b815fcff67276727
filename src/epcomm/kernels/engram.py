"""Engram fetch kernels (``backends/engram.py``): gather rows of every rank's storage by global index.

Letters: ``T`` tokens, ``PE`` entries a token, ``N`` entries a rank, ``R`` ranks, ``H`` hidden, ``PK`` scale packs
an entry. Row ``i = t * PE + j`` of the output is entry ``idx[t, j]``: rank ``idx // N``'s row ``idx % N``. Its
scales (FP8) are ``sf[idx, 0:PK]`` of the replicated table, written to ``out_sf[t, j*PK + p]`` at strides
``(sf_ts, sf_hs)`` (row-major, or DeepEP's TMA-aligned column-major).

An index outside ``[0, R*N)`` is not fetched: its row and scales are written as zeros and the error word records
``[ENGRAM_BAD_INDEX, -1, index, R*N]`` (first error wins), which the host raises as ``ValueError``.

Example (``R = 2``, ``N = 3``): ``idx = [[4, 0]]`` gives row 0 = rank 1's entry 1, row 1 = rank 0's entry 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvshmem
from .common import record_error

BAD_INDEX = tl.constexpr(16)  # backends/extras.ENGRAM_BAD_INDEX


@triton.jit
def _scales(sf_ptr, out_sf_ptr, rr, idx, ok, rm, sf_ts, sf_hs, PE: tl.constexpr, PK: tl.constexpr,
            PK_POW2: tl.constexpr):
    """The scales of output rows ``rr`` (entries ``idx``; zeros where not ``ok``)."""
    pp = tl.arange(0, PK_POW2)
    pm = pp < PK
    v = tl.load(sf_ptr + idx.to(tl.int64)[:, None] * PK + pp[None, :], mask=ok[:, None] & pm[None, :], other=0)
    t = (rr // PE).to(tl.int64)
    col = ((rr % PE) * PK).to(tl.int64)[:, None] + pp[None, :]
    tl.store(out_sf_ptr + t[:, None] * sf_ts + col * sf_hs, v, mask=rm[:, None] & pm[None, :])


@triton.jit
def _check(idx, rm, total, err_ptr):
    """The rows of this block whose index is outside ``[0, total)`` (recorded once in the error word)."""
    bad = rm & ((idx < 0) | (idx >= total))
    if tl.sum(bad.to(tl.int32), axis=0) > 0:
        worst = tl.max(tl.where(bad, idx, -2147483647 - 1), axis=0)
        record_error(err_ptr, BAD_INDEX, -1, worst, total)
    return rm & ~bad


@triton.jit(do_not_specialize=["rows", "n_entries", "total", "sf_ts", "sf_hs"])
def _engram_fetch_impl_kernel(idx_ptr, ptr_table, out_ptr, rows, n_entries, total, err_ptr,
                              sf_ptr, out_sf_ptr, sf_ts, sf_hs,
                              ROW_WORDS: tl.constexpr, W_POW2: tl.constexpr, RB: tl.constexpr, ELEM: tl.constexpr,
                              PE: tl.constexpr, PK: tl.constexpr, PK_POW2: tl.constexpr, HAS_SF: tl.constexpr,
                              ALIGNED: tl.constexpr = False):
    """nvlink: ``RB`` output rows a step, each loaded from its owner's symmetric storage (offset 0 of its buffer,
    ``ptr_table[owner]``) and stored into ``out`` (``ROW_WORDS`` words of ``ELEM`` a row). Programs take steps
    ``pid, pid + G, ...``: a program is what DeepEP calls a QP here. ``ALIGNED``: rows are multiples of 16 bytes
    (every row then starts 16-byte aligned in the storage and in ``out``: 16-byte vectors)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ww = tl.arange(0, W_POW2)
    for r0 in range(pid * RB, rows, nprog * RB):
        rr = r0 + tl.arange(0, RB)
        rm = rr < rows
        idx = tl.load(idx_ptr + rr, mask=rm, other=0)
        ok = _check(idx, rm, total, err_ptr)
        safe = tl.where(ok, idx, 0)
        owner = safe // n_entries
        base = tl.load(ptr_table + owner, mask=ok, other=0).to(tl.pointer_type(ELEM))
        src = base + (safe % n_entries).to(tl.int64) * ROW_WORDS
        dst = out_ptr + rr.to(tl.int64) * ROW_WORDS
        if ALIGNED:
            src = tl.multiple_of(src, 16)
            dst = tl.multiple_of(dst, 16)
        for w0 in range(0, ROW_WORDS, W_POW2):
            if ROW_WORDS % W_POW2 == 0:  # (whole steps: only the rows are masked, so the columns vectorise)
                v = tl.load(src[:, None] + (w0 + ww)[None, :], mask=ok[:, None], other=0)
                tl.store(dst[:, None] + (w0 + ww)[None, :], v, mask=rm[:, None])
            else:
                wm = (w0 + ww) < ROW_WORDS
                v = tl.load(src[:, None] + (w0 + ww)[None, :], mask=ok[:, None] & wm[None, :], other=0)
                tl.store(dst[:, None] + (w0 + ww)[None, :], v, mask=rm[:, None] & wm[None, :])
        if HAS_SF:
            _scales(sf_ptr, out_sf_ptr, rr, idx, ok, rm, sf_ts, sf_hs, PE, PK, PK_POW2)


@triton.jit(do_not_specialize=["rows", "n_entries", "total", "me", "recv_off", "sf_ts", "sf_hs"])
def _engram_fetch_impl_nvshmem_kernel(idx_ptr, ptr_table, me, recv_off, rows, n_entries, total, err_ptr,
                                      sf_ptr, out_sf_ptr, sf_ts, sf_hs,
                                      ROW_BYTES: tl.constexpr, PE: tl.constexpr, PK: tl.constexpr,
                                      PK_POW2: tl.constexpr, HAS_SF: tl.constexpr, SIM: tl.constexpr):
    """internode: output row ``i`` is fetched into this rank's receive area (``recv_off + i * ROW_BYTES`` of its
    symmetric buffer) by an NVSHMEM get from the owner's storage (offset 0 of its buffer), one row per step;
    non-blocking gets, completed by the ``quiet`` at the end of the program (so the rows are there when the kernel
    is). This rank's own rows are gets too (NVSHMEM serves them locally)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for i in range(pid, rows, nprog):
        idx = tl.load(idx_ptr + i)
        dst = recv_off + (i + tl.zeros((), tl.int64)) * ROW_BYTES
        if (idx < 0) | (idx >= total):
            record_error(err_ptr, BAD_INDEX, -1, idx, total)
            out = nvshmem._sym(ptr_table, me, dst)
            cc = tl.arange(0, 1024)
            for o in range(0, ROW_BYTES, 1024):
                tl.store(out + o + cc, tl.zeros((1024,), dtype=tl.uint8), mask=(o + cc) < ROW_BYTES)
        else:
            nvshmem.get(ptr_table, me, (idx // n_entries).to(tl.int32), dst,
                        (idx % n_entries).to(tl.int64) * ROW_BYTES, ROW_BYTES, SIM)
    nvshmem.quiet(SIM)
    if HAS_SF:
        for r0 in range(pid * 32, rows, nprog * 32):
            rr = r0 + tl.arange(0, 32)
            rm = rr < rows
            idx = tl.load(idx_ptr + rr, mask=rm, other=0)
            ok = rm & (idx >= 0) & (idx < total)
            _scales(sf_ptr, out_sf_ptr, rr, tl.where(ok, idx, 0), ok, rm, sf_ts, sf_hs, PE, PK, PK_POW2)


def row_words(row_bytes: int) -> tuple[int, object]:
    """``(words a row, word type)``: the widest of int32, int16 and int8 dividing ``row_bytes``.

    Example: ``row_words(256) == (64, tl.int32)`` (BF16, ``H = 128``); ``row_words(130) == (65, tl.int16)``."""
    for size, ty in ((4, tl.int32), (2, tl.int16)):
        if row_bytes % size == 0:
            return row_bytes // size, ty
    return row_bytes, tl.int8


def block_shape(words: int) -> tuple[int, int]:
    """``(W_POW2, RB)``: words of a row a step (a power of two, at most 1024) and rows a step (4096 words a tile).

    Example: ``block_shape(64) == (64, 32)``; ``block_shape(3584) == (1024, 4)``."""
    w = min(1024, triton.next_power_of_2(max(words, 1)))
    return w, max(1, min(32, 4096 // w))

"""Pipeline send/recv kernels (``backends/pp.py``): one tensor from a rank to a ring neighbour, under credit flow
control, ``inflight`` tensors at most in flight a direction.

A rank's symmetric buffer (offsets in bytes)::

    [0: data signals, 2 lanes x 8 bytes][16: credit signals, 2 lanes x 8 bytes][pad to 128]
    [128: receive slots, 2 lanes x inflight x slot_bytes]
    [internode only: send staging, 2 lanes x inflight x slot_bytes]

A slot is a 32-byte header (the tensor's byte count, int64) and the payload. Lane ``l`` of a receiver holds what
its previous rank sends (``l = 0``) or its next rank (``l = 1``; at ``R = 2`` both are the same rank, lane 0).
The sender's ``c``-th tensor on a lane goes to slot ``c % inflight``; it first waits until its credit signal for
that lane (raised by the receiver once per tensor consumed) reaches ``c - inflight + 1``, then writes the slot and
raises the receiver's data signal. The receiver's ``c``-th receive waits for its data signal to reach ``c + 1``,
checks the byte count, copies the payload out, and raises the sender's credit. Each side keeps its counts
(``ctr``: sends on lanes 0 and 1, then receives on lanes 0 and 1) on its device, so nothing is read on the host.
The nvlink signals are the low int32 word of each 8-byte signal; the internode ones are NVSHMEM uint64 signals.

Programs split the payload in ``BLOCK``-word chunks; the last program to finish (a ticket) publishes. After any
error recorded in the error word (a wait past its deadline, or a size mismatch) nothing more is published.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvshmem
from .common import peer_ptr, record_error, signal, ticket_last, wait_ge

DATA_OFF = tl.constexpr(0)
CREDIT_OFF = tl.constexpr(16)
SLOTS_OFF = tl.constexpr(128)
HEADER = tl.constexpr(32)
PHASE_SEND = tl.constexpr(12)  # kernels.common.PHASES
PHASE_RECV = tl.constexpr(13)
SIZE_MISMATCH = tl.constexpr(17)  # backends/extras.PP_SIZE_MISMATCH


@triton.jit
def _copy_share(dst, src, n_words, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """This program's chunks of ``n_words`` words: ``BLOCK`` words at ``pid, pid + G, ...`` times ``BLOCK``; the
    whole chunks unmasked (``ALIGNED``: both ends 16-byte aligned, so they move as 16-byte vectors), the last
    partial one masked, by the program whose turn it is."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cc = tl.arange(0, BLOCK)
    n_full = n_words // BLOCK * BLOCK
    for o in range(pid * BLOCK, n_full, nprog * BLOCK):
        o = tl.multiple_of(o, BLOCK)
        d = dst + o + cc
        s = src + o + cc
        if ALIGNED:  # (a pointer made from a loaded address is 4-byte aligned to the compiler unless told)
            d = tl.multiple_of(d, [16])
            s = tl.multiple_of(s, [16])
        tl.store(d, tl.load(s))
    if (n_full < n_words) & ((n_full // BLOCK) % nprog == pid):
        m = (n_full + cc) < n_words
        tl.store(dst + n_full + cc, tl.load(src + n_full + cc, mask=m), mask=m)


@triton.jit
def _take_slot(x_ptr, n_words, nbytes, ptr_table, me, src, at, err_ptr, ELEM: tl.constexpr, BLOCK: tl.constexpr,
               ALIGNED: tl.constexpr):
    """A receive's share of the slot at ``at`` of this rank's buffer: its header's byte count checked against
    ``nbytes`` (else error ``SIZE_MISMATCH`` naming ``src``), then this program's chunks of the payload into ``x``."""
    size = tl.load(peer_ptr(ptr_table, me, at, tl.int64))
    if size != nbytes:
        record_error(err_ptr, SIZE_MISMATCH, src, size.to(tl.int32), nbytes)
    else:
        _copy_share(x_ptr, peer_ptr(ptr_table, me, at + HEADER, ELEM), n_words, BLOCK, ALIGNED)


@triton.jit
def _slot(lane, c, inflight, slot_bytes):
    return (lane * inflight + c % inflight).to(tl.int64) * slot_bytes + SLOTS_OFF


@triton.jit(do_not_specialize=["n_words", "nbytes", "me", "dst", "lane", "inflight", "slot_bytes", "timeout_ns"])
def _pp_send_impl_kernel(x_ptr, n_words, nbytes, ptr_table, me, dst, lane, inflight, slot_bytes, ctr_ptr, ticket_ptr,
                         err_ptr, timeout_ns, ELEM: tl.constexpr, BLOCK: tl.constexpr, HAS_TIMER: tl.constexpr,
                         ALIGNED: tl.constexpr = False):
    """nvlink: wait for a free slot at ``dst``, store ``x`` into it (SM stores over NVLink), then publish the
    byte count and raise ``dst``'s data signal."""
    c = tl.load(ctr_ptr + lane)
    ok = wait_ge(peer_ptr(ptr_table, me, lane * 8 + CREDIT_OFF, tl.int32), c - inflight + 1, err_ptr, PHASE_SEND,
                 dst, timeout_ns, HAS_TIMER)
    at = _slot(lane, c, inflight, slot_bytes)
    if ok:
        _copy_share(peer_ptr(ptr_table, dst, at + HEADER, ELEM), x_ptr, n_words, BLOCK, ALIGNED)
    if ticket_last(ticket_ptr):
        if tl.atomic_add(err_ptr, 0, sem="relaxed", scope="sys") == 0:
            tl.store(peer_ptr(ptr_table, dst, at, tl.int64), nbytes.to(tl.int64))
            signal(peer_ptr(ptr_table, dst, lane * 8 + DATA_OFF, tl.int32), 1)
            tl.store(ctr_ptr + lane, c + 1)


@triton.jit(do_not_specialize=["n_words", "nbytes", "me", "src", "lane", "inflight", "slot_bytes", "timeout_ns"])
def _pp_recv_impl_kernel(x_ptr, n_words, nbytes, ptr_table, me, src, lane, inflight, slot_bytes, ctr_ptr, ticket_ptr,
                         err_ptr, timeout_ns, ELEM: tl.constexpr, BLOCK: tl.constexpr, HAS_TIMER: tl.constexpr,
                         ALIGNED: tl.constexpr = False):
    """nvlink: wait for the tensor in this rank's slot, check its byte count, copy it into ``x``, then raise
    ``src``'s credit."""
    c = tl.load(ctr_ptr + 2 + lane)
    ok = wait_ge(peer_ptr(ptr_table, me, lane * 8 + DATA_OFF, tl.int32), c + 1, err_ptr, PHASE_RECV, src,
                 timeout_ns, HAS_TIMER)
    at = _slot(lane, c, inflight, slot_bytes)
    if ok:
        _take_slot(x_ptr, n_words, nbytes, ptr_table, me, src, at, err_ptr, ELEM, BLOCK, ALIGNED)
    if ticket_last(ticket_ptr):
        if tl.atomic_add(err_ptr, 0, sem="relaxed", scope="sys") == 0:
            signal(peer_ptr(ptr_table, src, lane * 8 + CREDIT_OFF, tl.int32), 1)
            tl.store(ctr_ptr + 2 + lane, c + 1)


@triton.jit(do_not_specialize=["n_words", "nbytes", "me", "dst", "lane", "inflight", "slot_bytes", "send_off",
                               "timeout_ns"])
def _pp_send_impl_nvshmem_kernel(x_ptr, n_words, nbytes, ptr_table, me, dst, lane, inflight, slot_bytes, send_off,
                                 ctr_ptr, ticket_ptr, err_ptr, timeout_ns, ELEM: tl.constexpr, BLOCK: tl.constexpr,
                                 HAS_TIMER: tl.constexpr, SIM: tl.constexpr, ALIGNED: tl.constexpr = False):
    """internode: wait for a free slot at ``dst``, copy ``x`` into this rank's send staging (SM stores), then the
    last program puts header and payload into ``dst``'s slot with its data signal (one NVSHMEM put-with-signal:
    the data lands before the signal moves)."""
    c = tl.load(ctr_ptr + lane)
    ok = nvshmem.wait_signal(ptr_table, me, lane * 8 + CREDIT_OFF, c - inflight + 1, err_ptr, PHASE_SEND, dst,
                             timeout_ns, HAS_TIMER)
    at = _slot(lane, c, inflight, slot_bytes)
    stage = send_off + at - SLOTS_OFF
    if ok:
        _copy_share(peer_ptr(ptr_table, me, stage + HEADER, ELEM), x_ptr, n_words, BLOCK, ALIGNED)
    if ticket_last(ticket_ptr):
        if tl.atomic_add(err_ptr, 0, sem="relaxed", scope="sys") == 0:
            tl.store(peer_ptr(ptr_table, me, stage, tl.int64), nbytes.to(tl.int64))
            nvshmem.put_signal(ptr_table, me, dst, at, nvshmem._sym(ptr_table, me, stage), nbytes + HEADER,
                               lane * 8 + DATA_OFF, SIM)
            tl.store(ctr_ptr + lane, c + 1)


@triton.jit(do_not_specialize=["n_words", "nbytes", "me", "src", "lane", "inflight", "slot_bytes", "timeout_ns"])
def _pp_recv_impl_nvshmem_kernel(x_ptr, n_words, nbytes, ptr_table, me, src, lane, inflight, slot_bytes, ctr_ptr,
                                 ticket_ptr, err_ptr, timeout_ns, ELEM: tl.constexpr, BLOCK: tl.constexpr,
                                 HAS_TIMER: tl.constexpr, SIM: tl.constexpr, ALIGNED: tl.constexpr = False):
    """internode: wait for the data signal, check the byte count, copy the slot into ``x``, then the last program
    adds 1 to ``src``'s credit signal."""
    c = tl.load(ctr_ptr + 2 + lane)
    ok = nvshmem.wait_signal(ptr_table, me, lane * 8 + DATA_OFF, c + 1, err_ptr, PHASE_RECV, src, timeout_ns,
                             HAS_TIMER)
    at = _slot(lane, c, inflight, slot_bytes)
    if ok:
        _take_slot(x_ptr, n_words, nbytes, ptr_table, me, src, at, err_ptr, ELEM, BLOCK, ALIGNED)
    if ticket_last(ticket_ptr):
        if tl.atomic_add(err_ptr, 0, sem="relaxed", scope="sys") == 0:
            nvshmem.signal_add(ptr_table, me, src, lane * 8 + CREDIT_OFF, 1, SIM)
            tl.store(ctr_ptr + 2 + lane, c + 1)


def word_type(nbytes: int, ptr: int):
    """``(word size, Triton type)`` of the copy: int32 where ``nbytes`` and the tensor's address allow it, else
    int16 or int8. Example: ``word_type(1024, 0x7f0000000100) == (4, tl.int32)``; ``word_type(6, ...)`` is int16."""
    for size, ty in ((4, tl.int32), (2, tl.int16)):
        if nbytes % size == 0 and ptr % size == 0:
            return size, ty
    return 1, tl.int8


def programs(num_sms: int, device_sms: int, n_words: int, block: int) -> int:
    """Programs of a send or receive: ``num_sms`` (0: every SM of the device, as DeepEP), at most one a chunk.

    Example: ``programs(0, 132, 3584 * 4096, 2048) == 132``; ``programs(0, 132, 100, 2048) == 1``."""
    return max(1, min(num_sms or device_sms, triton.cdiv(max(n_words, 1), block)))

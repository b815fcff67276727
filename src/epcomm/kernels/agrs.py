"""AGRS kernels (``backends/agrs.py``): the handshakes of an all-gather session, and on internode its puts.

A rank's symmetric buffer::

    [slot signals: 32 slots x R x 8 bytes][session signals: R x 8 bytes][pad to 128][the session's data]

Signal ``[j][r]`` of rank ``q`` counts the all-gathers in slot ``j`` whose data rank ``r`` has written into
``q``'s buffer; signal ``[r]`` of the session area counts the sessions rank ``r`` has ended. Every rank uses slots
and sessions in the same order, so the host knows each target: the ``u``-th use of slot ``j`` waits for
``[j][r] >= u`` from every peer ``r``, the ``s``-th session end for ``[r] >= s``. nvlink signals are the low int32
word of each 8-byte signal (stores: ``kernels.common.signal``); internode ones are NVSHMEM uint64 signals.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvshmem
from .common import peer_ptr, signal, wait_ge

MAX_SLOTS = 32  # DeepEP's kNumMaxInflightAGRS: all-gathers a session


def slot_off(slot: int, num_ranks: int) -> int:
    """Byte offset of slot ``slot``'s signals. Example: ``slot_off(1, 4) == 32``."""
    return slot * num_ranks * 8


def session_off(num_ranks: int) -> int:
    """Byte offset of the session signals. Example: ``session_off(4) == 1024``."""
    return MAX_SLOTS * num_ranks * 8


def data_off(num_ranks: int) -> int:
    """Byte offset of the data. Example: ``data_off(4) == 1152``."""
    return (session_off(num_ranks) + num_ranks * 8 + 127) // 128 * 128


@triton.jit(do_not_specialize=["me", "R", "sig_off", "target", "timeout_ns"])
def _agrs_handshake_kernel(ptr_table, me, R, sig_off, target, err_ptr, phase, timeout_ns, HAS_TIMER: tl.constexpr):
    """nvlink, one program: raise signal ``[me]`` at ``sig_off`` of every peer (after what this stream copied before:
    the copy engine's writes are done when the kernel starts), then wait until every peer's signal here reaches
    ``target``."""
    for i in range(1, R):
        r = (me + i) % R
        signal(peer_ptr(ptr_table, r, sig_off + me * 8, tl.int32), 1)
    for i in range(1, R):
        r = (me + i) % R
        wait_ge(peer_ptr(ptr_table, me, sig_off + r * 8, tl.int32), target, err_ptr, phase, r, timeout_ns, HAS_TIMER)


@triton.jit(do_not_specialize=["me", "R", "n", "sig_off"])
def _agrs_put_nvshmem_kernel(ptr_table, me, R, offs_ptr, sizes_ptr, n, sig_off, SIM: tl.constexpr):
    """internode, one program a peer (``R - 1``): program ``p`` puts this rank's part of each of the ``n`` tensors
    (``sizes[k]`` bytes at ``offs[k] + sizes[k] * me`` of this rank's buffer, already written there) to the same
    place of peer ``(me + 1 + p) % R``, fences, then adds 1 to that peer's signal ``[me]`` at ``sig_off`` (``n = 0``:
    the session end's signal). No program waits here: the wait is :func:`_agrs_wait_signals_kernel`, launched after
    (programs of one grid may run one after another, as under the interpreter)."""
    r = (me + 1 + tl.program_id(0)) % R
    for k in range(n):
        off = tl.load(offs_ptr + k)
        nb = tl.load(sizes_ptr + k)
        at = off + nb * me
        nvshmem.put(ptr_table, me, r, at, nvshmem._sym(ptr_table, me, at), nb, SIM)
    nvshmem.fence(SIM)
    nvshmem.signal_add(ptr_table, me, r, sig_off + me * 8, 1, SIM)


@triton.jit(do_not_specialize=["me", "R", "sig_off", "target", "timeout_ns"])
def _agrs_wait_signals_kernel(ptr_table, me, R, sig_off, target, err_ptr, phase, timeout_ns, HAS_TIMER: tl.constexpr):
    """internode, one program: wait until every peer's signal ``[r]`` at ``sig_off`` here reaches ``target``. It reads
    this rank's own memory only and calls no NVSHMEM function, so it is launched as a plain Triton kernel (torch's
    NVSHMEM module initialisation fails on a module without NVSHMEM symbols)."""
    for i in range(1, R):
        r = (me + i) % R
        nvshmem.wait_signal(ptr_table, me, sig_off + r * 8, target, err_ptr, phase, r, timeout_ns, HAS_TIMER)

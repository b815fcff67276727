"""The ordering check of ``kernels/nvshmem.py``: a signal never overtakes its data.

Two ranks play ping-pong for ``rounds`` rounds. In round ``i`` rank 0 fills ``nbytes`` of its
staging area with the byte ``i % 251 + 1``, sends it to rank 1 with one :func:`put_signal`, and waits
for rank 1's acknowledgement; rank 1 waits for the signal to reach ``i + 1``, counts the bytes of its
copy that differ from the round's byte, records the count, and acknowledges with a bare
put-with-signal. A signal that overtook its data shows as a nonzero count. Used by tier 2 (CPU
processes, the simulation) and tier 3 (two GPUs, NVSHMEM).

``how`` picks how rank 0 orders the data before the signal: ``"put_signal"`` (one put-with-signal),
``"fence"`` or ``"quiet"`` (a plain put, that call, then a bare put-with-signal), or ``"none"`` (a plain
put, then the bare put-with-signal with nothing between: NVSHMEM does not order them, and the tier-2
simulation, as weak as NVSHMEM, delivers the signal first: stale bytes every round).

Buffer layout (bytes into each rank's symmetric buffer): ``[0, 8)`` data signal, ``[8, 16)``
acknowledgement signal, ``[64, 64 + nbytes)`` staging, ``[64 + nbytes, 64 + 2 nbytes)`` received data.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..kernels import nvshmem as nv
from ..kernels.common import PHASES

SIG_DATA, SIG_ACK, DATA = 0, 8, 64
FILL = tl.constexpr(1024)
HOW = {"put_signal": 0, "fence": 1, "quiet": 2, "none": 3}


@triton.jit
def _pingpong_kernel(ptr_table, me, rounds, nbytes, out_ptr, err_ptr, timeout_ns, SIM: tl.constexpr,
                     HAS_TIMER: tl.constexpr, ORDER: tl.constexpr = 0):
    """One program per rank (``me`` 0 or 1); ``out_ptr: int32[rounds]`` gets rank 1's mismatch counts;
    ``ORDER``: ``HOW[how]``."""
    stage = tl.load(ptr_table + me).to(tl.pointer_type(tl.uint8)) + 64
    recv = stage + nbytes
    cc = tl.arange(0, FILL)
    for i in range(rounds):
        val = (i % 251 + 1 + tl.zeros((), tl.int32)).to(tl.uint8)
        if me == 0:
            for o in range(0, nbytes, FILL):
                tl.store(stage + o + cc, tl.full((FILL,), 0, tl.uint8) + val, mask=(o + cc) < nbytes)
            if ORDER == 0:
                nv.put_signal(ptr_table, me, me + 1, 64 + nbytes, stage, nbytes, 0, SIM)
            else:
                nv.put(ptr_table, me, me + 1, 64 + nbytes, stage, nbytes, SIM)
                if ORDER == 1:
                    nv.fence(SIM)
                if ORDER == 2:
                    nv.quiet(SIM)
                nv.put_signal(ptr_table, me, me + 1, 64 + nbytes, stage, 0, 0, SIM)
            nv.wait_signal(ptr_table, me, 8, i + 1, err_ptr, 8, 1, timeout_ns, HAS_TIMER)
        else:
            nv.wait_signal(ptr_table, me, 0, i + 1, err_ptr, 3, 0, timeout_ns, HAS_TIMER)
            bad = tl.zeros((), tl.int32)
            for o in range(0, nbytes, FILL):
                m = (o + cc) < nbytes
                v = tl.load(recv + o + cc, mask=m, other=0, volatile=True)
                bad += tl.sum(((v != val) & m).to(tl.int32), 0)
            tl.store(out_ptr + i, bad)
            nv.put_signal(ptr_table, me, me - 1, 0, stage, 0, 8, SIM)
    nv.quiet(SIM)


@triton.jit
def _loopback_kernel(ptr_table, me, nbytes, out_ptr, err_ptr, timeout_ns, SIM: tl.constexpr,
                     HAS_TIMER: tl.constexpr):
    """One rank puts ``nbytes`` of byte 7 to itself with a signal, waits for the signal, counts the
    bytes that differ into ``out_ptr[0]`` (the single-GPU smoke test of the NVSHMEM path)."""
    stage = tl.load(ptr_table + me).to(tl.pointer_type(tl.uint8)) + 64
    recv = stage + nbytes
    cc = tl.arange(0, FILL)
    for o in range(0, nbytes, FILL):
        tl.store(stage + o + cc, tl.full((FILL,), 7, tl.uint8), mask=(o + cc) < nbytes)
    nv.put_signal(ptr_table, me, me, 64 + nbytes, stage, nbytes, 0, SIM)
    nv.wait_signal(ptr_table, me, 0, 1, err_ptr, 3, me, timeout_ns, HAS_TIMER)
    bad = tl.zeros((), tl.int32)
    for o in range(0, nbytes, FILL):
        m = (o + cc) < nbytes
        v = tl.load(recv + o + cc, mask=m, other=0, volatile=True)
        bad += tl.sum(((v != 7) & m).to(tl.int32), 0)
    tl.store(out_ptr, bad)
    nv.quiet(SIM)


def loopback(ptr_table, me: int, nbytes: int, out, err, timeout_ns: int, sim: bool) -> None:
    """Launch the loopback (``out: int32[1]``, ``err: int32[6]`` zeroed; the signal word starts at 0)."""
    k = nv.nvshmem_kernel(_loopback_kernel, sim)
    k[(1,)](ptr_table, me, nbytes, out, err, timeout_ns, SIM=sim, HAS_TIMER=not sim)


def pingpong(ptr_table, me: int, rounds: int, nbytes: int, out, err, timeout_ns: int, sim: bool,
             how: str = "put_signal") -> None:
    """Launch the ping-pong on this rank (``out: int32[rounds]``, ``err: int32[6]`` zeroed); ``how``: a
    key of :data:`HOW`."""
    if how not in HOW:
        raise ValueError(f"how={how!r} is not one of {sorted(HOW)}")
    k = nv.nvshmem_kernel(_pingpong_kernel, sim)
    k[(1,)](ptr_table, me, rounds, nbytes, out, err, timeout_ns, SIM=sim, HAS_TIMER=not sim, ORDER=HOW[how])


def describe_error(err: list[int]) -> str:
    return f"{PHASES.get(err[0], err[0])}: peer {err[1]}, signal {err[2]} < {err[3]}"

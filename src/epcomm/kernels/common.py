"""Triton helpers shared by the kernels: clocks, deadline-bounded waits, peer pointers, error words.

Ordering protocol (every flag in epcomm): the writer stores its data, runs a CTA barrier, then one
``atomic_add(flag, 1, sem="release", scope="sys")``; the reader spins on
``atomic_add(flag, 0, sem="acquire", scope="sys")`` until the counter reaches its target, then a CTA
barrier, then reads the data. Release/acquire at system scope orders the data before the flag, so
no flag is ever seen before its data. Counters only grow, so no flag needs resetting between calls;
they are int32 and wrap after 2**32 increments (days of decoding at tens of thousands of calls per
second), so "reached" means a non-negative wrapped difference ``counter - target``.

Error word (``int32[6]`` in local device memory): ``[code, peer, observed, target, mirror (int64)]``;
``code`` is a phase number from :data:`PHASES` (or 9/10 for input errors), set once by the first wait
that expires. Every later wait sees it and returns at once, so a dead peer never hangs a kernel.
``mirror`` is the address of a pinned, device-mapped host copy of the first four words: the kernel
that records an error also writes it there, so the host learns of it without a copy in every call
(0: no mirror, as under the interpreter).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

PHASES = {
    1: "dispatch/notify",
    2: "dispatch/wait-for-receiver-to-free-staging",
    3: "dispatch/receive-data",
    4: "combine/wait-for-owner-to-free-staging",
    5: "combine/receive-data",
    6: "low_latency_dispatch/receive",
    7: "low_latency_combine/receive",
    8: "barrier",
    # DeepEP V2's experimental calls (backends/pp.py, agrs.py)
    12: "pp_send/wait-for-free-slot",
    13: "pp_recv/receive-data",
    14: "all_gather/receive-data",
    15: "destroy_agrs_session/wait-for-peers",
}


# Under the Triton interpreter (``TRITON_INTERPRET=1``, read when this module loads) ``now_ns`` reads a
# simulated clock instead of 0: each read moves it 1000 "ns" on, so a duration measured between two
# reads is positive and the wait statistics that kernels add up can be seen to be filled on CPU.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
_sim_ns = [0]


def _sim_clock() -> int:
    """The simulated clock (plain Python: called only from interpreted kernels)."""
    _sim_ns[0] += 1000
    return _sim_ns[0]


# Triton's dependency walk (the compile cache key) refuses plain Python functions even in a branch the
# compiler drops (``INTERPRETED`` is False when compiling); marked as a builtin, it is left out of the key
_sim_clock.__triton_builtin__ = True


@triton.jit
def now_ns(HAS_TIMER: tl.constexpr):
    """Global nanosecond timer (``%globaltimer``). Without ``HAS_TIMER``: the simulated clock under the
    interpreter (``_sim_clock``), else 0."""
    if HAS_TIMER:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                      pack=1)
    elif INTERPRETED:
        t = tl.full((), _sim_clock(), tl.int64)
    else:
        t = tl.zeros((), dtype=tl.int64)
    return t


@triton.jit
def fence_sys():
    """``fence.sc.sys``: what this thread wrote, or saw its block write before a barrier, is visible to the whole
    system (peers, the host) before anything it writes after. Nothing under the interpreter, whose programs run
    one after another."""
    if INTERPRETED:
        pass
    else:
        tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def peer_ptr(ptr_table, rank, offset_bytes, dtype: tl.constexpr):
    """Typed pointer ``offset_bytes`` into rank ``rank``'s symmetric buffer (``ptr_table: int64[R]``)."""
    base = tl.load(ptr_table + rank).to(tl.pointer_type(tl.uint8))
    return (base + offset_bytes).to(tl.pointer_type(dtype))


@triton.jit
def signal(flag_ptr, value):
    """Release: everything this program wrote before is visible before the counter moves."""
    tl.debug_barrier()
    tl.atomic_add(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def ticket_last(ticket_ptr):
    """True in the last program of the (up to 3-D) grid to get here (the ticket resets itself). Each program's
    earlier writes are released (system scope) before its ticket, so the last one may publish."""
    return ticket_last_n(ticket_ptr, tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2))


@triton.jit
def ticket_last_n(ticket_ptr, n, LOCAL: tl.constexpr = False, GPU: tl.constexpr = False):
    """``ticket_last`` among ``n`` programs (the ones of a grid that took one role of a fused kernel).
    ``LOCAL``: a relaxed GPU-scope ticket, for a last program that publishes nothing to other GPUs or
    to the host (it only stores a counter the next kernel on the stream reads); the programs' writes
    are then not released, only counted. ``GPU``: an acquire-release ticket of GPU scope, for a last
    program that reads the other programs' stores and whose own results only later work on this GPU
    reads (no system-scope fence: the ``MEMBAR.SYS`` of the default is for peers and the host)."""
    tl.debug_barrier()
    if LOCAL:
        old = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
    elif GPU:
        old = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    else:
        old = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="sys")
    last = old == n - 1
    if last:
        tl.atomic_xchg(ticket_ptr, 0)
    return last


@triton.jit
def wait_ge(flag_ptr, target, err_ptr, phase, peer, timeout_ns, HAS_TIMER: tl.constexpr, mask_ptr=None,
            SHRINK: tl.constexpr = False):
    """Spin until ``*flag_ptr - target >= 0`` (acquire; int32, wrapped) or the deadline; True when reached.
    ``target`` must be the same in every thread of the program (the kernels' scalars are).

    On expiry records ``[phase, peer, observed, target]`` in the error word (first error wins) —
    or, with ``SHRINK``, masks ``peer`` in ``mask_ptr`` instead. Returns at once if an error was
    recorded already, or (``SHRINK``) if another program masked the peer meanwhile. Without a timer
    (interpreter), the deadline counts spins instead of nanoseconds.

    Every thread decides alike around a barrier: the first check is one atomic, whose result Triton
    broadcasts from one thread through shared memory with a barrier; the spin (``_spin``) has no
    barrier, as its end differs per thread (each reads its own clock and the error word); after it,
    whether the counter arrived and whether to record are read again by broadcast atomics.
    """
    v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if (v - target) < 0:  # wrapped difference: counters may wrap
        _spin(flag_ptr, target, err_ptr, timeout_ns, HAS_TIMER, mask_ptr, peer, SHRINK)
        v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        if (v - target) < 0:
            err = tl.atomic_add(err_ptr, 0, sem="relaxed", scope="sys")
            masked = tl.zeros((), dtype=tl.int32)
            if SHRINK:
                masked = tl.atomic_add(mask_ptr + peer, 0, sem="relaxed", scope="sys")
            if (err == 0) & (masked == 0):
                if SHRINK:
                    tl.atomic_xchg(mask_ptr + peer, 1)
                else:
                    record_error(err_ptr, phase, peer, v, target)
    tl.debug_barrier()
    return (v - target) >= 0


@triton.jit
def _spin(flag_ptr, target, err_ptr, timeout_ns, HAS_TIMER: tl.constexpr, mask_ptr, peer, SHRINK: tl.constexpr):
    """Each thread polls by itself (volatile loads, no atomic, so no barrier) until it sees the counter
    reach ``target``, an error recorded, ``peer`` masked (``SHRINK``) or its deadline pass."""
    t0 = now_ns(HAS_TIMER)
    spins = tl.zeros((), dtype=tl.int64)
    go = spins == 0
    while go:
        v = tl.load(flag_ptr, volatile=True)
        err = tl.load(err_ptr, volatile=True)
        masked = tl.zeros((), dtype=tl.int32)
        if SHRINK:
            masked = tl.load(mask_ptr + peer, volatile=True)
        spins += 1
        if HAS_TIMER:
            elapsed = now_ns(HAS_TIMER) - t0
        else:
            elapsed = spins
        go = ((v - target) < 0) & (err == 0) & (masked == 0) & (elapsed < timeout_ns)


@triton.jit
def record_error(err_ptr, code, peer, observed, target):
    """First error wins: ``[code, peer, observed, target]`` into the error word and its host mirror."""
    old = tl.atomic_cas(err_ptr, 0, code)
    if old == 0:
        tl.store(err_ptr + 1, peer)
        tl.store(err_ptr + 2, observed)
        tl.store(err_ptr + 3, target)
        mirror = tl.load((err_ptr + 4).to(tl.pointer_type(tl.int64)))
        if mirror != 0:
            host = mirror.to(tl.pointer_type(tl.int32))
            tl.store(host + 1, peer)
            tl.store(host + 2, observed)
            tl.store(host + 3, target)
            tl.store(host, code)


def symbol(mangled: str):
    """Give a kernel the symbol ``mangled``, a C++-mangled name: profilers demangle it, so a profile shows
    ``epcomm::ll::dispatch()`` (DeepEP's own LL timing finds its kernels by ``::dispatch`` and
    ``::combine`` in those names). Not under the Triton interpreter, which looks kernels up by name."""
    def rename(fn):
        from triton import knobs

        if not knobs.runtime.interpret:
            fn.__name__ = fn.__qualname__ = mangled
        return fn
    return rename
